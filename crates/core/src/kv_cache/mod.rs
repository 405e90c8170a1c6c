//! KV caches: where each layer's keys and values live between forward passes.
//!
//! Two views of one cache, as in vLLM:
//! - what the **scheduler** sees ([`CacheBook`]): capacity, usage, whether a sequence can grow,
//!   releasing a sequence, and a typed [`CacheError`] when space runs out;
//! - what **attention** sees ([`KvCache`]): once per forward, [`KvCache::plan`] reserves room for
//!   the batch's new tokens and returns a [`StepPlan`]; then each layer writes its new K/V
//!   ([`KvCache::write`]) and reads the K/V to attend over ([`KvCache::read`]).
//!
//! All four kinds store K/V the same way (a private `SlotStorage`: per layer a
//! `[targets, n_kv_heads, slots, head_dim]` tensor written in place) and differ only in how they
//! map a sequence's tokens to `(target, slot)`:
//!
//! | kind | target | slot | runs out when |
//! |---|---|---|---|
//! | [`StaticKvCache`] | one row per sequence, preallocated | the token's index | a sequence passes `max_len` or all rows are taken |
//! | [`DynamicKvCache`] | one row per sequence | the token's index | never: rows and length double as needed |
//! | [`SlidingKvCache`] | one row per sequence | token index mod ring size | all rows are taken |
//! | [`PagedKvCache`] | a block of the pool | index within the block | the pool has no free block |
//!
//! The model never asks a cache for positions: they come from the batch, and the cache records
//! the position of each token it stores so attention can mask by position.

mod dense;
mod dynamic;
pub mod encoding;
mod paged;
mod plan;
mod sliding;
mod static_;
mod storage;

use std::fmt;
use std::str::FromStr;

use burn::tensor::Tensor;

use crate::attention::StepIndex;
use crate::backend::InferenceBackend;

pub use dynamic::DynamicKvCache;
pub use paged::{BlockKey, BlockPool, DEFAULT_BLOCK_SIZE, PagedKvCache};
pub use plan::{FreshSpan, HistorySpan, ReadPlan, StepPlan, WriteRun};
pub use sliding::SlidingKvCache;
pub use static_::StaticKvCache;
pub use storage::{CachedKv, ReadIndex, RowPick};

use crate::batch::Batch;
use crate::dtype::KvDtype;
use crate::ids::{Position, SeqId, TokenId};

/// K/V copied to the host: per layer `(k, v)`, each `[tokens, n_kv_heads, head_dim]` as f32.
pub type HostKv = Vec<(Vec<f32>, Vec<f32>)>;

/// The per-layer shape of the K/V a cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer blocks (one K and one V tensor each).
    pub n_layers: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes that one token's K and V take across all layers.
    pub fn bytes_per_token(&self, dtype: impl Into<KvDtype>) -> usize {
        2 * self.n_layers * self.n_kv_heads * dtype.into().row_bytes(self.head_dim)
    }
}

/// The four cache implementations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// Preallocated to a maximum length, written in place.
    Static,
    /// Grows as tokens arrive.
    Dynamic,
    /// Keeps the last `window` tokens of each sequence in a ring.
    Sliding,
    /// A pool of fixed-size blocks and a block table per sequence.
    Paged,
}

impl CacheKind {
    /// Every kind.
    pub const ALL: [CacheKind; 4] = [
        CacheKind::Static,
        CacheKind::Dynamic,
        CacheKind::Sliding,
        CacheKind::Paged,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::Static => "static",
            CacheKind::Dynamic => "dynamic",
            CacheKind::Sliding => "sliding",
            CacheKind::Paged => "paged",
        }
    }
}

impl fmt::Display for CacheKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheKind {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CacheKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| CacheError::UnknownKind(s.to_string()))
    }
}

