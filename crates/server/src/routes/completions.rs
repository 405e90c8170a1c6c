//! `POST /v1/chat/completions` and `POST /v1/completions`: a body becomes a [`Job`] on the
//! blocking pool (validated, its chat template rendered or its prompts tokenized, texts too
//! long to fit refused first), is submitted, and is answered with one body ([`super::collect`])
//! or a stream ([`super::stream`]).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::job::{Endpoint, Job, submit};
use super::{AppState, Arrived, JsonBody, Loaded, Ready, blocking, collect, stream};
use crate::api::{self, ChatRequest, CompletionRequest, PromptInput};
use crate::error::ApiError;

/// What [`AppState::check_text_fits`] says a prompt must fit in.
const KV_CACHE: &str = "the server's KV cache (or the model's context, if smaller)";

pub(super) async fn chat_completions(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    Loaded(ready): Loaded,
    JsonBody(body): JsonBody<ChatRequest>,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || chat_job(&state, ready, body, arrived)).await
    };
    match job {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn completions(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    Loaded(ready): Loaded,
    JsonBody(body): JsonBody<CompletionRequest>,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || completion_job(&state, ready, body, arrived)).await
    };
    match job {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

/// A chat's job: its messages through the chat template (a text too long to fit refused
/// first).
fn chat_job(
    state: &AppState,
    ready: Arc<Ready>,
    body: ChatRequest,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let generation = body.generation()?;
    let text_bytes = body.messages.iter().map(api::Message::text_bytes).sum();
    let limit = ready.sequence_tokens();
    state.check_text_fits(&ready, text_bytes, limit, "messages", KV_CACHE)?;
    let prompt = ready
        .codec
        .chat_prompt(&body.messages, &body.template_variables()?)?;
    Job::new(
        state,
        ready,
        Endpoint::Chat,
        vec![prompt],
        generation,
        arrived,
    )
}

/// A completions request's job: its prompts tokenized (texts too long to fit refused first).
fn completion_job(
    state: &AppState,
    ready: Arc<Ready>,
    body: CompletionRequest,
    arrived: Instant,
) -> Result<Job, ApiError> {
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
    let limit = ready.sequence_tokens();
    let mut prompts = Vec::with_capacity(inputs.len());
    for input in inputs {
        prompts.push(match input {
            PromptInput::Text(text) => {
                state.check_text_fits(&ready, text.len(), limit, "prompt", KV_CACHE)?;
                ready.codec.encode(&text, true)?
            }
            PromptInput::Tokens(ids) => ids,
        });
    }
    Job::new(
        state,
        ready,
        Endpoint::Completions,
        prompts,
        generation,
        arrived,
    )
}

/// Submits `job` and answers with its body or its stream.
async fn run(state: Arc<AppState>, mut job: Job) -> Response {
    let updates = match submit(&state, &mut job).await {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    if job.generation.stream {
        return stream::stream(job, updates).into_response();
    }
    let choices = match collect::collect(&job, updates).await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    // A body with many choices and log-probabilities is megabytes of JSON to build.
    match blocking(move || collect::body(&job, &choices)).await {
        Ok(bytes) => super::json_response(bytes),
        Err(e) => e.into_response(),
    }
}
