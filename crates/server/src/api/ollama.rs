//! Ollama's API bodies (`/api/chat`, `/api/generate`, `/api/embed`, `/api/show`): parsed, and
//! validated into what kiln runs: a [`ChatInput`] for a chat, `options` into the sampling
//! settings ([`Options`]), `format` into structured output, `keep_alive` into how long the
//! model stays loaded ([`keep_alive`]).
//!
//! `options` are checked as Ollama checks them (a value of the wrong type is a 400 naming the
//! option); the options kiln has no use for (`num_ctx`, `num_thread`, `num_gpu`, ...) are
//! accepted and ignored, as Ollama ignores unknown ones. Images are refused until kiln takes
//! them.

use std::time::Duration;

use kiln_engine::OutputConstraint;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{
    ChatInput, CommonFields, Content, EmbeddingInput, Generation, Message, MessageFunctionCall,
    MessageToolCall, RequestBody, Stop, json_field, parse,
};
use crate::error::ApiError;

/// `POST /api/chat`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Option<Vec<OllamaMessage>>,
    /// In OpenAI's shape already (`[{"type": "function", "function": {...}}]`).
    pub tools: Option<Box<RawValue>>,
    pub format: Option<Box<RawValue>>,
    pub options: Option<Box<RawValue>>,
    /// Absent: streamed (Ollama's default).
    pub stream: Option<bool>,
    pub keep_alive: Option<Box<RawValue>>,
    pub think: Option<Box<RawValue>>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct OllamaMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub images: Option<Vec<Box<RawValue>>>,
    #[serde(default)]
    pub tool_calls: Option<Vec<OllamaToolCall>>,
    /// A `tool` message's function.
    #[serde(default)]
    pub tool_name: Option<String>,
}

/// An assistant's call: `{"function": {"name", "arguments": {...}}}`.
#[derive(Debug, Deserialize)]
pub struct OllamaToolCall {
    pub function: OllamaFunction,
}

/// A call's function; its arguments an object.
#[derive(Debug, Deserialize)]
pub struct OllamaFunction {
    pub name: String,
    #[serde(default)]
    pub arguments: Option<Box<RawValue>>,
}

/// `POST /api/generate`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct GenerateBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub system: Option<String>,
    /// The prompt as it is, without the chat template.
    pub raw: Option<bool>,
    pub format: Option<Box<RawValue>>,
    pub options: Option<Box<RawValue>>,
    pub stream: Option<bool>,
    pub keep_alive: Option<Box<RawValue>>,
    pub think: Option<Box<RawValue>>,
    /// Not supported (refused when given): a template of the request's own, an earlier
    /// answer's context, fill-in-the-middle, images.
    pub template: Option<String>,
    pub context: Option<Vec<u32>>,
    pub suffix: Option<String>,
    pub images: Option<Vec<Box<RawValue>>>,
}

/// `POST /api/embed`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct EmbedBody {
    pub model: Option<String>,
    pub input: Option<EmbeddingInput>,
    /// Cut the vector to this many dimensions (normalised again).
    pub dimensions: Option<u64>,
    pub keep_alive: Option<Box<RawValue>>,
    /// Inputs longer than the context are an error either way (no truncation).
    pub truncate: Option<bool>,
    pub options: Option<Box<RawValue>>,
}

/// `POST /api/show`: `model` (or the older `name`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ShowBody {
    pub model: Option<String>,
    pub name: Option<String>,
}

macro_rules! request_body {
    ($($t:ty => |$b:ident| $model:expr),* $(,)?) => {$(
        impl RequestBody for $t {
            fn parse(body: &[u8]) -> Result<Self, ApiError> {
                parse(body)
            }
            fn model(&self) -> Option<&str> {
                let $b = self;
                $model
            }
        }
    )*};
}

request_body! {
    ChatBody => |b| b.model.as_deref(),
    GenerateBody => |b| b.model.as_deref(),
    EmbedBody => |b| b.model.as_deref(),
    ShowBody => |b| b.model.as_deref().or(b.name.as_deref()),
}

