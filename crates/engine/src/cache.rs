//! Building the KV cache an engine runs on, by kind.

use kiln_core::kv_cache::{
    CacheError, CacheKind, DEFAULT_BLOCK_SIZE, DynamicKvCache, KvCache, KvLayout, PagedKvCache,
    SlidingKvCache, StaticKvCache,
};
use kiln_core::{Dtype, InferenceBackend};

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
        self.blocks
            .unwrap_or_else(|| self.max_sequences * self.max_len.div_ceil(self.page_size.max(1)))
    }

    /// Builds the cache.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] for zero sizes.
    pub fn build<B: InferenceBackend>(
        &self,
        layout: KvLayout,
        dtype: Dtype,
        device: &B::Device,
    ) -> Result<Box<dyn KvCache<B>>, CacheError> {
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