/// Why a cache refused a step. Every variant is recoverable: nothing was reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// The paged pool has too few free blocks.
    #[error("KV cache out of blocks: the step needs {needed} more, {free} are free")]
    OutOfBlocks {
        /// Blocks the step needs.
        needed: usize,
        /// Blocks free now.
        free: usize,
    },
    /// A sequence would outgrow the static cache's rows.
    #[error(
        "sequence {seq} would hold {needed} tokens, the cache holds at most {max} per sequence"
    )]
    SequenceTooLong {
        /// The sequence.
        seq: SeqId,
        /// Tokens it would hold after the step.
        needed: usize,
        /// The per-sequence limit.
        max: usize,
    },
    /// Every row of a static or sliding cache is taken.
    #[error("KV cache full: all {max_sequences} sequence slots are in use")]
    NoFreeSlot {
        /// How many sequences the cache holds at once.
        max_sequences: usize,
    },
    /// A sliding-window step that adds more tokens to a sequence with history than the ring
    /// can keep visible; split the step into chunks of at most `max`.
    #[error(
        "sequence {seq}: {tokens} tokens in one step, the sliding cache takes at most {max} (chunk the prompt)"
    )]
    StepTooLarge {
        /// The sequence.
        seq: SeqId,
        /// Tokens asked for.
        tokens: usize,
        /// The most one step may add to a sequence with history.
        max: usize,
    },
    /// [`CacheBook::truncate`] asked to keep more tokens than the sequence holds.
    #[error("sequence {seq} holds {len} tokens; cannot keep {keep}")]
    TruncateBeyondEnd {
        /// The sequence.
        seq: SeqId,
        /// Tokens asked to keep.
        keep: usize,
        /// Tokens it holds.
        len: usize,
    },
    /// [`CacheBook::truncate`] on a sliding cache would need keys the ring has already
    /// overwritten; the caller must release the sequence and recompute it.
    #[error(
        "sequence {seq}: rolling back {dropped} tokens needs keys the sliding window dropped (at most {max})"
    )]
    TruncateTooFar {
        /// The sequence.
        seq: SeqId,
        /// Tokens the truncation would drop.
        dropped: usize,
        /// The most this cache can drop.
        max: usize,
    },
    /// A query of `seq` at `position` would attend over keys the cache gave back once they left
    /// the model's attention window ([`CacheBook::set_attention_window`]): positions must
    /// only grow.
    #[error(
        "sequence {seq}: a query at position {position} needs keys the cache freed as they left \
         the model's attention window"
    )]
    KeysForgotten {
        /// The sequence.
        seq: SeqId,
        /// The query's position.
        position: Position,
    },
    /// [`KvCache::export`] of a sequence whose oldest tokens a sliding ring has overwritten (or
    /// the paged cache freed as they left the model's attention window).
    #[error("sequence {seq}: the cache keeps only the last {kept} of its {held} tokens")]
    NotAllHeld {
        /// The sequence.
        seq: SeqId,
        /// Tokens appended to it.
        held: usize,
        /// Tokens the cache still holds.
        kept: usize,
    },
    /// [`CacheBook::fork`] into a sequence that already holds tokens.
    #[error("sequence {seq} already holds {len} tokens; a fork needs an empty one")]
    AlreadyHeld {
        /// The sequence.
        seq: SeqId,
        /// Tokens it holds.
        len: usize,
    },
    /// A configuration value out of range.
    #[error("invalid cache configuration: {0}")]
    InvalidConfig(String),
    /// A cache kind name kiln does not know.
    #[error("unknown cache kind `{0}` (expected one of: static, dynamic, sliding, paged)")]
    UnknownKind(String),
}

/// The check every [`CacheBook::truncate`] starts with: `keep` must not exceed the `len` tokens
/// `seq` holds.
pub(crate) fn check_truncate(seq: SeqId, keep: usize, len: usize) -> Result<(), CacheError> {
    if keep > len {
        return Err(CacheError::TruncateBeyondEnd { seq, keep, len });
    }
    Ok(())
}

