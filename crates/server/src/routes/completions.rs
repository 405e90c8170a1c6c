//! `POST /v1/chat/completions` and `POST /v1/completions`: a body becomes a [`Job`] on the
//! blocking pool (validated, its chat template rendered or its prompts tokenized, texts too
//! long to fit refused first), is submitted, and is answered with one body ([`super::collect`])
//! or a stream ([`super::stream`]).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::job::{Endpoint, Job, submit};
use super::{AppState, Arrived, ModelBody, blocking, collect, stream};
use crate::api::{self, ChatRequest, CompletionRequest, PromptInput};
use crate::error::ApiError;
use crate::fleet::Lease;
use crate::reasoning;
use crate::tools::{self, ToolFormat, ToolRequest};
use kiln_core::TokenId;

/// What [`super::Ready::check_text_fits`] says a prompt must fit in.
const KV_CACHE: &str = "the server's KV cache (or the model's context, if smaller)";

pub(super) async fn chat_completions(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<ChatRequest>,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || chat_job(&state, lease, body, arrived)).await
    };
    match job {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn completions(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<CompletionRequest>,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || completion_job(&state, lease, body, arrived)).await
    };
    match job {
        Ok(job) => run(state, job).await,
        Err(e) => e.into_response(),
    }
}

/// A chat's job: its messages through the chat template (a text too long to fit refused
/// first), with the tools the request offers ([`tools::plan`]: the template's `tools`, the
/// generic format's system text, a grammar when a call is forced, how the output is read).
fn chat_job(
    state: &AppState,
    lease: Lease,
    body: ChatRequest,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let ready = lease.ready().clone();
    let mut generation = body.generation()?;
    let text_bytes = body.messages.iter().map(api::Message::text_bytes).sum();
    let limit = ready.sequence_tokens();
    ready.check_text_fits(text_bytes, limit, "messages", KV_CACHE)?;
    if body.messages.is_empty() {
        return Err(ApiError::invalid_field("messages", "messages is empty"));
    }
    let tool_request = ToolRequest::new(
        body.tools.as_deref(),
        body.tool_choice.as_deref(),
        body.parallel_tool_calls,
    )?;
    let mut variables = body.template_variables()?;
    let plan = tools::plan(
        tool_request.as_ref(),
        ready.tool_format,
        &mut variables,
        &mut generation.constraint,
    )?;
    let generic_text = match (&tool_request, plan.format) {
        (Some(request), Some(ToolFormat::Generic)) => Some(tools::generic_system_text(request)),
        _ => None,
    };
    let turns = tools::conversation(&body.messages, generic_text.as_deref())?;
    let prompt = ready.codec.chat_prompt_turns(&turns, &variables)?;
    let mut job = Job::new(
        state,
        lease,
        Endpoint::Chat,
        vec![prompt],
        generation,
        arrived,
    )?;
    job.tools = plan;
    if job.ready.splits_reasoning {
        job.thinking = Some(prompt_opens_thinking(&job.ready.codec, &job.prompts[0]));
    }
    Ok(job)
}

/// Whether a chat prompt leaves the model inside `<think>` (DeepSeek-R1 distills' and QwQ's
/// templates open it): read from the prompt's last tokens, where the generation prompt is.
fn prompt_opens_thinking(codec: &crate::Codec, prompt: &[TokenId]) -> bool {
    const TAIL_TOKENS: usize = 16;
    let tail = &prompt[prompt.len().saturating_sub(TAIL_TOKENS)..];
    codec
        .decode_all(tail)
        .is_ok_and(|text| reasoning::prompt_opens_thinking(&text))
}

/// A completions request's job: its prompts tokenized (texts too long to fit refused first).
fn completion_job(
    state: &AppState,
    lease: Lease,
    body: CompletionRequest,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let ready = lease.ready().clone();
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
                ready.check_text_fits(text.len(), limit, "prompt", KV_CACHE)?;
                ready.codec.encode(&text, true)?
            }
            PromptInput::Tokens(ids) => ids,
        });
    }
    Job::new(
        state,
        lease,
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
