//! `cargo xtask bench --compare llama.cpp`: kiln and llama.cpp on the same GGUF file with the
//! same threads, **interleaved in rounds** (kiln's matrix once, then llama.cpp's tools, then
//! again), medians over the rounds and kiln's ratio to llama.cpp per cell. These VMs drift
//! by 10-20 % within minutes, so two tools timed one after the other compare the machine's
//! moods as much as the tools; alternating them spreads the drift over both.
//!
//! llama.cpp's numbers per kiln cell (prompt `P`, batch `B`, `G` new tokens):
//! - batch 1, prefill: `llama-bench -p P -n 0` (pp`P`);
//! - batch 1, decode: `llama-bench -p 0 -n G -d P` (tg`G` after a context of `P`, as kiln
//!   decodes after its prompt);
//! - batch > 1: `llama-batched-bench -npp P -ntg G -npl B`, its prompt rate (`S_PP`) and
//!   generation rate (`S_TG`, all sequences' tokens over the generation time, as kiln's), each
//!   the best of flash attention on and off.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// One kiln cell's place in the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CellKey {
    pub prompt_len: u64,
    pub batch: u64,
}

/// Rates of one cell in one round: prompt tokens per second and generated tokens per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub prefill: f64,
    pub decode: f64,
}

/// How `cargo xtask bench` runs kiln for one round: the command for a report at a path.
pub trait KilnRound {
    /// Runs kiln's matrix once (one timed run per cell) and writes its JSON report to `out`.
    fn run(&self, out: &Path) -> Result<()>;
}

/// The comparison's settings.
pub struct Comparison<'a> {
    pub model: &'a Path,
    pub threads: usize,
    pub rounds: usize,
    pub bin: &'a Path,
}

