//! One served model's thread: loads it with the [`ModelLoader`], makes what the handlers need
//! of it ([`Ready`]: its codec, grammars, limits and the channel to this thread), runs its
//! engine ([`crate::worker`]) until it is told to stop (the model unloading, or the server
//! stopping), then frees it and tells the [`crate::fleet::Fleet`], also when it panicked. The
//! model, its KV cache and its engine never leave this thread.

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::channel;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use kiln_core::InferenceBackend;
use kiln_engine::Engine;

use crate::codec::Codec;
use crate::metrics::Capacity;
use crate::routes::{AppState, Ready};
use crate::{ModelLoader, ServedModel, cache_spec, pooling, worker};

/// Loads the model at `index` of the fleet, serves it until told to stop, and frees it.
pub(crate) fn run<B: InferenceBackend>(
    state: &Weak<AppState>,
    loader: &dyn ModelLoader<B>,
    index: usize,
) {
    let Some(state) = state.upgrade() else {
        return;
    };
    let fleet = state.fleet.clone();
    let alias = fleet.alias(index);
    let started = Instant::now();
    let loaded_and_served = std::panic::AssertUnwindSafe(|| {
        let served = loader.load(&alias)?;
        serve(&state, index, &alias, served, started)
    });
    match std::panic::catch_unwind(loaded_and_served) {
        // Everything the model held is dropped by now.
        Ok(Ok(())) => fleet.unloaded(index),
        Ok(Err(why)) => fleet.load_failed(index, why),
        // A panic must not leave the model "loading" or "loaded" for ever: requests and the
        // shutdown wait on its state.
        Err(_) => {
            state.metrics.retire(&alias);
            fleet.crashed(index);
        }
    }
}

/// Makes the model's [`Ready`], publishes it, and runs its engine until a stop has drained.
///
/// # Errors
/// The model cannot be served: no tokenizer, a chat template that does not compile, an engine
/// configuration out of range.
fn serve<B: InferenceBackend>(
    state: &Arc<AppState>,
    index: usize,
    alias: &str,
    model: ServedModel<B>,
    started: Instant,
) -> Result<(), String> {
    let options = &state.options;
    let ServedModel {
        loaded,
        cache: kv_cache,
        block_tokens,
        cache_bytes,
        memory_bytes,
        config,
        draft,
    } = model;
    let loaded = &loaded;
    let tokenizer = loaded.tokenizer.clone().ok_or_else(|| {
        format!(
            "{} has no tokenizer; the server needs one",
            loaded.path.display()
        )
    })?;
    let codec = Codec::new(
        tokenizer.clone(),
        loaded.chat_template.as_deref(),
        loaded.generation.bos,
        loaded.generation.eos.first().copied(),
    )
    .map_err(|e| e.to_string())?
    .with_special_tokens_in_content(options.special_tokens_in_content);
    let shape = kiln_core::CausalLm::shape(&loaded.model);
    // The token trie structured output needs, made once (tens of milliseconds).
    let grammars = loaded.generation.eos.first().and_then(|&eos| {
        kiln_engine::GrammarCompiler::new(&tokenizer.token_texts(shape.vocab), eos)
            .ok()
            .map(|c| c.with_json_whitespace(options.json_whitespace))
    });
    let (pooling, source, warning) = pooling::resolve(&loaded.path, options.embedding_pooling);
    if let Some(warning) = warning {
        tracing::warn!(target: "kiln::serve", model = alias, "{warning}; embeddings pool by the {} token(s) instead", pooling.name());
    }
    tracing::info!(target: "kiln::serve", model = alias, "/v1/embeddings pools by the {} token(s) ({})", pooling.name(), source.describe());
    let hidden_size = kiln_core::CausalLm::hidden_size(&loaded.model);
    let kv_tokens = kv_cache.usage().capacity;
    let cache = cache_spec(&*kv_cache, block_tokens, &shape, &config);
    let detok = move |ids: &[kiln_core::TokenId]| tokenizer.decode(ids, true).ok();
    // The draft's cache moves into the engine; its model stays here, borrowed.
    let (draft_model, draft_cache) = match draft {
        Some(d) => (Some(d.loaded), Some(d.cache)),
        None => (None, None),
    };
    let mut engine = Engine::new(&loaded.model, kv_cache, config)
        .map_err(|e| e.to_string())?
        .with_detokenizer(&detok);
    if let (Some(draft), Some(cache)) = (&draft_model, draft_cache) {
        engine = engine
            .with_draft_model(&draft.model, cache)
            .map_err(|e| e.to_string())?;
    }
    state.metrics.set_capacity(
        alias,
        Capacity {
            max_batch: config.max_batch,
            blocks: kv_tokens / block_tokens.max(1),
            block_tokens,
            bytes: cache_bytes,
        },
    );
    let (commands, received) = channel();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let ready = Arc::new(Ready {
        model: alias.to_string(),
        codec,
        eos: loaded.generation.eos.clone(),
        shape,
        kv_tokens,
        cache,
        max_batch: config.max_batch,
        grammars,
        hidden_size,
        pooling,
        tool_format: options.tool_parser.format(loaded.chat_template.as_deref()),
        splits_reasoning: options
            .reasoning_format
            .splits(loaded.chat_template.as_deref()),
        // A second read of the headers only (milliseconds), for the APIs that describe models.
        info: kiln_models::inspect(&loaded.path, &kiln_models::LoadOptions::default()).ok(),
        chat_template: loaded.chat_template.clone(),
        commands,
        in_flight: in_flight.clone(),
        embeddings_waiting: AtomicUsize::new(0),
        longest_token: OnceLock::new(),
    });
    state
        .fleet
        .loaded(index, ready, memory_bytes, started.elapsed());
    let shared = worker::Shared {
        metrics: &state.metrics,
        model: alias,
        block_tokens,
        in_flight: &in_flight,
    };
    worker::run(&mut engine, &received, &shared, options.shutdown_grace);
    state.metrics.retire(alias);
    Ok(())
}
