//! OpenAI's Responses API: `POST /v1/responses` over the same chat job as
//! `/v1/chat/completions` ([`super::completions::chat_job`]), answered as one response object
//! or as its typed server-sent events (`response.created`, `response.in_progress`, per output
//! item `response.output_item.added`, its parts' and text's or arguments' deltas and `done`s,
//! `response.output_item.done`, then `response.completed` or `response.incomplete`; every
//! event numbered by `sequence_number`). Responses are kept ([`crate::responses_store`]) for
//! `GET /v1/responses/{id}`, `DELETE`, `GET /v1/responses/{id}/input_items` and a later
//! request's `previous_response_id`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use kiln_engine::FinishReason;
use serde::Deserialize;
use serde_json::{Value, json};

use super::chat_stream::{ChatStream, Piece, Step};
use super::collect::{CallOut, ChatAnswer, chat_answers, collect};
use super::completions::chat_job;
use super::job::{Job, Origin, submit};
use super::stream::{ARGUMENT_PIECE_BYTES, EventWriter, pieces, sse};
use super::{AppState, Arrived, ModelBody, blocking, json_bytes, json_response};
use crate::api::responses::{Echo, ResponsesRequest};
use crate::api::{Content, Message, MessageFunctionCall, MessageToolCall};
use crate::error::ApiError;
use crate::responses_store::StoredResponse;

/// What a response carries besides its job: the request's echo, its own messages and input
/// items, and the conversation it continues.
struct Context {
    echo: Echo,
    new_messages: Vec<Message>,
    input_items: Vec<Value>,
    history: Vec<Message>,
    created_at: u64,
}

/// 404 for a response id not stored (never stored, deleted, evicted or `store: false`).
fn unknown(id: &str, param: Option<&str>) -> ApiError {
    let mut e = ApiError::not_found(format!(
        "no stored response has the id {:?} (it may have been deleted, evicted from the \
         server's store, or made with store: false)",
        id.chars().take(80).collect::<String>()
    ));
    e.param = param.map(str::to_string);
    e
}

pub(super) async fn create(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<ResponsesRequest>,
) -> Response {
    let history = match &body.previous_response_id {
        Some(id) => match state.responses.get(id) {
            Some(stored) => stored.conversation.clone(),
            None => return unknown(id, Some("previous_response_id")).into_response(),
        },
        None => Vec::new(),
    };
    let prepared = {
        let state = state.clone();
        blocking(move || {
            let prepared = body.prepare(&history, |prefix| state.response_id(prefix))?;
            let context = Context {
                echo: prepared.echo,
                new_messages: prepared.new_messages,
                input_items: prepared.input_items,
                history,
                created_at: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            };
            let job = chat_job(&state, lease, prepared.chat, Origin::RESPONSES, arrived)?;
            Ok((job, context))
        })
        .await
    };
    let (mut job, context) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => return e.into_response(),
    };
    let updates = match submit(&state, &mut job).await {
        Ok(updates) => updates,
        Err(e) => return e.into_response(),
    };
    if job.generation.stream {
        return stream(state, ChatStream::new(job, updates), context).into_response();
    }
    let choices = match collect(&job, updates).await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    let answered = blocking(move || {
        let answer = chat_answers(&job, &choices).remove(0);
        let choice = &choices[0];
        let finish = choice.finish.unwrap_or(FinishReason::Stop);
        let ids = OutputIds::new(&state);
        let response = finished(
            &job,
            &context,
            &ids,
            &answer,
            finish,
            (choice.tokens, choice.cached_tokens),
        );
        keep(&state, &job, context, &answer, &response);
        json_bytes(&response)
    })
    .await;
    match answered {
        Ok(bytes) => json_response(bytes),
        Err(e) => e.into_response(),
    }
}

/// The ids of a response's output items, made before any is sent.
struct OutputIds {
    reasoning: String,
    message: String,
    /// Function call items' ids are `fc_` and their call id's digits.
    call_prefix: &'static str,
}

impl OutputIds {
    fn new(state: &AppState) -> Self {
        Self {
            reasoning: state.response_id("rs_"),
            message: state.response_id("msg_"),
            call_prefix: "fc_",
        }
    }

