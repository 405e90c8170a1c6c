//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the
//! same chat job as `/v1/chat/completions` ([`super::completions::chat_job`]), answered as one
//! message body or as Anthropic's server-sent events (`message_start`, a
//! `content_block_start` / `content_block_delta`* / `content_block_stop` per thinking, text
//! or `tool_use` block, `message_delta` with the stop reason and usage, `message_stop`; an
//! error after the stream started is an `error` event). Errors are in Anthropic's shape
//! ([`crate::error::Dialect`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use kiln_engine::FinishReason;
use serde_json::{Value, json};

use super::chat_stream::{ChatStream, Ending, Piece, Step};
use super::collect::{CallOut, ChatAnswer, ChoiceState, chat_answers, collect};
use super::completions::{chat_job, render_chat};
use super::job::{Job, Origin, submit};
use super::stream::{ARGUMENT_PIECE_BYTES, EventWriter, pieces, sse};
use super::{AppState, Arrived, ModelBody, blocking, json_bytes, json_response};
use crate::api::anthropic::{MessageBody, MessageUsage, MessagesRequest, tool_use_id};
use crate::error::Dialect;

pub(super) async fn messages(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<MessagesRequest>,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || {
            let input = body.chat_input(true)?;
            chat_job(&state, lease, input, Origin::MESSAGES, arrived)
        })
        .await
    };
    let mut job = match job {
        Ok(job) => job,
        Err(e) => return e.into_response(),
    };
    let updates = match submit(&state, &mut job).await {
        Ok(updates) => updates,
        Err(e) => return e.into_response(),
    };
    if job.generation.stream {
        return stream(ChatStream::new(job, updates)).into_response();
    }
    let choices = match collect(&job, updates).await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    match blocking(move || {
        let answer = chat_answers(&job, &choices).remove(0);
        json_bytes(&message_body(&job, &choices[0], answer))
    })
    .await
    {
        Ok(bytes) => json_response(bytes),
        Err(e) => e.into_response(),
    }
}

/// `{"input_tokens": N}`: the prompt `/v1/messages` would run, tools and system included.
pub(super) async fn count_tokens(
    ModelBody { lease, body }: ModelBody<MessagesRequest>,
) -> Response {
    let counted = blocking(move || {
        let input = body.chat_input(false)?;
        let rendered = render_chat(lease.ready(), input, Origin::MESSAGES.prompt_field)?;
        json_bytes(&json!({"input_tokens": rendered.prompt.len()}))
    })
    .await;
    match counted {
        Ok(bytes) => json_response(bytes),
        Err(e) => e.into_response(),
    }
}

/// Anthropic's stop reason.
fn stop_reason(finish: FinishReason, stop_string: Option<&str>, calls: usize) -> &'static str {
    match finish {
        _ if calls > 0 => "tool_use",
        FinishReason::Length => "max_tokens",
        FinishReason::Stop if stop_string.is_some() => "stop_sequence",
        FinishReason::Eos | FinishReason::Stop => "end_turn",
    }
}

fn tool_use_block(call: &CallOut) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": tool_use_id(&call.id), "name": call.name, "input": input})
}

/// The whole message.
fn message_body<'a>(job: &'a Job, choice: &'a ChoiceState, answer: ChatAnswer) -> MessageBody<'a> {
    let mut content = Vec::new();
    if let Some(thinking) = answer.reasoning.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    if let Some(text) = answer.content.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(answer.calls.iter().map(tool_use_block));
    let finish = choice.finish.unwrap_or(FinishReason::Stop);
    let stop_string = choice.stop_string.as_deref();
    MessageBody {
        id: &job.id,
        kind: "message",
        role: "assistant",
        model: &job.ready.model,
        content,
        stop_reason: Some(stop_reason(finish, stop_string, answer.calls.len())),
        stop_sequence: stop_string.filter(|_| answer.calls.is_empty()),
        usage: MessageUsage::new(job.prompts[0].len(), choice.cached_tokens, choice.tokens),
    }
}

