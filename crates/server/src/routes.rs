//! The HTTP side: axum handlers for every endpoint. Handlers validate, tokenize and submit;
//! the engine thread ([`crate::worker`]) does the rest, and its updates become one JSON body or
//! a stream of server-sent events in OpenAI's schema.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use kiln_core::{ModelShape, TokenId};
use kiln_engine::GrammarCompiler;
use kiln_engine::{FinishReason, TokenLogprobs};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::ServerOptions;
use crate::api::{self, ChatRequest, CompletionRequest, Generation, PromptInput};
use crate::codec::Codec;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::worker::{Command, Submission, Update, finish_reason};

/// What the handlers share.
pub(crate) struct AppState {
    pub options: ServerOptions,
    /// Set once the model is loaded; `/health` answers 503 until then.
    pub ready: OnceLock<Ready>,
    pub commands: Sender<Command>,
    pub metrics: Arc<Metrics>,
    pub in_flight: Arc<AtomicUsize>,
    pub shutting_down: AtomicBool,
    next_id: AtomicU64,
    id_prefix: u64,
    /// Bytes of the tokenizer's longest token text, found at the first request: a text of
    /// more than `tokens × longest` bytes cannot be `tokens` tokens.
    longest_token: OnceLock<usize>,
}

/// The loaded model, as the handlers need it.
pub(crate) struct Ready {
    /// The name `/v1/models` lists and responses carry.
    pub model: String,
    /// When it was loaded (Unix seconds).
    pub created: u64,
    pub codec: Codec,
    /// End-of-sequence tokens.
    pub eos: Vec<TokenId>,
    /// The model's context, vocabulary and cache layout (what a prompt must fit).
    pub shape: ModelShape,
    /// Tokens the KV cache holds: a request's prompt and output must fit.
    pub kv_tokens: usize,
    /// Tokens per block of the paged cache (1 for the others).
    pub block_tokens: usize,
    pub max_batch: usize,
    /// Compiles structured-output constraints (`None`: the model names no end-of-sequence
    /// token, so none can be enforced).
    pub grammars: Option<GrammarCompiler>,
}

impl AppState {
    pub fn new(
        options: ServerOptions,
        commands: Sender<Command>,
        metrics: Arc<Metrics>,
        in_flight: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            options,
            ready: OnceLock::new(),
            commands,
            metrics,
            in_flight,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            id_prefix: unix_time_nanos(),
            longest_token: OnceLock::new(),
        }
    }

    /// Bytes of the longest token's text (at least 1).
    fn longest_token(&self, ready: &Ready) -> usize {
        *self.longest_token.get_or_init(|| {
            (0..ready.shape.vocab)
                .map(|id| ready.codec.token_text(TokenId(id as u32)).len())
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
        ready: &Ready,
        bytes: usize,
        tokens: usize,
        param: &str,
        what: &str,
    ) -> Result<(), ApiError> {
        let longest = self.longest_token(ready);
        let most = tokens.saturating_mul(longest).saturating_mul(2);
        if bytes > most {
            return Err(ApiError::invalid_field(
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

    fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready.get().ok_or_else(ApiError::loading)
    }

    /// A fresh response id: `prefix-` then 24 hex digits, unique within this process and
    /// unlikely to repeat across restarts.
    fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:08x}", self.id_prefix)
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

/// Every route, with the API key on every route that computes (`/v1/*`, `/tokenize`,
/// `/detokenize`), CORS when asked, and OpenAI-shaped 404 and 405.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let open = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    let cors = state.options.cors;
    let app = v1
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard_browsers,
        ))
        .with_state(state);
    if cors {
        // Mirror the origin and the requested headers: the official JS SDK sends
        // `x-stainless-*` headers that a fixed list would refuse at the preflight.
        app.layer(
            CorsLayer::new()
                .allow_origin(AllowOrigin::mirror_request())
                .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
                .allow_headers(AllowHeaders::mirror_request())
                .max_age(std::time::Duration::from_secs(600)),
        )
    } else {
        app
    }
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

/// What a web page in a browser must not be able to do to a server on this machine:
///
/// - send it work without a CORS preflight: a POST body must be declared JSON, which a
///   page cannot send cross-origin without one (HTML forms and `no-cors` fetches send only
///   `text/plain`, form or no content types), and the server answers preflights only with
///   `--cors`;
/// - reach it under another name (DNS rebinding: a page's own host name made to resolve to
///   127.0.0.1): a server listening on a loopback address without `--api-key` answers only
///   requests addressed to a loopback name.
async fn guard_browsers(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::POST {
        let content_type = request
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        if !content_type.is_some_and(is_json) {
            return ApiError::not_json(content_type).into_response();
        }
    }
    if state.options.api_key.is_none() && is_loopback_host(&state.options.host) {
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok());
        if let Some(host) = host.filter(|h| !is_loopback_host(strip_port(h))) {
            return ApiError::foreign_host(host, &state.options.host).into_response();
        }
    }
    next.run(request).await
}

/// `application/json` or `application/*+json`, any parameters (`charset=utf-8`) aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json"))
}