/// `options`, as far as kiln uses them.
#[derive(Debug, Default)]
pub struct Options {
    pub common: CommonFields,
}

/// `option "NAME" must be of type TYPE`, Ollama's words.
fn wrong_type(name: &str, kind: &str) -> ApiError {
    ApiError::invalid_field(
        &format!("options.{name}"),
        format!("option \"{name}\" must be of type {kind}"),
    )
}

impl Options {
    /// `options`, checked: a known option of the wrong type or out of range is a 400 naming
    /// it.
    ///
    /// # Errors
    /// A 400 naming the option.
    pub fn parse(raw: Option<&RawValue>) -> Result<Self, ApiError> {
        let mut common = CommonFields::default();
        let Some(raw) = raw else {
            return Ok(Self { common });
        };
        let map = match json_field("options", raw)? {
            Value::Object(map) => map,
            Value::Null => Map::new(),
            _ => {
                return Err(ApiError::invalid_field(
                    "options",
                    "options must be an object",
                ));
            }
        };
        let number = |name: &str| -> Result<Option<f32>, ApiError> {
            match map.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| wrong_type(name, "float")),
            }
        };
        let integer = |name: &str| -> Result<Option<i64>, ApiError> {
            match map.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_i64()
                    .or_else(|| v.as_f64().filter(|x| x.fract() == 0.0).map(|x| x as i64))
                    .map(Some)
                    .ok_or_else(|| wrong_type(name, "integer")),
            }
        };
        common.temperature = number("temperature")?;
        common.top_p = number("top_p")?;
        common.min_p = number("min_p")?;
        common.repetition_penalty = number("repeat_penalty")?;
        common.presence_penalty = number("presence_penalty")?;
        common.frequency_penalty = number("frequency_penalty")?;
        common.top_k = integer("top_k")?;
        // Ollama: -1 (and the older -2) is "no seed", a fresh draw each time.
        common.seed = integer("seed")?.filter(|&s| s >= 0);
        common.max_tokens = match integer("num_predict")? {
            None | Some(-1 | -2) => None,
            Some(n) if n > 0 => Some(n as u64),
            Some(n) => {
                return Err(ApiError::invalid_field(
                    "options.num_predict",
                    format!(
                        "option \"num_predict\" is {n}: expected -1 (no limit) or a positive number of tokens"
                    ),
                ));
            }
        };
        common.stop = match map.get("stop") {
            None | Some(Value::Null) => None,
            Some(Value::Array(list)) => Some(Stop::Many(
                list.iter()
                    .map(|s| s.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| wrong_type("stop", "[]string"))?,
            )),
            Some(_) => return Err(wrong_type("stop", "[]string")),
        };
        Ok(Self { common })
    }

    /// The generation these options and `stream` ask for; sampling errors name the option.
    ///
    /// # Errors
    /// A 400 naming the option out of range.
    pub fn generation(mut self, stream: bool) -> Result<Generation, ApiError> {
        self.common.stream = Some(stream);
        self.common.generation(None).map_err(|mut e| {
            if let Some(param) = &e.param {
                let option = match param.as_str() {
                    "repetition_penalty" => "repeat_penalty",
                    "max_tokens" => "num_predict",
                    other => other,
                };
                e.message = format!("option \"{option}\": {}", e.message);
                e.param = Some(format!("options.{option}"));
            }
            e
        })
    }
}

/// `format`: `"json"` (any JSON object), a JSON schema, or `""` / absent (free text).
///
/// # Errors
/// A 400 for anything else.
pub fn format(
    raw: Option<&RawValue>,
) -> Result<Option<(&'static str, OutputConstraint)>, ApiError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    match json_field("format", raw)? {
        Value::Null => Ok(None),
        Value::String(s) if s.is_empty() => Ok(None),
        Value::String(s) if s == "json" => Ok(Some(("format", OutputConstraint::JsonObject))),
        schema @ Value::Object(_) => Ok(Some(("format", OutputConstraint::JsonSchema(schema)))),
        other => Err(ApiError::invalid_field(
            "format",
            format!("format must be \"json\" or a JSON schema object, not {other}"),
        )),
    }
}

