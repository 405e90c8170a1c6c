//! `POST /v1/chat/completions` and `POST /v1/completions`: a body becomes a [`Job`] on the
//! blocking pool (validated, its chat template rendered or its prompts tokenized, texts too
//! long to fit refused first), is submitted, and is answered with one body ([`super::collect`])
//! or a stream ([`super::stream`]).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::job::{Job, Origin, submit};
use super::{AppState, Arrived, ModelBody, Ready, blocking, collect, stream};
use crate::api::{self, ChatInput, ChatRequest, CompletionRequest, Generation, PromptInput};
use crate::error::ApiError;
use crate::fleet::Lease;
use crate::reasoning;
use crate::tools::{self, ToolFormat, ToolPlan, ToolRequest, ToolTurns};
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
        blocking(move || {
            let input = ChatInput::from_openai(body)?;
            chat_job(&state, lease, input, Origin::CHAT, arrived)
        })
        .await
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

/// A chat's job: its messages through the chat template ([`render_chat`]), submitted as
/// `origin`'s.
pub(super) fn chat_job(
    state: &AppState,
    lease: Lease,
    input: ChatInput,
    origin: Origin,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let ready = lease.ready().clone();
    let RenderedChat {
        prompt,
        tools,
        generation,
    } = render_chat(&ready, input, origin.prompt_field)?;
    let mut job = Job::new(state, lease, origin, vec![prompt], generation, arrived)?;
    job.tools = tools;
    if job.ready.splits_reasoning {
        job.thinking = Some(prompt_opens_thinking(&job.ready.codec, &job.prompts[0]));
    }
    Ok(job)
}

/// A chat's prompt and what tool calling makes of it.
pub(super) struct RenderedChat {
    pub prompt: Vec<TokenId>,
    /// How the output is read for calls.
    pub tools: ToolPlan,
    /// The request's generation, with the tool grammar when a call is forced.
    pub generation: Generation,
}

/// A chat's messages through `ready`'s chat template (a text too long to fit refused first,
/// naming `prompt_field`), with the tools the request offers ([`tools::plan`]: the template's
/// `tools`, the generic format's system text, a grammar when a call is forced, how the output
/// is read).
pub(super) fn render_chat(
    ready: &Ready,
    input: ChatInput,
    prompt_field: &str,
) -> Result<RenderedChat, ApiError> {
    let ChatInput {
        messages,
        tools,
        tool_choice,
        parallel_tool_calls,
        mut variables,
        mut generation,
    } = input;
    let text_bytes = messages.iter().map(api::Message::text_bytes).sum();
    let limit = ready.sequence_tokens();
    ready.check_text_fits(text_bytes, limit, prompt_field, KV_CACHE)?;
    if messages.is_empty() {
        return Err(ApiError::invalid_field(
            prompt_field,
            format!("{prompt_field} is empty"),
        ));
    }
    let tool_request = ToolRequest::from_values(tools, tool_choice, parallel_tool_calls)?;
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
    // A template that knows no tools gets earlier calls and results as text, whether or not
    // this request offers tools (a reply after a tool result often offers none).
    let tool_turns = if ready.tool_format == Some(ToolFormat::Generic) {
        ToolTurns::AsText(generic_text.as_deref())
    } else {
        ToolTurns::Native
    };
    let turns = tools::conversation(&messages, tool_turns)?;
    let prompt = ready.codec.chat_prompt_turns(&turns, &variables)?;
    Ok(RenderedChat {
        prompt,
        tools: plan,
        generation,
    })
}

/// Whether a chat prompt leaves the model inside `<think>` (DeepSeek-R1 distills' and QwQ's
/// templates open it): read from the prompt's last tokens, where the generation prompt is.
pub(super) fn prompt_opens_thinking(codec: &crate::Codec, prompt: &[TokenId]) -> bool {
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
        Origin::COMPLETIONS,
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
