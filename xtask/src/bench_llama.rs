//! `cargo xtask bench --compare llama.cpp`: kiln and llama.cpp on the same GGUF file with the
//! same threads, **interleaved in rounds** (kiln's matrix once, then llama.cpp's tools, then
//! again), medians over the rounds and kiln's ratio to llama.cpp per cell. Cloud VMs drift in
//! speed within minutes (docs/benchmarks.md, "Method"), so two tools timed one after the other
//! compare the machine's moods as much as the tools; alternating them spreads the drift over
//! both.
//!
//! llama.cpp's numbers per kiln cell (prompt `P`, batch `B`, `G` new tokens):
//! - batch 1, prefill: `llama-bench -p P -n 0` (pp`P`);
//! - batch 1, decode: `llama-bench -p 0 -n G -d P` (tg`G` after a context of `P`, as kiln
//!   decodes after its prompt);
//! - both run with flash attention off and on (`-fa 0,1`), each cell the better of the two
//!   (llama.cpp's default, on, decoded far slower at long depths on the CPUs kiln is measured
//!   on: docs/benchmarks.md, "Figures that were in code comments");
//! - batch > 1: `llama-batched-bench -npp P -ntg G -npl B`, its prompt rate (`S_PP`) and
//!   generation rate (`S_TG`, all sequences' tokens over the generation time, as kiln's), each
//!   the best of flash attention on and off.
//!
//! Running kiln is the caller's ([`KilnRound`]); running and reading llama.cpp's tools is
//! [`crate::llama_cpp`]'s. This file pairs their numbers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::llama_cpp::{
    BatchedTest, BenchTest, parse_batched_bench, parse_llama_bench, tool_output,
};

/// A flash-attention setting as llama.cpp's tools print it (1, 0, -1), named.
fn fa_name(fa: i64) -> &'static str {
    match fa {
        1 => "on",
        0 => "off",
        _ => "auto",
    }
}

/// One kiln cell's place in the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CellKey {
    pub prompt_len: u64,
    pub batch: u64,
}

/// Rates of one cell: prompt tokens per second and generated tokens per second, each over all
/// the cell's sequences.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub prefill: f64,
    pub decode: f64,
}

/// llama.cpp's rates for a cell, with the tool and setting each came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaRates {
    pub rates: Rates,
    pub prefill_source: String,
    pub decode_source: String,
}

/// How `cargo xtask bench` runs kiln for one round.
pub trait KilnRound {
    /// Runs kiln's matrix once (one warm-up and one timed run per cell) and writes its JSON
    /// report to `out`.
    fn run(&self, out: &Path) -> Result<()>;
}

/// The comparison's settings.
pub struct Comparison<'a> {
    /// The GGUF file both engines run.
    pub model: &'a Path,
    /// Threads on both sides (llama.cpp's `-t`).
    pub threads: usize,
    pub rounds: usize,
    /// The folder of llama.cpp's tools.
    pub bin: &'a Path,
}