    fn call(&self, call: &CallOut) -> String {
        format!(
            "{}{}",
            self.call_prefix,
            call.id.strip_prefix("call_").unwrap_or(&call.id)
        )
    }
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "reasoning_text", "text": text}])
    };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn message_item(id: &str, text: Option<&str>, status: &str) -> Value {
    let content = match text {
        Some(text) => {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
        }
        None => json!([]),
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(echo: &Echo, ids: &OutputIds, call: &CallOut, arguments: &str, status: &str) -> Value {
    let mut item = json!({"type": "function_call", "id": ids.call(call), "call_id": call.id,
                          "name": call.name, "arguments": arguments, "status": status});
    if let Some((_, namespace)) = echo.namespaces.iter().find(|(f, _)| *f == call.name) {
        item["namespace"] = json!(namespace);
    }
    item
}

/// The output items of an answer: its reasoning, its text (unless it is only calls), its
/// calls.
fn output(echo: &Echo, ids: &OutputIds, answer: &ChatAnswer, status: &str) -> Vec<Value> {
    let mut items = Vec::new();
    if let Some(reasoning) = answer.reasoning.as_deref().filter(|r| !r.is_empty()) {
        items.push(reasoning_item(&ids.reasoning, reasoning, "completed"));
    }
    let text = answer.content.as_deref().unwrap_or_default();
    if !text.is_empty() || answer.calls.is_empty() {
        items.push(message_item(&ids.message, Some(text), status));
    }
    items.extend(
        answer
            .calls
            .iter()
            .map(|c| call_item(echo, ids, c, &c.arguments, "completed")),
    );
    items
}

/// The response object: `status` with its `output` and `usage` (`None` while in progress).
fn response_object(
    job: &Job,
    context: &Context,
    status: &str,
    output: Vec<Value>,
    usage: Option<Value>,
) -> Value {
    let echo = &context.echo;
    json!({
        "id": job.id,
        "object": "response",
        "created_at": context.created_at,
        "status": status,
        "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { json!(null) },
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": job.ready.model,
        "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning,
        "store": echo.store,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": echo.metadata,
    })
}

/// The usage object.
fn usage(job: &Job, answer: &ChatAnswer, tokens: usize, cached: usize) -> Value {
    let prompt = job.prompts[0].len();
    let reasoning_tokens = answer
        .reasoning
        .as_deref()
        .filter(|r| !r.is_empty())
        .and_then(|r| job.ready.codec.encode(r, false).ok())
        .map_or(0, |ids| ids.len().min(tokens));
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached.min(prompt), "cache_write_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + tokens,
    })
}

/// The finished response: completed, or incomplete when `max_output_tokens` cut it.
fn finished(
    job: &Job,
    context: &Context,
    ids: &OutputIds,
    answer: &ChatAnswer,
    finish: FinishReason,
    (tokens, cached): (usize, usize),
) -> Value {
    let status = status(finish);
    let usage = usage(job, answer, tokens, cached);
    response_object(
        job,
        context,
        status,
        output(&context.echo, ids, answer, status),
        Some(usage),
    )
}

fn status(finish: FinishReason) -> &'static str {
    if finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

/// Stores the response when the request asked (`store`, default true): its object, input
/// items, and the conversation through its answer.
fn keep(state: &AppState, job: &Job, context: Context, answer: &ChatAnswer, response: &Value) {
    if !context.echo.store {
        return;
    }
    let mut conversation = context.history;
    conversation.extend(context.new_messages);
    let calls: Vec<MessageToolCall> = answer
        .calls
        .iter()
        .map(|c| MessageToolCall {
            id: Some(c.id.clone()),
            function: MessageFunctionCall {
                name: c.name.clone(),
                arguments: Some(c.arguments.clone()),
            },
        })
        .collect();
    conversation.push(Message {
        role: "assistant".into(),
        content: Some(Content::Text(answer.content.clone().unwrap_or_default())),
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: None,
        name: None,
    });
    let stored = StoredResponse {
        response: response.clone(),
        input_items: context.input_items,
        conversation,
    };
    if !state.responses.put(job.id.clone(), stored) {
        tracing::warn!(target: "kiln::serve", id = %job.id, "response {} is larger than the whole response store (--responses-store-mb): not stored", job.id);
    }
}

pub(super) async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Response {
    match state.responses.get(&id) {
        Some(stored) => match json_bytes(&stored.response) {
            Ok(bytes) => json_response(bytes),
            Err(e) => e.into_response(),
        },
        None => unknown(&id, None).into_response(),
    }
}

