//! # kiln-server
//!
//! `kiln serve`: an OpenAI-compatible HTTP server over kiln's [`Engine`]. One thread (the
//! caller's) owns the model, the KV cache and the engine, and steps while there is work; a
//! small tokio runtime runs axum's handlers, which validate, tokenize and hand requests to the
//! engine thread over a channel, each with its own channel back for its tokens. Requests that
//! arrive while others run join the running batch at the next step; a client that goes away
//! cancels its request and frees its cache before the next step.
//!
//! - [`Server::start`] binds and answers at once (`/health` is 503 while the model loads);
//! - [`Server::serve`] takes the loaded model and runs the engine until SIGINT or SIGTERM,
//!   then stops accepting, lets running requests finish within the grace period, cancels the
//!   rest, and returns.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics` (Prometheus), `POST /tokenize`, `POST /detokenize`.
//! `docs/serve.md` describes each, with transcripts.

mod api;
mod codec;
mod error;
mod metrics;
mod routes;
mod worker;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

use kiln_core::InferenceBackend;
use kiln_core::kv_cache::KvCache;
use kiln_engine::{Engine, EngineConfig};
use kiln_models::LoadedModel;

pub use codec::Codec;
pub use error::ApiError;
pub use metrics::Metrics;

use crate::routes::{AppState, Ready};
use crate::worker::Command;

/// How the server listens and what it allows.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Address to listen on.
    pub host: String,
    /// Port; 0 picks a free one ([`Server::local_addr`] says which).
    pub port: u16,
    /// When set, `/v1/*` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Answer CORS preflights and allow any origin.
    pub cors: bool,
    /// Most requests (choices) waiting beyond the running batch; more are refused with 503.
    pub max_queue: usize,
    /// Largest request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long running requests may go on after SIGINT / SIGTERM before they are cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            cors: false,
            max_queue: 256,
            max_body_bytes: 8 << 20,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// What can stop the server from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("starting the HTTP runtime: {0}")]
    Runtime(std::io::Error),
    /// The model cannot be served (no tokenizer, a broken chat template).
    #[error("{0}")]
    Model(String),
    /// The engine refused its configuration.
    #[error(transparent)]
    Engine(#[from] kiln_engine::EngineError),
}

/// A model to serve, with its engine's cache and limits.
pub struct ServedModel<'a, B: InferenceBackend> {
    /// The loaded model.
    pub loaded: &'a LoadedModel<B>,
    /// The name `/v1/models` lists.
    pub name: String,
    /// The KV cache (empty).
    pub cache: Box<dyn KvCache<B>>,
    /// Tokens per cache block (for `/metrics`; 1 for caches without blocks).
    pub block_tokens: usize,
    /// Bytes of the cache pool (for `/metrics`).
    pub cache_bytes: u64,
    /// The engine's limits.
    pub config: EngineConfig,
    /// The draft model of speculative decoding, when [`EngineConfig::speculation`] drafts
    /// with a model.
    pub draft: Option<ServedDraft<'a, B>>,
}

/// A draft model and its cache (empty).
pub struct ServedDraft<'a, B: InferenceBackend> {
    /// The loaded draft model.
    pub loaded: &'a LoadedModel<B>,
    /// Its KV cache.
    pub cache: Box<dyn KvCache<B>>,
}

/// A listening server whose engine has not started yet.
pub struct Server {
    runtime: tokio::runtime::Runtime,
    state: Arc<AppState>,
    commands: Receiver<Command>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
    local_addr: SocketAddr,
}

