//! [`SlidingKvCache`]: keeps the last `window` tokens of each sequence.

use crate::backend::InferenceBackend;

use super::dense::{DenseCache, Policy, delegate_dense_cache};
use super::{CacheError, KvLayout};
use crate::dtype::KvDtype;

/// Each sequence owns a ring of `window + max_step - 1` slots: token `i` goes to slot
/// `i mod ring`. Positions keep counting past the window; attention masks every key more than
/// `window - 1` positions behind its query, so each token sees exactly the last `window` tokens
/// (itself included).
///
/// Why the ring is longer than the window: when a step adds `n` tokens to a sequence with
/// history, the first of them still needs the `window - 1` keys before it, so the ring must
/// hold `window - 1 + n`. Steps on sequences with history are limited to `max_step` tokens
/// ([`CacheError::StepTooLarge`] asks the caller to chunk); a fresh prompt of any length runs in
/// one step, since it attends over its own new K/V directly.
#[derive(Debug)]
pub struct SlidingKvCache<B: InferenceBackend> {
    inner: DenseCache<B>,
}

impl<B: InferenceBackend> SlidingKvCache<B> {
    /// A cache of `max_sequences` rings for attention window `window`, accepting up to
    /// `max_step` new tokens per step for a sequence with history.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] if a size is 0.
    pub fn new(
        layout: KvLayout,
        max_sequences: usize,
        window: usize,
        max_step: usize,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Result<Self, CacheError> {
        if max_sequences == 0 || window == 0 || max_step == 0 {
            return Err(CacheError::InvalidConfig(
                "a sliding cache needs a window, a step and a sequence of at least 1".into(),
            ));
        }
        let ring = window + max_step - 1;
        let policy = Policy::Sliding { window, max_step };
        Ok(Self {
            inner: DenseCache::new(policy, layout, max_sequences, ring, dtype, device),
        })
    }
}

delegate_dense_cache!(SlidingKvCache);