/// `think`: `true`/`false`, or `"low"`/`"medium"`/`"high"` (thinking on), as the template's
/// `enable_thinking`.
///
/// # Errors
/// A 400 for another value.
pub fn think(raw: Option<&RawValue>) -> Result<Option<bool>, ApiError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    match json_field("think", raw)? {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(b)),
        Value::String(s) if matches!(s.as_str(), "low" | "medium" | "high") => Ok(Some(true)),
        other => Err(ApiError::invalid_field(
            "think",
            format!("think must be true, false, \"low\", \"medium\" or \"high\", not {other}"),
        )),
    }
}

/// `keep_alive`: how long the model stays loaded once idle. A number is seconds, a string a
/// Go duration (`"5m"`, `"1h30m"`, `"300ms"`, or a bare number of seconds); negative is
/// for ever (`None`), zero unloads it as soon as it is idle. Absent: `Ok(None)` too, the
/// server's own rule (loaded until room is needed).
///
/// # Errors
/// A 400 for a value that is neither.
pub fn keep_alive(raw: Option<&RawValue>) -> Result<Option<Duration>, ApiError> {
    let bad = |why: String| ApiError::invalid_field("keep_alive", why);
    let Some(raw) = raw else {
        return Ok(None);
    };
    let seconds = match json_field("keep_alive", raw)? {
        Value::Null => return Ok(None),
        Value::Number(n) => n.as_f64().unwrap_or(0.0),
        Value::String(s) => go_duration(&s).ok_or_else(|| {
            bad(format!(
                "keep_alive {s:?} is not a duration: give seconds or a duration such as \"5m\" or \"1h30m\""
            ))
        })?,
        other => return Err(bad(format!("keep_alive must be a number or a duration, not {other}"))),
    };
    if seconds < 0.0 {
        return Ok(None);
    }
    // Ollama truncates a number of seconds to whole seconds.
    Duration::try_from_secs_f64(seconds.trunc().min(1e12))
        .map(Some)
        .map_err(|e| bad(format!("keep_alive: {e}")))
}

/// Seconds in a Go duration string (`"1h30m"`, `"-1s"`, `"2.5m"`, `"0"`), or a bare number of
/// seconds.
fn go_duration(text: &str) -> Option<f64> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return Some(seconds);
    }
    let (sign, mut rest) = match text.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let value: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_end..];
        total += value * scale;
    }
    Some(sign * total)
}

fn refuse_images(field: &str, images: Option<&Vec<Box<RawValue>>>) -> Result<(), ApiError> {
    match images {
        Some(images) if !images.is_empty() => Err(ApiError::invalid_field(
            field,
            format!("{field}: images are not supported yet"),
        )),
        _ => Ok(()),
    }
}