/// How full a cache is, in token slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheUsage {
    /// Slots the cache can hold now (for a dynamic cache: what is allocated).
    pub capacity: usize,
    /// Slots holding a token (for a paged cache: whole blocks in use).
    pub used: usize,
    /// Slots in blocks no sequence holds that keep a prefix for later requests (paged cache
    /// with prefix caching; evicted when room is needed, so they count as free).
    pub cached: usize,
    /// Sequences with at least one token.
    pub sequences: usize,
}

impl CacheUsage {
    /// Slots not in use (cached ones included: they are evicted on demand).
    pub fn free(&self) -> usize {
        self.capacity - self.used
    }
}

/// The scheduler's view of a cache: bookkeeping, no tensors.
pub trait CacheBook {
    /// Which implementation this is.
    fn kind(&self) -> CacheKind;

    /// The shape of what it stores.
    fn layout(&self) -> KvLayout;

    /// Capacity and use, in token slots.
    fn usage(&self) -> CacheUsage;

    /// Tokens appended to `seq` so far (0 for a sequence the cache does not know).
    fn seq_len(&self, seq: SeqId) -> usize;

    /// How many sequences it holds at once, when that is fixed (static and sliding: their
    /// rows); `None` when only memory limits it (dynamic, paged).
    fn max_sequences(&self) -> Option<usize> {
        None
    }

    /// The attention window: keys further back than this are invisible (sliding cache only).
    fn window(&self) -> Option<usize> {
        None
    }

    /// Tells the cache the model's widest attention window: `Some(w)` when every layer's query
    /// at `p` sees only keys at `p - w + 1 ..= p`, `None` when some layer sees every earlier
    /// position. A cache may then give back the space of keys no later query can see (the
    /// paged cache frees whole blocks that have left the window); the others ignore it.
    /// Masks, not this, keep attention inside the window.
    fn set_attention_window(&mut self, window: Option<usize>) {
        let _ = window;
    }

    /// Whether appending `n_new` tokens to `seq` (alone) would succeed now.
    ///
    /// # Errors
    /// The error [`KvCache::plan`] would return.
    fn check_append(&self, seq: SeqId, n_new: usize) -> Result<(), CacheError>;

    /// Reserves the space for one step before the model runs: each `(seq, n_new)` will append
    /// `n_new` tokens to `seq` (a sequence the cache does not know yet gets its row or first
    /// blocks now). The scheduler calls this before the forward, so it decides preemption up
    /// front; a [`KvCache::plan`] for a reserved step then cannot run out of space. All or
    /// nothing.
    ///
    /// # Errors
    /// The [`CacheError`] the step would hit (out of blocks or rows, a sequence too long).
    fn reserve(&mut self, step: &[(SeqId, usize)]) -> Result<(), CacheError>;

    /// Forgets `seq` and frees its space. Unknown sequences are ignored.
    fn release(&mut self, seq: SeqId);

    /// Keeps the first `keep` tokens of `seq` and forgets the rest, so a caller can roll a
    /// sequence back to a shared prefix (a chat whose re-rendered prompt diverges from what the
    /// cache holds) and append from there. `keep == 0` releases the sequence.
    ///
    /// # Errors
    /// [`CacheError::TruncateBeyondEnd`] if `keep` exceeds the sequence's length;
    /// [`CacheError::TruncateTooFar`] if a sliding cache no longer holds the keys the kept
    /// tokens' successors would attend over. Nothing changes on error.
    fn truncate(&mut self, seq: SeqId, keep: usize) -> Result<(), CacheError>;

    /// Starts `child` as a copy of `parent`: the same tokens at the same positions, so the two
    /// continue differently from there (beam search). `child` must hold no token (space
    /// reserved for it with zero tokens is used). The paged cache shares `parent`'s blocks
    /// (reference-counted; a shared partial last block is copied when either sequence writes
    /// into it); the row caches copy the row's filled slots into a free row.
    ///
    /// # Errors
    /// [`CacheError::AlreadyHeld`] if `child` holds tokens; [`CacheError::NoFreeSlot`] when a
    /// static or sliding cache has no row left for it. Nothing changes on error.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CacheError>;

