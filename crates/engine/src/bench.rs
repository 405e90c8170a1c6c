//! [`run_cell`]: one cell of kiln's benchmark matrix (`kiln bench`, `cargo xtask bench`):
//! `batch` synthetic prompts of `prompt_len` tokens submitted at once to an [`Engine`], each
//! generating exactly `new_tokens` tokens (no EOS, no stop strings), greedy or sampled
//! ([`Sampling`]). What is timed is [`Engine::step`], scheduler and samplers included, not a
//! loop of the benchmark's own.
//!
//! The cell's engine runs [`StepPolicy::PrefillFirst`] ([`Cell::engine_config`]), so its steps
//! fall into two phases, timed apart as llama.cpp's `llama-bench` (pp / tg) and vLLM's latency
//! benchmark do, each with a clean rate; the Python twin (`scripts/bench/transformers_bench.py`)
//! runs the same phases:
//! - **prefill**: the steps until every sequence has its first token. Each packs whole prompts
//!   up to `max_step_tokens` and samples the first token of every prompt it completes; a
//!   sequence's time to first token is the end of that step.
//! - **decode**: every later step, each one token for every sequence: `new_tokens - 1` steps;
//!   with speculative decoding ([`Cell::speculation`]) fewer steps, each one to K+1 tokens per
//!   sequence, and the decode rate counts the tokens.
//!
//! On backends whose device allocator reports its memory (wgpu, cuda), the run samples it after
//! every step, outside the step's time, and keeps the largest figures.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use kiln_core::sampling::SamplingParams;
use kiln_core::{DeviceMemory, InferenceBackend, TokenId};

use crate::cache::CacheSpec;
use crate::engine::{Engine, EngineConfig, StepPolicy};
use crate::error::EngineError;
use crate::request::{Event, Request};
use crate::speculate::{SpecCounts, Speculation};

/// How a cell picks its tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Sampling {
    /// Argmax (temperature 0).
    #[default]
    Greedy,
    /// Temperature 0.7 then top-p 0.9 over the whole vocabulary, a seeded draw (sequence `i`
    /// seeds its RNG with `i`, so runs agree): the usual chat settings, to measure what
    /// sampling adds to a step.
    TopP,
}

impl Sampling {
    /// Every setting.
    pub const ALL: [Sampling; 2] = [Sampling::Greedy, Sampling::TopP];

    /// The name on the command line and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Sampling::Greedy => "greedy",
            Sampling::TopP => "top-p",
        }
    }

    /// The settings of the cell's `seq`-th sequence.
    pub fn params(self, seq: usize) -> SamplingParams {
        match self {
            Sampling::Greedy => SamplingParams::greedy(),
            Sampling::TopP => SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                seed: Some(seq as u64),
                ..SamplingParams::default()
            },
        }
    }
}

