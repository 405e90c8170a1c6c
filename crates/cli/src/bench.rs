//! `kiln bench`: the benchmark matrix on one backend (`cargo xtask bench` runs it): for each
//! prompt length, batch size and sampling setting, the engine's prefill and decode rates, time
//! to first token, inter-token latency and peak memory (the process's resident set, and the
//! device allocator's where the backend reports it), each the median of several runs after a
//! warm-up, and the weight path the cell ran on.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kiln_core::backend::BackendKind;
use kiln_core::backend::BackendTask;
use kiln_core::{CausalLm, InferenceBackend};
use kiln_engine::bench::{Cell, CellTimings, Sampling, quantile, run_cell};
use kiln_engine::{EngineSettings, Run};
use kiln_kernels::GgmlType;
use kiln_models::random::{KnownShape, random_model};
use serde_json::json;

use crate::engine_args::{self, BENCH, EngineArgs};
use crate::exit::UsageError;
use crate::model_args::{ModelArgs, SpeculationArgs};
use crate::{bandwidth, memory, progress};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Random weights in the shape of a published model instead of a file: llama-3.2-1b,
    /// llama-3.1-8b, qwen2.5-0.5b, qwen3-0.6b, gemma-2-2b, gemma-3-1b, gpt2, gpt2-xl or
    /// santacoder.
    #[arg(long, value_name = "NAME", conflicts_with = "model")]
    shape: Option<KnownShape>,
    /// With --shape: the linear layers and embedding in random blocks of a GGUF type (Q8_0,
    /// Q4_0, Q4_1, Q4_K or Q6_K), kept quantized as a GGUF file's are, instead of dense.
    #[arg(long, value_name = "TYPE", requires = "shape", value_parser = parse_quantized_type)]
    weights: Option<GgmlType>,
    /// Prompt lengths, in tokens.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_values_t = [128, 512])]
    prompt_lens: Vec<usize>,
    /// Batch sizes: prompts run together.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_values_t = [1, 8, 32])]
    batch_sizes: Vec<usize>,
    /// Tokens generated per prompt (no EOS: every sequence generates all of them).
    #[arg(long, value_name = "N", default_value_t = 128)]
    new_tokens: usize,
    /// How tokens are picked: greedy (argmax), top-p (temperature 0.7, top-p 0.9, a draw
    /// seeded per sequence), or both (`greedy,top-p`) to see what sampling adds to a step.
    #[arg(long, value_name = "S,..", value_delimiter = ',', default_values_t = [Sampling::Greedy])]
    sampling: Vec<Sampling>,
    /// Timed runs per cell (the median is reported), after one warm-up run.
    #[arg(long, value_name = "N", default_value_t = 3)]
    repeats: usize,
    /// One small cell (prompt 128, batch 1, 32 new tokens, one timed run): checks the command
    /// works in well under a minute.
    #[arg(long)]
    quick: bool,
    /// Also count, per decode step, the kernel launches, the host-to-device uploads and the
    /// blocking device-to-host reads (GPU backends), and print them under the table.
    #[arg(long, short = 'v')]
    verbose: bool,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Every cell speculates (decode rates then count every token; acceptance and tokens per
    /// forward are reported per cell). Synthetic prompts give prompt lookup little to find.
    #[command(flatten)]
    speculation: SpeculationArgs,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

pub fn run(mut args: Args) -> Result<()> {
    if args.quick {
        args.prompt_lens = vec![128];
        args.batch_sizes = vec![1];
        args.new_tokens = 32;
        args.repeats = 1;
    }
    let sizes = args.prompt_lens.iter().chain(&args.batch_sizes);
    if args.new_tokens == 0 || args.repeats == 0 || sizes.clone().any(|&n| n == 0) {
        bail!(UsageError(
            "prompt lengths, batch sizes, --new-tokens and --repeats must be positive".into()
        ));
    }
    if args.sampling.is_empty() {
        bail!(UsageError("--sampling needs at least one setting".into()));
    }
    if args.shape.is_some() && args.speculation.draft_model.is_some() {
        bail!(UsageError(
            "--draft-model needs a model file to draft for, not random weights (--shape)".into()
        ));
    }
    args.speculation.speculation()?;
    let settings = args.engine.settings(&BENCH)?;
    let backend = args.model.backend;
    let count = args.verbose;
    crate::device::run_on(backend, count, Task(args, settings))?
}

struct Task(Args, EngineSettings);

/// A GGUF type kiln multiplies in its blocks, by llama.cpp's name in either case.
fn parse_quantized_type(name: &str) -> std::result::Result<GgmlType, String> {
    GgmlType::ALL
        .into_iter()
        .filter(|&ty| kiln_kernels::quant::has_kernel(ty))
        .find(|ty| ty.name().eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            let names: Vec<&str> = GgmlType::ALL
                .into_iter()
                .filter(|&ty| kiln_kernels::quant::has_kernel(ty))
                .map(GgmlType::name)
                .collect();
            format!("`{name}` is not one of {}", names.join(", "))
        })
}

