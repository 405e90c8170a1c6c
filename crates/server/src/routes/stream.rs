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

use super::job::{Endpoint, Job};
use crate::api::response::{
    ChatChunkChoice, ChatLogprob, ChatLogprobs, CompletionBody, Delta, TextChoice, TextLogprobs,
    finish_reason,
};
use crate::error::ApiError;
use crate::worker::Update;

/// The events of `job`'s answer, as `updates` bring them.
pub(super) fn stream(
    job: Job,
    updates: UnboundedReceiver<Update>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let streamer = Streamer {
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
}

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
    ) -> SseEvent {
        let codec = &self.job.ready.codec;
        match self.job.endpoint {
            Endpoint::Chat => {
                let logprobs = logprobs.map(|(t, lp)| ChatLogprobs {
                    content: vec![ChatLogprob::with_alternatives(codec, t, lp)],
                    refusal: None,
                });
                self.chunk(ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: None,
                        content: Some(text),
                    },
                    logprobs,
                    finish_reason: None,
                })
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
                self.chunk(TextChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason: None,
                })
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
                    events.push(self.chunk(ChatChunkChoice {
                        index,
                        delta: Delta {
                            role: Some("assistant"),
                            content: Some(""),
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
                let reason = Some(finish_reason(completion.finish_reason));
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