/// Runs the rounds, prints the table and returns kiln's report with its cells the medians
/// over the rounds, `repeats` the number of rounds, and a `llama_cpp` section (llama.cpp's
/// build, the threads, every round's numbers on both sides, the medians and the ratios).
///
/// # Errors
/// kiln or a llama.cpp tool failed, or their output lacked a number a cell needs.
pub fn compare(settings: &Comparison<'_>, kiln: &dyn KilnRound, scratch: &Path) -> Result<Value> {
    let mut kiln_reports: Vec<Value> = Vec::new();
    let mut kiln_rounds: Vec<BTreeMap<CellKey, Rates>> = Vec::new();
    let mut llama_rounds: Vec<BTreeMap<CellKey, LlamaRates>> = Vec::new();
    let mut build = Value::Null;
    for round in 1..=settings.rounds {
        let progress = |tool: &str| eprintln!("== round {round}/{}: {tool}", settings.rounds);
        progress("kiln bench");
        kiln.run(scratch)?;
        let report: Value = serde_json::from_str(
            &std::fs::read_to_string(scratch)
                .with_context(|| format!("reading kiln's report {}", scratch.display()))?,
        )
        .with_context(|| format!("kiln's report {} is not JSON", scratch.display()))?;
        let ours = kiln_rates(&report)?;
        let new_tokens = report["new_tokens"]
            .as_u64()
            .context("kiln's report has no new_tokens")?;
        let cells: Vec<CellKey> = ours.keys().copied().collect();
        let (theirs, this_build) = llama_round(settings, &cells, new_tokens, &progress)?;
        build = this_build;
        kiln_reports.push(report);
        kiln_rounds.push(ours);
        llama_rounds.push(theirs);
    }

    let rows = medians(&kiln_rounds, &llama_rounds);
    print_table(&rows, settings);
    let mut report = kiln_reports
        .last()
        .cloned()
        .context("--compare llama.cpp ran no round")?;
    report["cells"] = Value::Array(median_cells(&kiln_reports));
    // Each cell's numbers are now medians of one timed run per round: the transformers
    // comparison, which reads this, runs as many.
    report["repeats"] = json!(settings.rounds);
    report["llama_cpp"] = llama_section(settings, build, &kiln_reports, &llama_rounds, &rows);
    Ok(report)
}

/// One round of llama.cpp over kiln's cells: `llama-bench` for batch 1 and
/// `llama-batched-bench` for larger batches. Also returns llama-bench's build (null when no
/// cell has batch 1).
fn llama_round(
    settings: &Comparison<'_>,
    cells: &[CellKey],
    new_tokens: u64,
    progress: &dyn Fn(&str),
) -> Result<(BTreeMap<CellKey, LlamaRates>, Value)> {
    let singles: Vec<CellKey> = cells.iter().copied().filter(|c| c.batch == 1).collect();
    let batched: Vec<CellKey> = cells.iter().copied().filter(|c| c.batch > 1).collect();
    let mut out = BTreeMap::new();
    let mut build = Value::Null;
    if !singles.is_empty() {
        progress("llama-bench");
        let (rates, b) = llama_bench_cells(settings, &singles, new_tokens)?;
        out.extend(rates);
        build = b;
    }
    if !batched.is_empty() {
        let mut tests = Vec::new();
        // Flash attention helps some shapes and hurts others on the CPU: each cell takes the
        // better of the two, as llama.cpp's users would.
        for fa in ["on", "off"] {
            progress(&format!("llama-batched-bench -fa {fa}"));
            tests.extend(batched_bench(settings, &batched, new_tokens, fa)?);
        }
        out.extend(best_batched(&tests, &batched, new_tokens));
    }
    if let Some(missing) = cells.iter().find(|c| !out.contains_key(c)) {
        bail!(
            "llama.cpp gave no result for prompt {} batch {}",
            missing.prompt_len,
            missing.batch
        );
    }
    Ok((out, build))
}