/// A host name or address (without a port) that only reaches this machine.
fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let lower = host.to_ascii_lowercase();
    lower == "localhost"
        || lower.ends_with(".localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `host` of a `Host` header's `host[:port]` (IPv6 in brackets).
fn strip_port(value: &str) -> &str {
    if let Some(rest) = value.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    value.rsplit_once(':').map_or(value, |(host, _)| host)
}

/// The keyed routes need `Authorization: Bearer KEY` when the server has a key.
async fn require_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.options.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.trim().as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// The token of an `Authorization` value whose scheme is `Bearer` in any case (RFC 9110: the
/// scheme is case-insensitive), spaces around the token ignored.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The JSON body as `T`, read within `--max-body-bytes` and `--body-timeout`
/// ([`crate::body`]).
async fn json_body<T: api::RequestBody + Send + 'static>(
    state: &AppState,
    headers: &HeaderMap,
    request: Request,
) -> Result<T, ApiError> {
    let peer = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0);
    let bytes = crate::body::read(
        headers,
        request.into_body(),
        state.options.body_limits(),
        peer,
    )
    .await?;
    blocking(move || T::parse(&bytes)).await
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.ready() {
        Ok(_) => axum::Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let ready = state.ready()?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": ready.model,
            "object": "model",
            "created": ready.created,
            "owned_by": "kiln",
            "max_model_len": ready.shape.max_positions,
        }],
    }))
    .into_response())
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, ApiError> {
    state.ready()?;
    let body: api::TokenizeRequest = json_body(&state, &headers, request).await?;
    let body = blocking(move || {
        let ready = state.ready()?;
        let (param, text) = match (body.content, body.prompt) {
            (Some(text), _) => ("content", text),
            (None, Some(text)) => ("prompt", text),
            (None, None) => {
                return Err(ApiError::invalid_field(
                    "content",
                    "give the text as `content`",
                ));
            }
        };
        let context = ready.shape.max_positions;
        state.check_text_fits(ready, text.len(), context, param, "the model's context")?;
        let add_special = body.add_special.or(body.add_special_tokens).unwrap_or(true);
        let tokens = ready.codec.encode(&text, add_special)?;
        Ok(json!({
            "tokens": tokens,
            "count": tokens.len(),
            "max_model_len": context,
        }))
    })
    .await?;
    Ok(axum::Json(body).into_response())
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, ApiError> {
    let context = state.ready()?.shape.max_positions;
    let body: api::DetokenizeRequest = json_body(&state, &headers, request).await?;
    // No sequence of the model is longer than its context; the cap bounds the answer at
    // `context × longest token` bytes.
    if body.tokens.len() > context {
        return Err(ApiError::invalid_field(
            "tokens",
            format!(
                "{} ids given; at most the model's context, {context}",
                body.tokens.len()
            ),
        ));
    }
    let body = blocking(move || {
        let ready = state.ready()?;
        let ids: Vec<TokenId> = body.tokens.into_iter().map(TokenId).collect();
        let text = ready.codec.decode_all(&ids)?;
        // llama.cpp answers `content`, vLLM `prompt`.
        Ok(json!({"content": text, "prompt": text}))
    })
    .await?;
    Ok(axum::Json(body).into_response())
}

/// Which endpoint a job answers, for the shape of its bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

/// A validated request ready for the engine: one prompt per entry, `n` choices each.
struct Job {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompts: Vec<Vec<TokenId>>,
    generation: Generation,
    arrived: Instant,
    /// The engine requests, one per choice (a beam search: one per prompt); taken when
    /// submitted.
    requests: Vec<kiln_engine::Request>,
}

impl Job {
    /// Choices in all: choice `i` continues prompt `i / n` (OpenAI's order).
    fn choices(&self) -> usize {
        self.prompts.len() * self.generation.n
    }

    /// Choices each engine request answers: with beam search one request per prompt returns
    /// all `n` (its best hypotheses), otherwise one request per choice.
    fn choices_per_request(&self) -> usize {
        if self.generation.beam.is_some() {
            self.generation.n
        } else {
            1
        }
    }

    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    /// The usage object, from each choice's cached prompt tokens.
    fn usage(&self, completion_tokens: usize, cached_by_choice: &[usize]) -> Value {
        // A prompt counts once however many choices continue it, and so do its cached
        // tokens: those of its first choice (its siblings may have shared what it computed).
        let cached = cached_by_choice
            .chunks(self.generation.n.max(1))
            .map(|choices| choices.first().copied().unwrap_or(0))
            .sum();
        usage(self.prompt_tokens(), completion_tokens, cached)
    }

    /// A job of `prompts` with its engine requests, or why they cannot run.
    fn new(
        state: &AppState,
        endpoint: Endpoint,
        prompts: Vec<Vec<TokenId>>,
        generation: Generation,
        arrived: Instant,
    ) -> Result<Self, ApiError> {
        let ready = state.ready()?;
        let (prefix, param) = match endpoint {
            Endpoint::Chat => ("chatcmpl", "messages"),
            Endpoint::Completions => ("cmpl", "prompt"),
        };
        let mut job = Self {
            endpoint,
            id: state.response_id(prefix),
            created: unix_time(),
            model: ready.model.clone(),
            prompts,
            generation,
            arrived,
            requests: Vec::new(),
        };
        job.requests = job.requests(ready)?;
        // Rows of the batch it takes: the queue limit counts them, and a request that
        // takes more than the server ever runs or queues could never start.
        let rows: usize = job.requests.iter().map(kiln_engine::Request::rows).sum();
        let most = ready.max_batch + state.options.max_queue;
        if rows > most {
            let field = if job.generation.beam.is_some() {
                "num_beams"
            } else if job.prompts.len() > 1 {
                param
            } else {
                "n"
            };
            return Err(ApiError::invalid_field(
                field,
                format!(
                    "this request runs {rows} sequences (prompts × n, or prompts × num_beams); \
                     the server runs and queues at most {most} (--max-batch + --max-queue)"
                ),
            ));
        }
        let group = state.next_id.fetch_add(1, Ordering::Relaxed);
        for request in &mut job.requests {
            request.group = Some(group);
        }
        Ok(job)
    }

    /// The engine requests, one per choice.
    fn requests(&self, ready: &Ready) -> Result<Vec<kiln_engine::Request>, ApiError> {
        let g = &self.generation;
        let constraint = match &g.constraint {
            None => None,
            Some((field, constraint)) => {
                let Some(grammars) = &ready.grammars else {
                    return Err(ApiError::invalid_field(
                        field,
                        "this model names no end-of-sequence token: its output cannot be \
                         constrained",
                    ));
                };
                Some(
                    grammars
                        .compile(constraint)
                        .map_err(|e| ApiError::invalid_field(field, e.to_string()))?,
                )
            }
        };
        let limit = ready.shape.max_positions.min(ready.kv_tokens);
        let param = match self.endpoint {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        };
        let mut requests = Vec::with_capacity(self.choices());
        for prompt in &self.prompts {
            if let Some(why) = kiln_engine::prompt_problem(prompt, &ready.shape) {
                return Err(ApiError::invalid_field(param, why));
            }
            // The engine knows the context; the pool this server gave the cache may be smaller.
            if prompt.len() >= limit {
                return Err(ApiError::invalid_field(
                    param,
                    format!(
                        "the prompt has {} tokens; the server's KV cache holds {limit} tokens \
                         (--kv-cache-mb), and at least one must be left to generate",
                        prompt.len()
                    ),
                ));
            }
            // Without a limit, or with one past the context, generate up to the context.
            let room = limit - prompt.len();
            let max_tokens = match g.beam {
                // Every beam holds its own tokens: a search of n beams that runs to the end
                // needs n times them in the cache, and each beam may hold two partial
                // blocks (its own, and the copy of one it shared).
                Some(beam) => {
                    let margin = 2 * ready.block_tokens * beam.num_beams;
                    let room = room.saturating_sub(margin) / beam.num_beams;
                    match g.max_tokens {
                        Some(m) if m > room => {
                            return Err(ApiError::invalid_field(
                                "max_tokens",
                                format!(
                                    "{m} tokens for each of {} beams do not fit in the \
                                     server's KV cache ({limit} tokens, {} of them the \
                                     prompt's): at most {room}",
                                    beam.num_beams,
                                    prompt.len()
                                ),
                            ));
                        }
                        _ if room == 0 => {
                            return Err(ApiError::invalid_field(
                                "num_beams",
                                format!(
                                    "{} beams do not fit in the server's KV cache beside the \
                                     prompt ({limit} tokens, {} of them the prompt's)",
                                    beam.num_beams,
                                    prompt.len()
                                ),
                            ));
                        }
                        Some(m) => m,
                        None => room,
                    }
                }
                None => g.max_tokens.map_or(room, |m| m.min(room)),
            };
            let eos = if g.ignore_eos {
                Vec::new()
            } else {
                ready.eos.clone()
            };
            if let Some(beam) = g.beam {
                requests.push(kiln_engine::Request {
                    prompt: prompt.clone(),
                    max_tokens,
                    eos,
                    beam: Some(beam),
                    ..kiln_engine::Request::default()
                });
                continue;
            }
            for choice in 0..g.n {
                requests.push(kiln_engine::Request {
                    prompt: prompt.clone(),
                    max_tokens,
                    sampling: g.sampling_for(choice),
                    eos: eos.clone(),
                    stop: g.stop.clone(),
                    logprobs: g.logprobs,
                    constraint: constraint.clone(),
                    ..kiln_engine::Request::default()
                });
            }
        }
        Ok(requests)
    }
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
) -> Response {
    let arrived = Instant::now();
    let result = async {
        state.ready()?;
        let body: ChatRequest = json_body(&state, &headers, request).await?;
        let state = state.clone();
        blocking(move || {
            let ready = state.ready()?;
            let generation = body.generation()?;
            let text_bytes = body.messages.iter().map(api::Message::text_bytes).sum();
            let limit = ready.shape.max_positions.min(ready.kv_tokens);
            state.check_text_fits(ready, text_bytes, limit, "messages", KV_CACHE)?;
            let prompt = ready
                .codec
                .chat_prompt(&body.messages, &body.template_variables()?)?;
            Job::new(&state, Endpoint::Chat, vec![prompt], generation, arrived)
        })
        .await
    }
    .await;
    match result {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    request: Request,
) -> Response {
    let arrived = Instant::now();
    let result = async {
        state.ready()?;
        let body: CompletionRequest = json_body(&state, &headers, request).await?;
        let state = state.clone();
        blocking(move || completion_job(&state, body, arrived)).await
    }
    .await;
    match result {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

/// A completions request's job: its prompts tokenized (texts too long to fit refused first).
fn completion_job(
    state: &AppState,
    body: CompletionRequest,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let ready = state.ready()?;
    let generation = body.generation()?;
    let Some(prompt) = &body.prompt else {
        return Err(ApiError::invalid_field("prompt", "prompt is required"));
    };
    let inputs = prompt.inputs()?;
    if inputs.len() * generation.n > api::MAX_CHOICES {
        return Err(ApiError::invalid_field(
            "n",
            format!(
                "{} prompts times n = {} is more than {} choices",
                inputs.len(),
                generation.n,
                api::MAX_CHOICES
            ),
        ));
    }
    let limit = ready.shape.max_positions.min(ready.kv_tokens);
    let mut prompts = Vec::with_capacity(inputs.len());
    for input in inputs {
        prompts.push(match input {
            PromptInput::Text(text) => {
                state.check_text_fits(ready, text.len(), limit, "prompt", KV_CACHE)?;
                ready.codec.encode(&text, true)?
            }
            PromptInput::Tokens(ids) => ids,
        });
    }
    Job::new(state, Endpoint::Completions, prompts, generation, arrived)
}

/// What [`AppState::check_text_fits`] says a prompt must fit in.
const KV_CACHE: &str = "the server's KV cache (or the model's context, if smaller)";

/// Submits `job` and answers with its body or its stream.
async fn run(state: Arc<AppState>, mut job: Job) -> Response {
    let updates = match submit(&state, &mut job).await {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    if job.generation.stream {
        return stream(state, job, updates).into_response();
    }
    let choices = match collect(&job, updates).await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    // A body with many choices and log-probabilities is megabytes of JSON to build.
    match blocking(move || body(&state, &job, &choices)).await {
        Ok(body) => axum::Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Queues the job's requests on the engine thread, or refuses them: the queue is full, the
/// server is stopping, or the engine refused them.
async fn submit(state: &AppState, job: &mut Job) -> Result<UnboundedReceiver<Update>, ApiError> {
    let ready = state.ready()?;
    let requests = std::mem::take(&mut job.requests);
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    // Rows, not requests: a beam search of 8 beams queues as 8.
    let n: usize = requests.iter().map(kiln_engine::Request::rows).sum();
    let limit = ready.max_batch + state.options.max_queue;
    let before = state.in_flight.fetch_add(n, Ordering::SeqCst);
    if before + n > limit {
        state.in_flight.fetch_sub(n, Ordering::SeqCst);
        state.metrics.rejected();
        return Err(ApiError::queue_full(state.options.max_queue));
    }
    let (tx, mut rx) = unbounded_channel();
    let submission = Submission {
        requests,
        updates: tx,
        arrived: job.arrived,
        tag: job.id.clone(),
    };
    if state.commands.send(Command::Submit(submission)).is_err() {
        state.in_flight.fetch_sub(n, Ordering::SeqCst);
        return Err(ApiError::shutting_down());
    }
    match rx.recv().await {
        Some(Update::Accepted) => Ok(rx),
        Some(Update::Rejected(e)) => Err(e),
        Some(other) => Err(ApiError::internal(format!(
            "the engine answered {other:?} before accepting the request"
        ))),
        None => Err(ApiError::shutting_down()),
    }
}

/// What one choice has produced so far.
#[derive(Default)]
struct ChoiceState {
    text: String,
    tokens: usize,
    cached_tokens: usize,
    logprobs: Vec<(TokenId, TokenLogprobs)>,
    finish: Option<FinishReason>,
}

/// Waits for every choice.
async fn collect(
    job: &Job,
    mut updates: UnboundedReceiver<Update>,
) -> Result<Vec<ChoiceState>, ApiError> {
    let mut choices: Vec<ChoiceState> =
        (0..job.choices()).map(|_| ChoiceState::default()).collect();
    let per_request = job.choices_per_request();
    let mut open = job.choices() / per_request;
    while open > 0 {
        match updates.recv().await {
            Some(Update::Token {
                choice,
                token,
                logprobs,
                ..
            }) => {
                if let Some(lp) = logprobs {
                    choices[choice].logprobs.push((token, lp));
                }
            }
            Some(Update::Finished { choice, completion }) if per_request > 1 => {
                // A beam search: its hypotheses are the prompt's choices, best first.
                let first = choice * per_request;
                for (k, h) in completion.beams.iter().enumerate().take(per_request) {
                    let c = &mut choices[first + k];
                    c.text = h.text.clone().unwrap_or_default();
                    c.tokens = h.tokens.len();
                    c.cached_tokens = completion.cached_tokens;
                    c.finish = Some(h.finish_reason);
                }
                open -= 1;
            }
            Some(Update::Finished { choice, completion }) => {
                let c = &mut choices[choice];
                c.text = completion.text.unwrap_or_default();
                c.tokens = completion.tokens.len();
                c.cached_tokens = completion.cached_tokens;
                c.finish = Some(completion.finish_reason);
                open -= 1;
            }
            Some(Update::Text { .. } | Update::Accepted) => {}
            Some(Update::Failed(e) | Update::Rejected(e)) => return Err(e),
            None => return Err(ApiError::shutting_down()),
        }
    }
    Ok(choices)
}

/// The whole body of a finished job.
fn body(state: &AppState, job: &Job, choices: &[ChoiceState]) -> Result<Value, ApiError> {
    let ready = state.ready()?;
    let completion_tokens: usize = choices.iter().map(|c| c.tokens).sum();
    let cached: Vec<usize> = choices.iter().map(|c| c.cached_tokens).collect();
    let body_choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let reason = c.finish.map(finish_reason);
            match job.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": job.generation.logprobs.map(|_| chat_logprobs(&ready.codec, &c.logprobs)),
                    "finish_reason": reason,
                }),
                Endpoint::Completions => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": job.generation.logprobs.map(|top| completion_logprobs(&ready.codec, &c.logprobs, top, 0)),
                    "finish_reason": reason,
                }),
            }
        })
        .collect();
    let object = match job.endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    Ok(json!({
        "id": job.id,
        "object": object,
        "created": job.created,
        "model": job.model,
        "choices": body_choices,
        "usage": job.usage(completion_tokens, &cached),
    }))
}

