//! [`Session`]: one conversation whose KV cache outlives each reply. Every turn passes the whole
//! context (the re-rendered chat so far); the session reuses the longest prefix its cache
//! already holds, rolls the cache back to it where the new context diverges
//! ([`kiln_core::KvCache`]'s `truncate`), and computes only the rest. A cache that cannot roll
//! back that far (a sliding window) recomputes from the start, so the tokens are always those
//! of a full recompute.

use std::ops::ControlFlow;

use kiln_core::kv_cache::KvCache;
use kiln_core::{CausalLm, CoreError, InferenceBackend, SeqId, TokenId};

use crate::generate::{GenerateRequest, Generation, continue_sequence};
use crate::sequence::common_prefix;

/// The one sequence a session keeps in its cache.
const SEQ: SeqId = SeqId(0);

/// What one [`Session::reply`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The generated tokens, why they ended, and the timings.
    pub generation: Generation,
    /// Prompt tokens the cache already held (not recomputed).
    pub reused: usize,
    /// Prompt tokens computed for this reply.
    pub prefilled: usize,
}

/// A conversation over one model and one cache of any kind.
pub struct Session<'a, B: InferenceBackend> {
    model: &'a dyn CausalLm<B>,
    cache: Box<dyn KvCache<B>>,
    /// Exactly the tokens the cache holds for [`SEQ`], in order.
    cached: Vec<TokenId>,
}

impl<'a, B: InferenceBackend> Session<'a, B> {
    /// A session over `model` with `cache` (which must be empty).
    pub fn new(model: &'a dyn CausalLm<B>, cache: Box<dyn KvCache<B>>) -> Self {
        Self {
            model,
            cache,
            cached: Vec::new(),
        }
    }

    /// The tokens whose keys and values the cache holds.
    pub fn cached(&self) -> &[TokenId] {
        &self.cached
    }

    /// The cache, for its kind and usage.
    pub fn cache(&self) -> &dyn KvCache<B> {
        self.cache.as_ref()
    }

    /// Forgets the conversation and frees its cache.
    pub fn reset(&mut self) {
        self.cache.release(SEQ);
        self.cached.clear();
    }

    /// Generates a reply to `request.prompt`, the whole context so far, calling `on_token`
    /// with each new token (return `ControlFlow::Break` to stop, e.g. on Ctrl-C). Only the
    /// part of the prompt the cache does not already hold is computed.
    ///
    /// # Errors
    /// As [`crate::generate()`]. After an error the session is reset.
    pub fn reply(
        &mut self,
        request: &GenerateRequest,
        on_token: impl FnMut(TokenId) -> ControlFlow<()>,
    ) -> Result<Reply, CoreError> {
        let prompt = &request.prompt;
        // At least the last prompt token is fed: its logits pick the first new token.
        let shared = common_prefix(&self.cached, prompt).min(prompt.len().saturating_sub(1));
        let reused = match self.cache.truncate(SEQ, shared) {
            Ok(()) => shared,
            Err(_) => {
                self.cache.release(SEQ);
                0
            }
        };
        self.cached.truncate(reused);
        let result = continue_sequence(
            self.model,
            self.cache.as_mut(),
            SEQ,
            request,
            reused,
            on_token,
        );
        match result {
            Ok(generation) => {
                let held = self.cache.seq_len(SEQ);
                self.cached = prompt
                    .iter()
                    .chain(&generation.tokens)
                    .copied()
                    .take(held)
                    .collect();
                Ok(Reply {
                    reused,
                    prefilled: prompt.len() - reused,
                    generation,
                })
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }
}