/// `llama-bench`'s pp`P` and tg`G` at depth `P` for batch-1 cells, and its build.
fn llama_bench_cells(
    settings: &Comparison<'_>,
    cells: &[CellKey],
    new_tokens: u64,
) -> Result<(BTreeMap<CellKey, LlamaRates>, Value)> {
    let prompts = join(cells.iter().map(|c| c.prompt_len));
    let run = |tests: &[&str]| {
        let mut command = Command::new(settings.bin.join("llama-bench"));
        command.arg("-m").arg(settings.model);
        command.args(["-t", &settings.threads.to_string(), "-r", "1", "-o", "json"]);
        command.args(["-fa", "0,1"]);
        command.args(tests);
        parse_llama_bench(&tool_output(&mut command, "llama-bench")?)
    };
    let prefill = run(&["-p", &prompts, "-n", "0"])?;
    let decode = run(&["-p", "0", "-n", &new_tokens.to_string(), "-d", &prompts])?;
    let build = prefill.first().map_or(
        Value::Null,
        |t| json!({ "build_commit": t.build_commit, "build_number": t.build_number }),
    );
    let mut out = BTreeMap::new();
    for cell in cells {
        let p = cell.prompt_len;
        let best = |tests: &[BenchTest], wanted: &dyn Fn(&BenchTest) -> bool| {
            tests
                .iter()
                .filter(|t| wanted(t))
                .max_by(|a, b| a.avg_ts.total_cmp(&b.avg_ts))
                .cloned()
        };
        let pp = best(&prefill, &|t| t.n_prompt == p && t.n_gen == 0)
            .with_context(|| format!("llama-bench gave no pp{p}"))?;
        let tg = best(&decode, &|t| t.n_gen == new_tokens && t.n_depth == p)
            .with_context(|| format!("llama-bench gave no tg{new_tokens} @ d{p}"))?;
        let rates = Rates {
            prefill: pp.avg_ts,
            decode: tg.avg_ts,
        };
        out.insert(
            *cell,
            LlamaRates {
                rates,
                prefill_source: format!("llama-bench pp{p} fa={}", fa_name(pp.flash_attn)),
                decode_source: format!(
                    "llama-bench tg{new_tokens} @ d{p} fa={}",
                    fa_name(tg.flash_attn)
                ),
            },
        );
    }
    Ok((out, build))
}

/// One run of `llama-batched-bench` over the batched cells' prompt lengths and batch sizes,
/// with flash attention `fa` (`on` or `off`).
fn batched_bench(
    settings: &Comparison<'_>,
    cells: &[CellKey],
    new_tokens: u64,
    fa: &str,
) -> Result<Vec<BatchedTest>> {
    let prompt_max = cells.iter().map(|c| c.prompt_len).max().unwrap_or(0);
    let batch_max = cells.iter().map(|c| c.batch).max().unwrap_or(0);
    // The tool runs every prompt length with every batch size and skips, silently, each
    // whose sequences would not all fit in the context: room for the largest.
    let context = batch_max * (prompt_max + new_tokens);
    let mut command = Command::new(settings.bin.join("llama-batched-bench"));
    command.arg("-m").arg(settings.model);
    command.args(["-t", &settings.threads.to_string()]);
    command.args(["-c", &context.to_string()]);
    command.args(["-npp", &join(cells.iter().map(|c| c.prompt_len))]);
    command.args(["-ntg", &new_tokens.to_string()]);
    command.args(["-npl", &join(cells.iter().map(|c| c.batch))]);
    command.args(["-fa", fa, "--output-format", "jsonl"]);
    parse_batched_bench(&tool_output(&mut command, "llama-batched-bench")?)
}

/// Per cell, the best `S_PP` and the best `S_TG` among `tests` (each independently: they may
/// come from different flash-attention settings), labelled with their setting.
pub fn best_batched(
    tests: &[BatchedTest],
    cells: &[CellKey],
    new_tokens: u64,
) -> BTreeMap<CellKey, LlamaRates> {
    let mut best: BTreeMap<CellKey, LlamaRates> = BTreeMap::new();
    for test in tests.iter().filter(|t| t.tg == new_tokens) {
        let key = CellKey {
            prompt_len: test.pp,
            batch: test.pl,
        };
        if !cells.contains(&key) {
            continue;
        }
        let entry = best.entry(key).or_insert_with(|| LlamaRates {
            rates: Rates {
                prefill: f64::NEG_INFINITY,
                decode: f64::NEG_INFINITY,
            },
            prefill_source: String::new(),
            decode_source: String::new(),
        });
        if test.speed_pp > entry.rates.prefill {
            entry.rates.prefill = test.speed_pp;
            entry.prefill_source = format!("batched-bench S_PP fa={}", fa_name(test.flash_attn));
        }
        if test.speed_tg > entry.rates.decode {
            entry.rates.decode = test.speed_tg;
            entry.decode_source = format!("batched-bench S_TG fa={}", fa_name(test.flash_attn));
        }
    }
    best
}

