//! Building the KV cache an engine runs on, by kind.

use kiln_core::kv_cache::{
    CacheError, CacheKind, DEFAULT_BLOCK_SIZE, DynamicKvCache, KvCache, KvLayout, PagedKvCache,
    SlidingKvCache, StaticKvCache,
};
use kiln_core::{InferenceBackend, KvDtype};

/// Which cache and how big.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSpec {
    /// The implementation.
    pub kind: CacheKind,
    /// Sequences held at once (static and sliding: rows; paged: sizes the default pool).
    pub max_sequences: usize,
    /// Tokens one sequence may hold (static: the row length; paged: sizes the default pool).
    pub max_len: usize,
    /// Sliding: the attention window.
    pub window: usize,
    /// Sliding: the most tokens one step adds to a sequence (the engine's prefill chunk).
    pub max_step: usize,
    /// Paged: tokens per block.
    pub page_size: usize,
    /// Paged: blocks in the pool (default: enough for `max_sequences` of `max_len`).
    pub blocks: Option<usize>,
}

impl CacheSpec {
    /// A paged cache for `max_sequences` sequences of up to `max_len` tokens.
    pub fn paged(max_sequences: usize, max_len: usize) -> Self {
        Self {
            kind: CacheKind::Paged,
            max_sequences,
            max_len,
            window: max_len,
            max_step: max_len,
            page_size: DEFAULT_BLOCK_SIZE,
            blocks: None,
        }
    }

    /// Blocks in the paged pool.
    pub fn pool_blocks(&self) -> usize {
        self.pool_blocks_checked().unwrap_or(usize::MAX)
    }

    /// Token slots the cache allocates when built (a dynamic cache: none up front; a sliding
    /// ring also holds a step's tokens past its window); `None` if the count overflows.
    pub fn slots(&self) -> Option<u64> {
        let sequences = self.max_sequences as u64;
        match self.kind {
            CacheKind::Static => sequences.checked_mul(self.max_len as u64),
            CacheKind::Dynamic => Some(0),
            CacheKind::Sliding => (self.window as u64)
                .checked_add(self.max_step as u64)?
                .checked_sub(1)?
                .checked_mul(sequences),
            CacheKind::Paged => {
                (self.pool_blocks_checked()? as u64).checked_mul(self.page_size as u64)
            }
        }
    }

    /// Bytes the cache allocates when built for `layout` in `dtype` ([`Self::slots`] of
    /// [`KvLayout::bytes_per_token`]); `None` if the count overflows.
    pub fn bytes(&self, layout: KvLayout, dtype: impl Into<KvDtype>) -> Option<u64> {
        self.slots()?
            .checked_mul(layout.bytes_per_token(dtype) as u64)
    }

    /// The most tokens each sequence of `request` may generate when it runs alone in this
    /// cache, no sequence longer than `context` tokens: 0 when its prompt leaves no room.
    ///
    /// A request of one sequence has what its prompt leaves of the cache's slots. A beam
    /// search's beams ([`crate::Request::beam`]) share the prompt, but each holds its own
    /// generated tokens, and on a paged cache each may also hold two partial blocks (its own,
    /// and the copy of one it shared with the beam it forked from): what is left after those is
    /// split between the beams, so a search that runs to its end never runs the cache out.
    pub fn room_per_sequence(&self, request: &crate::Request, context: usize) -> usize {
        // A dynamic cache grows on demand: only the context bounds it.
        let slots = match self.kind {
            CacheKind::Dynamic => None,
            _ => self.slots(),
        };
        let held = slots.map_or(usize::MAX, |s| usize::try_from(s).unwrap_or(usize::MAX));
        let room = context.min(held).saturating_sub(request.prompt.len());
        let Some(beam) = request.beam else {
            return room;
        };
        let beams = beam.num_beams.max(1);
        let block = match self.kind {
            CacheKind::Paged => self.page_size.max(1),
            _ => 1,
        };
        room.saturating_sub(2 * block * beams) / beams
    }

    /// [`Self::pool_blocks`], `None` if it overflows.
    fn pool_blocks_checked(&self) -> Option<usize> {
        match self.blocks {
            Some(blocks) => Some(blocks),
            None => self
                .max_sequences
                .checked_mul(self.max_len.div_ceil(self.page_size.max(1))),
        }
    }

    /// Builds the cache.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] for zero sizes, sizes whose bytes do not fit in an
    /// address space (checked before anything is allocated), or a Q8_0 cache on a backend
    /// whose attention cannot read it (the GPU backends) or for heads that are not whole
    /// blocks of 32.
    pub fn build<B: InferenceBackend>(
        &self,
        layout: KvLayout,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Result<Box<dyn KvCache<B>>, CacheError> {
        let dtype = dtype.into();
        if dtype == KvDtype::Q8_0 && B::STEP_ATTENTION {
            return Err(CacheError::InvalidConfig(
                "a q8_0 KV cache is read by the cpu backends' attention only: use f16 on a GPU"
                    .into(),
            ));
        }
        if !dtype.holds_rows_of(layout.head_dim) {
            return Err(CacheError::InvalidConfig(format!(
                "a {dtype} KV cache holds heads of whole 32-value blocks, and this model's heads \
                 have {} values",
                layout.head_dim
            )));
        }
        if self
            .bytes(layout, dtype)
            .is_none_or(|b| b > isize::MAX as u64)
        {
            return Err(CacheError::InvalidConfig(format!(
                "a {} cache of {} sequences × {} tokens ({} blocks of {}) does not fit in memory",
                self.kind,
                self.max_sequences,
                self.max_len,
                self.blocks.map_or("default".to_string(), |b| b.to_string()),
                self.page_size
            )));
        }
        Ok(match self.kind {
            CacheKind::Static => Box::new(StaticKvCache::<B>::new(
                layout,
                self.max_sequences,
                self.max_len,
                dtype,
                device,
            )?),
            CacheKind::Dynamic => Box::new(DynamicKvCache::<B>::new(layout, dtype, device)),
            CacheKind::Sliding => Box::new(SlidingKvCache::<B>::new(
                layout,
                self.max_sequences,
                self.window,
                self.max_step,
                dtype,
                device,
            )?),
            CacheKind::Paged => Box::new(PagedKvCache::<B>::new(
                layout,
                self.pool_blocks(),
                self.page_size,
                dtype,
                device,
            )?),
        })
    }
}

#[cfg(test)]
mod room_per_sequence_tests {
    use kiln_core::TokenId;

    use super::CacheSpec;
    use crate::{BeamSearch, Request};

    #[test]
    fn beams_split_what_the_prompt_leaves_less_two_blocks_each() {
        // 100 blocks of 16: 1600 slots, within a context of 8192.
        let spec = CacheSpec {
            blocks: Some(100),
            ..CacheSpec::paged(4, 8192)
        };
        let prompt = vec![TokenId(1); 100];
        let one = Request {
            prompt: prompt.clone(),
            ..Request::default()
        };
        assert_eq!(spec.room_per_sequence(&one, 8192), 1500);
        assert_eq!(spec.room_per_sequence(&one, 1000), 900);
        let beams = Request {
            prompt,
            beam: Some(BeamSearch::new(4)),
            ..Request::default()
        };
        // (1500 - 2 × 16 × 4) / 4
        assert_eq!(spec.room_per_sequence(&beams, 8192), 343);
        assert_eq!(spec.room_per_sequence(&beams, 200), 0);
    }
}
