//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
//! request body, validated into a [`ChatInput`] (the conversation and tools in OpenAI's shape),
//! and the response bodies.
//!
//! Translation: `system` (a string or text blocks) is the first message; a user turn's
//! `tool_result` blocks become `tool` messages (before its text), an assistant turn's
//! `tool_use` blocks its calls; `thinking` blocks sent back are dropped, as the templates of
//! thinking models drop earlier reasoning; `thinking: {"type": "enabled"}` sets the template's
//! `enable_thinking`. `tool_choice` `auto` / `any` / `tool` / `none` are OpenAI's `auto` /
//! `required` / a named function / `none`. Images and documents, server tools, and
//! `cache_control` (kiln caches prefixes on its own) are not taken: the first two are a 400,
//! the last is ignored.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::{ChatInput, CommonFields, Content, Message, MessageFunctionCall, MessageToolCall};
use super::{RequestBody, Stop, json_field, parse};
use crate::error::ApiError;

/// `POST /v1/messages` (and `count_tokens`, which reads the same fields but `max_tokens`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MessagesRequest {
    /// A served model's name.
    pub model: Option<String>,
    /// Most tokens to generate (required by `/v1/messages`).
    pub max_tokens: Option<u64>,
    /// The conversation: user and assistant turns.
    pub messages: Vec<InputMessage>,
    /// A string or a list of text blocks.
    pub system: Option<Box<RawValue>>,
    /// Strings that end the answer (the one that did is reported as `stop_sequence`).
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens.
    pub top_k: Option<i64>,
    /// Server-sent events in Anthropic's names.
    pub stream: Option<bool>,
    /// `[{"name", "description"?, "input_schema"}]`.
    pub tools: Option<Box<RawValue>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}`.
    pub tool_choice: Option<Box<RawValue>>,
    /// `{"type": "enabled", "budget_tokens"}` or `{"type": "disabled"}`.
    pub thinking: Option<Box<RawValue>>,
}

/// One turn.
#[derive(Debug, Deserialize)]
pub struct InputMessage {
    /// `user` or `assistant`.
    pub role: String,
    /// A string or a list of content blocks, as text (read by [`blocks`]).
    pub content: Box<RawValue>,
}

/// One content block, every kind's fields together.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    /// `text`.
    text: Option<String>,
    /// `tool_use`.
    id: Option<String>,
    name: Option<String>,
    input: Option<Box<RawValue>>,
    /// `tool_result`.
    tool_use_id: Option<String>,
    content: Option<Box<RawValue>>,
    is_error: Option<bool>,
}

impl RequestBody for MessagesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// A content field's blocks: a string is one text block.
fn blocks(field: &str, raw: &RawValue) -> Result<Vec<Block>, ApiError> {
    if raw.get().trim_start().starts_with('"') {
        let text: String = serde_json::from_str(raw.get())
            .map_err(|e| ApiError::invalid_field(field, format!("{field}: {e}")))?;
        return Ok(vec![Block {
            kind: "text".into(),
            text: Some(text),
            ..Block::default()
        }]);
    }
    serde_json::from_str(raw.get()).map_err(|e| {
        ApiError::invalid_field(
            field,
            format!("{field} must be a string or a list of content blocks: {e}"),
        )
    })
}

/// The text of text-only blocks (`system`, a `tool_result`'s content).
fn text_of(field: &str, raw: &RawValue) -> Result<String, ApiError> {
    let mut text = String::new();
    for (k, block) in blocks(field, raw)?.into_iter().enumerate() {
        match (block.kind.as_str(), block.text) {
            // Joined as chat completions joins text parts.
            ("text", Some(t)) => text.push_str(&t),
            (kind, _) => {
                return Err(ApiError::invalid_field(
                    &format!("{field}[{k}]"),
                    format!(
                        "{field}[{k}]: blocks of type {kind:?} are not supported here; only text blocks are"
                    ),
                ));
            }
        }
    }
    Ok(text)
}

fn message(role: &str, text: String) -> Message {
    Message {
        role: role.into(),
        content: Some(Content::Text(text)),
        tool_calls: None,
        tool_call_id: None,
        name: None,
    }
}

impl MessagesRequest {
    /// The conversation in OpenAI's shape: `system` first, tool results as `tool` messages
    /// (each must answer a `tool_use` made earlier), calls as the assistant's `tool_calls`.
    ///
    /// # Errors
    /// A 400 naming the message or block at fault.
    fn conversation(&self) -> Result<Vec<Message>, ApiError> {
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            let text = text_of("system", system)?;
            if !text.is_empty() {
                out.push(message("system", text));
            }
        }
        // The calls made so far: (id, function name).
        let mut calls: Vec<(String, String)> = Vec::new();
        for (i, m) in self.messages.iter().enumerate() {
            if !matches!(m.role.as_str(), "user" | "assistant") {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role is {:?}: expected user or assistant",
                        m.role
                    ),
                ));
            }
            let field = format!("messages[{i}].content");
            let mut text = String::new();
            let mut made = Vec::new();
            for (k, block) in blocks(&field, &m.content)?.into_iter().enumerate() {
                let at = format!("{field}[{k}]");
                match (m.role.as_str(), block.kind.as_str()) {
                    (_, "text") => text.push_str(block.text.as_deref().unwrap_or_default()),
                    ("assistant", "tool_use") => {
                        let call = tool_use(&at, block)?;
                        calls.push((
                            call.id.clone().unwrap_or_default(),
                            call.function.name.clone(),
                        ));
                        made.push(call);
                    }
                    ("assistant", "thinking" | "redacted_thinking") => {}
                    ("user", "tool_result") => {
                        let Some(id) = block.tool_use_id else {
                            return Err(ApiError::invalid_field(
                                &format!("{at}.tool_use_id"),
                                format!("{at}: a tool_result block needs its tool_use_id"),
                            ));
                        };
                        let Some((_, name)) = calls.iter().find(|(made, _)| *made == id) else {
                            return Err(ApiError::invalid_field(
                                &format!("{at}.tool_use_id"),
                                format!(
                                    "{at}: tool_use_id {id:?} answers no tool_use block of an \
                                     earlier assistant turn"
                                ),
                            ));
                        };
                        let mut content = match &block.content {
                            Some(raw) => text_of(&format!("{at}.content"), raw)?,
                            None => String::new(),
                        };
                        if block.is_error == Some(true) {
                            content = format!("Error: {content}");
                        }
                        out.push(Message {
                            role: "tool".into(),
                            content: Some(Content::Text(content)),
                            tool_calls: None,
                            tool_call_id: Some(id),
                            name: Some(name.clone()),
                        });
                    }
                    (_, "image" | "document") => {
                        return Err(ApiError::invalid_field(
                            &at,
                            format!("{at}: {} blocks are not supported yet", block.kind),
                        ));
                    }
                    (role, kind) => {
                        return Err(ApiError::invalid_field(
                            &at,
                            format!("{at}: a {role} turn cannot hold a block of type {kind:?}"),
                        ));
                    }
                }
            }
            match m.role.as_str() {
                "assistant" => out.push(Message {
                    tool_calls: (!made.is_empty()).then_some(made),
                    ..message("assistant", text)
                }),
                _ if text.is_empty() && out.last().is_some_and(|l| l.role == "tool") => {}
                _ => out.push(message("user", text)),
            }
        }
        Ok(out)
    }

    /// The tools in OpenAI's shape.
    fn tools(&self) -> Result<Option<Value>, ApiError> {
        let Some(raw) = &self.tools else {
            return Ok(None);
        };
        let Value::Array(list) = json_field("tools", raw)? else {
            return Err(ApiError::invalid_field("tools", "tools must be a list"));
        };
        let mut tools = Vec::with_capacity(list.len());
        for (i, tool) in list.into_iter().enumerate() {
            let kind = tool.get("type").and_then(Value::as_str).unwrap_or("custom");
            if kind != "custom" {
                return Err(ApiError::invalid_field(
                    &format!("tools[{i}].type"),
                    format!(
                        "tools[{i}]: server tools ({kind:?}) are not supported; give client tools with a name and an input_schema"
                    ),
                ));
            }
            let mut function = Map::new();
            for key in ["name", "description"] {
                if let Some(v) = tool.get(key) {
                    function.insert(key.into(), v.clone());
                }
            }
            match tool.get("input_schema") {
                Some(schema) => function.insert("parameters".into(), schema.clone()),
                None => {
                    return Err(ApiError::invalid_field(
                        &format!("tools[{i}].input_schema"),
                        format!("tools[{i}] needs an input_schema"),
                    ));
                }
            };
            tools.push(json!({"type": "function", "function": function}));
        }
        Ok(Some(Value::Array(tools)))
    }

    /// `tool_choice` in OpenAI's shape, and whether several calls may come back.
    fn tool_choice(&self) -> Result<(Option<Value>, Option<bool>), ApiError> {
        const FIELD: &str = "tool_choice";
        let Some(raw) = &self.tool_choice else {
            return Ok((None, None));
        };
        let value = json_field(FIELD, raw)?;
        let parallel = value
            .get("disable_parallel_tool_use")
            .and_then(Value::as_bool)
            .map(|disable| !disable);
        let choice = match value.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match value.get("name").and_then(Value::as_str) {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => {
                    return Err(ApiError::invalid_field(
                        FIELD,
                        "tool_choice of type \"tool\" needs the tool's name",
                    ));
                }
            },
            _ => {
                return Err(ApiError::invalid_field(
                    FIELD,
                    "tool_choice needs a type: \"auto\", \"any\", \"tool\" or \"none\"",
                ));
            }
        };
        Ok((Some(choice), parallel))
    }

    /// `thinking` as the template's `enable_thinking`.
    fn thinking(&self) -> Result<Option<bool>, ApiError> {
        let Some(raw) = &self.thinking else {
            return Ok(None);
        };
        match json_field("thinking", raw)?
            .get("type")
            .and_then(Value::as_str)
        {
            Some("enabled" | "adaptive") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            _ => Err(ApiError::invalid_field(
                "thinking",
                "thinking needs a type: \"enabled\" or \"disabled\"",
            )),
        }
    }

    /// The request as a [`ChatInput`]; `generating` when it must say how much to generate
    /// (`/v1/messages`; `count_tokens` does not).
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn chat_input(&self, generating: bool) -> Result<ChatInput, ApiError> {
        if generating && self.max_tokens.is_none() {
            return Err(ApiError::invalid_field(
                "max_tokens",
                "max_tokens: field required",
            ));
        }
        let common = CommonFields {
            model: self.model.clone(),
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(Stop::Many),
            stream: self.stream,
            ..CommonFields::default()
        };
        let generation = common.generation(None)?;
        let (tool_choice, parallel_tool_calls) = self.tool_choice()?;
        let mut variables = Map::new();
        if let Some(thinking) = self.thinking()? {
            variables.insert("enable_thinking".into(), Value::Bool(thinking));
        }
        Ok(ChatInput {
            messages: self.conversation()?,
            tools: self.tools()?,
            tool_choice,
            parallel_tool_calls,
            variables,
            generation,
        })
    }
}

/// A tool_use block as an OpenAI call: its input must be an object.
fn tool_use(at: &str, block: Block) -> Result<MessageToolCall, ApiError> {
    let (Some(id), Some(name)) = (block.id, block.name) else {
        return Err(ApiError::invalid_field(
            at,
            format!("{at}: a tool_use block needs an id and a name"),
        ));
    };
    let input = match &block.input {
        Some(raw) => json_field(&format!("{at}.input"), raw)?,
        None => Value::Object(Map::new()),
    };
    if !input.is_object() {
        return Err(ApiError::invalid_field(
            &format!("{at}.input"),
            format!("{at}.input must be an object"),
        ));
    }
    Ok(MessageToolCall {
        id: Some(id),
        function: MessageFunctionCall {
            name,
            arguments: Some(input.to_string()),
        },
    })
}

/// `/v1/messages`' answer.
#[derive(Debug, Serialize)]
pub struct MessageBody<'a> {
    pub id: &'a str,
    /// Always `"message"`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Always `"assistant"`.
    pub role: &'static str,
    pub model: &'a str,
    pub content: Vec<Value>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use` (`null` in `message_start`).
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<&'a str>,
    pub usage: MessageUsage,
}

