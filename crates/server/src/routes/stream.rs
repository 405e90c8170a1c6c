//! A streamed answer: server-sent events, one chunk per piece of text as the engine's updates
//! come (after a first chunk per choice with the role, for chat), a last chunk per choice with
//! its `finish_reason`, the usage chunk if asked for, then `data: [DONE]`. An error after the
//! stream started is one data event with the error object, then `[DONE]`.

use std::collections::HashMap;
use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::StreamExt;
use kiln_core::TokenId;
use kiln_engine::TokenLogprobs;
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver;

use super::chat_stream::ChoiceReader;
use super::collect::call_outs;
use super::job::{Endpoint, Job};
use crate::api::response::{
    ChatChunkChoice, ChatLogprob, ChatLogprobs, CompletionBody, Delta, FunctionDelta, TextChoice,
    TextLogprobs, ToolCallDelta, chat_finish_reason, finish_reason,
};
use crate::error::ApiError;
use crate::reasoning::Split;
use crate::tools::Parsed;
use crate::worker::Update;

/// The events of `job`'s answer, as `updates` bring them.
pub(super) fn stream(
    job: Job,
    updates: UnboundedReceiver<Update>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let readers = match job.endpoint {
        Endpoint::Chat => (0..job.choices())
            .map(|_| ChoiceReader::new(&job))
            .collect(),
        Endpoint::Completions => Vec::new(),
    };
    let streamer = Streamer {
        readers,
        open: job.choices(),
        completion_tokens: 0,
        cached_tokens: vec![0; job.choices()],
        text_offsets: HashMap::new(),
        started: false,
        done: false,
        job,
        updates,
    };
    sse(streamer)
}

/// A writer of server-sent events in some API's shape: the events of each next update, until
/// its last has gone out.
pub(super) trait EventWriter: Send + 'static {
    /// Whether its last event has gone out.
    fn ended(&self) -> bool;

    /// The events of the next update (possibly none).
    fn events(&mut self) -> impl Future<Output = Vec<SseEvent>> + Send;
}

