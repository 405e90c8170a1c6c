//! Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`,
//! `/api/ps`, `/api/version`) over the same jobs as the OpenAI routes: a chat through
//! [`super::completions::chat_job`], a raw prompt tokenized as `/v1/completions` does, vectors
//! from [`super::embeddings::embed`]. Answers stream as newline-delimited JSON unless
//! `"stream": false` (Ollama's default is to stream); errors are `{"error": "..."}`
//! ([`crate::error::Dialect`]). `keep_alive` sets how long the model stays loaded once idle
//! ([`crate::fleet::Lease::keep_alive`]).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use kiln_engine::FinishReason;
use serde_json::{Map, Value, json};

use super::chat_stream::{ChatStream, Ending, Piece, Step};
use super::collect::{ChoiceState, chat_answers, collect};
use super::completions::chat_job;
use super::embeddings::{embed, hidden_size};
use super::job::{Endpoint, Job, Origin, submit};
use super::{AppState, Arrived, ModelBody, Ready, blocking, json_response};
use crate::api::ChatInput;
use crate::api::ollama::{ChatBody, EmbedBody, GenerateBody, GenerateInput, ShowBody, keep_alive};
use crate::error::{ApiError, Dialect};
use crate::fleet::Lease;

/// The version `/api/version` reports: Ollama's API as of the version whose fields kiln
/// writes (clients compare it to decide what they may send).
const OLLAMA_VERSION: &str = "0.12.0";

pub(super) async fn version() -> Response {
    json_response(json!({"version": OLLAMA_VERSION}).to_string().into_bytes())
}

/// A time as Ollama writes it (RFC 3339, UTC, nanoseconds).
fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let (year, month, day) = kiln_models::chat::civil_date(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rest / 3600,
        rest / 60 % 60,
        rest % 60,
        since.subsec_nanos()
    )
}

/// One NDJSON line: `value`'s JSON with the characters that Python's `str.splitlines` (the
/// official client's line reader) takes for line ends escaped, then `\n`.
fn line(value: &Value) -> String {
    let mut text = value.to_string();
    for (raw, escaped) in [
        ('\u{85}', "\\u0085"),
        ('\u{2028}', "\\u2028"),
        ('\u{2029}', "\\u2029"),
    ] {
        if text.contains(raw) {
            text = text.replace(raw, escaped);
        }
    }
    text.push('\n');
    text
}

/// One JSON object, not streamed.
fn whole(value: &Value) -> Response {
    json_response(line(value).into_bytes())
}

/// The model's name as Ollama's answers carry it.
fn stamp(ready: &Ready) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("model".into(), json!(ready.model));
    map.insert("created_at".into(), json!(rfc3339(SystemTime::now())));
    map
}

/// Ollama's `done_reason`.
fn done_reason(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stop => "stop",
    }
}

