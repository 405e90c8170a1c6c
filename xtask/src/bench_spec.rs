//! `cargo xtask bench-spec [--kiln PATH] [--prompts FILE] [--max-tokens N] [--rounds N]
//! [--prompt-lookup N] [--draft-tokens K] [--draft-model PATH] [-- kiln generate flags]`:
//! decode speed at batch 1 with and without speculative decoding, in one command. `kiln
//! generate --prompts-file FILE --max-batch 1 --temperature 0 --json` runs the prompt set
//! (default `benches/prompts/grounded.jsonl`: rewriting, code edits, reformatting, summaries,
//! where the output copies from the input) plainly, with `--prompt-lookup`, and with
//! `--draft-model` when one is named, alternating, for `--rounds` rounds. Each run's decode
//! rate is its decoded tokens (every generated token after each prompt's first) over its
//! decode time, summed over the prompts; the command prints the median over rounds of each
//! mode, its ratio to plain decoding, the median of the rounds' own ratios (each pairing runs
//! seconds apart), the acceptance rate and tokens per forward, checks that
//! every mode generated the same tokens (greedy), and writes `target/bench/spec-<date>.json`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{kiln_binary, today};
use crate::bench_llama::median;
use crate::workspace_root;

const USAGE: &str = "usage: cargo xtask bench-spec [--kiln PATH] [--prompts FILE] [--max-tokens N] [--rounds N] [--prompt-lookup N] [--draft-tokens K] [--draft-model PATH] [-- kiln generate flags]";

struct Options {
    kiln: Option<PathBuf>,
    prompts: PathBuf,
    max_tokens: usize,
    rounds: usize,
    prompt_lookup: usize,
    /// `--draft-tokens` for kiln (`None`: kiln's default for each draft source).
    draft_tokens: Option<usize>,
    /// A draft model for a third mode (`default`: the embedded default model).
    draft_model: Option<String>,
    /// More `kiln generate` flags for both modes (a model, a dtype, a backend).
    extra: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        kiln: None,
        prompts: workspace_root().join("benches/prompts/grounded.jsonl"),
        max_tokens: 128,
        rounds: 5,
        prompt_lookup: 3,
        draft_tokens: None,
        draft_model: None,
        extra: Vec::new(),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == "--" {
            o.extra = args.cloned().collect();
            break;
        }
        let mut value = || crate::flag_value(&mut args, arg, USAGE);
        let number = |v: String| crate::positive_number(arg, &v);
        match arg.as_str() {
            "--kiln" => o.kiln = Some(std::path::absolute(value()?)?),
            "--prompts" => o.prompts = std::path::absolute(value()?)?,
            "--max-tokens" => o.max_tokens = number(value()?)?,
            "--rounds" => o.rounds = number(value()?)?,
            "--prompt-lookup" => o.prompt_lookup = number(value()?)?,
            "--draft-tokens" => o.draft_tokens = Some(number(value()?)?),
            "--draft-model" => o.draft_model = Some(value()?),
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    Ok(o)
}

/// One `kiln generate` run over the prompt set.
#[derive(Debug)]
struct Run {
    /// Decoded tokens per second over the whole set.
    decode_tokens_per_s: f64,
    /// Every prompt's tokens, in order.
    tokens: Vec<Value>,
    drafted: u64,
    accepted: u64,
    /// Tokens per forward over the whole set.
    tokens_per_forward: f64,
}

/// How a run decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    PromptLookup,
    DraftModel,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::PromptLookup => "prompt lookup",
            Self::DraftModel => "draft model",
        }
    }
}

