//! [`StaticKvCache`]: preallocated to a maximum length, written in place (gpt-fast's cache).

use crate::backend::InferenceBackend;

use super::dense::{DenseCache, Policy, delegate_dense_cache};
use super::{CacheError, KvLayout};
use crate::dtype::KvDtype;

/// `max_sequences` rows of `max_len` slots per layer, allocated once. A token at index `i` of
/// its sequence goes to slot `i` of the sequence's row; nothing is ever copied or moved.
#[derive(Debug)]
pub struct StaticKvCache<B: InferenceBackend> {
    inner: DenseCache<B>,
}

impl<B: InferenceBackend> StaticKvCache<B> {
    /// Allocates `max_sequences x max_len` token slots per layer.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] if either size is 0.
    pub fn new(
        layout: KvLayout,
        max_sequences: usize,
        max_len: usize,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Result<Self, CacheError> {
        if max_sequences == 0 || max_len == 0 {
            return Err(CacheError::InvalidConfig(
                "a static cache needs at least one sequence of one token".into(),
            ));
        }
        let policy = Policy::Static { max_len };
        Ok(Self {
            inner: DenseCache::new(policy, layout, max_sequences, max_len, dtype, device),
        })
    }
}

delegate_dense_cache!(StaticKvCache);