/// The final object's counts and durations (nanoseconds).
fn counts(
    map: &mut Map<String, Value>,
    arrived: Instant,
    prompt_tokens: usize,
    tokens: usize,
    timings: kiln_engine::Timings,
) {
    let nanos = |d: Duration| json!(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    map.insert("total_duration".into(), nanos(arrived.elapsed()));
    map.insert("load_duration".into(), json!(0));
    map.insert("prompt_eval_count".into(), json!(prompt_tokens));
    map.insert(
        "prompt_eval_duration".into(),
        nanos(timings.time_to_first_token),
    );
    map.insert("eval_count".into(), json!(tokens));
    map.insert("eval_duration".into(), nanos(timings.decode));
}

/// The answer to a request with nothing to run: the model is loaded (`load`) or, with
/// `keep_alive: 0`, unloaded once this lease ends (`unload`).
fn loaded_answer(ready: &Ready, chat: bool, unload: bool) -> Response {
    let mut map = stamp(ready);
    if chat {
        map.insert(
            "message".into(),
            json!({"role": "assistant", "content": ""}),
        );
    } else {
        map.insert("response".into(), json!(""));
    }
    map.insert("done".into(), json!(true));
    map.insert(
        "done_reason".into(),
        json!(if unload { "unload" } else { "load" }),
    );
    whole(&Value::Object(map))
}

/// Applies a request's `keep_alive` (when it gives one) to its model, and returns it.
fn keep_model(
    lease: &Lease,
    raw: Option<&serde_json::value::RawValue>,
) -> Result<Option<Duration>, ApiError> {
    let keep = keep_alive(raw)?;
    if raw.is_some() {
        lease.keep_alive(keep);
    }
    Ok(keep)
}

pub(super) async fn chat(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<ChatBody>,
) -> Response {
    let keep = match keep_model(&lease, body.keep_alive.as_deref()) {
        Ok(keep) => keep,
        Err(e) => return e.into_response(),
    };
    let input = blocking(move || body.chat_input()).await;
    let input = match input {
        Ok(Some(input)) => input,
        Ok(None) => return loaded_answer(lease.ready(), true, keep == Some(Duration::ZERO)),
        Err(e) => return e.into_response(),
    };
    run_chat(state, lease, input, Origin::OLLAMA_CHAT, arrived).await
}

pub(super) async fn generate(
    Arrived(arrived): Arrived,
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<GenerateBody>,
) -> Response {
    let keep = match keep_model(&lease, body.keep_alive.as_deref()) {
        Ok(keep) => keep,
        Err(e) => return e.into_response(),
    };
    match body.input() {
        Ok(GenerateInput::Load) => {
            loaded_answer(lease.ready(), false, keep == Some(Duration::ZERO))
        }
        Ok(GenerateInput::Chat(input)) => {
            run_chat(state, lease, *input, Origin::OLLAMA_GENERATE, arrived).await
        }
        Ok(GenerateInput::Raw(prompt, generation)) => {
            let job = {
                let state = state.clone();
                blocking(move || {
                    let ready = lease.ready().clone();
                    ready.check_text_fits(
                        prompt.len(),
                        ready.sequence_tokens(),
                        "prompt",
                        "the server's KV cache (or the model's context, if smaller)",
                    )?;
                    let ids = ready.codec.encode(&prompt, true)?;
                    Job::new(
                        &state,
                        lease,
                        Origin::OLLAMA_GENERATE,
                        vec![ids],
                        *generation,
                        arrived,
                    )
                })
                .await
            };
            match job {
                Ok(job) => answer(state, job).await,
                Err(e) => e.into_response(),
            }
        }
        Err(e) => e.into_response(),
    }
}

async fn run_chat(
    state: Arc<AppState>,
    lease: Lease,
    input: ChatInput,
    origin: Origin,
    arrived: Instant,
) -> Response {
    let job = {
        let state = state.clone();
        blocking(move || chat_job(&state, lease, input, origin, arrived)).await
    };
    match job {
        Ok(job) => answer(state, job).await,
        Err(e) => e.into_response(),
    }
}

/// Submits `job` and answers with one object or a stream of lines.
async fn answer(state: Arc<AppState>, mut job: Job) -> Response {
    let updates = match submit(&state, &mut job).await {
        Ok(updates) => updates,
        Err(e) => return e.into_response(),
    };
    if job.generation.stream {
        return stream(ChatStream::new(job, updates));
    }
    let choices = match collect(&job, updates).await {
        Ok(choices) => choices,
        Err(e) => return e.into_response(),
    };
    whole(&final_object(&job, &choices[0]))
}

/// A call as Ollama writes it: its arguments an object.
fn tool_call(name: &str, arguments: &str) -> Value {
    let arguments: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"function": {"name": name, "arguments": arguments}})
}

/// The whole answer of a job that was not streamed.
fn final_object(job: &Job, choice: &ChoiceState) -> Value {
    let mut map = stamp(&job.ready);
    let answer = chat_answers(job, std::slice::from_ref(choice)).remove(0);
    let content = json!(answer.content.unwrap_or_default());
    match job.endpoint {
        Endpoint::Chat => {
            let mut message = Map::new();
            message.insert("role".into(), json!("assistant"));
            message.insert("content".into(), content);
            if let Some(thinking) = answer.reasoning {
                message.insert("thinking".into(), json!(thinking));
            }
            if !answer.calls.is_empty() {
                let calls: Vec<Value> = answer
                    .calls
                    .iter()
                    .map(|c| tool_call(&c.name, &c.arguments))
                    .collect();
                message.insert("tool_calls".into(), json!(calls));
            }
            map.insert("message".into(), Value::Object(message));
        }
        Endpoint::Completions => {
            map.insert("response".into(), content);
            if let Some(thinking) = answer.reasoning {
                map.insert("thinking".into(), json!(thinking));
            }
        }
    }
    map.insert("done".into(), json!(true));
    map.insert(
        "done_reason".into(),
        json!(done_reason(choice.finish.unwrap_or(FinishReason::Stop))),
    );
    counts(
        &mut map,
        job.arrived,
        job.prompts[0].len(),
        choice.tokens,
        choice.timings,
    );
    Value::Object(map)
}