fn generate(kiln: &Path, o: &Options, mode: Mode) -> Result<Run> {
    let mut command = Command::new(kiln);
    command
        .args(["generate", "--json", "--quiet", "--max-batch", "1"])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            &o.max_tokens.to_string(),
        ])
        .arg("--prompts-file")
        .arg(&o.prompts)
        .args(&o.extra);
    match (mode, &o.draft_model) {
        (Mode::Plain, _) => {}
        (Mode::PromptLookup, _) => {
            command.args(["--prompt-lookup", &o.prompt_lookup.to_string()]);
        }
        (Mode::DraftModel, Some(path)) => {
            command.args(["--draft-model", path]);
        }
        (Mode::DraftModel, None) => bail!("no draft model named"),
    }
    if let (true, Some(k)) = (mode != Mode::Plain, o.draft_tokens) {
        command.args(["--draft-tokens", &k.to_string()]);
    }
    let output = command
        .output()
        .with_context(|| format!("running {}", kiln.display()))?;
    if !output.status.success() {
        bail!(
            "kiln generate failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let mut decoded = 0.0;
    let mut decode_ms = 0.0;
    let (mut drafted, mut accepted, mut forwards_tokens, mut forwards) = (0, 0, 0.0, 0.0);
    let mut tokens = Vec::new();
    for line in String::from_utf8(output.stdout)?.lines() {
        let report: Value = serde_json::from_str(line).context("kiln generate's JSON")?;
        let n = report["tokens"].as_array().map_or(0, Vec::len);
        decoded += n.saturating_sub(1) as f64;
        decode_ms += report["timings"]["decode_ms"].as_f64().unwrap_or(0.0);
        let spec = &report["speculation"];
        drafted += spec["drafted_tokens"].as_u64().unwrap_or(0);
        accepted += spec["accepted_tokens"].as_u64().unwrap_or(0);
        let per_forward = spec["tokens_per_forward"].as_f64().unwrap_or(0.0);
        if per_forward > 0.0 {
            forwards += n as f64 / per_forward;
            forwards_tokens += n as f64;
        }
        tokens.push(report["tokens"].clone());
    }
    Ok(Run {
        decode_tokens_per_s: decoded / (decode_ms / 1e3),
        tokens,
        drafted,
        accepted,
        tokens_per_forward: forwards_tokens / forwards,
    })
}

pub fn bench_spec(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let kiln = kiln_binary(o.kiln.as_deref())?;
    let mut modes = vec![Mode::Plain, Mode::PromptLookup];
    if o.draft_model.is_some() {
        modes.push(Mode::DraftModel);
    }
    let mut runs: Vec<Vec<Run>> = modes.iter().map(|_| Vec::new()).collect();
    for round in 1..=o.rounds {
        for (&mode, runs) in modes.iter().zip(&mut runs) {
            let run = generate(&kiln, &o, mode)?;
            eprintln!(
                "round {round}/{}: {:<13} {:7.1} decode tok/s",
                o.rounds,
                mode.name(),
                run.decode_tokens_per_s
            );
            runs.push(run);
        }
    }
    for (mode, mode_runs) in modes.iter().zip(&runs).skip(1) {
        for (a, b) in runs[0].iter().zip(mode_runs) {
            if a.tokens != b.tokens {
                bail!(
                    "speculative decoding ({}) changed the greedy tokens",
                    mode.name()
                );
            }
        }
    }
    let rate = |runs: &[Run]| {
        median(
            &runs
                .iter()
                .map(|r| r.decode_tokens_per_s)
                .collect::<Vec<_>>(),
        )
    };
    let plain_rate = rate(&runs[0]);
    let prompts = runs[0].last().context("at least one round")?.tokens.len();
    println!(
        "decode at batch 1, {prompts} prompts from {}, {} tokens each at most, median of {} rounds:",
        o.prompts.display(),
        o.max_tokens,
        o.rounds
    );
    println!("  {:<32} {plain_rate:7.1} tok/s", "plain");
    let mut report_modes = Vec::new();
    for (&mode, mode_runs) in modes.iter().zip(&runs).skip(1) {
        let speed = rate(mode_runs);
        let last = mode_runs.last().context("at least one round")?;
        let acceptance = last.accepted as f64 / last.drafted.max(1) as f64;
        let k = o
            .draft_tokens
            .map_or_else(|| "default".to_string(), |k| k.to_string());
        let label = match mode {
            Mode::PromptLookup => format!("prompt lookup (n {}, K {k})", o.prompt_lookup),
            _ => format!("draft model (K {k})"),
        };
        // Each round's ratio pairs runs seconds apart, so a VM that changes speed between
        // rounds moves both of its runs; the ratio of the medians can pair different states.
        let paired = median(
            &runs[0]
                .iter()
                .zip(mode_runs)
                .map(|(plain, run)| run.decode_tokens_per_s / plain.decode_tokens_per_s)
                .collect::<Vec<_>>(),
        );
        println!(
            "  {label:<32} {speed:7.1} tok/s   {:.2}x (paired {paired:.2}x)   acceptance {:.0} % ({} of {} drafts), {:.2} tokens per forward",
            speed / plain_rate,
            acceptance * 100.0,
            last.accepted,
            last.drafted,
            last.tokens_per_forward
        );
        report_modes.push(json!({
            "mode": mode.name(),
            "decode_tokens_per_s": mode_runs.iter().map(|r| r.decode_tokens_per_s).collect::<Vec<_>>(),
            "median_ratio": speed / plain_rate,
            "median_paired_ratio": paired,
            "acceptance_rate": acceptance,
            "tokens_per_forward": last.tokens_per_forward,
        }));
    }
    let out = workspace_root()
        .join("target/bench")
        .join(format!("spec-{}.json", today()));
    std::fs::create_dir_all(out.parent().context("a parent")?)?;
    let report = json!({
        "prompts": o.prompts,
        "max_tokens": o.max_tokens,
        "rounds": o.rounds,
        "prompt_lookup": o.prompt_lookup,
        "draft_tokens": o.draft_tokens,
        "draft_model": o.draft_model,
        "extra_flags": o.extra,
        "plain_decode_tokens_per_s": runs[0].iter().map(|r| r.decode_tokens_per_s).collect::<Vec<_>>(),
        "speculative": report_modes,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", out.display());
    Ok(())
}