    /// Forgets every sequence (and every cached prefix).
    fn clear(&mut self);

    /// Turns prefix caching on, in the key space `key_space` (derive it from the model and
    /// dtype, so nothing is shared across models); returns false if this kind does not
    /// support it (only the paged cache does: a sliding ring overwrites what it would share).
    fn enable_prefix_cache(&mut self, key_space: u64) -> bool {
        let _ = key_space;
        false
    }

    /// Whether prefix caching is on.
    fn prefix_cache_enabled(&self) -> bool {
        false
    }

    /// How many of `common` leading tokens that two sequences have in common the cache could
    /// share between them (whole blocks; 0 with prefix caching off).
    fn shareable(&self, common: usize) -> usize {
        let _ = common;
        0
    }

    /// How many leading tokens of `tokens` [`CacheBook::attach_prefix`] would find cached now
    /// (whole blocks, never the last token). Changes nothing.
    fn cached_prefix(&self, tokens: &[TokenId]) -> usize {
        let _ = tokens;
        0
    }

    /// Starts `seq`, which the cache must not hold yet, on the cached blocks that `tokens`
    /// (its context from position 0) begin with, shared with whoever else holds them; returns
    /// how many tokens it now holds (0: nothing cached, prefix caching off, or `seq` known).
    /// The caller feeds the rest from there.
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[TokenId]) -> usize {
        let _ = (seq, tokens);
        0
    }
}

/// Attention's view of a cache.
pub trait KvCache<B: InferenceBackend>: CacheBook {
    /// Reserves room for every new token of `batch`, records their positions, and says where
    /// they go and what each sequence attends over. Atomic: on error nothing changes.
    ///
    /// A sequence the cache holds no token of is *fresh*: it attends only over its own new
    /// tokens, which lets a batch of fresh prompts run as one packed sequence.
    ///
    /// # Errors
    /// [`CacheError`] when the step does not fit.
    fn plan(&mut self, batch: &Batch) -> Result<StepPlan, CacheError>;

    /// The precision the K/V are stored in (each write is cast to it).
    fn dtype(&self) -> KvDtype;

    /// Writes one layer's new K/V where the plan says, in place.
    ///
    /// # Shapes
    /// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`, packed like the batch.
    fn write(&mut self, layer: usize, plan: &StepPlan, k: Tensor<B, 3>, v: Tensor<B, 3>);

    /// The K/V that the plan's history rows attend over (after this step's write), where
    /// they are stored.
    fn read<'a>(&self, layer: usize, index: &'a ReadIndex<B>) -> CachedKv<'a, B>;

    /// Writes one layer's new K/V at the places of a [`StepIndex`] (backends with
    /// [`InferenceBackend::STEP_ATTENTION`]), in place.
    ///
    /// # Shapes
    /// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`, packed like the batch.
    fn write_places(
        &mut self,
        layer: usize,
        index: &StepIndex<B>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    );

    /// One layer's K and V storage, `[targets, n_kv_heads, slots, head_dim]` each: handles to
    /// the cache's own tensors, to be dropped before the next write.
    fn storage(&self, layer: usize) -> (Tensor<B, 4>, Tensor<B, 4>);

    /// Copies the K/V of every token `seq` holds to the host, in token order, for snapshots
    /// and tests.
    ///
    /// # Shapes
    /// - returns per layer `(k, v)`, each `[seq_len, n_kv_heads, head_dim]` as f32
    ///
    /// # Errors
    /// [`CacheError::NotAllHeld`] if a sliding ring has overwritten some of them.
    fn export(&self, seq: SeqId) -> Result<HostKv, CacheError>;
}