/// Medians over the timed runs of one cell.
#[derive(Debug, Clone)]
struct CellReport {
    cell: Cell,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
    time_to_first_token_ms: f64,
    itl_p50_ms: f64,
    itl_p99_ms: f64,
    /// Speculation's counts over the timed runs.
    speculation: kiln_engine::SpecCounts,
    peak_rss_bytes: Option<u64>,
    /// The device allocator's reserved bytes at their largest over the runs.
    peak_device_bytes: Option<u64>,
    /// The model's linear weights the runs read, by storage: `"<count> <kind>"`, the kind a
    /// dtype (dense, the backend's matmul) or a GGUF type marked quantized (kiln's kernels).
    weights: Vec<String>,
    /// Per decode step of the last run: kernel launches (where counted), uploads and blocking
    /// reads.
    per_step: StepWork,
}

/// A decode step's device work, averaged over a run's decode steps.
#[derive(Debug, Clone, Copy, Default)]
struct StepWork {
    launches: Option<f64>,
    uploads: f64,
    reads: f64,
}

impl StepWork {
    fn of(run: &CellTimings) -> Self {
        let steps = run.decode_steps.len().max(1) as f64;
        let work = &run.decode_work;
        StepWork {
            launches: work.launches.map(|l| l as f64 / steps),
            uploads: work.transfers.uploads as f64 / steps,
            reads: work.transfers.reads as f64 / steps,
        }
    }
}

