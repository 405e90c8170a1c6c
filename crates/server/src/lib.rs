//! # kiln-server
//!
//! `kiln serve`: an OpenAI-compatible HTTP server over kiln's [`kiln_engine::Engine`]. Each
//! served model has one engine thread that owns it, its KV cache and its engine, and steps
//! while there is work (`engine_thread.rs`, `worker.rs`); a small tokio runtime runs axum's
//! handlers, which validate, tokenize and hand requests to the model's engine thread over a
//! channel, each with its own channel back for its tokens. Requests that arrive while others
//! run join the running batch at the next step; a client that goes away cancels its request
//! and frees its cache before the next step. With several models (`fleet.rs`) a request names
//! one; it is loaded on first use, and the least recently used idle one is unloaded when a
//! memory budget would be exceeded.
//!
//! - [`Server::start`] binds and answers at once (`/health` is 503 while the first model
//!   loads);
//! - [`Server::serve`] loads the first model through a [`ModelLoader`] and serves until SIGINT
//!   or SIGTERM, then stops accepting, lets running requests finish within the grace period,
//!   cancels the rest, and returns; a second signal cancels everything at once.
//!
//! Connections are accepted and served by `listener.rs` (hyper's HTTP/1 with deadlines for
//! request heads, an idle timeout and a cap on open connections), and request bodies read by
//! `body.rs` (a size limit and a deadline). `routes/` holds the router, its middleware (the
//! browser guard, the API key, CORS) and one file per endpoint family, with the SSE streamer
//! and the non-streamed collector apart; `api/` the request types, their validation and the
//! typed response bodies; `worker.rs` the engine thread.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `POST /v1/embeddings`, `GET /health`, `GET /metrics` (Prometheus), `POST /tokenize`,
//! `POST /detokenize`.
//! `docs/serve.md` describes each, with transcripts.

mod api;
mod body;
mod codec;
mod engine_thread;
mod error;
mod fleet;
mod listener;
mod metrics;
mod pooling;
mod reasoning;
mod responses_store;
mod routes;
mod tools;
mod worker;

// The fuzzer and counting allocator kiln-models' tests use (std only, shared by path): the
// request parsers are fuzzed and their memory measured with it.
#[cfg(test)]
#[path = "../../models/tests/fuzz/harness.rs"]
mod harness;

#[cfg(test)]
#[global_allocator]
static GUARD: harness::Guard = harness::Guard;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kiln_core::InferenceBackend;
use kiln_core::kv_cache::KvCache;
use kiln_engine::{CacheSpec, EngineConfig};
use kiln_models::LoadedModel;

pub use codec::Codec;
pub use error::ApiError;
pub use fleet::{FleetLimits, ModelEntry};
pub use metrics::Metrics;
pub use reasoning::ReasoningFormat;
pub use tools::{ToolFormat, ToolParser};
pub use worker::rows_for_one_request;

