//! Embeddings: each input's final hidden states (after the model's final norm, before its
//! head: transformers' `last_hidden_state`), pooled into one vector and L2-normalised, as
//! decoder embedding models (Qwen3-Embedding) and sentence-transformers define them.
//!
//! An [`Embedding`] is a job of several inputs, run a few at a time ([`Embedding::step`]):
//! each step packs the next inputs into one [`Batch`] (no padding, one span each, positions
//! from 0) and runs one [`CausalLm::hidden_states`] forward on a scratch cache of its own,
//! sized for that batch and dropped after it. Nothing is written to, or taken from, the
//! engine's cache, so an embedding never holds blocks a generation needs and leaves no K/V
//! behind; a caller that also generates (the server's engine thread) alternates these steps
//! with [`crate::Engine::step`], so neither waits for the other to finish.
//!
//! It knows nothing of text or HTTP: token ids in, vectors out.

use kiln_core::kv_cache::StaticKvCache;
use kiln_core::{Batch, CausalLm, InferenceBackend, LogitsFor, Position, SeqId, TokenId};

use crate::error::EngineError;

/// How one input's hidden states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// The last token's state (Qwen3-Embedding and other decoder embedders, whose last token
    /// has attended to all the others): sentence-transformers' `pooling_mode_lasttoken`.
    #[default]
    Last,
    /// The mean of every token's state: sentence-transformers' `pooling_mode_mean_tokens`.
    Mean,
}

impl Pooling {
    /// The name `--embedding-pooling` takes and the log shows.
    pub fn name(self) -> &'static str {
        match self {
            Self::Last => "last",
            Self::Mean => "mean",
        }
    }
}

impl std::str::FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "last" => Ok(Self::Last),
            "mean" => Ok(Self::Mean),
            other => Err(format!(
                "unknown pooling `{other}` (expected `last` or `mean`)"
            )),
        }
    }
}

/// The most token slots (inputs × the longest of them) one step's scratch cache holds, unless
/// one input alone is longer: the same order as a generation step's default
/// `max_step_tokens`, so a step of embeddings takes about as long as a step of prefill.
pub const STEP_TOKENS: usize = 2048;

/// One job of inputs to embed, run a step at a time.
#[derive(Debug, Clone)]
pub struct Embedding {
    inputs: Vec<Vec<TokenId>>,
    pooling: Pooling,
    /// One normalised vector per input embedded so far, in input order.
    vectors: Vec<Vec<f32>>,
}

impl Embedding {
    /// A job embedding each of `inputs` with `pooling`.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for no inputs or an empty one.
    pub fn new(inputs: Vec<Vec<TokenId>>, pooling: Pooling) -> Result<Self, EngineError> {
        if inputs.is_empty() {
            return Err(EngineError::InvalidRequest("nothing to embed".into()));
        }
        if let Some(i) = inputs.iter().position(Vec::is_empty) {
            return Err(EngineError::InvalidRequest(format!(
                "input {i} has no tokens"
            )));
        }
        let vectors = Vec::with_capacity(inputs.len());
        Ok(Self {
            inputs,
            pooling,
            vectors,
        })
    }

    /// Every input is embedded.
    pub fn is_done(&self) -> bool {
        self.vectors.len() == self.inputs.len()
    }

    /// Tokens of every input together.
    pub fn tokens(&self) -> usize {
        self.inputs.iter().map(Vec::len).sum()
    }

    /// Embeds the next inputs: as many as fit in [`STEP_TOKENS`] slots (at least one), in one
    /// packed forward. Does nothing once [`Embedding::is_done`].
    ///
    /// # Errors
    /// An input longer than the model's context, a token outside its vocabulary, a model that
    /// gives no hidden states, or a failed forward.
    pub fn step<B: InferenceBackend>(
        &mut self,
        model: &dyn CausalLm<B>,
    ) -> Result<(), EngineError> {
        let first = self.vectors.len();
        let chunk = next_chunk(&self.inputs[first..], STEP_TOKENS);
        if chunk == 0 {
            return Ok(());
        }
        let vectors = embed_batch(model, &self.inputs[first..first + chunk], self.pooling)?;
        self.vectors.extend(vectors);
        Ok(())
    }

    /// One L2-normalised vector per input, in input order (those embedded so far).
    pub fn into_vectors(self) -> Vec<Vec<f32>> {
        self.vectors
    }
}

/// Embeds every one of `inputs` with `pooling` ([`Embedding`], stepped to the end).
///
/// # Shapes
/// - returns `inputs.len()` vectors of `d_model` values, each of L2 norm 1.
///
/// # Errors
/// As [`Embedding::new`] and [`Embedding::step`].
pub fn embed<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    inputs: Vec<Vec<TokenId>>,
    pooling: Pooling,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut job = Embedding::new(inputs, pooling)?;
    while !job.is_done() {
        job.step(model)?;
    }
    Ok(job.into_vectors())
}