/// A streamed piece as one line.
fn piece_line(job: &Job, piece: Piece) -> Value {
    let mut map = stamp(&job.ready);
    let (text_key, thinking_key) = match job.endpoint {
        Endpoint::Chat => ("content", "thinking"),
        Endpoint::Completions => ("response", "thinking"),
    };
    let mut fields = Map::new();
    if job.endpoint == Endpoint::Chat {
        fields.insert("role".into(), json!("assistant"));
    }
    match piece {
        Piece::Content(text) => {
            fields.insert(text_key.into(), json!(text));
        }
        Piece::Reasoning(text) => {
            fields.insert(text_key.into(), json!(""));
            fields.insert(thinking_key.into(), json!(text));
        }
        Piece::Call(call) => {
            fields.insert(text_key.into(), json!(""));
            fields.insert(
                "tool_calls".into(),
                json!([tool_call(&call.name, &call.arguments)]),
            );
        }
    }
    match job.endpoint {
        Endpoint::Chat => {
            map.insert("message".into(), Value::Object(fields));
        }
        Endpoint::Completions => map.extend(fields),
    }
    map.insert("done".into(), json!(false));
    Value::Object(map)
}

/// The last line of a stream.
fn ending_line(job: &Job, ending: &Ending) -> Value {
    let mut map = stamp(&job.ready);
    match job.endpoint {
        Endpoint::Chat => {
            map.insert(
                "message".into(),
                json!({"role": "assistant", "content": ""}),
            );
        }
        Endpoint::Completions => {
            map.insert("response".into(), json!(""));
        }
    }
    map.insert("done".into(), json!(true));
    map.insert("done_reason".into(), json!(done_reason(ending.finish)));
    counts(
        &mut map,
        job.arrived,
        job.prompts[0].len(),
        ending.tokens,
        ending.timings,
    );
    Value::Object(map)
}

/// The answer as newline-delimited JSON: a line per piece, a last line with `done: true` and
/// the counts; an error after the start is a line `{"error": "..."}`.
fn stream(chat: ChatStream) -> Response {
    let lines = futures_util::stream::unfold(Some(chat), |chat| async move {
        let mut chat = chat?;
        let (lines, more) = match chat.next().await {
            Step::Pieces(pieces) => (
                pieces
                    .into_iter()
                    .map(|p| line(&piece_line(&chat.job, p)))
                    .collect(),
                true,
            ),
            Step::Ended(pieces, ending) => {
                let mut lines: Vec<String> = pieces
                    .into_iter()
                    .map(|p| line(&piece_line(&chat.job, p)))
                    .collect();
                lines.push(line(&ending_line(&chat.job, &ending)));
                (lines, false)
            }
            Step::Failed(e) => (vec![line(&e.body_in(Dialect::Ollama))], false),
        };
        Some((lines.concat(), more.then_some(chat)))
    })
    .filter(|chunk| std::future::ready(!chunk.is_empty()))
    .map(Ok::<_, std::convert::Infallible>);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response()
}

pub(super) async fn embed_route(
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<EmbedBody>,
) -> Response {
    let started = Instant::now();
    let result = async {
        keep_model(&lease, body.keep_alive.as_deref())?;
        let ready = lease.ready().clone();
        let d_model = hidden_size(&ready)?;
        let dimensions = match body.dimensions {
            None => None,
            Some(n) if (1..=d_model as u64).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid_field(
                    "dimensions",
                    format!("dimensions = {n}: expected 1 to {d_model}"),
                ));
            }
        };
        let empty =
            matches!(&body.input, Some(crate::api::EmbeddingInput::Texts(t)) if t.is_empty());
        let (vectors, tokens) = if empty {
            (Vec::new(), 0)
        } else {
            embed(&state, &ready, body.input).await?
        };
        let vectors: Vec<Vec<f32>> = match dimensions {
            Some(n) => vectors
                .iter()
                .map(|v| kiln_engine::embed::truncate(v, n))
                .collect(),
            None => vectors,
        };
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Ok(json!({
            "model": ready.model,
            "embeddings": vectors,
            "total_duration": nanos,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }))
    }
    .await;
    match result {
        Ok(value) => match blocking(move || Ok(line(&value))).await {
            Ok(text) => json_response(text.into_bytes()),
            Err(e) => e.into_response(),
        },
        Err(e) => e.into_response(),
    }
}

/// A stand-in digest for a served model: 64 hex digits of a hash of its name, source and
/// size (Ollama's is the sha256 of its manifest; kiln has none, and hashing gigabytes of weights
/// per listing would cost seconds).
fn digest(alias: &str, source: &str, bytes: u64) -> String {
    let mut out = String::with_capacity(64);
    for round in 0u64..4 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325 ^ round;
        for b in alias
            .bytes()
            .chain([0])
            .chain(source.bytes())
            .chain(bytes.to_le_bytes())
            .chain(round.to_le_bytes())
        {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{hash:016x}"));
    }
    out
}