/// OpenAI's usage object; `cached_tokens` are prompt tokens whose K/V came from the prefix
/// cache.
fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// JSON has no infinities; a token the model rules out entirely reads as -9999 (as vLLM).
fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// One token's entry in a chat `logprobs.content`.
fn chat_logprob_entry(codec: &Codec, token: TokenId, lp: &TokenLogprobs) -> Value {
    let entry = |id: TokenId, logprob: f32| {
        let text = codec.token_text(id);
        let bytes: Vec<u8> = text.clone().into_bytes();
        json!({"token": text, "logprob": finite(logprob), "bytes": bytes})
    };
    let mut value = entry(token, lp.logprob);
    value["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
    value
}

fn chat_logprobs(codec: &Codec, tokens: &[(TokenId, TokenLogprobs)]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|(t, lp)| chat_logprob_entry(codec, *t, lp))
        .collect();
    json!({"content": content, "refusal": null})
}

/// The legacy completions `logprobs` object; `offset` is where the first token's text starts
/// in the choice's text.
fn completion_logprobs(
    codec: &Codec,
    tokens: &[(TokenId, TokenLogprobs)],
    top: usize,
    offset: usize,
) -> Value {
    let mut texts = Vec::with_capacity(tokens.len());
    let mut offsets = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for (t, _) in tokens {
        let text = codec.token_text(*t);
        offsets.push(at);
        at += text.len();
        texts.push(text);
    }
    let top_logprobs: Vec<Value> = tokens
        .iter()
        .map(|(_, lp)| {
            let map: serde_json::Map<String, Value> = lp
                .top
                .iter()
                .take(top)
                .map(|&(id, l)| (codec.token_text(id), json!(finite(l))))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|(_, lp)| finite(lp.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    })
}

/// Server-sent events: chunks as tokens come, then the usage chunk if asked for, then
/// `[DONE]`. An error after the stream started is sent as a data event, then `[DONE]`.
fn stream(
    state: Arc<AppState>,
    job: Job,
    updates: UnboundedReceiver<Update>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let streamer = Streamer {
        state,
        open: job.choices(),
        completion_tokens: 0,
        cached_tokens: vec![0; job.choices()],
        text_offsets: HashMap::new(),
        started: false,
        done: false,
        job,
        updates,
    };
    let events = futures_util::stream::unfold(streamer, |mut s| async move {
        if s.done {
            return None;
        }
        let events = s.next_events().await;
        Some((events, s))
    })
    .flat_map(|events| futures_util::stream::iter(events.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

struct Streamer {
    state: Arc<AppState>,
    job: Job,
    updates: UnboundedReceiver<Update>,
    open: usize,
    completion_tokens: usize,
    /// Prompt tokens found in the prefix cache, per choice.
    cached_tokens: Vec<usize>,
    /// Bytes of text sent so far per choice (the completions `text_offset`).
    text_offsets: HashMap<usize, usize>,
    started: bool,
    done: bool,
}

impl Streamer {
    fn data(value: &Value) -> SseEvent {
        SseEvent::default().data(value.to_string())
    }

    fn done_event() -> SseEvent {
        SseEvent::default().data("[DONE]")
    }

    /// A chunk with one choice.
    fn chunk(&self, choice: Value) -> SseEvent {
        let object = match self.job.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut body = json!({
            "id": self.job.id,
            "object": object,
            "created": self.job.created,
            "model": self.job.model,
            "choices": [choice],
        });
        if self.job.generation.include_usage {
            body["usage"] = Value::Null;
        }
        Self::data(&body)
    }

    /// A piece of text (and a token's log-probabilities) for choice `index`.
    fn text_chunk(
        &mut self,
        index: usize,
        text: &str,
        logprobs: Option<(TokenId, &TokenLogprobs)>,
    ) -> SseEvent {
        let Some(ready) = self.state.ready.get() else {
            return Self::data(&ApiError::loading().body());
        };
        let codec = &ready.codec;
        match self.job.endpoint {
            Endpoint::Chat => {
                let lp = logprobs.map(|(t, lp)| {
                    json!({"content": [chat_logprob_entry(codec, t, lp)], "refusal": null})
                });
                self.chunk(json!({
                    "index": index,
                    "delta": {"content": text},
                    "logprobs": lp,
                    "finish_reason": null,
                }))
            }
            Endpoint::Completions => {
                let offset = self.text_offsets.entry(index).or_insert(0);
                let lp = logprobs.map(|(t, lp)| {
                    completion_logprobs(
                        codec,
                        &[(t, lp.clone())],
                        self.job.generation.logprobs.unwrap_or(0),
                        *offset,
                    )
                });
                *offset += text.len();
                self.chunk(json!({
                    "index": index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": null,
                }))
            }
        }
    }

    /// The events for the next update (the role chunks first, for chat).
    async fn next_events(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if !self.started {
            self.started = true;
            if self.job.endpoint == Endpoint::Chat {
                for index in 0..self.job.choices() {
                    events.push(self.chunk(json!({
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": null,
                        "finish_reason": null,
                    })));
                }
                return events;
            }
        }
        if self.open == 0 {
            if self.job.generation.include_usage {
                let object = match self.job.endpoint {
                    Endpoint::Chat => "chat.completion.chunk",
                    Endpoint::Completions => "text_completion",
                };
                events.push(Self::data(&json!({
                    "id": self.job.id,
                    "object": object,
                    "created": self.job.created,
                    "model": self.job.model,
                    "choices": [],
                    "usage": self.job.usage(self.completion_tokens, &self.cached_tokens),
                })));
            }
            events.push(Self::done_event());
            self.done = true;
            return events;
        }
        match self.updates.recv().await {
            Some(Update::Token {
                choice,
                token,
                text,
                logprobs,
            }) => {
                if !text.is_empty() || logprobs.is_some() {
                    events.push(self.text_chunk(
                        choice,
                        &text,
                        logprobs.as_ref().map(|lp| (token, lp)),
                    ));
                }
            }
            Some(Update::Text { choice, text }) => {
                if !text.is_empty() {
                    events.push(self.text_chunk(choice, &text, None));
                }
            }
            Some(Update::Finished { choice, completion }) => {
                self.open -= 1;
                self.completion_tokens += completion.tokens.len();
                self.cached_tokens[choice] = completion.cached_tokens;
                let reason = finish_reason(completion.finish_reason);
                let last = match self.job.endpoint {
                    Endpoint::Chat => json!({
                        "index": choice,
                        "delta": {},
                        "logprobs": null,
                        "finish_reason": reason,
                    }),
                    Endpoint::Completions => json!({
                        "index": choice,
                        "text": "",
                        "logprobs": null,
                        "finish_reason": reason,
                    }),
                };
                events.push(self.chunk(last));
            }
            Some(Update::Accepted) => {}
            Some(Update::Failed(e)) => {
                events.push(Self::data(&e.body()));
                events.push(Self::done_event());
                self.done = true;
            }
            Some(Update::Rejected(e)) => {
                events.push(Self::data(&e.body()));
                events.push(Self::done_event());
                self.done = true;
            }
            None => {
                events.push(Self::data(&ApiError::shutting_down().body()));
                events.push(Self::done_event());
                self.done = true;
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, is_json, is_loopback_host, strip_port};

    #[test]
    fn only_json_bodies_and_loopback_names_pass_the_browser_guard() {
        for t in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.api+json",
        ] {
            assert!(is_json(t), "{t}");
        }
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "application/jsonp",
        ] {
            assert!(!is_json(t), "{t}");
        }
        for h in [
            "localhost:8080",
            "LOCALHOST",
            "127.0.0.1:80",
            "127.1.2.3",
            "[::1]:8080",
            "[::1]",
            "app.localhost:3000",
        ] {
            assert!(is_loopback_host(strip_port(h)), "{h}");
        }
        for h in [
            "evil.example:8080",
            "192.168.1.2",
            "localhost.evil.example",
            "[::2]:80",
            "0.0.0.0:8080",
        ] {
            assert!(!is_loopback_host(strip_port(h)), "{h}");
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_spaces_around_the_token_do_not_count() {
        for value in [
            "Bearer sk-1",
            "bearer sk-1",
            "BEARER sk-1",
            "Bearer   sk-1  ",
            " Bearer sk-1",
        ] {
            assert_eq!(bearer_token(value), Some("sk-1"), "{value:?}");
        }
        for value in ["Basic sk-1", "Bearersk-1", "sk-1", ""] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }
}
