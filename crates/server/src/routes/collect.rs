//! A non-streamed answer: every choice's updates collected until it ends ([`collect`]), a
//! chat's choices read into reasoning, content and calls ([`chat_answers`], whatever the API),
//! then written as one OpenAI body ([`body`]).

use kiln_core::TokenId;
use kiln_engine::{FinishReason, Timings, TokenLogprobs};
use tokio::sync::mpsc::UnboundedReceiver;

use super::job::{Endpoint, Job};
use crate::api::response::{
    ChatChoice, ChatLogprobs, ChatMessage, CompletionBody, FunctionCallBody, TextChoice,
    TextLogprobs, ToolCallBody, Usage, chat_finish_reason, finish_reason,
};
use crate::error::ApiError;
use crate::reasoning;
use crate::tools::{self, Parsed, ParsedCall};
use crate::worker::Update;

/// What one choice has produced so far.
#[derive(Default)]
pub(super) struct ChoiceState {
    pub text: String,
    pub tokens: usize,
    pub cached_tokens: usize,
    logprobs: Vec<(TokenId, TokenLogprobs)>,
    pub finish: Option<FinishReason>,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// Its time to first token and decode time.
    pub timings: Timings,
}

/// A tool call as every API writes it back: its id, the function and its arguments (JSON
/// text of an object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CallOut {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// One chat choice's output, read: its reasoning (when the model's is split), its content and
/// its calls (when the request offered tools).
pub(super) struct ChatAnswer {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub calls: Vec<CallOut>,
}

/// Each chat choice's output read as the job says: reasoning first (its text may look like
/// calls), then the calls in the answer.
pub(super) fn chat_answers(job: &Job, choices: &[ChoiceState]) -> Vec<ChatAnswer> {
    choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let (reasoning, answer) = match job.thinking {
                Some(starts_thinking) => reasoning::split(&c.text, starts_thinking),
                None => (None, Some(c.text.clone())),
            };
            let parsed = match &answer {
                Some(answer) => tools::parse(&job.tools, answer),
                None => Parsed::default(),
            };
            ChatAnswer {
                reasoning,
                content: parsed.content,
                calls: call_outs(job, index, &parsed.calls),
            }
        })
        .collect()
}

/// Choice `choice`'s calls, each with its id.
pub(super) fn call_outs(job: &Job, choice: usize, calls: &[ParsedCall]) -> Vec<CallOut> {
    calls
        .iter()
        .enumerate()
        .map(|(k, call)| CallOut {
            id: tools::call_id(job.tools.format, &job.id, choice, k),
            name: call.name.clone(),
            arguments: call.arguments.clone(),
        })
        .collect()
}

/// Waits for every choice.
pub(super) async fn collect(
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
                c.stop_string = completion.stop_string;
                c.timings = completion.timings;
                open -= 1;
            }
            Some(Update::Text { .. } | Update::Accepted) => {}
            Some(Update::Failed(e) | Update::Rejected(e)) => return Err(e),
            None => return Err(ApiError::shutting_down()),
        }
    }
    Ok(choices)
}

/// The whole body of a finished job, as JSON.
pub(super) fn body(job: &Job, choices: &[ChoiceState]) -> Result<Vec<u8>, ApiError> {
    let codec = &job.ready.codec;
    let completion_tokens: usize = choices.iter().map(|c| c.tokens).sum();
    let cached: Vec<usize> = choices.iter().map(|c| c.cached_tokens).collect();
    let usage = job.usage(completion_tokens, &cached);
    let logprobs = job.generation.logprobs;
    match job.endpoint {
        Endpoint::Chat => {
            let answers = chat_answers(job, choices);
            let choices = choices
                .iter()
                .zip(&answers)
                .enumerate()
                .map(|(index, (c, a))| ChatChoice {
                    index,
                    message: ChatMessage {
                        role: "assistant",
                        content: a.content.as_deref(),
                        reasoning_content: a.reasoning.as_deref(),
                        tool_calls: (!a.calls.is_empty()).then(|| tool_calls(&a.calls)),
                    },
                    logprobs: logprobs.map(|_| ChatLogprobs::new(codec, &c.logprobs)),
                    finish_reason: c.finish.map(|f| chat_finish_reason(f, a.calls.len())),
                });
            super::json_bytes(&answer(job, choices.collect(), usage))
        }
        Endpoint::Completions => {
            let choices = choices.iter().enumerate().map(|(index, c)| TextChoice {
                index,
                text: &c.text,
                logprobs: logprobs.map(|top| TextLogprobs::new(codec, &c.logprobs, top, 0)),
                finish_reason: c.finish.map(finish_reason),
            });
            super::json_bytes(&answer(job, choices.collect(), usage))
        }
    }
}

/// Calls as OpenAI's chat body writes them.
fn tool_calls(calls: &[CallOut]) -> Vec<ToolCallBody> {
    calls
        .iter()
        .map(|call| ToolCallBody {
            id: call.id.clone(),
            kind: "function",
            function: FunctionCallBody {
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            },
        })
        .collect()
}

/// A whole answer with `choices`.
fn answer<C>(job: &Job, choices: Vec<C>, usage: Usage) -> CompletionBody<'_, C> {
    CompletionBody {
        id: &job.id,
        object: job.endpoint.object(),
        created: job.created,
        model: &job.ready.model,
        choices,
        usage: Some(Some(usage)),
    }
}