impl ChatBody {
    /// The chat as a [`ChatInput`], or `None` when it has no messages (Ollama's request to
    /// load or unload the model).
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn chat_input(&self) -> Result<Option<ChatInput>, ApiError> {
        let options = Options::parse(self.options.as_deref())?;
        let mut generation = options.generation(self.stream.unwrap_or(true))?;
        generation.constraint = format(self.format.as_deref())?;
        let messages = match &self.messages {
            Some(messages) if !messages.is_empty() => messages,
            _ => return Ok(None),
        };
        let mut out = Vec::with_capacity(messages.len());
        // The calls made so far, for the `tool` messages that answer them: (id, name).
        let mut calls: Vec<(String, String)> = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            refuse_images(&format!("messages[{i}].images"), m.images.as_ref())?;
            let content = Some(Content::Text(m.content.clone().unwrap_or_default()));
            let mut message = Message {
                role: m.role.clone(),
                content,
                tool_calls: None,
                tool_call_id: None,
                name: None,
            };
            match m.role.as_str() {
                "assistant" => {
                    let made = m.tool_calls.iter().flatten().enumerate().map(|(k, call)| {
                        let field = format!("messages[{i}].tool_calls[{k}].function.arguments");
                        let arguments = match &call.function.arguments {
                            Some(raw) => json_field(&field, raw)?,
                            None => Value::Object(Map::new()),
                        };
                        // Ollama's calls carry no id: one is made, and a `tool` message answers
                        // the earliest call of its name not answered yet.
                        let id = format!("call_{i}_{k}");
                        calls.push((id.clone(), call.function.name.clone()));
                        Ok(MessageToolCall {
                            id: Some(id),
                            function: MessageFunctionCall {
                                name: call.function.name.clone(),
                                arguments: Some(arguments.to_string()),
                            },
                        })
                    });
                    let made = made.collect::<Result<Vec<_>, ApiError>>()?;
                    message.tool_calls = (!made.is_empty()).then_some(made);
                }
                "tool" => {
                    let name = m.tool_name.clone();
                    let at = match &name {
                        Some(name) => calls.iter().position(|(_, n)| n == name),
                        None => (!calls.is_empty()).then_some(0),
                    };
                    let (id, called) = match at {
                        Some(at) => calls.remove(at),
                        None => (format!("call_{i}"), name.clone().unwrap_or_default()),
                    };
                    message.tool_call_id = Some(id);
                    message.name = Some(name.unwrap_or(called));
                }
                _ => {}
            }
            out.push(message);
        }
        let tools = self
            .tools
            .as_deref()
            .map(|raw| json_field("tools", raw))
            .transpose()?
            // The official client sends `"tools": []` with every chat.
            .filter(|t| t.as_array().is_none_or(|list| !list.is_empty()));
        let mut variables = Map::new();
        if let Some(thinking) = think(self.think.as_deref())? {
            variables.insert("enable_thinking".into(), Value::Bool(thinking));
        }
        Ok(Some(ChatInput {
            messages: out,
            tools,
            tool_choice: None,
            parallel_tool_calls: None,
            variables,
            generation,
        }))
    }
}

/// What `/api/generate` runs.
pub enum GenerateInput {
    /// No prompt: load (or, with `keep_alive: 0`, unload) the model.
    Load,
    /// The prompt as it is (`raw`), tokenized with the model's special tokens.
    Raw(String, Box<Generation>),
    /// `system` and `prompt` through the chat template, as a chat of two messages.
    Chat(Box<ChatInput>),
}

impl GenerateBody {
    /// What the request runs.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn input(&self) -> Result<GenerateInput, ApiError> {
        for (field, given) in [
            ("template", self.template.is_some()),
            (
                "context",
                self.context.as_ref().is_some_and(|c| !c.is_empty()),
            ),
            (
                "suffix",
                self.suffix.as_ref().is_some_and(|s| !s.is_empty()),
            ),
        ] {
            if given {
                return Err(ApiError::invalid_field(
                    field,
                    format!(
                        "{field} is not supported: kiln renders the model's own chat template, or the prompt as it is with raw"
                    ),
                ));
            }
        }
        refuse_images("images", self.images.as_ref())?;
        let options = Options::parse(self.options.as_deref())?;
        let mut generation = options.generation(self.stream.unwrap_or(true))?;
        generation.constraint = format(self.format.as_deref())?;
        let prompt = match &self.prompt {
            Some(p) if !p.is_empty() => p.clone(),
            _ => return Ok(GenerateInput::Load),
        };
        if self.raw == Some(true) {
            if self.system.is_some() {
                return Err(ApiError::invalid_field(
                    "raw",
                    "raw mode does not support template, system, or context",
                ));
            }
            return Ok(GenerateInput::Raw(prompt, Box::new(generation)));
        }
        let message = |role: &str, text: String| Message {
            role: role.into(),
            content: Some(Content::Text(text)),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        };
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = self.system.clone().filter(|s| !s.is_empty()) {
            messages.push(message("system", system));
        }
        messages.push(message("user", prompt));
        let mut variables = Map::new();
        if let Some(thinking) = think(self.think.as_deref())? {
            variables.insert("enable_thinking".into(), Value::Bool(thinking));
        }
        Ok(GenerateInput::Chat(Box::new(ChatInput {
            messages,
            tools: None,
            tool_choice: None,
            parallel_tool_calls: None,
            variables,
            generation,
        })))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn raw(v: Value) -> Box<RawValue> {
        RawValue::from_string(v.to_string()).unwrap()
    }

