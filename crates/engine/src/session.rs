//! [`Session`]: one conversation whose KV cache outlives each reply. Every turn passes the whole
//! context (the re-rendered chat so far); the session reuses the longest prefix its cache
//! already holds, rolls the cache back to it where the new context diverges, and computes
//! only the rest. A cache that cannot roll back that far (a sliding window) recomputes from
//! the start, so the tokens are always those of a full recompute.
//!
//! A session is an [`Engine`] whose every reply keeps its cache ([`Request::keep_cache`]) and
//! continues the previous reply's ([`Request::continues`]).

use std::ops::ControlFlow;

use kiln_core::kv_cache::KvCache;
use kiln_core::{CausalLm, InferenceBackend, TokenId};

use crate::engine::{Engine, EngineConfig};
use crate::error::EngineError;
use crate::generate::run_alone;
use crate::request::{Completion, Request, RequestId};

/// A conversation over one model and one cache of any kind.
pub struct Session<'a, B: InferenceBackend> {
    engine: Engine<'a, B>,
    /// The last reply, whose cache the engine keeps.
    last: Option<RequestId>,
}

impl<'a, B: InferenceBackend> Session<'a, B> {
    /// A session over `model` with `cache` (which must be empty).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] if `config` has zero limits. Its `max_batch` is
    /// irrelevant: a session runs one reply at a time.
    pub fn new(
        model: &'a dyn CausalLm<B>,
        cache: Box<dyn KvCache<B>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Ok(Self {
            engine: Engine::new(model, cache, config)?,
            last: None,
        })
    }

    /// The tokens whose keys and values the cache holds.
    pub fn cached(&self) -> &[TokenId] {
        self.last
            .and_then(|id| self.engine.kept_tokens(id))
            .unwrap_or_default()
    }

    /// The cache, for its kind and usage.
    pub fn cache(&self) -> &dyn KvCache<B> {
        self.engine.cache()
    }

    /// Forgets the conversation and frees its cache.
    pub fn reset(&mut self) {
        if let Some(id) = self.last.take() {
            self.engine.release_kept(id);
        }
    }

    /// Generates a reply to `request.prompt`, the whole context so far, calling `on_token`
    /// with each new token (return `ControlFlow::Break` to stop, e.g. on Ctrl-C). Only the
    /// part of the prompt the cache does not already hold is computed
    /// ([`Completion::cached_tokens`] says how much was reused).
    ///
    /// # Errors
    /// As [`Engine::submit`] and [`Engine::step`]; `request.continues` is the session's to
    /// set. After an error the session is reset.
    pub fn reply(
        &mut self,
        mut request: Request,
        on_token: impl FnMut(TokenId) -> ControlFlow<()>,
    ) -> Result<Completion, EngineError> {
        if request.continues.is_some() {
            return Err(EngineError::InvalidRequest(
                "a session's reply continues the previous one; `continues` is not for the caller"
                    .into(),
            ));
        }
        request.keep_cache = true;
        request.continues = self.last;
        match run_alone(&mut self.engine, request, on_token) {
            Ok(completion) => {
                self.last = Some(completion.id);
                Ok(completion)
            }
            Err(e) => {
                // A refused request leaves the previous reply's cache kept: free it.
                self.reset();
                Err(e)
            }
        }
    }
}