/// `writer`'s events as one answer of server-sent events, with keep-alive comments while it
/// waits.
pub(super) fn sse<W: EventWriter>(
    writer: W,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let events = futures_util::stream::unfold(writer, |mut w| async move {
        if w.ended() {
            return None;
        }
        let events = w.events().await;
        Some((events, w))
    })
    .flat_map(|events| futures_util::stream::iter(events.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

impl EventWriter for Streamer {
    fn ended(&self) -> bool {
        self.done
    }

    fn events(&mut self) -> impl Future<Output = Vec<SseEvent>> + Send {
        self.next_events()
    }
}

struct Streamer {
    job: Job,
    updates: UnboundedReceiver<Update>,
    /// Engine requests not finished yet.
    open: usize,
    completion_tokens: usize,
    /// Prompt tokens found in the prefix cache, per choice.
    cached_tokens: Vec<usize>,
    /// Bytes of text sent so far per choice (the completions `text_offset`).
    text_offsets: HashMap<usize, usize>,
    started: bool,
    done: bool,
    /// Per chat choice: what of its text is reasoning, what is content now and what is held
    /// for the calls (empty for completions).
    readers: Vec<ChoiceReader>,
}

/// Bytes of a call's arguments per chunk: they stream in pieces, as OpenAI streams them (and
/// every other API's writer does too).
pub(super) const ARGUMENT_PIECE_BYTES: usize = 24;

/// One data event of `value`'s JSON.
fn data<T: Serialize>(value: &T) -> SseEvent {
    match serde_json::to_string(value) {
        Ok(json) => SseEvent::default().data(json),
        // Not reached: every body is strings and numbers under string keys.
        Err(_) => SseEvent::default().data(
            r#"{"error":{"message":"kiln could not write this chunk","type":"server_error","param":null,"code":null}}"#,
        ),
    }
}

fn error_event(error: &ApiError) -> SseEvent {
    data(&error.envelope())
}

fn done_event() -> SseEvent {
    SseEvent::default().data("[DONE]")
}

impl Streamer {
    /// A chunk with one choice (`usage: null` beside it when the client asked for usage).
    fn chunk<C: Serialize>(&self, choice: C) -> SseEvent {
        data(&CompletionBody {
            id: &self.job.id,
            object: self.job.endpoint.chunk_object(),
            created: self.job.created,
            model: &self.job.ready.model,
            choices: vec![choice],
            usage: self.job.generation.include_usage.then_some(None),
        })
    }

    /// A piece of text (and a token's log-probabilities) for choice `index`.
    fn text_chunk(
        &mut self,
        index: usize,
        text: &str,
        logprobs: Option<(TokenId, &TokenLogprobs)>,
    ) -> Option<SseEvent> {
        let codec = &self.job.ready.codec;
        match self.job.endpoint {
            Endpoint::Chat => {
                let split = self.readers[index].push(text);
                self.chat_piece(index, split, logprobs)
            }
            Endpoint::Completions => {
                let offset = self.text_offsets.entry(index).or_insert(0);
                let logprobs = logprobs.map(|(t, lp)| {
                    TextLogprobs::new(
                        codec,
                        &[(t, lp.clone())],
                        self.job.generation.logprobs.unwrap_or(0),
                        *offset,
                    )
                });
                *offset += text.len();
                Some(self.chunk(TextChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason: None,
                }))
            }
        }
    }

    /// A chat choice's next reasoning and answer text (and a token's log-probabilities) as one
    /// chunk (the reader has held back what may be a call). `None` when there is nothing to
    /// send.
    fn chat_piece(
        &mut self,
        index: usize,
        split: Split,
        logprobs: Option<(TokenId, &TokenLogprobs)>,
    ) -> Option<SseEvent> {
        let thought = split.reasoning;
        let content = split.content;
        if content.is_empty() && thought.is_empty() && logprobs.is_none() {
            return None;
        }
        let codec = &self.job.ready.codec;
        let logprobs = logprobs.map(|(t, lp)| ChatLogprobs {
            content: vec![ChatLogprob::with_alternatives(codec, t, lp)],
            refusal: None,
        });
        Some(self.chunk(ChatChunkChoice {
            index,
            delta: Delta {
                content: (!content.is_empty() || thought.is_empty()).then_some(&content),
                reasoning_content: (!thought.is_empty()).then_some(&thought),
                ..Delta::default()
            },
            logprobs,
            finish_reason: None,
        }))
    }

    /// What a chat choice held back, sent when it ends: the rest of its content, then each
    /// call (its id, type and name first, then its arguments in pieces).
    fn held_events(&self, index: usize, held: Parsed) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let delta_chunk = |delta: Delta<'_>| {
            self.chunk(ChatChunkChoice {
                index,
                delta,
                logprobs: None,
                finish_reason: None,
            })
        };
        if let Some(content) = held.content.as_deref().filter(|c| !c.is_empty()) {
            events.push(delta_chunk(Delta {
                content: Some(content),
                ..Delta::default()
            }));
        }
        for (k, call) in call_outs(&self.job, index, &held.calls).iter().enumerate() {
            events.push(delta_chunk(Delta {
                tool_calls: Some(vec![ToolCallDelta {
                    index: k,
                    id: Some(call.id.clone()),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(call.name.clone()),
                        arguments: Some(String::new()),
                    },
                }]),
                ..Delta::default()
            }));
            for piece in pieces(&call.arguments, ARGUMENT_PIECE_BYTES) {
                events.push(delta_chunk(Delta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index: k,
                        id: None,
                        kind: None,
                        function: FunctionDelta {
                            name: None,
                            arguments: Some(piece.to_string()),
                        },
                    }]),
                    ..Delta::default()
                }));
            }
        }
        events
    }

    /// The events for the next update (the role chunks first, for chat).
    async fn next_events(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if !self.started {
            self.started = true;
            if self.job.endpoint == Endpoint::Chat {
                for index in 0..self.job.choices() {
                    events.push(self.chunk(ChatChunkChoice {
                        index,
                        delta: Delta {
                            role: Some("assistant"),
                            content: Some(""),
                            reasoning_content: None,
                            tool_calls: None,
                        },
                        logprobs: None,
                        finish_reason: None,
                    }));
                }
                return events;
            }
        }
        if self.open == 0 {
            if self.job.generation.include_usage {
                let usage = self.job.usage(self.completion_tokens, &self.cached_tokens);
                events.push(data(&CompletionBody::<ChatChunkChoice<'_>> {
                    id: &self.job.id,
                    object: self.job.endpoint.chunk_object(),
                    created: self.job.created,
                    model: &self.job.ready.model,
                    choices: Vec::new(),
                    usage: Some(Some(usage)),
                }));
            }
            events.push(done_event());
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
                    events.extend(self.text_chunk(
                        choice,
                        &text,
                        logprobs.as_ref().map(|lp| (token, lp)),
                    ));
                }
            }
            Some(Update::Text { choice, text }) => {
                if !text.is_empty() {
                    events.extend(self.text_chunk(choice, &text, None));
                }
            }
            Some(Update::Finished { choice, completion }) => {
                self.open -= 1;
                self.completion_tokens += completion.tokens.len();
                self.cached_tokens[choice] = completion.cached_tokens;
                // What the readers held back goes out as the text and calls it turned out
                // to be.
                let (tail, held) = match self.readers.get_mut(choice) {
                    Some(reader) => reader.finish(),
                    None => Default::default(),
                };
                events.extend(self.chat_piece(choice, tail, None));
                let calls = held.calls.len();
                events.extend(self.held_events(choice, held));
                let reason = Some(match self.job.endpoint {
                    Endpoint::Chat => chat_finish_reason(completion.finish_reason, calls),
                    Endpoint::Completions => finish_reason(completion.finish_reason),
                });
                events.push(match self.job.endpoint {
                    Endpoint::Chat => self.chunk(ChatChunkChoice {
                        index: choice,
                        delta: Delta::default(),
                        logprobs: None,
                        finish_reason: reason,
                    }),
                    Endpoint::Completions => self.chunk(TextChoice {
                        index: choice,
                        text: "",
                        logprobs: None,
                        finish_reason: reason,
                    }),
                });
            }
            Some(Update::Accepted) => {}
            Some(Update::Failed(e) | Update::Rejected(e)) => {
                events.push(error_event(&e));
                events.push(done_event());
                self.done = true;
            }
            None => {
                events.push(error_event(&ApiError::shutting_down()));
                events.push(done_event());
                self.done = true;
            }
        }
        events
    }
}

/// `text` in pieces of about `bytes` bytes, cut at character boundaries.
pub(super) fn pieces(text: &str, bytes: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = bytes.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        out.push(&rest[..cut]);
        rest = &rest[cut..];
    }
    out
}
