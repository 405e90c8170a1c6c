//! [`DynamicKvCache`]: grows as tokens and sequences arrive.

use crate::backend::InferenceBackend;

use super::KvLayout;
use super::dense::{DenseCache, Policy, delegate_dense_cache};
use crate::dtype::KvDtype;

/// Starts small and doubles its rows or its length whenever a step needs more, copying what it
/// holds (amortised O(1) per token, like `Vec`). It never refuses a step; its memory is bounded
/// only by the device.
#[derive(Debug)]
pub struct DynamicKvCache<B: InferenceBackend> {
    inner: DenseCache<B>,
}

impl<B: InferenceBackend> DynamicKvCache<B> {
    /// Rows and slots allocated before the first step.
    pub const INITIAL_ROWS: usize = 1;
    /// Slots per row allocated before the first step.
    pub const INITIAL_SLOTS: usize = 16;

    /// An empty cache with room for one sequence of 16 tokens.
    pub fn new(layout: KvLayout, dtype: impl Into<KvDtype>, device: &B::Device) -> Self {
        let inner = DenseCache::new(
            Policy::Dynamic,
            layout,
            Self::INITIAL_ROWS,
            Self::INITIAL_SLOTS,
            dtype,
            device,
        );
        Self { inner }
    }
}

delegate_dense_cache!(DynamicKvCache);