pub(super) async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if state.responses.delete(&id) {
        json_response(
            json!({"id": id, "object": "response", "deleted": true})
                .to_string()
                .into_bytes(),
        )
    } else {
        unknown(&id, None).into_response()
    }
}

/// `input_items`' query: `order` (`desc`, the default, or `asc`), `limit` (1-100, default 20),
/// `after` (an item id).
#[derive(Debug, Deserialize)]
pub(super) struct ItemsQuery {
    order: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
}

pub(super) async fn input_items(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(query): Query<ItemsQuery>,
) -> Response {
    let Some(stored) = state.responses.get(&id) else {
        return unknown(&id, None).into_response();
    };
    let limit = query.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return ApiError::invalid_field("limit", format!("limit = {limit}: expected 1 to 100"))
            .into_response();
    }
    let mut items: Vec<&Value> = stored.input_items.iter().collect();
    match query.order.as_deref() {
        None | Some("desc") => items.reverse(),
        Some("asc") => {}
        Some(other) => {
            return ApiError::invalid_field(
                "order",
                format!("order {other:?}: expected \"asc\" or \"desc\""),
            )
            .into_response();
        }
    }
    if let Some(after) = &query.after {
        match items.iter().position(|item| item["id"] == json!(after)) {
            Some(at) => {
                items.drain(..=at);
            }
            None => {
                return ApiError::invalid_field(
                    "after",
                    format!("after: no input item of {id} has the id {after:?}"),
                )
                .into_response();
            }
        }
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    let first = items.first().map(|i| i["id"].clone());
    let last = items.last().map(|i| i["id"].clone());
    let body = json!({"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": has_more});
    json_response(body.to_string().into_bytes())
}

/// The output item being streamed.
enum Open {
    Reasoning { index: usize, text: String },
    Message { index: usize, text: String },
}

/// A streamed response's writer: the events' numbers, the items done so far and the one open.
struct Writer {
    state: Arc<AppState>,
    chat: ChatStream,
    context: Option<Context>,
    ids: OutputIds,
    sequence: u64,
    done_items: Vec<Value>,
    open: Option<Open>,
    /// The whole answer so far, to store and to count reasoning tokens.
    reasoning: String,
    content: String,
    calls: Vec<CallOut>,
    started: bool,
    finished: bool,
}

impl Writer {
    fn event(&mut self, kind: &'static str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseEvent::default().event(kind).data(data.to_string())
    }

    fn lifecycle(&mut self, kind: &'static str, response: Value) -> SseEvent {
        self.event(kind, json!({"response": response}))
    }

    /// Closes the open item, if any (a message as `status`: `completed`, or `incomplete` when
    /// the answer was cut).
    fn close(&mut self, events: &mut Vec<SseEvent>) {
        self.close_as("completed", events);
    }