/// Anthropic's usage: `input_tokens` are the prompt's tokens not read from the cache (the
/// prompt is `input_tokens + cache_read_input_tokens`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MessageUsage {
    pub input_tokens: usize,
    pub output_tokens: usize,
    pub cache_creation_input_tokens: usize,
    pub cache_read_input_tokens: usize,
}

impl MessageUsage {
    /// The usage of a prompt of `prompt_tokens`, `cached` of them from the prefix cache.
    pub fn new(prompt_tokens: usize, cached: usize, output_tokens: usize) -> Self {
        let cached = cached.min(prompt_tokens);
        Self {
            input_tokens: prompt_tokens - cached,
            output_tokens,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: cached,
        }
    }
}

/// A `tool_use` id from a call id (`call_…` → `toolu_…`, as Anthropic's ids look).
pub fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(body: Value) -> Result<ChatInput, ApiError> {
        MessagesRequest::parse(body.to_string().as_bytes())?.chat_input(true)
    }

    fn roles(input: &ChatInput) -> Vec<&str> {
        input.messages.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn system_blocks_and_tool_turns_become_openai_messages() {
        let chat = input(json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12 C"}]},
                    {"type": "text", "text": "Thanks."},
                ]},
            ],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"],
        }))
        .unwrap();
        assert_eq!(
            roles(&chat),
            ["system", "user", "assistant", "tool", "user"]
        );
        let call = &chat.messages[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(call.function.name, "get_weather");
        assert_eq!(
            call.function.arguments.as_deref(),
            Some(r#"{"city":"Oslo"}"#)
        );
        assert_eq!(chat.messages[3].name.as_deref(), Some("get_weather"));
        assert_eq!(chat.tool_choice, Some(json!("required")));
        assert_eq!(chat.parallel_tool_calls, Some(false));
        assert_eq!(
            chat.tools.unwrap()[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(chat.generation.stop, ["END"]);
        assert_eq!(chat.generation.max_tokens, Some(8));
    }

    #[test]
    fn bad_turns_and_blocks_are_a_400_naming_them() {
        let base = |messages: Value| json!({"max_tokens": 4, "messages": messages});
        let cases = [
            (
                json!({"messages": [{"role": "user", "content": "hi"}]}),
                "max_tokens",
            ),
            (
                base(json!([{"role": "tool", "content": "x"}])),
                "messages[0].role",
            ),
            (
                base(json!([{"role": "user", "content": [{"type": "bogus"}]}])),
                "messages[0].content[0]",
            ),
            (
                base(
                    json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]),
                ),
                "messages[0].content[0].tool_use_id",
            ),
            (
                base(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])),
                "messages[0].content[0]",
            ),
        ];
        for (body, param) in cases {
            let e = input(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        let e = input(base(json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}])))
            .err()
            .unwrap();
        assert!(e.message.contains("toolu_9"), "{}", e.message);
    }

    #[test]
    fn usage_counts_cached_prompt_tokens_apart() {
        let u = MessageUsage::new(10, 4, 3);
        assert_eq!((u.input_tokens, u.cache_read_input_tokens), (6, 4));
        assert_eq!(tool_use_id("call_ab12"), "toolu_ab12");
    }
}