use crate::body::BodyLimits;
use crate::fleet::Fleet;
use crate::listener::{ConnectionLimits, Phase};
use crate::routes::AppState;

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
    /// Most sequences (choices, beams) waiting beyond the running batch; more are refused
    /// with 503.
    pub max_queue: usize,
    /// Largest request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long running requests may go on after SIGINT / SIGTERM before they are cancelled.
    /// It counts from the signal, once: the engine's requests and the connections share it.
    pub shutdown_grace: Duration,
    /// How long a client may take to send a request's head (request line and headers), from
    /// when its connection opens or its previous response ends; then the connection closes.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's whole body, from when the handler asks
    /// for it; then it gets 408 and the connection closes.
    pub body_timeout: Duration,
    /// How long a connection with no request in progress stays open waiting for the next one
    /// (in effect at most `header_timeout`, whose clock runs meanwhile).
    pub keep_alive_timeout: Duration,
    /// Most connections open at once (at least 1): at the limit the server stops accepting
    /// until one closes.
    pub max_connections: usize,
    /// Tokenize special-token text in chat messages as the control tokens it spells (the
    /// default, `false`, reads it as plain text, so a user cannot close their turn).
    pub special_tokens_in_content: bool,
    /// Whitespace JSON output may have between its tokens (bounded by default).
    pub json_whitespace: kiln_engine::JsonWhitespace,
    /// How `/v1/embeddings` pools when the model's files do not say
    /// (sentence-transformers' `1_Pooling/config.json`); `None`: the last token.
    pub embedding_pooling: Option<kiln_engine::Pooling>,
    /// How tool calls are read (`--tool-parser`): from the chat template (the default), a named
    /// format, or off.
    pub tool_parser: ToolParser,
    /// Whether a thinking model's `<think>…</think>` goes to `reasoning_content`
    /// (`--reasoning-format`).
    pub reasoning_format: ReasoningFormat,
    /// Most bytes the Responses API's stored responses hold together
    /// (`--responses-store-mb`); past it the least recently used are evicted.
    pub responses_store_bytes: usize,
}

impl ServerOptions {
    /// What a request body may be.
    pub(crate) fn body_limits(&self) -> BodyLimits {
        BodyLimits {
            max_bytes: self.max_body_bytes,
            timeout: self.body_timeout,
        }
    }

    fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            header_timeout: self.header_timeout,
            keep_alive_timeout: self.keep_alive_timeout,
            max_connections: self.max_connections.max(1),
        }
    }
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
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 1024,
            special_tokens_in_content: false,
            json_whitespace: kiln_engine::JsonWhitespace::Bounded,
            embedding_pooling: None,
            tool_parser: ToolParser::Auto,
            responses_store_bytes: 64 << 20,
            reasoning_format: ReasoningFormat::Auto,
        }
    }
}

/// How [`Server::serve`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Stopped {
    /// After one SIGINT or SIGTERM: running requests had the grace period to finish.
    Gracefully,
    /// A second signal came during the grace period: everything still running was cancelled
    /// at once. (A command-line program conventionally exits 130 then, as after Ctrl-C.)
    Forced,
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
    /// The models cannot be served (none, an alias twice, no tokenizer, a broken chat
    /// template).
    #[error("{0}")]
    Model(String),
    /// The first model failed to load.
    #[error("loading the model: {0}")]
    Load(String),
}

/// A model to serve, with its engine's cache and limits, as a [`ModelLoader`] gives it.
pub struct ServedModel<B: InferenceBackend> {
    /// The loaded model.
    pub loaded: LoadedModel<B>,
    /// The KV cache (empty).
    pub cache: Box<dyn KvCache<B>>,
    /// Tokens per cache block (for `/metrics`; 1 for caches without blocks).
    pub block_tokens: usize,
    /// Bytes of the cache pool (for `/metrics`).
    pub cache_bytes: u64,
    /// Bytes it holds in all: weights as held, the KV cache, a draft model and its cache
    /// (what `--models-memory-mb` counts).
    pub memory_bytes: u64,
    /// The engine's limits.
    pub config: EngineConfig,
    /// The draft model of speculative decoding, when [`EngineConfig::speculation`] drafts
    /// with a model.
    pub draft: Option<ServedDraft<B>>,
}

/// A draft model and its cache (empty).
pub struct ServedDraft<B: InferenceBackend> {
    /// The loaded draft model.
    pub loaded: LoadedModel<B>,
    /// Its KV cache.
    pub cache: Box<dyn KvCache<B>>,
}

/// Loads the served models when the server needs them: the first at start-up, the others on
/// first use and again after an unload. Called on the model's own engine thread, which the
/// model never leaves.
pub trait ModelLoader<B: InferenceBackend>: Send + Sync + 'static {
    /// Loads the model named `alias` ([`ModelEntry::alias`]), with its cache.
    ///
    /// # Errors
    /// Why it cannot load, for the log and the requests waiting on it.
    fn load(&self, alias: &str) -> Result<ServedModel<B>, String>;
}

