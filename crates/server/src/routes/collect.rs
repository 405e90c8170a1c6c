//! A non-streamed answer: every choice's updates collected until it ends ([`collect`]), then
//! written as one body ([`body`]).

use kiln_core::TokenId;
use kiln_engine::{FinishReason, TokenLogprobs};
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
    text: String,
    tokens: usize,
    cached_tokens: usize,
    logprobs: Vec<(TokenId, TokenLogprobs)>,
    finish: Option<FinishReason>,
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
            // Reasoning first (its text may look like calls), then the calls in the answer.
            let split: Vec<(Option<String>, Option<String>)> = choices
                .iter()
                .map(|c| match job.thinking {
                    Some(starts_thinking) => reasoning::split(&c.text, starts_thinking),
                    None => (None, Some(c.text.clone())),
                })
                .collect();
            let parsed: Vec<Parsed> = split
                .iter()
                .map(|(_, answer)| match answer {
                    Some(answer) => tools::parse(&job.tools, answer),
                    None => Parsed::default(),
                })
                .collect();
            let choices = choices
                .iter()
                .zip(parsed.iter().zip(&split))
                .enumerate()
                .map(|(index, (c, (p, (thought, _))))| ChatChoice {
                    index,
                    message: ChatMessage {
                        role: "assistant",
                        content: p.content.as_deref(),
                        reasoning_content: thought.as_deref(),
                        tool_calls: (!p.calls.is_empty()).then(|| tool_calls(job, index, &p.calls)),
                    },
                    logprobs: logprobs.map(|_| ChatLogprobs::new(codec, &c.logprobs)),
                    finish_reason: c.finish.map(|f| chat_finish_reason(f, p.calls.len())),
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

/// Choice `choice`'s calls as the body writes them, each with its id.
fn tool_calls(job: &Job, choice: usize, calls: &[ParsedCall]) -> Vec<ToolCallBody> {
    calls
        .iter()
        .enumerate()
        .map(|(k, call)| ToolCallBody {
            id: tools::call_id(job.tools.format, &job.id, choice, k),
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
