//! [`generate`]: one request on the engine, with a callback per token.

use std::ops::ControlFlow;

use kiln_core::kv_cache::KvCache;
use kiln_core::{CausalLm, InferenceBackend, TokenId};

use crate::engine::{Engine, EngineConfig};
use crate::error::EngineError;
use crate::request::{Completion, Event, Request};

/// Generates one continuation of `request.prompt` on `cache` (which must hold no sequences),
/// calling `on_token` with each new token (return `ControlFlow::Break` to stop: the
/// completion then ends with [`crate::FinishReason::Stop`]). It is an [`Engine`] with this one
/// request, so everything the engine does (chunked prefill, prefix caching on a paged cache)
/// happens here too.
///
/// # Errors
/// As [`Engine::submit`] and [`Engine::step`].
pub fn generate<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    cache: &mut dyn KvCache<B>,
    request: Request,
    on_token: impl FnMut(TokenId) -> ControlFlow<()>,
) -> Result<Completion, EngineError> {
    let config = EngineConfig {
        max_batch: 1,
        ..EngineConfig::default()
    };
    let mut engine = Engine::borrowing(model, cache, config)?;
    run_alone(&mut engine, request, on_token)
}

/// Submits `request` to `engine` and steps until it finishes, calling `on_token` with each of
/// its tokens; `ControlFlow::Break` stops it ([`Engine::stop`]).
pub(crate) fn run_alone<B: InferenceBackend>(
    engine: &mut Engine<'_, B>,
    request: Request,
    mut on_token: impl FnMut(TokenId) -> ControlFlow<()>,
) -> Result<Completion, EngineError> {
    let id = engine.submit(request)?;
    loop {
        let events = engine.step().inspect_err(|_| {
            engine.cancel(id);
        })?;
        for event in events {
            match event {
                Event::Token { id: of, token, .. } if of == id && on_token(token).is_break() => {
                    engine.stop(id);
                }
                Event::Finished(completion) if completion.id == id => return Ok(completion),
                _ => {}
            }
        }
        if engine.is_idle() {
            // Not reached: a request reports its completion as it leaves the engine.
            return Err(EngineError::InvalidRequest(format!(
                "request {} left the engine without finishing",
                id.0
            )));
        }
    }
}