impl fmt::Display for Sampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Sampling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Sampling::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Sampling::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown sampling `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// What one cell runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    /// Tokens per prompt.
    pub prompt_len: usize,
    /// Prompts run together.
    pub batch: usize,
    /// Tokens generated per prompt (the first comes from the prefill).
    pub new_tokens: usize,
    /// Most prompt tokens per prefill step: whole prompts are packed up to it, and a longer
    /// prompt runs alone.
    pub max_step_tokens: usize,
    /// How tokens are picked.
    pub sampling: Sampling,
    /// Speculative decoding (`None`: off). A draft model, if it drafts with one, is the
    /// engine's ([`Engine::with_draft_model`]).
    pub speculation: Option<Speculation>,
}

impl Cell {
    /// Decode steps of a warm-up run: enough to compile and tune the decode kernels without
    /// paying for the whole decode again. On cubecl's backends a context length first met in a
    /// timed run can still compile a kernel once; that run's ITL p99 shows it, and the median of
    /// several runs leaves it out.
    pub const WARM_UP_NEW_TOKENS: usize = 8;

    /// The run that precedes the timed ones: the same prefill (every prefill shape of the cell,
    /// all sequences in the cache) and the first [`Self::WARM_UP_NEW_TOKENS`] tokens.
    pub fn warm_up(&self) -> Cell {
        Cell {
            new_tokens: self.new_tokens.min(Self::WARM_UP_NEW_TOKENS),
            ..*self
        }
    }

    /// The engine a cell runs on (its warm-up too): every sequence at once, prefill steps of
    /// whole prompts up to `max_step_tokens` (a longer prompt in one step), prefill apart
    /// from decode, and no prefix caching: a cell times computing its prompts, and its runs
    /// repeat them.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            max_batch: self.batch,
            max_step_tokens: self.max_step_tokens.max(self.prompt_len),
            policy: StepPolicy::PrefillFirst,
            prefix_cache: false,
            speculation: self.speculation,
            max_group_rows: None,
        }
    }

    /// A paged cache that holds every sequence of the cell whole.
    pub fn cache_spec(&self) -> CacheSpec {
        CacheSpec::paged(self.batch, self.prompt_len + self.new_tokens)
    }
}

/// Raw timings of one run of a cell.
#[derive(Debug, Clone, PartialEq)]
pub struct CellTimings {
    /// From the start (before the requests are submitted) to the end of the step that gave
    /// the last sequence its first token.
    pub prefill: Duration,
    /// Per sequence, in submission order: from the start to the end of the step that gave its
    /// first token.
    pub time_to_first_token: Vec<Duration>,
    /// Each decode step (one token for every sequence: `new_tokens - 1` of them; with
    /// speculation fewer, each one or more tokens per sequence still decoding).
    pub decode_steps: Vec<Duration>,
    /// Tokens the decode steps produced, over all sequences.
    pub decode_tokens: usize,
    /// The run's speculation counts (zero without speculation).
    pub speculation: SpecCounts,
    /// The tokens generated, per sequence in submission order (for checking runs agree).
    pub tokens: Vec<Vec<TokenId>>,
    /// The device allocator's largest figures after any step of the run, each its own
    /// maximum; `None` where the backend does not report them.
    pub peak_device_memory: Option<DeviceMemory>,
    /// What the decode steps cost in launches and transfers, all steps together.
    pub decode_work: DeviceWork,
}

/// Kernel launches and host-device transfers over some steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceWork {
    /// Kernels launched, where the backend counts them
    /// ([`kiln_core::backend::launches_settled`]).
    pub launches: Option<u64>,
    /// Uploads and blocking reads ([`kiln_core::tensor::transfers`]).
    pub transfers: kiln_core::tensor::Transfers,
}

impl CellTimings {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_s(&self, cell: &Cell) -> f64 {
        rate(cell.batch * cell.prompt_len, self.prefill)
    }

    /// Tokens per second of decode, all sequences together.
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode_steps.iter().sum())
    }
}

fn rate(tokens: usize, time: Duration) -> f64 {
    let seconds = time.as_secs_f64();
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

/// The `q`-quantile (0..=1) of `values`, by the nearest-rank method; 0 for none.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `batch` prompts of `len` tokens, ids spread over the vocabulary, different per prompt.
pub fn synthetic_prompts(batch: usize, len: usize, vocab: usize) -> Vec<Vec<TokenId>> {
    (0..batch)
        .map(|p| {
            (0..len)
                .map(|i| TokenId(((i * 7919 + p * 104_729 + 13) % vocab) as u32))
                .collect()
        })
        .collect()
}

/// Runs `cell` once on `engine`, which must be idle and built with [`Cell::engine_config`] on
/// a cache that holds `batch` sequences of `prompt_len + new_tokens` tokens
/// ([`Cell::cache_spec`]); the engine is idle again, its cache empty, when it returns.
///
/// # Errors
/// [`EngineError::InvalidConfig`] for an engine that is busy or configured otherwise, or a run
/// that did not keep prefill and decode apart (a cache too small, so sequences were
/// preempted); the engine's own errors (a prompt past the context, a model failure).
pub fn run_cell<B: InferenceBackend>(
    engine: &mut Engine<'_, B>,
    cell: &Cell,
) -> Result<CellTimings, EngineError> {
    let invalid = |m: String| Err(EngineError::InvalidConfig(m));
    if engine.config() != cell.engine_config() {
        return invalid(format!(
            "a benchmark cell needs the engine configured as {:?}, not {:?}",
            cell.engine_config(),
            engine.config()
        ));
    }
    if !engine.is_idle() {
        return invalid("a benchmark cell needs an idle engine".into());
    }
    if cell.new_tokens == 0 {
        return invalid("a benchmark cell generates at least one token".into());
    }
    let model = engine.model();
    let prompts = synthetic_prompts(cell.batch, cell.prompt_len, model.shape().vocab);
    let device = model.device();
    let mut peak_device_memory: Option<DeviceMemory> = None;
    let mut sample_memory = || {
        if let Some(now) = B::device_memory(&device) {
            let peak = peak_device_memory.get_or_insert(now);
            peak.in_use = peak.in_use.max(now.in_use);
            peak.reserved = peak.reserved.max(now.reserved);
        }
    };

    let before = engine.speculation_stats();
    let start = Instant::now();
    // The engine's id of each request -> its index in the cell.
    let mut index = HashMap::with_capacity(cell.batch);
    for (i, prompt) in prompts.into_iter().enumerate() {
        let id = engine.submit(Request {
            prompt,
            max_tokens: cell.new_tokens,
            sampling: cell.sampling.params(i),
            // No EOS and no stop strings: every sequence generates all `new_tokens`.
            eos: Vec::new(),
            ..Request::default()
        })?;
        index.insert(id, i);
    }

    let mut tokens: Vec<Vec<TokenId>> = vec![Vec::with_capacity(cell.new_tokens); cell.batch];
    let mut time_to_first_token = vec![Duration::ZERO; cell.batch];
    let mut waiting_for_first = cell.batch;
    let mut prefill = None;
    let mut decode_steps = Vec::with_capacity(cell.new_tokens.saturating_sub(1));
    let mut decode_tokens = 0;
    let mut preemptions = 0;
    let mut decode_transfers = kiln_core::tensor::Transfers::default();
    let mut launches_at_decode = None;
    while !engine.is_idle() {
        let transfers_before = kiln_core::tensor::transfers();
        let step_start = Instant::now();
        let events = engine.step()?;
        let step = step_start.elapsed();
        let now = start.elapsed();
        sample_memory();
        let mut step_tokens = 0;
        for event in events {
            match event {
                Event::Token { id, token, .. } => {
                    // The engine was idle: every request it serves is one of the cell's.
                    let Some(&i) = index.get(&id) else { continue };
                    if tokens[i].is_empty() {
                        time_to_first_token[i] = now;
                        waiting_for_first -= 1;
                    }
                    tokens[i].push(token);
                    step_tokens += 1;
                }
                Event::Finished(completion) => preemptions += completion.preemptions,
                Event::Text { .. } => {}
            }
        }
        if prefill.is_some() {
            if step_tokens != cell.batch && cell.speculation.is_none() {
                return invalid(format!(
                    "a decode step gave {step_tokens} tokens for {} sequences",
                    cell.batch
                ));
            }
            decode_steps.push(step);
            decode_tokens += step_tokens;
            let moved = kiln_core::tensor::transfers() - transfers_before;
            decode_transfers.uploads += moved.uploads;
            decode_transfers.reads += moved.reads;
        } else if waiting_for_first == 0 {
            prefill = Some(now);
            launches_at_decode = kiln_core::backend::launches_settled();
        }
    }
    let decode_work = DeviceWork {
        launches: launches_at_decode
            .zip(kiln_core::backend::launches_settled())
            .map(|(before, after)| after - before),
        transfers: decode_transfers,
    };
    if preemptions > 0 {
        return invalid(format!(
            "the cache is too small for the cell: {preemptions} preemptions"
        ));
    }
    let after = engine.speculation_stats();
    let speculation = SpecCounts {
        drafted: after.drafted - before.drafted,
        accepted: after.accepted - before.accepted,
        forwards: after.forwards - before.forwards,
        tokens: after.tokens - before.tokens,
    };
    Ok(CellTimings {
        prefill: prefill.unwrap_or_default(),
        time_to_first_token,
        decode_steps,
        decode_tokens,
        decode_work,
        speculation,
        tokens,
        peak_device_memory,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

    use kiln_core::Dtype;
    use kiln_core::kv_cache::CacheKind;
    use kiln_core::testing::{Recording, Scripted};

    use super::*;

    type B = burn::backend::Flex;

    const VOCAB: usize = Scripted::VOCAB;

    /// Next token = last token + 1 (mod the vocabulary), as a one-hot row far above the rest,
    /// so greedy and top-p agree; plans the cache (blocks are really reserved and freed) and
    /// records each forward's sequences and tokens.
    type CountUp = Recording<Scripted>;

    fn count_up() -> CountUp {
        Recording::new(Scripted {
            script: |token, _| (token + 1) % VOCAB as u32,
        })
    }

    fn cell(sampling: Sampling) -> Cell {
        Cell {
            prompt_len: 3,
            batch: 5,
            new_tokens: 4,
            max_step_tokens: 8,
            sampling,
            speculation: None,
        }
    }

    fn engine<'a>(model: &'a CountUp, cell: &Cell, spec: CacheSpec) -> Engine<'a, B> {
        let cache = spec
            .build::<B>(
                model.inner.shape().kv_layout(),
                Dtype::F32,
                &Default::default(),
            )
            .unwrap();
        Engine::new(model, cache, cell.engine_config()).unwrap()
    }

    /// Every sequence generates exactly `new_tokens` (no EOS stops it), the prefill packs whole
    /// prompts up to `max_step_tokens` apart from the decode, and each decode step is one token
    /// for every sequence: `new_tokens - 1` of them. The same engine runs the cell again (the
    /// warm-up, then the timed runs) with the same tokens.
    #[test]
    fn a_cell_generates_new_tokens_for_every_sequence_through_the_engine() {
        for sampling in Sampling::ALL {
            let model = count_up();
            let cell = cell(sampling);
            let mut engine = engine(&model, &cell, cell.cache_spec());
            let timings = run_cell(&mut engine, &cell).unwrap();

            let prompts = synthetic_prompts(cell.batch, cell.prompt_len, VOCAB);
            let expected: Vec<Vec<TokenId>> = prompts
                .iter()
                .map(|p| {
                    let last = p[p.len() - 1].0 as usize;
                    (1..=cell.new_tokens)
                        .map(|k| TokenId(((last + k) % VOCAB) as u32))
                        .collect()
                })
                .collect();
            assert_eq!(timings.tokens, expected, "{sampling}");
            assert_eq!(timings.decode_steps.len(), cell.new_tokens - 1);
            assert_eq!(timings.time_to_first_token.len(), cell.batch);
            assert!(
                timings
                    .time_to_first_token
                    .iter()
                    .all(|&t| t <= timings.prefill)
            );
            assert!(timings.time_to_first_token.is_sorted());
            // 2 prompts of 3 fit in 8 tokens: three prefill steps, then the decode steps.
            let decode = (cell.batch, cell.batch);
            assert_eq!(
                model.forwards(),
                [(2, 6), (2, 6), (1, 3), decode, decode, decode]
            );
            assert!(engine.is_idle());
            assert_eq!(engine.cache().usage().used, 0, "the cell empties its cache");

            let again = run_cell(&mut engine, &cell.warm_up()).unwrap();
            assert_eq!(again.tokens, timings.tokens);
        }
    }

    /// A speculative cell (the model drafting for itself: every draft stands) gives the plain
    /// cell's tokens in fewer decode steps, counting every decoded token.
    #[test]
    fn a_speculative_cell_counts_tokens_not_steps() {
        let model = count_up();
        let plain = Cell {
            new_tokens: 9,
            ..cell(Sampling::Greedy)
        };
        let cell = Cell {
            speculation: Some(Speculation {
                source: crate::DraftSource::Model,
                draft_tokens: 3,
                adaptive: false,
                max_batch: 0,
            }),
            ..plain
        };
        let expected = run_cell(&mut engine(&model, &plain, plain.cache_spec()), &plain).unwrap();
        let draft_cache = cell
            .cache_spec()
            .build::<B>(
                model.inner.shape().kv_layout(),
                Dtype::F32,
                &Default::default(),
            )
            .unwrap();
        let mut fast = engine(&model, &cell, cell.cache_spec())
            .with_draft_model(&model, draft_cache)
            .unwrap();
        let timings = run_cell(&mut fast, &cell).unwrap();
        assert_eq!(timings.tokens, expected.tokens);
        assert_eq!(timings.decode_tokens, cell.batch * (cell.new_tokens - 1));
        assert_eq!(expected.decode_tokens, timings.decode_tokens);
        // 8 decoded tokens per sequence: 4, then 4 (three drafts and the token after them).
        assert_eq!(timings.decode_steps.len(), 2);
        let spec = timings.speculation;
        assert_eq!((spec.drafted, spec.accepted), (30, 30));
        assert_eq!(expected.speculation.drafted, 0);
        assert!(spec.tokens_per_forward() > expected.speculation.tokens_per_forward());
    }

    #[test]
    fn a_prompt_longer_than_a_step_runs_whole_and_one_token_means_no_decode_step() {
        let model = count_up();
        let cell = Cell {
            prompt_len: 12,
            batch: 2,
            new_tokens: 1,
            max_step_tokens: 8,
            sampling: Sampling::Greedy,
            speculation: None,
        };
        let mut engine = engine(&model, &cell, cell.cache_spec());
        let timings = run_cell(&mut engine, &cell).unwrap();
        assert!(timings.tokens.iter().all(|t| t.len() == 1));
        assert!(timings.decode_steps.is_empty());
        assert_eq!(model.forwards(), [(1, 12), (1, 12)]);
    }

    #[test]
    fn an_engine_configured_otherwise_or_a_cache_too_small_is_refused() {
        let model = count_up();
        let cell = cell(Sampling::Greedy);
        let cache = cell
            .cache_spec()
            .build::<B>(
                model.inner.shape().kv_layout(),
                Dtype::F32,
                &Default::default(),
            )
            .unwrap();
        let mut mixed = Engine::new(&model, cache, EngineConfig::default()).unwrap();
        assert!(matches!(
            run_cell(&mut mixed, &cell),
            Err(EngineError::InvalidConfig(_))
        ));

        // Blocks of 2 tokens: the five prompts alone need 10 and the pool has 9, so a sequence
        // is preempted and the phases no longer separate.
        let small = CacheSpec {
            kind: CacheKind::Paged,
            page_size: 2,
            blocks: Some(9),
            ..cell.cache_spec()
        };
        let mut engine = engine(&model, &cell, small);
        assert!(matches!(
            run_cell(&mut engine, &cell),
            Err(EngineError::InvalidConfig(_))
        ));
    }

    #[test]
    fn warm_up_keeps_the_prefill_and_shortens_the_decode() {
        let cell = Cell {
            prompt_len: 512,
            batch: 32,
            new_tokens: 128,
            max_step_tokens: 512,
            sampling: Sampling::TopP,
            speculation: None,
        };
        let warm_up = cell.warm_up();
        assert_eq!(warm_up.new_tokens, Cell::WARM_UP_NEW_TOKENS);
        assert_eq!((warm_up.prompt_len, warm_up.batch), (512, 32));
        assert_eq!(warm_up.engine_config(), cell.engine_config());
        let short = Cell {
            new_tokens: 3,
            ..cell
        };
        assert_eq!(short.warm_up(), short);
    }

    #[test]
    fn sampling_names_round_trip_and_top_p_is_seeded_per_sequence() {
        for s in Sampling::ALL {
            assert_eq!(s.name().parse::<Sampling>(), Ok(s));
        }
        assert!("typical".parse::<Sampling>().is_err());
        assert!(Sampling::Greedy.params(3).is_greedy());
        let p = Sampling::TopP.params(3);
        assert_eq!((p.temperature, p.top_p, p.seed), (0.7, 0.9, Some(3)));
        assert!(p.validate().is_ok());
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
