//! [`StepPlan`]: what a cache decided for one forward pass, on the host.

use std::ops::Range;

use crate::batch::Batch;
use crate::ids::{BlockId, Position, SeqId};

/// A contiguous run of new tokens written to one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRun {
    /// Row (dense caches) or block (paged cache) written.
    pub target: usize,
    /// First slot written in the target.
    pub slot: usize,
    /// The tokens of the packed batch written there, in order.
    pub tokens: Range<usize>,
}

/// A sequence that had no token in the cache before this step: it attends only over its own
/// new tokens, so all fresh sequences run as one packed, block-causal attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreshSpan {
    /// The sequence.
    pub seq: SeqId,
    /// Its tokens in the packed batch.
    pub tokens: Range<usize>,
}

/// A sequence with history: its new tokens attend over what the cache holds for it (this step's
/// tokens included), read as one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistorySpan {
    /// The sequence.
    pub seq: SeqId,
    /// Its new tokens in the packed batch.
    pub tokens: Range<usize>,
    /// The position stored in each key slot of its row as read (`None`: empty or padding).
    pub key_positions: Vec<Option<Position>>,
}

/// Which stored K/V the history rows read, in the order of [`StepPlan::history`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadPlan {
    /// No sequence has history.
    None,
    /// Dense caches: the first `keys` slots of each row.
    Rows {
        /// Row of each history sequence.
        rows: Vec<usize>,
        /// Slots read per row.
        keys: usize,
    },
    /// Paged cache: each sequence's block table, padded to the longest.
    Blocks {
        /// `blocks_per_row` blocks for each history sequence, row-major.
        blocks: Vec<BlockId>,
        /// Blocks per sequence.
        blocks_per_row: usize,
    },
}

/// A cache's plan for one forward: where the new K/V go and what each sequence attends over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Keys further back than this many positions are invisible.
    pub window: Option<usize>,
    /// Where each layer's new K/V are written.
    pub writes: Vec<WriteRun>,
    /// Sequences without history, in packing order.
    pub fresh: Vec<FreshSpan>,
    /// Sequences with history, in packing order.
    pub history: Vec<HistorySpan>,
    /// What the history rows read.
    pub read: ReadPlan,
}

/// One sequence of a batch as a cache sees it before planning.
#[derive(Debug, Clone)]
pub(crate) struct Incoming {
    pub seq: SeqId,
    pub tokens: Range<usize>,
    /// Tokens the cache held for it before this step.
    pub held: usize,
}

impl Incoming {
    pub fn n_new(&self) -> usize {
        self.tokens.len()
    }
}

/// The batch's sequences with what the cache already holds for each.
pub(crate) fn incoming(batch: &Batch, held: impl Fn(SeqId) -> usize) -> Vec<Incoming> {
    batch
        .ranges()
        .map(|(seq, tokens)| Incoming {
            seq,
            tokens,
            held: held(seq),
        })
        .collect()
}

/// Splits `tokens`, to be stored from token index `first` on, into runs that do not cross a
/// boundary every `span` slots; yields `(chunk index, slot in chunk, tokens)`.
pub(crate) fn runs_by_chunk(
    first: usize,
    tokens: Range<usize>,
    span: usize,
) -> impl Iterator<Item = (usize, usize, Range<usize>)> {
    let mut next = tokens.start;
    std::iter::from_fn(move || {
        if next >= tokens.end {
            return None;
        }
        let index = first + (next - tokens.start);
        let (chunk, slot) = (index / span, index % span);
        let len = (span - slot).min(tokens.end - next);
        let run = next..next + len;
        next += len;
        Some((chunk, slot, run))
    })
}