/// `values`, sorted and deduplicated, comma-separated: a llama.cpp list argument.
fn join(values: impl Iterator<Item = u64>) -> String {
    let values: BTreeSet<u64> = values.collect();
    values
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn cell_key(cell: &Value) -> Option<CellKey> {
    Some(CellKey {
        prompt_len: cell["prompt_len"].as_u64()?,
        batch: cell["batch"].as_u64()?,
    })
}

/// kiln's greedy cells' rates from its report (llama.cpp's benchmarks do not sample; a report
/// without `sampling` predates the setting and was greedy).
fn kiln_rates(report: &Value) -> Result<BTreeMap<CellKey, Rates>> {
    let cells = report["cells"]
        .as_array()
        .context("kiln's report has no cells")?;
    let greedy = |c: &&Value| c["sampling"].as_str().is_none_or(|s| s == "greedy");
    cells
        .iter()
        .filter(greedy)
        .map(|c| {
            let key =
                cell_key(c).context("kiln's report has a cell without prompt_len or batch")?;
            let rate = |k: &str| {
                c[k].as_f64()
                    .with_context(|| format!("kiln's report has a cell without {k}"))
            };
            let rates = Rates {
                prefill: rate("prefill_tokens_per_s")?,
                decode: rate("decode_tokens_per_s")?,
            };
            Ok((key, rates))
        })
        .collect()
}

/// The median of `values` (the mean of the middle two for an even count; NaN for none).
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

/// kiln's cells with every measured number the median over the rounds' reports: the last
/// report's cells, each matched by prompt length, batch and sampling in the others. Integers
/// (memory in bytes) stay integers, and the fields that name the cell are left alone.
pub fn median_cells(reports: &[Value]) -> Vec<Value> {
    let Some(last) = reports.last() else {
        return Vec::new();
    };
    let same_cell = |a: &Value, b: &Value| {
        ["prompt_len", "batch", "sampling"]
            .iter()
            .all(|k| a[k] == b[k])
    };
    let mut cells = last["cells"].as_array().cloned().unwrap_or_default();
    for cell in &mut cells {
        let matches: Vec<&Value> = reports
            .iter()
            .filter_map(|r| r["cells"].as_array()?.iter().find(|c| same_cell(c, cell)))
            .collect();
        let Some(fields) = cell.as_object_mut() else {
            continue;
        };
        for (key, value) in fields.iter_mut() {
            if !value.is_number() || key == "prompt_len" || key == "batch" {
                continue;
            }
            let integer = value.is_u64();
            let m = median(
                &matches
                    .iter()
                    .filter_map(|c| c[key.as_str()].as_f64())
                    .collect::<Vec<_>>(),
            );
            *value = if integer {
                json!(m.round() as u64)
            } else {
                json!(m)
            };
        }
    }
    cells
}

/// A cell's medians on both sides.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub key: CellKey,
    pub kiln: Rates,
    pub llama: LlamaRates,
}

/// Per cell, the median over rounds of each side's rates. A llama.cpp source is each round's
/// when they agree, else all of them (`a | b`): the best flash-attention setting can change
/// from round to round.
pub fn medians(
    kiln: &[BTreeMap<CellKey, Rates>],
    llama: &[BTreeMap<CellKey, LlamaRates>],
) -> Vec<Row> {
    let Some(first) = llama.first() else {
        return Vec::new();
    };
    let med = |v: &[Rates], f: fn(&Rates) -> f64| median(&v.iter().map(f).collect::<Vec<_>>());
    first
        .keys()
        .filter_map(|key| {
            let ours: Vec<Rates> = kiln.iter().filter_map(|r| r.get(key).copied()).collect();
            let theirs: Vec<&LlamaRates> = llama.iter().filter_map(|r| r.get(key)).collect();
            if ours.is_empty() {
                return None;
            }
            let sources = |f: fn(&LlamaRates) -> &str| {
                let unique: BTreeSet<&str> = theirs.iter().map(|r| f(r)).collect();
                unique.into_iter().collect::<Vec<_>>().join(" | ")
            };
            let their_rates: Vec<Rates> = theirs.iter().map(|r| r.rates).collect();
            Some(Row {
                key: *key,
                kiln: Rates {
                    prefill: med(&ours, |r| r.prefill),
                    decode: med(&ours, |r| r.decode),
                },
                llama: LlamaRates {
                    rates: Rates {
                        prefill: med(&their_rates, |r| r.prefill),
                        decode: med(&their_rates, |r| r.decode),
                    },
                    prefill_source: sources(|r| &r.prefill_source),
                    decode_source: sources(|r| &r.decode_source),
                },
            })
        })
        .collect()
}