/// How many of `inputs`, from the first, one step takes: while the scratch cache (inputs ×
/// the longest) stays within `slots`, and always one.
fn next_chunk(inputs: &[Vec<TokenId>], slots: usize) -> usize {
    let mut longest = 0;
    for (n, input) in inputs.iter().enumerate() {
        longest = longest.max(input.len());
        if n > 0 && (n + 1) * longest > slots {
            return n;
        }
    }
    inputs.len()
}

/// One packed forward over `inputs` (each at positions from 0) on a scratch cache, pooled and
/// normalised.
///
/// # Shapes
/// - returns `inputs.len()` vectors of `d_model` values.
fn embed_batch<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    inputs: &[Vec<TokenId>],
    pooling: Pooling,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let shape = model.shape();
    let longest = inputs.iter().map(Vec::len).max().unwrap_or(0);
    if longest > shape.max_positions {
        return Err(EngineError::InvalidRequest(format!(
            "an input of {longest} tokens is longer than the model's context, {}",
            shape.max_positions
        )));
    }
    let mut batch = Batch::new();
    for (i, input) in inputs.iter().enumerate() {
        batch.push(SeqId(i as u64), input, Position(0))?;
    }
    let mut scratch = StaticKvCache::<B>::new(
        shape.kv_layout(),
        inputs.len(),
        longest,
        model.dtype(),
        &model.device(),
    )
    .map_err(kiln_core::CoreError::from)?;
    let rows = match pooling {
        Pooling::Last => LogitsFor::LastOfEachSequence,
        Pooling::Mean => LogitsFor::All,
    };
    // `[rows, d_model]`, row-major.
    let states = kiln_core::tensor::host_f32(model.hidden_states(&batch, &mut scratch, rows)?);
    let width = states.len()
        / match pooling {
            Pooling::Last => inputs.len(),
            Pooling::Mean => batch.n_tokens(),
        };
    let mut vectors = Vec::with_capacity(inputs.len());
    match pooling {
        Pooling::Last => vectors.extend(states.chunks_exact(width).map(<[f32]>::to_vec)),
        Pooling::Mean => {
            for (_, range) in batch.ranges() {
                let mut sum = vec![0.0f64; width];
                for row in states[range.start * width..range.end * width].chunks_exact(width) {
                    for (s, &v) in sum.iter_mut().zip(row) {
                        *s += f64::from(v);
                    }
                }
                let n = range.len() as f64;
                vectors.push(sum.into_iter().map(|s| (s / n) as f32).collect());
            }
        }
    }
    for v in &mut vectors {
        normalize(v);
    }
    Ok(vectors)
}

/// Scales `v` to L2 norm 1 (a zero vector stays zero), summing in f64.
pub fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for x in v.iter_mut() {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}

/// `v`'s first `dimensions` values, normalised again (Matryoshka models are trained so this
/// prefix is an embedding of its own; OpenAI's `dimensions`).
///
/// # Shapes
/// - returns `min(dimensions, v.len())` values.
pub fn truncate(v: &[f32], dimensions: usize) -> Vec<f32> {
    let mut out = v[..dimensions.min(v.len())].to_vec();
    normalize(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<TokenId> {
        (0..n as u32).map(TokenId).collect()
    }

    #[test]
    fn a_chunk_stays_within_its_slots_and_takes_at_least_one() {
        assert_eq!(next_chunk(&[ids(4), ids(4), ids(4)], 8), 2);
        assert_eq!(next_chunk(&[ids(10), ids(1)], 8), 1);
        assert_eq!(next_chunk(&[ids(1), ids(1), ids(9)], 8), 2);
        assert_eq!(next_chunk(&vec![ids(2); 4], 8), 4);
        assert_eq!(next_chunk(&[], 8), 0);
    }

    #[test]
    fn truncation_renormalises() {
        let v = truncate(&[3.0, 4.0, 12.0], 2);
        assert!((v[0] - 0.6).abs() < 1e-7 && (v[1] - 0.8).abs() < 1e-7);
        let mut zero = vec![0.0; 3];
        normalize(&mut zero);
        assert_eq!(zero, vec![0.0; 3]);
    }

    #[test]
    fn empty_jobs_and_inputs_are_refused() {
        assert!(Embedding::new(Vec::new(), Pooling::Last).is_err());
        assert!(Embedding::new(vec![ids(2), Vec::new()], Pooling::Mean).is_err());
        assert_eq!("mean".parse::<Pooling>(), Ok(Pooling::Mean));
        assert!("max".parse::<Pooling>().is_err());
    }
}