/// A listening server whose engine has not started yet.
pub struct Server {
    runtime: tokio::runtime::Runtime,
    state: Arc<AppState>,
    serving: tokio::task::JoinHandle<()>,
    stop: Arc<Stop>,
    local_addr: SocketAddr,
}

/// The stop, shared by the signal task, the listener and [`Server::serve`].
struct Stop {
    /// What the listener and its connections are to do.
    phase: tokio::sync::watch::Sender<Phase>,
    /// When the first signal came: the one grace period counts from here.
    since: OnceLock<Instant>,
    /// A second signal came.
    forced: AtomicBool,
}

/// After the grace period the engine cuts off what still runs; its clients' error answers
/// are written within this much more before the connections are dropped.
const FLUSH: Duration = Duration::from_millis(500);

impl Server {
    /// Binds the address and starts answering for `models` (at least one; the first is the
    /// default, loaded by [`Server::serve`], the others on first use within `limits`):
    /// `/health` says 503 and the API endpoints 503 until the first has loaded. SIGINT and
    /// SIGTERM start a graceful stop from now on.
    ///
    /// # Errors
    /// No model, an alias given twice or not a valid name, the runtime cannot start, or the
    /// address cannot be bound.
    pub fn start(
        options: ServerOptions,
        models: Vec<ModelEntry>,
        limits: FleetLimits,
    ) -> Result<Self, ServerError> {
        let fleet = Arc::new(Fleet::new(models, limits).map_err(ServerError::Model)?);
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
        let state = Arc::new(AppState::new(options, fleet, Arc::new(Metrics::default())));
        let (phase, watching) = tokio::sync::watch::channel(Phase::Serving);
        let stop = Arc::new(Stop {
            phase,
            since: OnceLock::new(),
            forced: AtomicBool::new(false),
        });
        runtime.spawn(on_signal(state.clone(), stop.clone()));
        let app = routes::router(state.clone());
        let limits = state.options.connection_limits();
        let serving = runtime.spawn(listener::serve(listener, app, limits, watching));
        Ok(Self {
            runtime,
            state,
            serving,
            stop,
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

    /// Serves the models until SIGINT or SIGTERM: loads the first now (each model on an engine
    /// thread of its own, with `loader`), the others when a request names them. Then stops
    /// gracefully: no new connections or requests, running ones finish within the grace period
    /// (counted from the signal) and the rest are cancelled (their clients get an error), open
    /// connections close. A second signal during the grace period cancels everything at once
    /// ([`Stopped::Forced`]).
    ///
    /// # Errors
    /// The first model cannot load: the loader failed, it has no tokenizer, its chat template
    /// does not compile, or its engine configuration is out of range.
    pub fn serve<B: InferenceBackend>(
        self,
        loader: impl ModelLoader<B>,
    ) -> Result<Stopped, ServerError> {
        let loader = Arc::new(loader);
        // Weak: the fleet keeps the spawner, and the state keeps the fleet.
        let state = Arc::downgrade(&self.state);
        self.state.fleet.set_spawner(Box::new(move |index| {
            let (loader, state) = (loader.clone(), state.clone());
            std::thread::Builder::new()
                .name(format!("kiln-engine-{index}"))
                .spawn(move || engine_thread::run(&state, &*loader, index))
                .map(drop)
        }));
        self.state
            .fleet
            .load_blocking(0)
            .map_err(ServerError::Load)?;
        // Until a signal has stopped every engine thread.
        self.state.fleet.wait_stopped();
        let Self {
            runtime,
            state,
            mut serving,
            stop,
            ..
        } = self;
        let since = *stop.since.get_or_init(Instant::now);
        stop.phase.send_if_modified(|phase| {
            let serving = *phase == Phase::Serving;
            if serving {
                *phase = Phase::Draining;
            }
            serving
        });
        // One grace period from the signal for the connections too (the engine's ran out at the
        // same time): then what is still open is dropped, slow uploads and stalled clients
        // included. `FLUSH` lets the answers of requests cut off just now go out.
        let deadline = later(since, state.options.shutdown_grace).max(Instant::now() + FLUSH);
        runtime.block_on(async {
            let deadline = tokio::time::Instant::from_std(deadline);
            if tokio::time::timeout_at(deadline, &mut serving).await.is_err() {
                tracing::info!(target: "kiln::serve", "grace period over: closing the connections still open");
                stop.phase.send_replace(Phase::Aborting);
                let _ = serving.await;
            }
        });
        runtime.shutdown_timeout(Duration::from_secs(1));
        Ok(if stop.forced.load(Ordering::SeqCst) {
            Stopped::Forced
        } else {
            Stopped::Gracefully
        })
    }
}

/// The served cache as the engine describes it, from what [`ServedModel`] says of it: its kind,
/// rows and window from the cache, its token slots as blocks of `block_tokens`. The handlers
/// ask it what a request may generate ([`CacheSpec::room_per_sequence`]).
pub(crate) fn cache_spec<B: InferenceBackend>(
    cache: &dyn KvCache<B>,
    block_tokens: usize,
    shape: &kiln_core::ModelShape,
    config: &EngineConfig,
) -> CacheSpec {
    let slots = cache.usage().capacity;
    let page_size = block_tokens.max(1);
    let rows = cache.max_sequences();
    CacheSpec {
        kind: cache.kind(),
        max_sequences: rows.unwrap_or(config.max_batch),
        // A static cache's rows share its slots; the others size nothing by it.
        max_len: rows.map_or(shape.max_positions, |rows| slots / rows.max(1)),
        window: cache.window().unwrap_or(shape.max_positions),
        max_step: config.max_step_tokens,
        page_size,
        blocks: Some(slots / page_size),
    }
}

/// `at + span`, or a day after `at` when that overflows the clock (a grace of
/// `Duration::MAX` from a library caller).
fn later(at: Instant, span: Duration) -> Instant {
    at.checked_add(span)
        .or_else(|| at.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(at)
}

/// Waits for SIGINT or SIGTERM, then stops taking requests and connections and tells the
/// engine thread; a second signal drops every connection, which cancels what still runs (the
/// engine thread sees its clients gone before its next step), so [`Server::serve`] returns at
/// once.
async fn on_signal(state: Arc<AppState>, stop: Arc<Stop>) {
    let mut signals = Signals::new();
    signals.next().await;
    let _ = stop.since.set(Instant::now());
    tracing::info!(
        target: "kiln::serve",
        "shutting down: no new requests; running ones may finish within {} s (--shutdown-grace); a second SIGINT or SIGTERM stops at once",
        state.options.shutdown_grace.as_secs_f64()
    );
    state.fleet.shutdown();
    stop.phase.send_replace(Phase::Draining);
    signals.next().await;
    tracing::warn!(target: "kiln::serve", "second signal: stopping now, cancelling the requests still running");
    stop.forced.store(true, Ordering::SeqCst);
    stop.phase.send_replace(Phase::Aborting);
}

/// SIGINT and SIGTERM, as many times as they come.
struct Signals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Self {
                interrupt: signal(SignalKind::interrupt()).ok(),
                terminate: signal(SignalKind::terminate()).ok(),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The next signal (never, if none could be listened for).
    async fn next(&mut self) {
        #[cfg(unix)]
        {
            async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
                // `recv` gives `None` when the stream can deliver no more: wait forever then.
                if let Some(s) = signal
                    && s.recv().await.is_some()
                {
                    return;
                }
                std::future::pending().await
            }
            tokio::select! {
                () = recv(&mut self.interrupt) => {}
                () = recv(&mut self.terminate) => {}
            }
        }
        #[cfg(not(unix))]
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