/// `details`, from what the model's headers say (empty strings for a model never loaded).
fn details(ready: Option<&Ready>) -> Value {
    let info = ready.and_then(|r| r.info.as_ref());
    let family = info.map_or("", |i| i.config.architecture.name());
    let format = info.map_or(String::new(), |i| match i.format {
        kiln_models::ModelFormat::Gguf => "gguf".into(),
        other => format!("{other:?}").to_lowercase(),
    });
    let quantization = info
        .and_then(|i| i.stored_types.first())
        .map_or(String::new(), |(t, _)| t.clone());
    let parameters = info.map_or(String::new(), |i| parameter_size(i.config.parameters()));
    json!({
        "parent_model": "",
        "format": format,
        "family": family,
        "families": if family.is_empty() { json!(null) } else { json!([family]) },
        "parameter_size": parameters,
        "quantization_level": quantization,
    })
}

/// `135M`, `1.2B`, as Ollama writes a parameter count.
fn parameter_size(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.0}M", n / 1e6)
    } else {
        format!("{:.0}K", n / 1e3)
    }
}

/// One model as `/api/tags` and `/api/ps` list it.
fn listed(state: &AppState, index: usize) -> (Value, Option<Arc<Ready>>) {
    let (entry, bytes) = state.fleet.entry(index);
    let ready = state.fleet.loaded_model(index);
    let value = json!({
        "name": entry.alias,
        "model": entry.alias,
        "modified_at": rfc3339(SystemTime::now()),
        "size": bytes,
        "digest": digest(&entry.alias, &entry.source, bytes),
        "details": details(ready.as_deref()),
    });
    (value, ready)
}

pub(super) async fn tags(State(state): State<Arc<AppState>>) -> Response {
    let models: Vec<Value> = (0..state.fleet.count())
        .map(|i| listed(&state, i).0)
        .collect();
    whole(&json!({"models": models}))
}

pub(super) async fn ps(State(state): State<Arc<AppState>>) -> Response {
    let now = Instant::now();
    let models: Vec<Value> = (0..state.fleet.count())
        .filter_map(|i| {
            let (mut value, ready) = listed(&state, i);
            let ready = ready?;
            // Not on a timer: loaded until room is needed; Ollama writes a far date.
            let left = state
                .fleet
                .expires(i)
                .map_or(Duration::from_secs(100 * 365 * 86_400), |t| {
                    t.saturating_duration_since(now)
                });
            value["expires_at"] = json!(rfc3339(SystemTime::now() + left));
            value["size_vram"] = json!(0);
            value["context_length"] = json!(ready.sequence_tokens());
            Some(value)
        })
        .collect();
    whole(&json!({"models": models}))
}

pub(super) async fn show(
    State(state): State<Arc<AppState>>,
    ModelBody { lease, body }: ModelBody<ShowBody>,
) -> Response {
    let ready = lease.ready();
    let index = match state
        .fleet
        .index_of(body.model.as_deref().or(body.name.as_deref()))
    {
        Ok(index) => index,
        Err(e) => return e.into_response(),
    };
    let (entry, _) = state.fleet.entry(index);
    let mut model_info = Map::new();
    if let Some(info) = &ready.info {
        let family = info.config.architecture.name();
        model_info.insert("general.architecture".into(), json!(family));
        model_info.insert(
            "general.parameter_count".into(),
            json!(info.config.parameters()),
        );
        for (key, value) in [
            ("context_length", ready.shape.max_positions),
            ("embedding_length", info.config.d_model),
            ("block_count", info.config.n_layers),
            ("attention.head_count", info.config.n_heads),
            ("attention.head_count_kv", info.config.n_kv_heads),
            ("feed_forward_length", info.config.d_ff),
        ] {
            model_info.insert(format!("{family}.{key}"), json!(value));
        }
    }
    let mut capabilities = vec!["completion"];
    if ready.hidden_size.is_some() {
        capabilities.push("embedding");
    }
    if ready.tool_format.is_some() {
        capabilities.push("tools");
    }
    if ready.splits_reasoning {
        capabilities.push("thinking");
    }
    whole(&json!({
        "modelfile": format!("# served by kiln\nFROM {}\n", entry.source),
        "parameters": "",
        "template": ready.chat_template.clone().unwrap_or_default(),
        "details": details(Some(ready)),
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": rfc3339(SystemTime::now()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_in_utc() {
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 123);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.000000123Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000000Z");
    }

    #[test]
    fn lines_escape_what_python_splits_lines_at() {
        let text = line(&json!({"response": "a\u{2028}b\u{85}c\nd"}));
        assert_eq!(text, "{\"response\":\"a\\u2028b\\u0085c\\nd\"}\n");
        assert_eq!(text.lines().count(), 1);
    }

    #[test]
    fn parameter_counts_read_as_ollama_writes_them() {
        assert_eq!(parameter_size(134_515_008), "135M");
        assert_eq!(parameter_size(1_235_814_400), "1.2B");
        assert_eq!(digest("a", "b", 1).len(), 64);
        assert_ne!(digest("a", "b", 1), digest("a", "b", 2));
    }
}
