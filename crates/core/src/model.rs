//! The contract between the engine and any model: [`CausalLm`].

use burn::tensor::Tensor;

use crate::backend::InferenceBackend;

use crate::batch::Batch;
use crate::dtype::Dtype;
use crate::error::{CoreError, Result};
use crate::kv_cache::{KvCache, KvLayout};

/// The dimensions of a decoder-only model that the engine and the caches need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (`n_heads` without grouped-query attention).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size: the width of the logits.
    pub vocab: usize,
    /// Largest position the model accepts plus one (its context length).
    pub max_positions: usize,
}

impl ModelShape {
    /// The per-layer K/V shape a cache for this model must hold.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}

/// Which positions of a batch a forward returns logits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every token: `[n_tokens, vocab]` (tests, scoring).
    All,
    /// The last token of each sequence, in packing order: `[n_sequences, vocab]` (generation).
    LastOfEachSequence,
    /// The last `n[i]` tokens of sequence `i`, in packing order: `[sum of n, vocab]`
    /// (speculative decoding verifies a sequence's drafted tokens and the token before them
    /// in one forward). Each `n[i]` is between 1 and the sequence's tokens in the batch.
    LastOfEach(Vec<usize>),
}

impl LogitsFor {
    /// The batch rows (token indices, ascending) whose logits this asks for; `None` for all
    /// (also when the rows asked for are every row, as in a step of single-token decodes).
    ///
    /// # Errors
    /// [`CoreError::ModelInput`] if a [`LogitsFor::LastOfEach`] count does not fit its
    /// sequence, or there is not one count per sequence.
    pub fn rows(&self, batch: &Batch) -> Result<Option<Vec<usize>>> {
        Ok(match self {
            Self::All => None,
            Self::LastOfEachSequence => Some(batch.last_indices()),
            Self::LastOfEach(counts) => {
                if counts.len() != batch.spans().len() {
                    return Err(CoreError::ModelInput(format!(
                        "{} logits counts for a batch of {} sequences",
                        counts.len(),
                        batch.spans().len()
                    )));
                }
                let mut rows = Vec::with_capacity(counts.iter().sum());
                for ((seq, range), &n) in batch.ranges().zip(counts) {
                    if n == 0 || n > range.len() {
                        return Err(CoreError::ModelInput(format!(
                            "logits for the last {n} tokens of sequence {seq}, which has {} \
                             in the batch",
                            range.len()
                        )));
                    }
                    rows.extend(range.end - n..range.end);
                }
                Some(rows)
            }
        }
        .filter(|rows| rows.len() != batch.n_tokens()))
    }
}

/// A causal language model the engine can drive.
///
/// The model never owns the cache: each forward appends the batch's K/V to `cache` and attends
/// over what the cache holds for each sequence. Positions come from the batch.
pub trait CausalLm<B: InferenceBackend> {
    /// The model's dimensions.
    fn shape(&self) -> ModelShape;

    /// The precision the model computes in.
    fn dtype(&self) -> Dtype;

    /// The device the weights live on.
    fn device(&self) -> B::Device;

    /// A string that differs between models that would give different outputs: cache
    /// snapshots made by one model are refused by another. The default is the shape; models
    /// with weights should add a digest of them.
    fn fingerprint(&self) -> String {
        format!("{:?}", self.shape())
    }

    /// The widest attention window over the model's layers: `Some(w)` when every layer's
    /// query at `p` sees only keys at `p - w + 1 ..= p` (Mistral's and Phi-3's
    /// `sliding_window`), `None` when some layer sees every earlier position. The engine
    /// passes it to its cache ([`crate::kv_cache::CacheBook::set_attention_window`]) so keys
    /// that have left it can be freed.
    fn attention_window(&self) -> Option<usize> {
        None
    }

    /// One forward pass over a packed batch.
    ///
    /// # Shapes
    /// - returns `[n_tokens, vocab]` for [`LogitsFor::All`], `[n_sequences, vocab]` for
    ///   [`LogitsFor::LastOfEachSequence`]; always f32.
    ///
    /// # Errors
    /// The cache's refusal (out of space) before any compute, or invalid input (token id
    /// outside the vocabulary, position past the context).
    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> Result<Tensor<B, 2>>;

    /// The width of the states [`CausalLm::hidden_states`] returns (`d_model`); `None` (the
    /// default) for a model that gives none.
    fn hidden_size(&self) -> Option<usize> {
        None
    }

    /// The same forward pass as [`CausalLm::forward`], stopped before the output head: the
    /// final hidden states after the model's final norm (transformers' `last_hidden_state`),
    /// for embeddings. It writes the batch's K/V to `cache` as a forward does.
    ///
    /// # Shapes
    /// - returns `[rows, d_model]`, the rows [`LogitsFor`] picks as for logits; always f32.
    ///
    /// # Errors
    /// As [`CausalLm::forward`]; [`CoreError::ModelInput`] from a model that gives no hidden
    /// states (the default, where [`CausalLm::hidden_size`] is `None`).
    fn hidden_states(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        rows: LogitsFor,
    ) -> Result<Tensor<B, 2>> {
        let _ = (batch, cache, rows);
        Err(CoreError::ModelInput(
            "this model does not give its hidden states".into(),
        ))
    }
}
