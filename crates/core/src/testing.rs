//! Stand-in models for tests (the `test-support` feature): [`CausalLm`]s with no weights whose
//! logits are a pure function of each token and its position, so that the engine, its
//! scheduler and the benchmark harness are tested without loading a model (nanochat's "engine
//! tested with a mock model").
//!
//! Each plans the cache on every forward, so blocks are really reserved, registered and freed
//! as a real model's would be; none reads or writes K/V. [`Recording`] wraps any model and
//! keeps what it was fed.
//!
//! Not for production: nothing here is fast, and the models know nothing of language.

use std::cell::RefCell;

use burn::tensor::{Tensor, TensorData};

use crate::{Batch, CausalLm, Dtype, InferenceBackend, KvCache, LogitsFor, ModelShape, Result};

/// The shape every stand-in shares (one layer, one head of width 2, 1,024 positions), with
/// `vocab` tokens.
pub fn stand_in_shape(vocab: usize) -> ModelShape {
    ModelShape {
        n_layers: 1,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 2,
        vocab,
        max_positions: 1024,
    }
}

/// A stand-in's forward: plans the cache for `batch` (so its blocks are reserved) and returns
/// `row(token, position)` for each token `logits` asks for.
///
/// # Shapes
/// - `row` returns `[vocab]`; the result is `[rows, vocab]` (rows as [`LogitsFor::rows`])
///
/// # Errors
/// The cache's refusal, or `logits` asking for rows the batch does not have.
pub fn logits_rows<B: InferenceBackend>(
    batch: &Batch,
    cache: &mut dyn KvCache<B>,
    logits: LogitsFor,
    vocab: usize,
    row: impl Fn(u32, u32) -> Vec<f32>,
) -> Result<Tensor<B, 2>> {
    cache.plan(batch)?;
    let wanted = logits.rows(batch)?;
    let mut rows = Vec::new();
    for i in wanted.unwrap_or_else(|| (0..batch.n_tokens()).collect()) {
        rows.extend(row(batch.tokens()[i].0, batch.positions()[i].0));
    }
    let n = rows.len() / vocab;
    Ok(Tensor::from_data(
        TensorData::new(rows, [n, vocab]),
        &Default::default(),
    ))
}

/// Next token = `script(last token, its position)`, as a one-hot row (10 above zeros, so
/// greedy, top-k and top-p all pick it), over [`Scripted::VOCAB`] tokens.
#[derive(Debug, Clone, Copy)]
pub struct Scripted {
    /// The next token after a token at a position; below [`Scripted::VOCAB`].
    pub script: fn(u32, u32) -> u32,
}

impl Scripted {
    /// The vocabulary of every scripted model.
    pub const VOCAB: usize = 32;

    /// The model's dimensions (also [`CausalLm::shape`]; this one needs no backend named).
    pub fn shape(&self) -> ModelShape {
        stand_in_shape(Self::VOCAB)
    }
}

impl<B: InferenceBackend> CausalLm<B> for Scripted {
    fn shape(&self) -> ModelShape {
        Scripted::shape(self)
    }

    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn device(&self) -> B::Device {
        Default::default()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> Result<Tensor<B, 2>> {
        logits_rows(batch, cache, logits, Self::VOCAB, |token, position| {
            let mut row = vec![0f32; Self::VOCAB];
            row[(self.script)(token, position) as usize] = 10.0;
            row
        })
    }
}

/// Logits `logit(last token, its position, candidate)`: a model with a real distribution over
/// the next token (unlike [`Scripted`]'s one-hot rows), for tests of sampling and speculative
/// decoding.
#[derive(Debug, Clone, Copy)]
pub struct Soft {
    /// The logit of a candidate after a token at a position.
    pub logit: fn(u32, u32, u32) -> f32,
    /// Vocabulary size.
    pub vocab: usize,
}

impl Soft {
    /// The logits after `token` at `position`.
    ///
    /// # Shapes
    /// - returns `[vocab]`
    pub fn row(&self, token: u32, position: u32) -> Vec<f32> {
        (0..self.vocab as u32)
            .map(|v| (self.logit)(token, position, v))
            .collect()
    }

    /// The model's dimensions (also [`CausalLm::shape`]; this one needs no backend named).
    pub fn shape(&self) -> ModelShape {
        stand_in_shape(self.vocab)
    }
}

impl<B: InferenceBackend> CausalLm<B> for Soft {
    fn shape(&self) -> ModelShape {
        Soft::shape(self)
    }

    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn device(&self) -> B::Device {
        Default::default()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> Result<Tensor<B, 2>> {
        logits_rows(batch, cache, logits, self.vocab, |token, position| {
            self.row(token, position)
        })
    }
}

/// A model that records each forward it completes as `(sequences, tokens)` of its batch: what a
/// test asserts about scheduling (how steps were packed, how many prompt tokens a prefix cache
/// saved).
#[derive(Debug, Default)]
pub struct Recording<M> {
    /// The model that computes (call its own `shape()` where no backend is named).
    pub inner: M,
    forwards: RefCell<Vec<(usize, usize)>>,
}

impl<M> Recording<M> {
    /// `inner`, recording from now on.
    pub fn new(inner: M) -> Self {
        Self {
            inner,
            forwards: RefCell::new(Vec::new()),
        }
    }

    /// Each forward so far, oldest first: the batch's sequences and tokens.
    pub fn forwards(&self) -> Vec<(usize, usize)> {
        self.forwards.borrow().clone()
    }

    /// Every token fed so far, over all forwards.
    pub fn tokens_fed(&self) -> usize {
        self.forwards
            .borrow()
            .iter()
            .map(|&(_, tokens)| tokens)
            .sum()
    }
}

impl<B: InferenceBackend, M: CausalLm<B>> CausalLm<B> for Recording<M> {
    fn shape(&self) -> ModelShape {
        self.inner.shape()
    }

    fn dtype(&self) -> Dtype {
        self.inner.dtype()
    }

    fn device(&self) -> B::Device {
        self.inner.device()
    }

    fn fingerprint(&self) -> String {
        self.inner.fingerprint()
    }

    fn attention_window(&self) -> Option<usize> {
        self.inner.attention_window()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> Result<Tensor<B, 2>> {
        let out = self.inner.forward(batch, cache, logits)?;
        self.forwards
            .borrow_mut()
            .push((batch.spans().len(), batch.n_tokens()));
        Ok(out)
    }
}
