//! A packed batch: the tokens of one forward pass, with explicit positions and the sequence each
//! run of tokens belongs to.
//!
//! Packing means no padding: the spans are laid end to end, so `tokens[0..spans[0].len]` belong
//! to `spans[0].seq`, the next `spans[1].len` tokens to `spans[1].seq`, and so on. A sequence
//! appears at most once per batch.

use std::collections::HashSet;
use std::ops::Range;

use crate::error::{CoreError, Result};
use crate::ids::{Position, SeqId, TokenId};

/// One sequence's run of tokens in a [`Batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// The sequence these tokens extend.
    pub seq: SeqId,
    /// How many consecutive tokens of the batch belong to it.
    pub len: usize,
}

/// The input of one forward pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    tokens: Vec<TokenId>,
    positions: Vec<Position>,
    spans: Vec<SeqSpan>,
}

impl Batch {
    /// An empty batch; add sequences with [`Batch::push`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A batch of one sequence whose tokens sit at `start, start + 1, ...`.
    pub fn single(seq: SeqId, tokens: &[TokenId], start: Position) -> Result<Self> {
        let mut batch = Self::new();
        batch.push(seq, tokens, start)?;
        Ok(batch)
    }

    /// Appends `tokens` of `seq`, at consecutive positions from `start`.
    ///
    /// # Errors
    /// [`CoreError::InvalidBatch`] if `tokens` is empty or `seq` is already in the batch.
    pub fn push(&mut self, seq: SeqId, tokens: &[TokenId], start: Position) -> Result<()> {
        let positions = (0..tokens.len() as u32)
            .map(|i| Position(start.0 + i))
            .collect();
        self.push_with_positions(seq, tokens, positions)
    }

    /// Appends `tokens` of `seq` with explicit positions (one per token, increasing).
    ///
    /// # Errors
    /// [`CoreError::InvalidBatch`] if the lengths differ, positions do not increase, `tokens` is
    /// empty or `seq` is already in the batch.
    pub fn push_with_positions(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        positions: Vec<Position>,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Err(CoreError::InvalidBatch(format!(
                "sequence {seq} has no tokens"
            )));
        }
        if positions.len() != tokens.len() {
            return Err(CoreError::InvalidBatch(format!(
                "sequence {seq}: {} tokens but {} positions",
                tokens.len(),
                positions.len()
            )));
        }
        if positions.windows(2).any(|w| w[1] <= w[0]) {
            return Err(CoreError::InvalidBatch(format!(
                "sequence {seq}: positions must increase"
            )));
        }
        if self.spans.iter().any(|s| s.seq == seq) {
            return Err(CoreError::InvalidBatch(format!(
                "sequence {seq} appears twice in one batch"
            )));
        }
        self.tokens.extend_from_slice(tokens);
        self.positions.extend(positions);
        self.spans.push(SeqSpan {
            seq,
            len: tokens.len(),
        });
        Ok(())
    }

    /// All tokens, packed. `[n_tokens]`
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    /// Each token's position in its own sequence. `[n_tokens]`
    pub fn positions(&self) -> &[Position] {
        &self.positions
    }

    /// The sequences, in packing order.
    pub fn spans(&self) -> &[SeqSpan] {
        &self.spans
    }

    /// Total number of tokens.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the batch holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Each sequence with the range of its tokens in the packed batch.
    pub fn ranges(&self) -> impl Iterator<Item = (SeqId, Range<usize>)> + '_ {
        self.spans.iter().scan(0usize, |start, span| {
            let range = *start..*start + span.len;
            *start += span.len;
            Some((span.seq, range))
        })
    }

    /// Index of the last token of each sequence, in packing order.
    pub fn last_indices(&self) -> Vec<usize> {
        self.ranges().map(|(_, r)| r.end - 1).collect()
    }

    /// The distinct sequences of the batch.
    pub fn seq_ids(&self) -> HashSet<SeqId> {
        self.spans.iter().map(|s| s.seq).collect()
    }
}