impl Server {
    /// Binds the address and starts answering: `/health` says 503 and the API endpoints 503
    /// until [`Server::serve`] has the model. SIGINT and SIGTERM start a graceful stop from
    /// now on.
    ///
    /// # Errors
    /// The runtime cannot start, or the address cannot be bound.
    pub fn start(options: ServerOptions) -> Result<Self, ServerError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kiln-http")
            .enable_all()
            .build()
            .map_err(ServerError::Runtime)?;
        let addr = format!("{}:{}", options.host, options.port);
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(&addr))
            .map_err(|source| ServerError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServerError::Bind { addr, source })?;
        let (tx, commands) = channel();
        let state = Arc::new(AppState::new(
            options,
            tx.clone(),
            Arc::new(Metrics::default()),
            Arc::new(AtomicUsize::new(0)),
        ));
        let stop = Arc::new(tokio::sync::Notify::new());
        runtime.spawn(on_signal(state.clone(), tx, stop.clone()));
        let app = routes::router(state.clone());
        let serving = runtime.spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.notified().await })
                .await
        });
        Ok(Self {
            runtime,
            state,
            commands,
            serving,
            local_addr,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// Serves `model` on this thread until SIGINT or SIGTERM, then stops gracefully: no new
    /// requests, running ones finish within the grace period and the rest are cancelled
    /// (their clients get an error), open connections close.
    ///
    /// # Errors
    /// A model without a tokenizer, a chat template that does not compile, or an engine
    /// configuration out of range.
    pub fn serve<B: InferenceBackend>(self, model: ServedModel<'_, B>) -> Result<(), ServerError> {
        let loaded = model.loaded;
        let tokenizer = loaded.tokenizer.clone().ok_or_else(|| {
            ServerError::Model(format!(
                "{} has no tokenizer; the server needs one",
                loaded.path.display()
            ))
        })?;
        let codec = Codec::new(
            tokenizer.clone(),
            loaded.chat_template.as_deref(),
            loaded.generation.bos,
            loaded.generation.eos.first().copied(),
        )
        .map_err(|e| ServerError::Model(e.to_string()))?;
        let shape = kiln_core::CausalLm::shape(&loaded.model);
        // The token trie structured output needs, made once (tens of milliseconds).
        let grammars = loaded.generation.eos.first().and_then(|&eos| {
            kiln_engine::GrammarCompiler::new(&tokenizer.token_texts(shape.vocab), eos).ok()
        });
        let kv_tokens = model.cache.usage().capacity;
        let detok = move |ids: &[kiln_core::TokenId]| tokenizer.decode(ids, true).ok();
        let mut engine =
            Engine::new(&loaded.model, model.cache, model.config)?.with_detokenizer(&detok);
        if let Some(draft) = model.draft {
            engine = engine.with_draft_model(&draft.loaded.model, draft.cache)?;
        }
        self.state.metrics.set_capacity(
            model.config.max_batch,
            kv_tokens / model.block_tokens.max(1),
            model.block_tokens,
            model.cache_bytes,
        );
        let _ = self.state.ready.set(Ready {
            model: model.name,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            codec,
            eos: loaded.generation.eos.clone(),
            shape,
            kv_tokens,
            block_tokens: model.block_tokens.max(1),
            max_batch: model.config.max_batch,
            grammars,
        });
        let shared = worker::Shared {
            metrics: &self.state.metrics,
            in_flight: &self.state.in_flight,
            block_tokens: model.block_tokens,
        };
        worker::run(
            &mut engine,
            &self.commands,
            &shared,
            self.state.options.shutdown_grace,
        );
        // Submissions still queued are dropped with the channel: their handlers answer 503.
        let Self {
            runtime,
            state,
            commands,
            serving,
            ..
        } = self;
        state.shutting_down.store(true, Ordering::SeqCst);
        drop(commands);
        let grace = state.options.shutdown_grace;
        runtime.block_on(async move {
            let _ = tokio::time::timeout(grace, serving).await;
        });
        runtime.shutdown_timeout(Duration::from_secs(1));
        Ok(())
    }
}

/// Waits for SIGINT or SIGTERM, then stops taking requests and tells the engine thread.
async fn on_signal(
    state: Arc<AppState>,
    commands: Sender<Command>,
    stop: Arc<tokio::sync::Notify>,
) {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = interrupt => {}
            () = terminate => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    tracing::info!(target: "kiln::serve", "shutting down: no new requests; running ones may finish");
    state.shutting_down.store(true, Ordering::SeqCst);
    let _ = commands.send(Command::Shutdown);
    stop.notify_one();
}