    #[test]
    fn options_map_to_sampling_and_bad_ones_are_named() {
        let o = Options::parse(Some(&raw(json!({
            "temperature": 0, "top_k": 5, "num_predict": 7, "stop": ["x"], "seed": -1,
            "repeat_penalty": 1.1, "num_ctx": 4096, "mirostat": 0,
        }))))
        .unwrap();
        let g = o.generation(false).unwrap();
        assert_eq!(g.sampling.temperature, 0.0);
        assert_eq!(g.sampling.top_k, 5);
        assert_eq!(g.max_tokens, Some(7));
        assert_eq!(g.stop, ["x"]);
        assert_eq!(g.sampling.seed, None);
        for (options, param) in [
            (json!({"num_predict": "x"}), "options.num_predict"),
            (json!({"temperature": "hot"}), "options.temperature"),
            (json!({"stop": "x"}), "options.stop"),
            (json!({"num_predict": 0}), "options.num_predict"),
        ] {
            let e = Options::parse(Some(&raw(options.clone()))).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{options}");
        }
        let e = Options::parse(Some(&raw(json!({"temperature": -1}))))
            .unwrap()
            .generation(false)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("options.temperature"));
        assert!(e.message.contains("temperature"), "{}", e.message);
    }

    #[test]
    fn keep_alive_reads_seconds_and_go_durations() {
        let k = |v: Value| keep_alive(Some(&raw(v)));
        assert_eq!(k(json!(0.0)).unwrap(), Some(Duration::ZERO));
        assert_eq!(k(json!(-1)).unwrap(), None);
        assert_eq!(k(json!("5m")).unwrap(), Some(Duration::from_secs(300)));
        assert_eq!(k(json!("1h30m")).unwrap(), Some(Duration::from_secs(5400)));
        assert_eq!(k(json!("-1s")).unwrap(), None);
        assert_eq!(k(json!("120")).unwrap(), Some(Duration::from_secs(120)));
        assert_eq!(k(json!(1.9)).unwrap(), Some(Duration::from_secs(1)));
        assert!(k(json!("soon")).is_err());
        assert!(k(json!("5x")).is_err());
        assert!(k(json!([1])).is_err());
        assert_eq!(keep_alive(None).unwrap(), None);
    }

    #[test]
    fn a_tool_message_answers_the_call_of_its_name() {
        let body: ChatBody = parse(
            json!({"messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [
                    {"function": {"name": "time", "arguments": {}}},
                    {"function": {"name": "weather", "arguments": {"city": "Oslo"}}},
                ]},
                {"role": "tool", "content": "12 C", "tool_name": "weather"},
            ], "tools": []})
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let chat = body.chat_input().unwrap().unwrap();
        let calls = chat.messages[1].tool_calls.as_ref().unwrap();
        assert_eq!(
            calls[1].function.arguments.as_deref(),
            Some(r#"{"city":"Oslo"}"#)
        );
        assert_eq!(chat.messages[2].tool_call_id, calls[1].id);
        assert_eq!(chat.messages[2].name.as_deref(), Some("weather"));
        assert!(chat.tools.is_none(), "an empty tools list offers none");
        assert!(chat.generation.stream, "Ollama streams unless told not to");
    }
}