/// The report's `llama_cpp` section.
fn llama_section(
    settings: &Comparison<'_>,
    build: Value,
    kiln_reports: &[Value],
    llama_rounds: &[BTreeMap<CellKey, LlamaRates>],
    rows: &[Row],
) -> Value {
    let rounds: Vec<Value> = kiln_reports
        .iter()
        .zip(llama_rounds)
        .map(|(kiln, llama)| {
            let llama: Vec<Value> = llama
                .iter()
                .map(|(k, r)| {
                    json!({
                        "prompt_len": k.prompt_len, "batch": k.batch,
                        "prefill_tokens_per_s": r.rates.prefill,
                        "decode_tokens_per_s": r.rates.decode,
                        "prefill_source": r.prefill_source,
                        "decode_source": r.decode_source,
                    })
                })
                .collect();
            json!({ "kiln": kiln["cells"], "llama_cpp": llama })
        })
        .collect();
    let cells: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "prompt_len": r.key.prompt_len, "batch": r.key.batch,
                "kiln_prefill_tokens_per_s": r.kiln.prefill,
                "llama_prefill_tokens_per_s": r.llama.rates.prefill,
                "prefill_ratio": r.kiln.prefill / r.llama.rates.prefill,
                "llama_prefill_source": r.llama.prefill_source,
                "kiln_decode_tokens_per_s": r.kiln.decode,
                "llama_decode_tokens_per_s": r.llama.rates.decode,
                "decode_ratio": r.kiln.decode / r.llama.rates.decode,
                "llama_decode_source": r.llama.decode_source,
            })
        })
        .collect();
    json!({
        "build": build,
        "model": settings.model.display().to_string(),
        "threads": settings.threads,
        "rounds": rounds,
        "cells": cells,
    })
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

    fn key(prompt_len: u64, batch: u64) -> CellKey {
        CellKey { prompt_len, batch }
    }

    fn rates(prefill: f64, decode: f64) -> Rates {
        Rates { prefill, decode }
    }

    fn batched(pl: u64, flash_attn: i64, speed_pp: f64, speed_tg: f64) -> BatchedTest {
        BatchedTest {
            pp: 64,
            tg: 16,
            pl,
            flash_attn,
            speed_pp,
            speed_tg,
        }
    }

    #[test]
    fn median_takes_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn batched_cells_take_each_rate_at_its_best_setting() {
        let tests = [
            batched(8, 1, 300.0, 250.0),
            batched(8, 0, 320.0, 200.0),
            // A batch kiln did not run, and another tg: neither is a cell.
            batched(4, 1, 999.0, 999.0),
            BatchedTest {
                tg: 32,
                ..batched(8, 1, 999.0, 999.0)
            },
        ];
        let best = best_batched(&tests, &[key(64, 8)], 16);
        assert_eq!(best.len(), 1);
        let cell = &best[&key(64, 8)];
        assert_eq!(cell.rates, rates(320.0, 250.0));
        assert_eq!(cell.prefill_source, "batched-bench S_PP fa=off");
        assert_eq!(cell.decode_source, "batched-bench S_TG fa=on");
    }

    #[test]
    fn medians_pair_each_cell_across_rounds_and_ratios_follow() {
        let kiln: Vec<BTreeMap<CellKey, Rates>> = [(100.0, 10.0), (300.0, 30.0), (200.0, 20.0)]
            .iter()
            .map(|&(p, d)| BTreeMap::from([(key(128, 8), rates(p, d))]))
            .collect();
        let llama: Vec<BTreeMap<CellKey, LlamaRates>> =
            [(50.0, 5.0, "on"), (70.0, 9.0, "off"), (60.0, 7.0, "on")]
                .iter()
                .map(|&(p, d, fa)| {
                    let r = LlamaRates {
                        rates: rates(p, d),
                        prefill_source: "batched-bench S_PP fa=on".into(),
                        decode_source: format!("batched-bench S_TG fa={fa}"),
                    };
                    BTreeMap::from([(key(128, 8), r)])
                })
                .collect();
        let rows = medians(&kiln, &llama);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].kiln, rates(200.0, 20.0));
        assert_eq!(rows[0].llama.rates, rates(60.0, 7.0));
        assert_eq!(rows[0].llama.prefill_source, "batched-bench S_PP fa=on");
        assert_eq!(
            rows[0].llama.decode_source,
            "batched-bench S_TG fa=off | batched-bench S_TG fa=on"
        );
        let section = llama_section(
            &Comparison {
                model: Path::new("m.gguf"),
                threads: 2,
                rounds: 3,
                bin: Path::new("bin"),
            },
            Value::Null,
            &vec![json!({ "cells": [] }); 3],
            &llama,
            &rows,
        );
        let cell = &section["cells"][0];
        assert_eq!(cell["prefill_ratio"], json!(200.0 / 60.0));
        assert_eq!(cell["decode_ratio"], json!(20.0 / 7.0));
        assert_eq!(section["rounds"].as_array().map(Vec::len), Some(3));
    }

    #[test]
    fn median_cells_take_every_measured_number_and_keep_integers_integers() {
        let cell = |sampling: &str, decode: f64, rss: u64| {
            json!({
                "prompt_len": 64, "batch": 8, "sampling": sampling, "weights": ["90 Q4_1"],
                "decode_tokens_per_s": decode, "peak_rss_bytes": rss,
                "peak_device_reserved_bytes": null,
            })
        };
        let reports = [
            json!({ "cells": [cell("greedy", 10.0, 300), cell("top-p", 1.0, 5)] }),
            json!({ "cells": [cell("top-p", 3.0, 7), cell("greedy", 30.0, 100)] }),
            json!({ "cells": [cell("greedy", 20.0, 200), cell("top-p", 2.0, 6)] }),
        ];
        let cells = median_cells(&reports);
        assert_eq!(cells.len(), 2);
        assert_eq!(cells[0]["sampling"], "greedy");
        assert_eq!(cells[0]["decode_tokens_per_s"], json!(20.0));
        assert_eq!(cells[0]["peak_rss_bytes"], json!(200));
        assert_eq!(cells[0]["prompt_len"], json!(64));
        assert_eq!(cells[0]["weights"], json!(["90 Q4_1"]));
        assert!(cells[0]["peak_device_reserved_bytes"].is_null());
        assert_eq!(cells[1]["decode_tokens_per_s"], json!(2.0));
    }

    #[test]
    fn kiln_rates_read_greedy_cells_and_name_what_is_missing() {
        let report = json!({ "cells": [
            { "prompt_len": 64, "batch": 1, "sampling": "greedy",
              "prefill_tokens_per_s": 500.0, "decode_tokens_per_s": 90.0 },
            { "prompt_len": 64, "batch": 1, "sampling": "top-p",
              "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0 },
        ]});
        let ours = kiln_rates(&report).unwrap();
        assert_eq!(ours, BTreeMap::from([(key(64, 1), rates(500.0, 90.0))]));
        let broken = json!({ "cells": [{ "prompt_len": 64, "batch": 1 }] });
        let err = kiln_rates(&broken).unwrap_err().to_string();
        assert!(err.contains("prefill_tokens_per_s"), "{err}");
    }
}