impl CellReport {
    /// The memory figure the comparison uses: the device's where reported, else the RSS.
    fn peak_memory_bytes(&self) -> Option<u64> {
        self.peak_device_bytes.or(self.peak_rss_bytes)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    quantile(&values.into_iter().collect::<Vec<_>>(), 0.5)
}

fn report(
    cell: Cell,
    runs: &[CellTimings],
    peak_rss_bytes: Option<u64>,
    weights: Vec<String>,
) -> CellReport {
    let itl = |q: f64| {
        median(runs.iter().map(|r| {
            let steps: Vec<f64> = r.decode_steps.iter().copied().map(ms).collect();
            quantile(&steps, q)
        }))
    };
    CellReport {
        cell,
        prefill_tokens_per_s: median(runs.iter().map(|r| r.prefill_tokens_per_s(&cell))),
        decode_tokens_per_s: median(runs.iter().map(CellTimings::decode_tokens_per_s)),
        time_to_first_token_ms: median(runs.iter().map(|r| {
            let ttft: Vec<f64> = r.time_to_first_token.iter().copied().map(ms).collect();
            quantile(&ttft, 0.5)
        })),
        itl_p50_ms: itl(0.5),
        itl_p99_ms: itl(0.99),
        speculation: runs.iter().fold(Default::default(), |mut sum, r| {
            sum.add(&r.speculation);
            sum
        }),
        peak_rss_bytes,
        peak_device_bytes: runs
            .iter()
            .filter_map(|r| r.peak_device_memory.map(|m| m.reserved))
            .max(),
        weights,
        per_step: runs.last().map(StepWork::of).unwrap_or_default(),
    }
}

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let Task(args, settings) = self;
        let dtype = args.model.dtype();
        let (model, name, draft) = match args.shape {
            Some(shape) => (
                random_model::<B>(
                    shape,
                    dtype,
                    args.weights,
                    args.model
                        .activations_for_random_weights(args.weights.is_some())?,
                    0,
                    &device,
                )?,
                format!("{} (random weights)", shape.name()),
                None,
            ),
            None => {
                let loaded = args.model.load::<B>(&device)?;
                args.model.refuse_idle_activations(&loaded)?;
                let draft = args
                    .speculation
                    .load_draft(args.model.backend, &loaded, &device)?;
                let name = loaded.path.display().to_string();
                (loaded.model, name, draft)
            }
        };
        let speculation = args.speculation.speculation()?;
        let kv_dtype = args.model.kv_dtype(&model)?;
        let shape = model.shape();
        let longest = args.prompt_lens.iter().max().copied().unwrap_or(0) + args.new_tokens;
        if longest > shape.max_positions {
            bail!(UsageError(format!(
                "prompt + new tokens ({longest}) exceed the model's context ({})",
                shape.max_positions
            )));
        }
        let reports_device_memory = B::device_memory(&device).is_some();
        let memory_kind = if reports_device_memory {
            "device (reserved)"
        } else {
            "RSS"
        };
        // `run_on` has already probed the backend; this only names the device.
        let device_name = args.model.backend.require().unwrap_or_default();
        eprintln!(
            "kiln bench: {name} on {} ({device_name}), {dtype}, KV cache {kv_dtype}, {} new tokens, median of {} runs after a warm-up ({} new tokens)",
            args.model.backend,
            args.new_tokens,
            args.repeats,
            args.new_tokens.min(Cell::WARM_UP_NEW_TOKENS)
        );
        let weight_bytes = model.linear_weight_bytes();
        // What the model holds; each cell reports it again, as the path its runs took.
        let summary = model.weight_summary();
        let weights: Vec<String> = summary
            .iter()
            .map(|(kind, count, _)| format!("{count} {kind}"))
            .collect();
        let weight_kinds: Vec<&str> = summary.iter().map(|(kind, _, _)| kind.as_str()).collect();
        let weight_kinds = weight_kinds.join(" + ");
        eprintln!("weights: {}", weights.join(", "));
        let (bandwidth, where_) = match args.model.backend {
            BackendKind::Cpu | BackendKind::Ndarray => (Some(bandwidth::host()), "host"),
            BackendKind::Wgpu | BackendKind::Cuda => (bandwidth::device::<B>(&device), "device"),
        };
        let bound = bandwidth.map(|b| b / weight_bytes as f64);
        match (bandwidth, bound) {
            (Some(bandwidth), Some(bound)) => eprintln!(
                "memory bandwidth ({where_}, measured): {:.1} GB/s; weights read per token {:.0} MB; decode bound at batch 1: {bound:.1} tok/s",
                bandwidth / 1e9,
                weight_bytes as f64 / 1e6
            ),
            _ => eprintln!("memory bandwidth ({where_}): could not be measured"),
        }
        println!(
            "{:>6} {:>5} {:>8} {:>14} {:>13} {:>9} {:>11} {:>11} {:>12}{}  weights",
            "prompt",
            "batch",
            "sampling",
            "prefill tok/s",
            "decode tok/s",
            "TTFT ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "peak RSS MB",
            if reports_device_memory {
                format!(" {:>12}", "peak dev MB")
            } else {
                String::new()
            }
        );
        let mut cells = Vec::new();
        for &prompt_len in &args.prompt_lens {
            for &batch in &args.batch_sizes {
                for &sampling in &args.sampling {
                    cells.push(Cell {
                        prompt_len,
                        batch,
                        new_tokens: args.new_tokens,
                        max_step_tokens: settings.max_step_tokens,
                        sampling,
                        speculation,
                    });
                }
            }
        }
        let bar = progress::bar(
            (cells.len() * (args.repeats + 1)) as u64,
            "benchmarking".into(),
            "runs",
        );
        let mut reports = Vec::new();
        for cell in cells {
            B::release_unused_device_memory(&device);
            // Every sequence of the cell held whole, its prompts read in one step each.
            let run = Run {
                requests: Some(cell.batch),
                max_len: cell.prompt_len + cell.new_tokens,
                longest_prompt: cell.prompt_len,
                ..engine_args::run_for(&model, kv_dtype, args.model.backend)
            };
            let mut spec = engine_args::spec(&settings, &run, &BENCH)?;
            spec.config.speculation = speculation;
            // One engine per cell, its warm-up and timed runs one after another on it.
            let draft_model = draft.as_ref().map(|d| &d.model as &dyn CausalLm<B>);
            let mut engine = spec.engine(&model, kv_dtype, draft_model)?;
            memory::reset_peak();
            let mut runs = Vec::with_capacity(args.repeats);
            for run in 0..=args.repeats {
                let this_run = if run == 0 { cell.warm_up() } else { cell };
                let timings = run_cell(&mut engine, &this_run).with_context(|| {
                    format!(
                        "prompt {}, batch {}, {}",
                        cell.prompt_len, cell.batch, cell.sampling
                    )
                })?;
                bar.inc(1);
                if run > 0 {
                    runs.push(timings);
                }
            }
            let peak = memory::peak_rss();
            let r = report(cell, &runs, peak, weights.clone());
            let megabytes =
                |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.0}", b as f64 / 1e6));
            bar.suspend(|| {
                println!(
                    "{:>6} {:>5} {:>8} {:>14.1} {:>13.1} {:>9.1} {:>11.2} {:>11.2} {:>12}{}  {weight_kinds}",
                    cell.prompt_len,
                    cell.batch,
                    cell.sampling.name(),
                    r.prefill_tokens_per_s,
                    r.decode_tokens_per_s,
                    r.time_to_first_token_ms,
                    r.itl_p50_ms,
                    r.itl_p99_ms,
                    megabytes(r.peak_rss_bytes),
                    if reports_device_memory {
                        format!(" {:>12}", megabytes(r.peak_device_bytes))
                    } else {
                        String::new()
                    }
                );
                if args.verbose {
                    let w = r.per_step;
                    println!(
                        "{:>22} per decode step: {} kernel launches, {:.1} uploads, {:.1} blocking reads",
                        "",
                        w.launches.map_or("uncounted".into(), |l| format!("{l:.1}")),
                        w.uploads,
                        w.reads
                    );
                }
                if speculation.is_some() {
                    println!(
                        "{:>22} speculation: {:.0} % of {} drafts accepted, {:.2} tokens per forward",
                        "",
                        r.speculation.acceptance_rate() * 100.0,
                        r.speculation.drafted,
                        r.speculation.tokens_per_forward()
                    );
                }
            });
            reports.push(r);
        }
        bar.finish_and_clear();
        let (fallbacks, first_fallback) = kiln_core::backend::kernel_fallbacks();
        if args.verbose && fallbacks > 0 {
            println!(
                "{fallbacks} kernel calls ran burn's composition instead of kiln's kernel (first: {})",
                first_fallback.as_deref().unwrap_or("?")
            );
        }
        if let Some(path) = &args.json {
            let value = json!({
                "model": name,
                "backend": args.model.backend.name(),
                "device": device_name,
                "dtype": dtype.name(),
                "kv_dtype": kv_dtype.name(),
                "weights": weights,
                "parameters": model.config().parameters(),
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "memory": memory_kind,
                "bandwidth_bytes_per_s": bandwidth,
                "bandwidth_measured_on": where_,
                "weight_bytes": weight_bytes,
                "decode_bound_batch_1_tokens_per_s": bound,
                "kernel_fallbacks": fallbacks,
                "cells": reports.iter().map(|r| json!({
                    "prompt_len": r.cell.prompt_len,
                    "batch": r.cell.batch,
                    "sampling": r.cell.sampling.name(),
                    "weights": r.weights,
                    "prefill_tokens_per_s": r.prefill_tokens_per_s,
                    "decode_tokens_per_s": r.decode_tokens_per_s,
                    "time_to_first_token_ms": r.time_to_first_token_ms,
                    "itl_p50_ms": r.itl_p50_ms,
                    "itl_p99_ms": r.itl_p99_ms,
                    "speculation": speculation.map(|_| json!({
                        "acceptance_rate": r.speculation.acceptance_rate(),
                        "tokens_per_forward": r.speculation.tokens_per_forward(),
                    })),
                    "peak_memory_bytes": r.peak_memory_bytes(),
                    "peak_rss_bytes": r.peak_rss_bytes,
                    "peak_device_reserved_bytes": r.peak_device_bytes,
                    "per_decode_step": {
                        "kernel_launches": r.per_step.launches,
                        "uploads": r.per_step.uploads,
                        "blocking_reads": r.per_step.reads,
                    },
                })).collect::<Vec<_>>(),
            });
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(path, serde_json::to_string_pretty(&value)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}
