//! The HTTP side: the router, what the handlers share, and the extractors that hand each
//! handler a loaded model and a parsed body. Handlers validate, tokenize and submit; the engine
//! thread ([`crate::worker`]) does the rest, and its updates become one JSON body
//! ([`collect`]) or a stream of server-sent events ([`stream`]) in OpenAI's schema
//! ([`crate::api::response`]).
//!
//! One file per endpoint family: [`completions`] (chat and completions, with [`job`]),
//! [`anthropic`] (Anthropic's Messages API), [`responses`] (OpenAI's Responses API),
//! [`ollama`] (Ollama's `/api/*`), [`models`], [`embeddings`], [`tokenize`] (and
//! detokenize), [`health`] (and metrics). Every chat API's answer is read by the same
//! [`collect::chat_answers`] or, streamed, [`chat_stream`], and written in its own shape.
//! What every request passes through on its way in (the browser guard, the API key, CORS, the
//! error shape of the route's API) is [`middleware`].
//!
//! The handlers speak in requests and tokens: what a request may generate in the cache is the
//! engine's answer ([`kiln_engine::CacheSpec::room_per_sequence`]), never block arithmetic here.

mod anthropic;
mod chat_stream;
mod collect;
mod completions;
mod embeddings;
mod health;
mod job;
mod middleware;
mod models;
mod ollama;
mod responses;
mod stream;
mod tokenize;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kiln_core::{ModelShape, TokenId};
use kiln_engine::{CacheSpec, GrammarCompiler};
use serde::Serialize;

use crate::ServerOptions;
use crate::api::RequestBody;
use crate::codec::Codec;
use crate::error::ApiError;
use crate::fleet::{Fleet, Lease};
use crate::metrics::Metrics;
use crate::responses_store::ResponseStore;
use crate::worker::Command;

/// Most responses the Responses API keeps at once, whatever their size.
const MAX_STORED_RESPONSES: usize = 10_000;

/// What the handlers share.
pub(crate) struct AppState {
    pub options: ServerOptions,
    /// The models: which are loaded, and the leases requests hold on them.
    pub fleet: Arc<Fleet>,
    pub metrics: Arc<Metrics>,
    /// The Responses API's stored responses.
    pub responses: ResponseStore,
    next_id: AtomicU64,
    id_prefix: u64,
}

/// The loaded model, as the handlers need it.
pub(crate) struct Ready {
    /// The name `/v1/models` lists and responses carry.
    pub model: String,
    pub codec: Codec,
    /// End-of-sequence tokens.
    pub eos: Vec<TokenId>,
    /// The model's context, vocabulary and cache layout (what a prompt must fit).
    pub shape: ModelShape,
    /// Tokens the KV cache holds: a request's prompt and output must fit.
    pub kv_tokens: usize,
    /// The KV cache, as the engine describes it: it says how much a request may generate.
    pub cache: CacheSpec,
    pub max_batch: usize,
    /// Compiles structured-output constraints (`None`: the model names no end-of-sequence
    /// token, so none can be enforced).
    pub grammars: Option<GrammarCompiler>,
    /// The width of the model's hidden states (`None`: it gives none, so no embeddings).
    pub hidden_size: Option<usize>,
    /// How `/v1/embeddings` pools an input's states into one vector.
    pub pooling: kiln_engine::Pooling,
    /// How this model's tool calls are written and read (`None`: tool calling off).
    pub tool_format: Option<crate::tools::ToolFormat>,
    /// Whether chat answers are split into `reasoning_content` and `content`
    /// ([`crate::reasoning`]).
    pub splits_reasoning: bool,
    /// What the model is, read from its files' headers when it loaded (`None`: they could not
    /// be read again), for the APIs that describe models (Ollama's `/api/show`).
    pub info: Option<kiln_models::ModelInfo>,
    /// The chat template's source text.
    pub chat_template: Option<String>,
    /// The model's engine thread.
    pub commands: Sender<Command>,
    /// Rows of engine requests accepted and not yet ended (the queue limit counts them).
    pub in_flight: Arc<AtomicUsize>,
    /// Embedding requests handed to the engine thread and not answered yet (at most
    /// `--max-queue`).
    pub embeddings_waiting: AtomicUsize,
    /// Bytes of the tokenizer's longest token text, found at the first request: a text of
    /// more than `tokens × longest` bytes cannot be `tokens` tokens.
    pub longest_token: OnceLock<usize>,
}

impl Ready {
    /// Tokens one sequence may hold: the model's context, or the KV cache if smaller.
    pub fn sequence_tokens(&self) -> usize {
        self.shape.max_positions.min(self.kv_tokens)
    }

    /// Bytes of the longest token's text (at least 1).
    fn longest_token(&self) -> usize {
        *self.longest_token.get_or_init(|| {
            (0..self.shape.vocab)
                .map(|id| self.codec.token_text(TokenId(id as u32)).len())
                .max()
                .unwrap_or(1)
                .max(1)
        })
    }