/// Runs the rounds and returns kiln's last report with its rates replaced by the medians and a
/// `llama_cpp` section (per-round numbers, medians, ratios); prints the table.
pub fn compare(settings: &Comparison<'_>, kiln: &dyn KilnRound, scratch: &Path) -> Result<Value> {
    let mut kiln_rounds: Vec<BTreeMap<CellKey, Rates>> = Vec::new();
    let mut llama_rounds: Vec<BTreeMap<CellKey, LlamaRates>> = Vec::new();
    let mut report = Value::Null;
    let mut build = Value::Null;
    for round in 1..=settings.rounds {
        eprintln!("round {round}/{}: kiln bench", settings.rounds);
        kiln.run(scratch)?;
        report = serde_json::from_str(
            &std::fs::read_to_string(scratch)
                .with_context(|| format!("reading {}", scratch.display()))?,
        )
        .context("kiln bench wrote no JSON report")?;
        let ours = kiln_rates(&report)?;
        let cells: Vec<CellKey> = ours.keys().copied().collect();
        let new_tokens = report["new_tokens"]
            .as_u64()
            .context("kiln's report has no new_tokens")?;
        kiln_rounds.push(ours);
        let (theirs, commit) = llama_round(settings, &cells, new_tokens, round)?;
        build = commit;
        llama_rounds.push(theirs);
    }
    let rows = medians(&kiln_rounds, &llama_rounds);
    print_table(&rows, settings);
    for cell in report["cells"].as_array_mut().into_iter().flatten() {
        let Some(key) = cell_key(cell) else { continue };
        if let Some(row) = rows.iter().find(|r| r.key == key) {
            cell["prefill_tokens_per_s"] = json!(row.kiln.prefill);
            cell["decode_tokens_per_s"] = json!(row.kiln.decode);
        }
    }
    report["rounds"] = json!(settings.rounds);
    report["llama_cpp"] = json!({
        "build_commit": build,
        "threads": settings.threads,
        "model": settings.model.display().to_string(),
        "rounds": (0..settings.rounds).map(|i| json!({
            "kiln": rates_json(kiln_rounds[i].iter().map(|(k, r)| (*k, *r))),
            "llama_cpp": llama_rounds[i].iter().map(|(k, r)| json!({
                "prompt_len": k.prompt_len, "batch": k.batch,
                "prefill_tokens_per_s": r.rates.prefill, "decode_tokens_per_s": r.rates.decode,
                "prefill_source": r.prefill_source, "decode_source": r.decode_source,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "cells": rows.iter().map(|r| json!({
            "prompt_len": r.key.prompt_len, "batch": r.key.batch,
            "kiln_prefill_tokens_per_s": r.kiln.prefill, "llama_prefill_tokens_per_s": r.llama.rates.prefill,
            "prefill_ratio": r.kiln.prefill / r.llama.rates.prefill,
            "kiln_decode_tokens_per_s": r.kiln.decode, "llama_decode_tokens_per_s": r.llama.rates.decode,
            "decode_ratio": r.kiln.decode / r.llama.rates.decode,
            "llama_prefill_source": r.llama.prefill_source, "llama_decode_source": r.llama.decode_source,
        })).collect::<Vec<_>>(),
    });
    Ok(report)
}

/// llama.cpp's rates for a cell, with the tool and setting each came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaRates {
    pub rates: Rates,
    pub prefill_source: String,
    pub decode_source: String,
}

/// One round of llama.cpp over kiln's cells; also returns llama-bench's build commit.
fn llama_round(
    settings: &Comparison<'_>,
    cells: &[CellKey],
    new_tokens: u64,
    round: usize,
) -> Result<(BTreeMap<CellKey, LlamaRates>, Value)> {
    let join = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v.dedup();
        v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
    };
    let mut prompts: Vec<u64> = cells.iter().map(|c| c.prompt_len).collect();
    let prompts = join(&mut prompts);
    let threads = settings.threads.to_string();
    let model = settings.model.to_string_lossy().to_string();
    let mut out = BTreeMap::new();

    eprintln!("round {round}/{}: llama-bench", settings.rounds);
    let bench = settings.bin.join("llama-bench");
    let mut pp = Command::new(&bench);
    pp.args(["-m", &model, "-t", &threads, "-r", "1", "-o", "json"]);
    pp.args(["-p", &prompts, "-n", "0"]);
    let prefill = parse_llama_bench(&output(&mut pp, "llama-bench")?)?;
    let mut tg = Command::new(&bench);
    tg.args(["-m", &model, "-t", &threads, "-r", "1", "-o", "json"]);
    tg.args(["-p", "0", "-n", &new_tokens.to_string(), "-d", &prompts]);
    let decode = parse_llama_bench(&output(&mut tg, "llama-bench")?)?;
    let commit = prefill
        .first()
        .map_or(Value::Null, |r| json!(r.build_commit));
    for cell in cells.iter().filter(|c| c.batch == 1) {
        let pp = prefill
            .iter()
            .find(|r| r.n_prompt == cell.prompt_len && r.n_gen == 0)
            .with_context(|| format!("llama-bench gave no pp{}", cell.prompt_len))?;
        let tg = decode
            .iter()
            .find(|r| r.n_gen == new_tokens && r.n_depth == cell.prompt_len)
            .with_context(|| {
                format!("llama-bench gave no tg{new_tokens} @ d{}", cell.prompt_len)
            })?;
        out.insert(
            *cell,
            LlamaRates {
                rates: Rates {
                    prefill: pp.avg_ts,
                    decode: tg.avg_ts,
                },
                prefill_source: format!("llama-bench pp{}", cell.prompt_len),
                decode_source: format!("llama-bench tg{new_tokens} @ d{}", cell.prompt_len),
            },
        );
    }

    let mut batches: Vec<u64> = cells.iter().map(|c| c.batch).filter(|&b| b > 1).collect();
    if !batches.is_empty() {
        let batches = join(&mut batches);
        let most = cells.iter().map(|c| c.batch * (c.prompt_len + new_tokens));
        let context = most.max().unwrap_or(0) + 16;
        let mut best: BTreeMap<CellKey, LlamaRates> = BTreeMap::new();
        for fa in ["on", "off"] {
            eprintln!(
                "round {round}/{}: llama-batched-bench -fa {fa}",
                settings.rounds
            );
            let mut batched = Command::new(settings.bin.join("llama-batched-bench"));
            batched.args(["-m", &model, "-t", &threads, "-c", &context.to_string()]);
            batched.args(["-npp", &prompts, "-ntg", &new_tokens.to_string()]);
            batched.args(["-npl", &batches, "-fa", fa, "--output-format", "jsonl"]);
            for row in parse_batched(&output(&mut batched, "llama-batched-bench")?)? {
                let key = CellKey {
                    prompt_len: row.pp,
                    batch: row.pl,
                };
                if !cells.contains(&key) || row.tg != new_tokens {
                    continue;
                }
                let entry = best.entry(key).or_insert_with(|| LlamaRates {
                    rates: Rates {
                        prefill: 0.0,
                        decode: 0.0,
                    },
                    prefill_source: String::new(),
                    decode_source: String::new(),
                });
                if row.speed_pp > entry.rates.prefill {
                    entry.rates.prefill = row.speed_pp;
                    entry.prefill_source = format!("batched-bench S_PP fa={fa}");
                }
                if row.speed_tg > entry.rates.decode {
                    entry.rates.decode = row.speed_tg;
                    entry.decode_source = format!("batched-bench S_TG fa={fa}");
                }
            }
        }
        out.extend(best);
    }
    if let Some(missing) = cells.iter().find(|c| !out.contains_key(c)) {
        bail!(
            "llama.cpp gave no result for prompt {} batch {}",
            missing.prompt_len,
            missing.batch
        );
    }
    Ok((out, commit))
}

/// Runs a tool and returns its stdout; its stderr (model loading chatter) is dropped unless
/// it fails.
fn output(command: &mut Command, tool: &str) -> Result<String> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {tool}"))?;
    if !out.status.success() {
        bail!(
            "{tool} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("{tool} printed no text"))
}

/// One test of `llama-bench -o json`.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    pub n_prompt: u64,
    pub n_gen: u64,
    pub n_depth: u64,
    pub avg_ts: f64,
    pub build_commit: String,
}

/// Parses `llama-bench -o json`: an array of tests.
pub fn parse_llama_bench(text: &str) -> Result<Vec<BenchRow>> {
    let tests: Value = serde_json::from_str(text).context("llama-bench printed no JSON")?;
    let tests = tests
        .as_array()
        .context("llama-bench's JSON is not a list")?;
    tests
        .iter()
        .map(|t| {
            let field = |k: &str| {
                t[k].as_u64()
                    .with_context(|| format!("llama-bench test without {k}"))
            };
            Ok(BenchRow {
                n_prompt: field("n_prompt")?,
                n_gen: field("n_gen")?,
                n_depth: t["n_depth"].as_u64().unwrap_or(0),
                avg_ts: t["avg_ts"]
                    .as_f64()
                    .context("llama-bench test without avg_ts")?,
                build_commit: t["build_commit"].as_str().unwrap_or("?").to_string(),
            })
        })
        .collect()
}

/// One line of `llama-batched-bench --output-format jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchedRow {
    pub pp: u64,
    pub tg: u64,
    pub pl: u64,
    pub speed_pp: f64,
    pub speed_tg: f64,
}

/// Parses `llama-batched-bench --output-format jsonl`: one JSON object per line.
pub fn parse_batched(text: &str) -> Result<Vec<BatchedRow>> {
    text.lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|line| {
            let v: Value = serde_json::from_str(line)
                .with_context(|| format!("llama-batched-bench line is not JSON: {line}"))?;
            let int = |k: &str| {
                v[k].as_u64()
                    .with_context(|| format!("llama-batched-bench line without {k}"))
            };
            let float = |k: &str| {
                v[k].as_f64()
                    .with_context(|| format!("llama-batched-bench line without {k}"))
            };
            Ok(BatchedRow {
                pp: int("pp")?,
                tg: int("tg")?,
                pl: int("pl")?,
                speed_pp: float("speed_pp")?,
                speed_tg: float("speed_tg")?,
            })
        })
        .collect()
}

fn cell_key(cell: &Value) -> Option<CellKey> {
    Some(CellKey {
        prompt_len: cell["prompt_len"].as_u64()?,
        batch: cell["batch"].as_u64()?,
    })
}

/// kiln's greedy cells' rates from its report (llama.cpp does not sample).
fn kiln_rates(report: &Value) -> Result<BTreeMap<CellKey, Rates>> {
    let cells = report["cells"]
        .as_array()
        .context("kiln's report has no cells")?;
    let greedy = |c: &&Value| c["sampling"].as_str().is_none_or(|s| s == "greedy");
    cells
        .iter()
        .filter(greedy)
        .map(|c| {
            let key = cell_key(c).context("a kiln cell without prompt_len or batch")?;
            let rate = |k: &str| {
                c[k].as_f64()
                    .with_context(|| format!("a kiln cell without {k}"))
            };
            Ok((
                key,
                Rates {
                    prefill: rate("prefill_tokens_per_s")?,
                    decode: rate("decode_tokens_per_s")?,
                },
            ))
        })
        .collect()
}

fn rates_json(rates: impl Iterator<Item = (CellKey, Rates)>) -> Vec<Value> {
    rates
        .map(|(k, r)| {
            json!({
                "prompt_len": k.prompt_len, "batch": k.batch,
                "prefill_tokens_per_s": r.prefill, "decode_tokens_per_s": r.decode,
            })
        })
        .collect()
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// A cell's medians on both sides.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub key: CellKey,
    pub kiln: Rates,
    pub llama: LlamaRates,
}

/// Per cell, the median over rounds of each side's rates (llama.cpp's sources from the first
/// round).
pub fn medians(
    kiln: &[BTreeMap<CellKey, Rates>],
    llama: &[BTreeMap<CellKey, LlamaRates>],
) -> Vec<Row> {
    let Some(first) = llama.first() else {
        return Vec::new();
    };
    first
        .iter()
        .filter_map(|(key, sources)| {
            let ours: Vec<Rates> = kiln.iter().filter_map(|r| r.get(key).copied()).collect();
            let theirs: Vec<Rates> = llama
                .iter()
                .filter_map(|r| r.get(key))
                .map(|r| r.rates)
                .collect();
            if ours.is_empty() {
                return None;
            }
            let med =
                |v: &[Rates], f: fn(&Rates) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
            Some(Row {
                key: *key,
                kiln: Rates {
                    prefill: med(&ours, |r| r.prefill),
                    decode: med(&ours, |r| r.decode),
                },
                llama: LlamaRates {
                    rates: Rates {
                        prefill: med(&theirs, |r| r.prefill),
                        decode: med(&theirs, |r| r.decode),
                    },
                    ..sources.clone()
                },
            })
        })
        .collect()
}

fn print_table(rows: &[Row], settings: &Comparison<'_>) {
    println!(
        "\nkiln / llama.cpp on {} ({} threads, median of {} interleaved rounds; ratio above 1: kiln is faster)",
        settings.model.display(),
        settings.threads,
        settings.rounds
    );
    println!(
        "{:>6} {:>5} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | llama.cpp source (prefill; decode)",
        "prompt", "batch", "kiln pp/s", "llama", "ratio", "kiln tg/s", "llama", "ratio"
    );
    for r in rows {
        println!(
            "{:>6} {:>5} | {:>9.1} {:>9.1} {:>6.2} | {:>9.1} {:>9.1} {:>6.2} | {}; {}",
            r.key.prompt_len,
            r.key.batch,
            r.kiln.prefill,
            r.llama.rates.prefill,
            r.kiln.prefill / r.llama.rates.prefill,
            r.kiln.decode,
            r.llama.rates.decode,
            r.kiln.decode / r.llama.rates.decode,
            r.llama.prefill_source,
            r.llama.decode_source,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from `llama-bench -p 32 -n 8 -r 1 -o json` of this build (ggml 0.25.3).
    const LLAMA_BENCH: &str = r#"[
  {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
    "model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": 32, "n_gen": 0, "n_depth": 0,
    "avg_ns": 739056788, "stddev_ns": 0, "avg_ts": 43.298432, "stddev_ts": 0.000000,
    "samples_ns": [ 739056788 ], "samples_ts": [ 43.2984 ]
  },
  {
    "build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC",
    "model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": 0, "n_gen": 8, "n_depth": 32,
    "avg_ns": 95056788, "stddev_ns": 0, "avg_ts": 84.160000, "stddev_ts": 0.000000,
    "samples_ns": [ 95056788 ], "samples_ts": [ 84.16 ]
  }
]"#;

    /// From `llama-batched-bench -c 512 -npp 32 -ntg 8 -npl 1,2 -fa off --output-format jsonl`.
    const BATCHED: &str = r#"{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 1, "n_kv": 40, "t_pp": 0.455026, "speed_pp": 70.325653, "t_tg": 0.257042, "speed_tg": 31.123320, "t": 0.712068, "speed": 56.174412}
{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 0, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 2, "n_kv": 80, "t_pp": 0.917320, "speed_pp": 69.768456, "t_tg": 0.496095, "speed_tg": 32.251888, "t": 1.413415, "speed": 56.600506}
"#;

    #[test]
    fn llama_bench_json_gives_each_test_its_rate() {
        let rows = parse_llama_bench(LLAMA_BENCH).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].n_prompt, rows[0].n_gen, rows[0].n_depth),
            (32, 0, 0)
        );
        assert_eq!(rows[0].avg_ts, 43.298432);
        assert_eq!((rows[1].n_gen, rows[1].n_depth), (8, 32));
        assert_eq!(rows[1].build_commit, "0c1e570");
    }

    #[test]
    fn batched_bench_jsonl_gives_each_batch_its_rates() {
        let rows = parse_batched(&format!("main: loading\n{BATCHED}")).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].pp, rows[1].tg, rows[1].pl), (32, 8, 2));
        assert_eq!((rows[1].speed_pp, rows[1].speed_tg), (69.768456, 32.251888));
    }

    #[test]
    fn broken_tool_output_is_an_error_naming_the_tool() {
        let err = parse_llama_bench("[{\"n_prompt\": 1}]").unwrap_err();
        assert!(err.to_string().contains("llama-bench"), "{err}");
        let err = parse_batched("{\"pp\": 1}").unwrap_err();
        assert!(err.to_string().contains("llama-batched-bench"), "{err}");
        assert!(parse_llama_bench("not json").is_err());
    }

    #[test]
    fn medians_pair_each_cell_across_rounds() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let key = CellKey {
            prompt_len: 128,
            batch: 1,
        };
        let kiln: Vec<BTreeMap<CellKey, Rates>> = [(100.0, 10.0), (300.0, 30.0), (200.0, 20.0)]
            .iter()
            .map(|&(p, d)| {
                BTreeMap::from([(
                    key,
                    Rates {
                        prefill: p,
                        decode: d,
                    },
                )])
            })
            .collect();
        let llama: Vec<BTreeMap<CellKey, LlamaRates>> = [(50.0, 5.0), (70.0, 9.0), (60.0, 7.0)]
            .iter()
            .map(|&(p, d)| {
                BTreeMap::from([(
                    key,
                    LlamaRates {
                        rates: Rates {
                            prefill: p,
                            decode: d,
                        },
                        prefill_source: "pp128".into(),
                        decode_source: "tg128".into(),
                    },
                )])
            })
            .collect();
        let rows = medians(&kiln, &llama);
        assert_eq!(rows.len(), 1);
        assert_eq!(
            rows[0].kiln,
            Rates {
                prefill: 200.0,
                decode: 20.0
            }
        );
        assert_eq!(
            rows[0].llama.rates,
            Rates {
                prefill: 60.0,
                decode: 7.0
            }
        );
        assert_eq!(rows[0].llama.decode_source, "tg128");
    }
}
