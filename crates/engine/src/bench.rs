//! [`run_cell`]: one cell of kiln's benchmark matrix (`kiln bench`, `cargo xtask bench`):
//! `batch` synthetic prompts of `prompt_len` tokens, prefilled packed, then decoded together
//! greedily for `new_tokens` tokens, no EOS. Prefill and decode are timed as separate phases,
//! as llama.cpp's `llama-bench` (pp / tg) and vLLM's latency benchmark do, so each has a clean
//! rate; the Python twin (`scripts/bench/transformers_bench.py`) runs the same phases.
//!
//! On backends whose device allocator reports its memory (wgpu, cuda), the run samples it after
//! every forward and keeps the largest figures.

use std::time::{Duration, Instant};

use kiln_core::kv_cache::KvCache;
use kiln_core::{
    Batch, CausalLm, CoreError, DeviceMemory, InferenceBackend, LogitsFor, Position, SeqId, TokenId,
};

/// What one cell runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    /// Tokens per prompt.
    pub prompt_len: usize,
    /// Prompts run together.
    pub batch: usize,
    /// Tokens generated per prompt (the first comes from the prefill).
    pub new_tokens: usize,
    /// Most prompt tokens per prefill forward (whole prompts are packed up to it).
    pub max_step_tokens: usize,
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
}

/// Raw timings of one run of a cell.
#[derive(Debug, Clone, PartialEq)]
pub struct CellTimings {
    /// From the start to the end of the last prefill forward.
    pub prefill: Duration,
    /// Per sequence: from the start to its first token.
    pub time_to_first_token: Vec<Duration>,
    /// Each decode step (one token for every sequence).
    pub decode_steps: Vec<Duration>,
    /// The tokens generated, per sequence (for checking runs agree).
    pub tokens: Vec<Vec<TokenId>>,
    /// The device allocator's largest figures after any forward of the run, each its own
    /// maximum; `None` where the backend does not report them.
    pub peak_device_memory: Option<DeviceMemory>,
}

impl CellTimings {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_s(&self, cell: &Cell) -> f64 {
        rate(cell.batch * cell.prompt_len, self.prefill)
    }

    /// Tokens per second of decode, all sequences together.
    pub fn decode_tokens_per_s(&self, cell: &Cell) -> f64 {
        rate(
            cell.batch * self.decode_steps.len(),
            self.decode_steps.iter().sum(),
        )
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

fn argmax(row: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    TokenId(best as u32)
}

/// Runs `cell` once on `cache` (which must be empty and hold `batch` sequences of
/// `prompt_len + new_tokens`), and empties it again.
///
/// # Errors
/// The model's or cache's refusal (a cache too small, a prompt past the context).
pub fn run_cell<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    cache: &mut dyn KvCache<B>,
    cell: &Cell,
) -> Result<CellTimings, CoreError> {
    let vocab = model.shape().vocab;
    let prompts = synthetic_prompts(cell.batch, cell.prompt_len, vocab);
    let mut tokens: Vec<Vec<TokenId>> = vec![Vec::with_capacity(cell.new_tokens); cell.batch];
    let mut time_to_first_token = vec![Duration::ZERO; cell.batch];
    let per_step = cell.max_step_tokens.max(cell.prompt_len);
    let device = model.device();
    let mut peak_device_memory: Option<DeviceMemory> = None;
    let mut sample_memory = || {
        if let Some(now) = B::device_memory(&device) {
            let peak = peak_device_memory.get_or_insert(now);
            peak.in_use = peak.in_use.max(now.in_use);
            peak.reserved = peak.reserved.max(now.reserved);
        }
    };

    let start = Instant::now();
    let mut next = 0;
    while next < cell.batch {
        let first = next;
        let mut batch = Batch::new();
        while next < cell.batch
            && (batch.is_empty() || batch.n_tokens() + cell.prompt_len <= per_step)
        {
            batch.push(SeqId(next as u64), &prompts[next], Position(0))?;
            next += 1;
        }
        let logits = model.forward(&batch, cache, LogitsFor::LastOfEachSequence)?;
        let rows: Vec<f32> = logits.into_data().iter::<f32>().collect();
        let now = start.elapsed();
        sample_memory();
        for (seq, row) in (first..next).zip(rows.chunks(vocab)) {
            tokens[seq].push(argmax(row));
            time_to_first_token[seq] = now;
        }
    }
    let prefill = start.elapsed();

    let mut decode_steps = Vec::with_capacity(cell.new_tokens.saturating_sub(1));
    for step in 1..cell.new_tokens {
        let step_start = Instant::now();
        let mut batch = Batch::new();
        let position = Position((cell.prompt_len + step - 1) as u32);
        for (seq, generated) in tokens.iter().enumerate() {
            let last = *generated
                .last()
                .expect("prefill gave every sequence a token");
            batch.push(SeqId(seq as u64), &[last], position)?;
        }
        let logits = model.forward(&batch, cache, LogitsFor::LastOfEachSequence)?;
        let rows: Vec<f32> = logits.into_data().iter::<f32>().collect();
        for (generated, row) in tokens.iter_mut().zip(rows.chunks(vocab)) {
            generated.push(argmax(row));
        }
        decode_steps.push(step_start.elapsed());
        sample_memory();
    }
    cache.clear();
    Ok(CellTimings {
        prefill,
        time_to_first_token,
        decode_steps,
        tokens,
        peak_device_memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_keeps_the_prefill_and_shortens_the_decode() {
        let cell = Cell {
            prompt_len: 512,
            batch: 32,
            new_tokens: 128,
            max_step_tokens: 512,
        };
        let warm_up = cell.warm_up();
        assert_eq!(warm_up.new_tokens, Cell::WARM_UP_NEW_TOKENS);
        assert_eq!((warm_up.prompt_len, warm_up.batch), (512, 32));
        let short = Cell {
            new_tokens: 3,
            ..cell
        };
        assert_eq!(short.warm_up(), short);
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