    /// Refuses a text of `bytes` before tokenizing it when it cannot fit in `tokens`
    /// tokens: every token stands for at most [`Self::longest_token`] bytes (twice that
    /// allowed, for normalizers that shorten text).
    fn check_text_fits(
        &self,
        bytes: usize,
        tokens: usize,
        param: &str,
        what: &str,
    ) -> Result<(), ApiError> {
        let longest = self.longest_token();
        let most = tokens.saturating_mul(longest).saturating_mul(2);
        if bytes > most {
            return Err(ApiError::context_length_exceeded(
                param,
                format!(
                    "{param} is {bytes} bytes of text; {what} holds {tokens} tokens, and no \
                     token of this tokenizer stands for more than {longest} bytes, so at most \
                     {most} bytes can fit"
                ),
            ));
        }
        Ok(())
    }
}

impl AppState {
    pub fn new(options: ServerOptions, fleet: Arc<Fleet>, metrics: Arc<Metrics>) -> Self {
        Self {
            responses: ResponseStore::new(options.responses_store_bytes, MAX_STORED_RESPONSES),
            options,
            fleet,
            metrics,
            next_id: AtomicU64::new(0),
            id_prefix: unix_time_nanos(),
        }
    }

    /// The next number of this process's sequence (response ids, request groups).
    fn next_number(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A fresh response id: `prefix` (with its separator: `chatcmpl-`, `msg_`) then 24 hex
    /// digits, unique within this process and unlikely to repeat across restarts.
    fn response_id(&self, prefix: &str) -> String {
        let n = self.next_number();
        format!("{prefix}{:016x}{n:08x}", self.id_prefix)
    }
}

fn unix_time_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Runs CPU work (parsing, templating, tokenizing, building a large body) on tokio's blocking
/// pool, so the two async threads stay free to accept, read and stream for other clients.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("a worker thread failed: {e}")))?
}

/// `value` as a JSON body (`application/json`, as `axum::Json` sends it), serialized where
/// it is called: on the blocking pool for a large one.
fn json_bytes<T: Serialize>(value: &T) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(value).map_err(|e| ApiError::internal(format!("writing JSON: {e}")))
}

/// A 200 with `bytes` of JSON.
fn json_response(bytes: Vec<u8>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        bytes,
    )
        .into_response()
}

/// Every route: the API key on every route that computes (`/v1/*`, `/tokenize`,
/// `/detokenize`), the browser guard on all, CORS when asked, and OpenAI-shaped 404 and 405.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models::models))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::input_items),
        )
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed_route))
        .route("/api/show", post(ollama::show))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::require_key,
        ));
    let open = Router::new()
        .route("/api/version", get(ollama::version))
        .route("/health", get(health::health))
        .route("/metrics", get(health::metrics));
    let cors = state.options.cors;
    let app = keyed
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::guard_browsers,
        ))
        .with_state(state);
    let app = if cors {
        app.layer(middleware::cors())
    } else {
        app
    };
    app.layer(axum::middleware::from_fn(middleware::speak_dialect))
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route {} {}",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// The JSON body as `T` ([`JsonBody`]) and a lease on the model its `model` names
/// ([`Fleet::acquire`]: loaded first if need be; 503 `model_loading` before the server is up,
/// 404 for a name it does not serve).
pub(crate) struct ModelBody<T> {
    pub lease: Lease,
    pub body: T,
}

impl<T: RequestBody + Send + 'static> FromRequest<Arc<AppState>> for ModelBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        // Not loaded yet at start-up: refused before the body is read.
        if !state.fleet.started() {
            return Err(ApiError::loading());
        }
        let JsonBody(body) = JsonBody::<T>::from_request(request, state).await?;
        let lease = state.fleet.acquire(body.model()).await?;
        Ok(Self { lease, body })
    }
}

/// When the request reached its handler (time to first token counts from here). Taken before
/// the body is read: put it before [`JsonBody`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrived(pub Instant);

impl<S: Send + Sync> FromRequestParts<S> for Arrived {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Arrived(Instant::now()))
    }
}

/// The JSON body as `T`, read within `--max-body-bytes` and `--body-timeout`
/// ([`crate::body`]: 413, 408) and parsed on the blocking pool (400 naming the field).
pub(crate) struct JsonBody<T>(pub T);

impl<T: RequestBody + Send + 'static> FromRequest<Arc<AppState>> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let peer = request
            .extensions()
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0);
        let (parts, body) = request.into_parts();
        let bytes =
            crate::body::read(&parts.headers, body, state.options.body_limits(), peer).await?;
        blocking(move || T::parse(&bytes)).await.map(JsonBody)
    }
}