    fn close_as(&mut self, status: &str, events: &mut Vec<SseEvent>) {
        let Some(open) = self.open.take() else {
            return;
        };
        match open {
            Open::Reasoning { index, text } => {
                let id = self.ids.reasoning.clone();
                let part = json!({"type": "reasoning_text", "text": text});
                let e = self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                events.push(e);
                let e = self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
                events.push(e);
                let item = reasoning_item(&id, &text, "completed");
                self.done_items.push(item.clone());
                let e = self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                events.push(e);
            }
            Open::Message { index, text } => {
                let id = self.ids.message.clone();
                let part =
                    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let e = self.event("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
                events.push(e);
                let e = self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
                events.push(e);
                let item = message_item(&id, Some(&text), status);
                self.done_items.push(item.clone());
                let e = self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                events.push(e);
            }
        }
    }

    /// Opens a reasoning or message item (closing the open one) when `reasoning` asks for the
    /// other kind.
    fn open(&mut self, reasoning: bool, events: &mut Vec<SseEvent>) {
        match (&self.open, reasoning) {
            (Some(Open::Reasoning { .. }), true) | (Some(Open::Message { .. }), false) => return,
            _ => self.close(events),
        }
        let index = self.done_items.len();
        let (id, item, part) = if reasoning {
            let id = self.ids.reasoning.clone();
            let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [], "status": "in_progress"});
            (id, item, json!({"type": "reasoning_text", "text": ""}))
        } else {
            let id = self.ids.message.clone();
            (
                id.clone(),
                message_item(&id, None, "in_progress"),
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
            )
        };
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        events.push(e);
        let e = self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
        );
        events.push(e);
        self.open = Some(if reasoning {
            Open::Reasoning {
                index,
                text: String::new(),
            }
        } else {
            Open::Message {
                index,
                text: String::new(),
            }
        });
    }

    fn piece(&mut self, piece: Piece, events: &mut Vec<SseEvent>) {
        match piece {
            Piece::Reasoning(text) => {
                self.open(true, events);
                self.reasoning.push_str(&text);
                let id = self.ids.reasoning.clone();
                if let Some(Open::Reasoning { index, text: all }) = &mut self.open {
                    all.push_str(&text);
                    let index = *index;
                    let e = self.event("response.reasoning_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}));
                    events.push(e);
                }
            }
            Piece::Content(text) => {
                self.open(false, events);
                self.content.push_str(&text);
                let id = self.ids.message.clone();
                if let Some(Open::Message { index, text: all }) = &mut self.open {
                    all.push_str(&text);
                    let index = *index;
                    let e = self.event("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}));
                    events.push(e);
                }
            }
            Piece::Call(call) => {
                self.close(events);
                let index = self.done_items.len();
                let id = self.ids.call(&call);
                let echo = &self.context.as_ref().map(|c| c.echo.clone());
                let Some(echo) = echo else {
                    return;
                };
                let added = call_item(echo, &self.ids, &call, "", "in_progress");
                let e = self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": added}),
                );
                events.push(e);
                for piece in pieces(&call.arguments, ARGUMENT_PIECE_BYTES) {
                    let e = self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": piece}),
                    );
                    events.push(e);
                }
                let e = self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "arguments": call.arguments, "name": call.name}));
                events.push(e);
                let item = call_item(echo, &self.ids, &call, &call.arguments, "completed");
                self.done_items.push(item.clone());
                let e = self.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
                events.push(e);
                self.calls.push(call);
            }
        }
    }

    async fn next_events(&mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let Some(context) = self.context.as_ref() else {
            self.finished = true;
            return events;
        };
        if !self.started {
            self.started = true;
            let response =
                response_object(&self.chat.job, context, "in_progress", Vec::new(), None);
            let e = self.lifecycle("response.created", response.clone());
            events.push(e);
            let e = self.lifecycle("response.in_progress", response);
            events.push(e);
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
                // An answer with neither text nor calls still has its (empty) message.
                if self.done_items.is_empty() && self.open.is_none() {
                    self.open(false, &mut events);
                }
                let status = status(ending.finish);
                self.close_as(status, &mut events);
                let answer = ChatAnswer {
                    reasoning: (!self.reasoning.is_empty()).then(|| self.reasoning.clone()),
                    content: Some(self.content.clone()),
                    calls: std::mem::take(&mut self.calls),
                };
                let usage = usage(&self.chat.job, &answer, ending.tokens, ending.cached_tokens);
                let Some(context) = self.context.take() else {
                    return events;
                };
                let response = response_object(
                    &self.chat.job,
                    &context,
                    status,
                    std::mem::take(&mut self.done_items),
                    Some(usage),
                );
                keep(&self.state, &self.chat.job, context, &answer, &response);
                let kind = if status == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                let e = self.lifecycle(kind, response);
                events.push(e);
                self.finished = true;
            }
            Step::Failed(e) => {
                let mut response = response_object(
                    &self.chat.job,
                    context,
                    "failed",
                    std::mem::take(&mut self.done_items),
                    None,
                );
                response["error"] = json!({"code": "server_error", "message": e.message});
                let e = self.lifecycle("response.failed", response);
                events.push(e);
                self.finished = true;
            }
        }
        events
    }
}

impl EventWriter for Writer {
    fn ended(&self) -> bool {
        self.finished
    }

    fn events(&mut self) -> impl Future<Output = Vec<SseEvent>> + Send {
        self.next_events()
    }
}

/// The response as typed server-sent events.
fn stream(
    state: Arc<AppState>,
    chat: ChatStream,
    context: Context,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let writer = Writer {
        ids: OutputIds::new(&state),
        state,
        chat,
        context: Some(context),
        sequence: 0,
        done_items: Vec::new(),
        open: None,
        reasoning: String::new(),
        content: String::new(),
        calls: Vec::new(),
        started: false,
        finished: false,
    };
    sse(writer)
}