/// The open content block of a streamed message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// A streamed message's writer: which block is open and the next block's index.
struct Writer {
    chat: ChatStream,
    open: Option<Open>,
    next_index: usize,
    started: bool,
    done: bool,
}

fn event(name: &'static str, data: &Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

impl Writer {
    fn close(&mut self, events: &mut Vec<SseEvent>) {
        if self.open.take().is_some() {
            let index = self.next_index - 1;
            events.push(event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    /// Opens a block of `block`'s content (closing the open one) and returns its index.
    fn start(&mut self, block: Value, events: &mut Vec<SseEvent>) -> usize {
        self.close(events);
        let index = self.next_index;
        self.next_index += 1;
        events.push(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn piece(&mut self, piece: Piece, events: &mut Vec<SseEvent>) {
        let (kind, delta) = match piece {
            Piece::Reasoning(text) => (
                Open::Thinking,
                json!({"type": "thinking_delta", "thinking": text}),
            ),
            Piece::Content(text) => (Open::Text, json!({"type": "text_delta", "text": text})),
            Piece::Call(call) => {
                let mut block = tool_use_block(&call);
                let input = block["input"].to_string();
                block["input"] = json!({});
                let index = self.start(block, events);
                for piece in pieces(&input, ARGUMENT_PIECE_BYTES) {
                    events.push(event(
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": piece}}),
                    ));
                }
                events.push(event(
                    "content_block_stop",
                    &json!({"type": "content_block_stop", "index": index}),
                ));
                return;
            }
        };
        if self.open != Some(kind) {
            let block = match kind {
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Open::Text => json!({"type": "text", "text": ""}),
            };
            self.start(block, events);
            self.open = Some(kind);
        }
        events.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.next_index - 1, "delta": delta}),
        ));
    }

    fn end(&mut self, ending: &Ending, events: &mut Vec<SseEvent>) {
        self.close(events);
        let reason = stop_reason(ending.finish, ending.stop_string.as_deref(), ending.calls);
        let stop_sequence = ending.stop_string.as_deref().filter(|_| ending.calls == 0);
        let usage = MessageUsage::new(
            self.chat.job.prompts[0].len(),
            ending.cached_tokens,
            ending.tokens,
        );
        events.push(event(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                    "usage": usage}),
        ));
        events.push(event("message_stop", &json!({"type": "message_stop"})));
    }

    async fn next_events(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if !self.started {
            self.started = true;
            let job = &self.chat.job;
            let message = MessageBody {
                id: &job.id,
                kind: "message",
                role: "assistant",
                model: &job.ready.model,
                content: Vec::new(),
                stop_reason: None,
                stop_sequence: None,
                usage: MessageUsage::new(job.prompts[0].len(), 0, 0),
            };
            events.push(event(
                "message_start",
                &json!({"type": "message_start", "message": message}),
            ));
            events.push(event("ping", &json!({"type": "ping"})));
            return events;
        }
        match self.chat.next().await {
            Step::Pieces(pieces) => {
                for piece in pieces {
                    self.piece(piece, &mut events);
                }
            }
            Step::Ended(pieces, ending) => {
                for piece in pieces {
                    self.piece(piece, &mut events);
                }
                self.end(&ending, &mut events);
                self.done = true;
            }
            Step::Failed(e) => {
                events.push(event("error", &e.body_in(Dialect::Anthropic)));
                self.done = true;
            }
        }
        events
    }
}

impl EventWriter for Writer {
    fn ended(&self) -> bool {
        self.done
    }

    fn events(&mut self) -> impl Future<Output = Vec<SseEvent>> + Send {
        self.next_events()
    }
}

/// The message as Anthropic's server-sent events.
fn stream(chat: ChatStream) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    sse(Writer {
        chat,
        open: None,
        next_index: 0,
        started: false,
        done: false,
    })
}
