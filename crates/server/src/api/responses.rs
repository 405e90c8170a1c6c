//! OpenAI's Responses API (`POST /v1/responses`): the request body, validated into a
//! [`ChatInput`] (the conversation and tools in chat completions' shape) with what the response
//! object echoes back ([`Echo`]) and this request's input items as `input_items` lists them.
//!
//! Translation: `instructions` are a system message first (this request's only: they do not
//! carry over through `previous_response_id`); the previous response's conversation comes
//! next, then the input: messages (a string is one user message), `function_call` items as the
//! assistant's calls, `function_call_output` items as `tool` messages (each must answer a call
//! made earlier), `reasoning` items dropped (the templates of thinking models drop earlier
//! reasoning). `text.format` is structured output; `reasoning.effort: "none"` turns a
//! thinking template's thinking off. Images, files and hosted tools are refused (400).

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use kiln_engine::OutputConstraint;

use super::{
    ChatInput, CommonFields, Content, Message, MessageFunctionCall, MessageToolCall, RequestBody,
    json_field, parse,
};
use crate::error::ApiError;

/// `POST /v1/responses`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string, or a list of input items, as text (read by [`ResponsesRequest::prepare`]).
    pub input: Option<Box<RawValue>>,
    /// A system message for this request only.
    pub instructions: Option<String>,
    /// `[{"type": "function", "name", "description"?, "parameters"?, "strict"?}]`.
    pub tools: Option<Box<RawValue>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`.
    pub tool_choice: Option<Box<RawValue>>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Box<RawValue>>,
    pub max_output_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens (a kiln extension, as on chat completions).
    pub top_k: Option<i64>,
    /// Sampling seed (a kiln extension, as on chat completions).
    pub seed: Option<i64>,
    /// Keep the response for `GET`, `input_items` and `previous_response_id` (default true).
    pub store: Option<bool>,
    /// Continue the conversation of this stored response.
    pub previous_response_id: Option<String>,
    pub stream: Option<bool>,
    /// `{"effort", "summary"}`: `effort: "none"` turns thinking off; the rest is accepted.
    pub reasoning: Option<Box<RawValue>>,
    /// Echoed back.
    pub metadata: Option<Box<RawValue>>,
}

impl RequestBody for ResponsesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// One input item, every kind's fields together.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    id: Option<String>,
    /// A message's.
    role: Option<String>,
    content: Option<Box<RawValue>>,
    /// A function call's (and its output's `call_id`).
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    /// A function call output's: a string or a list of text parts.
    output: Option<Box<RawValue>>,
}

/// One content part.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    refusal: Option<String>,
}

/// What the response object echoes of the request.
#[derive(Debug, Clone)]
pub struct Echo {
    pub instructions: Option<String>,
    /// The tools in the Responses API's shape.
    pub tools: Value,
    /// The namespace of each function offered inside one: `(function, namespace)`.
    pub namespaces: Vec<(String, String)>,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    /// `{"format": ...}`.
    pub text: Value,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_output_tokens: Option<u64>,
    pub metadata: Value,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub reasoning: Value,
}

/// A request made ready: the chat to run, this request's own messages and input items (what
/// a stored response keeps), and what the response echoes.
pub struct Prepared {
    pub chat: ChatInput,
    /// This request's input as messages (no instructions).
    pub new_messages: Vec<Message>,
    /// This request's input items, each with an id.
    pub input_items: Vec<Value>,
    pub echo: Echo,
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

/// The text of a message's content (a string, or text parts) and its parts as listed.
fn content_text(
    field: &str,
    raw: &RawValue,
    assistant: bool,
) -> Result<(String, Vec<Value>), ApiError> {
    let listed_kind = if assistant {
        "output_text"
    } else {
        "input_text"
    };
    if raw.get().trim_start().starts_with('"') {
        let text: String = serde_json::from_str(raw.get())
            .map_err(|e| ApiError::invalid_field("input", format!("{field}: {e}")))?;
        let part = part_value(listed_kind, &text);
        return Ok((text, vec![part]));
    }
    let parts: Vec<Part> = serde_json::from_str(raw.get()).map_err(|e| {
        ApiError::invalid_field(
            "input",
            format!("{field} must be a string or a list of content parts: {e}"),
        )
    })?;
    let mut text = String::new();
    let mut listed = Vec::with_capacity(parts.len());
    for (k, part) in parts.into_iter().enumerate() {
        let piece = match (part.kind.as_str(), part.text, part.refusal) {
            ("input_text" | "output_text" | "text", Some(t), _) => t,
            ("refusal", _, Some(r)) => r,
            ("input_image" | "input_file" | "input_audio", _, _) => {
                return Err(ApiError::invalid_field(
                    "input",
                    format!("{field}[{k}]: {} parts are not supported yet", part.kind),
                ));
            }
            (kind, _, _) => {
                return Err(ApiError::invalid_field(
                    "input",
                    format!("{field}[{k}]: content parts of type {kind:?} are not supported"),
                ));
            }
        };
        listed.push(part_value(listed_kind, &piece));
        text.push_str(&piece);
    }
    Ok((text, listed))
}

fn part_value(kind: &str, text: &str) -> Value {
    if kind == "output_text" {
        json!({"type": kind, "text": text, "annotations": []})
    } else {
        json!({"type": kind, "text": text})
    }
}

/// A request's tools: as the model is offered them (chat completions' shape), as the response
/// echoes them, and the namespace of each function that came in one (`(function, namespace)`).
struct Tools {
    chat: Option<Value>,
    echo: Value,
    namespaces: Vec<(String, String)>,
}

/// A function tool in chat completions' shape.
fn chat_function(tool: &Value) -> Value {
    let mut function = Map::new();
    for key in ["name", "description", "parameters"] {
        if let Some(v) = tool.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), v.clone());
        }
    }
    json!({"type": "function", "function": function})
}

/// A function tool as the response echoes it.
fn echo_function(tool: &Value) -> Value {
    json!({
        "type": "function",
        "name": tool.get("name").cloned().unwrap_or(Value::Null),
        "description": tool.get("description").cloned().unwrap_or(Value::Null),
        "parameters": tool.get("parameters").cloned().unwrap_or(Value::Null),
        "strict": tool.get("strict").cloned().unwrap_or(Value::Bool(true)),
    })
}

/// A function call output's text: a string, or its text parts joined.
fn output_text(field: &str, raw: Option<&RawValue>) -> Result<String, ApiError> {
    match raw {
        None => Ok(String::new()),
        Some(raw) => content_text(field, raw, false).map(|(text, _)| text),
    }
}

impl ResponsesRequest {
    /// The request made ready, continuing `history` (the previous response's conversation);
    /// `next_id(prefix)` gives fresh ids for the input items that come without one.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn prepare(
        &self,
        history: &[Message],
        mut next_id: impl FnMut(&str) -> String,
    ) -> Result<Prepared, ApiError> {
        let common = CommonFields {
            model: self.model.clone(),
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            stream: self.stream,
            ..CommonFields::default()
        };
        let mut generation = common.generation(None).map_err(|mut e| {
            if e.param.as_deref() == Some("max_tokens") {
                e.param = Some("max_output_tokens".into());
                e.message = e.message.replace("max_tokens", "max_output_tokens");
            }
            e
        })?;
        let (constraint, text) = self.text_format()?;
        generation.constraint = constraint.map(|c| ("text", c));
        let (new_messages, input_items) = self.input(history, &mut next_id)?;
        let Tools {
            chat: tools,
            echo: echo_tools,
            namespaces,
        } = self.tools()?;
        let (tool_choice, echo_choice) = self.tool_choice()?;
        let mut variables = Map::new();
        let reasoning = match &self.reasoning {
            Some(raw) => json_field("reasoning", raw)?,
            None => Value::Null,
        };
        if reasoning.get("effort").and_then(Value::as_str) == Some("none") {
            variables.insert("enable_thinking".into(), Value::Bool(false));
        }
        let mut messages = Vec::with_capacity(history.len() + new_messages.len() + 1);
        if let Some(instructions) = self.instructions.clone().filter(|i| !i.is_empty()) {
            messages.push(message("system", instructions));
        }
        messages.extend(history.iter().cloned());
        messages.extend(new_messages.iter().cloned());
        let metadata = match &self.metadata {
            Some(raw) => json_field("metadata", raw)?,
            None => json!({}),
        };
        let echo = Echo {
            instructions: self.instructions.clone(),
            tools: echo_tools,
            namespaces,
            tool_choice: echo_choice,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            text,
            temperature: self.temperature,
            top_p: self.top_p,
            max_output_tokens: self.max_output_tokens,
            metadata: if metadata.is_null() {
                json!({})
            } else {
                metadata
            },
            previous_response_id: self.previous_response_id.clone(),
            store: self.store.unwrap_or(true),
            reasoning,
        };
        Ok(Prepared {
            chat: ChatInput {
                messages,
                tools,
                tool_choice,
                parallel_tool_calls: self.parallel_tool_calls,
                variables,
                generation,
            },
            new_messages,
            input_items,
            echo,
        })
    }

    /// `text.format` as a constraint, and `text` as the response echoes it.
    fn text_format(&self) -> Result<(Option<OutputConstraint>, Value), ApiError> {
        const FIELD: &str = "text";
        let text = match &self.text {
            Some(raw) => json_field(FIELD, raw)?,
            None => Value::Null,
        };
        let Some(format) = text.get("format").filter(|f| !f.is_null()) else {
            return Ok((None, json!({"format": {"type": "text"}})));
        };
        let constraint = match format.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(OutputConstraint::JsonObject),
            Some("json_schema") => match format.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Some(OutputConstraint::JsonSchema(schema.clone()))
                }
                _ => {
                    return Err(ApiError::invalid_field(
                        FIELD,
                        "text.format of type json_schema needs a \"schema\" object",
                    ));
                }
            },
            _ => {
                return Err(ApiError::invalid_field(
                    FIELD,
                    "text.format needs a type: \"text\", \"json_object\" or \"json_schema\"",
                ));
            }
        };
        Ok((constraint, json!({"format": format})))
    }

    /// The tools in chat completions' shape, as the response echoes them, and the namespace
    /// of each function that came in one. A `namespace` tool's functions are offered as they
    /// are (their calls carry the namespace back); hosted tools kiln cannot run (`web_search`,
    /// `file_search`, `code_interpreter`, MCP servers, custom text tools, ...) are not offered
    /// to the model, and the log says so: clients such as the Codex CLI declare them whatever
    /// the server.
    fn tools(&self) -> Result<Tools, ApiError> {
        let Some(raw) = &self.tools else {
            return Ok(Tools {
                chat: None,
                echo: json!([]),
                namespaces: Vec::new(),
            });
        };
        let Value::Array(list) = json_field("tools", raw)? else {
            return Err(ApiError::invalid_field("tools", "tools must be a list"));
        };
        let mut chat = Vec::with_capacity(list.len());
        let mut echo = Vec::with_capacity(list.len());
        let mut namespaces = Vec::new();
        let mut dropped = Vec::new();
        for (i, tool) in list.into_iter().enumerate() {
            match tool.get("type").and_then(Value::as_str).unwrap_or("") {
                "function" => {
                    chat.push(chat_function(&tool));
                    echo.push(echo_function(&tool));
                }
                "namespace" => {
                    let name = tool.get("name").and_then(Value::as_str).unwrap_or("");
                    let Some(Value::Array(inner)) = tool.get("tools") else {
                        return Err(ApiError::invalid_field(
                            "tools",
                            format!("tools[{i}]: a namespace needs a list of tools"),
                        ));
                    };
                    for function in inner {
                        if function.get("type").and_then(Value::as_str) != Some("function") {
                            dropped.push(format!(
                                "{name}.{}",
                                function.get("type").unwrap_or(&Value::Null)
                            ));
                            continue;
                        }
                        chat.push(chat_function(function));
                        if let Some(f) = function.get("name").and_then(Value::as_str) {
                            namespaces.push((f.to_string(), name.to_string()));
                        }
                    }
                    echo.push(tool);
                }
                "" => {
                    return Err(ApiError::invalid_field(
                        "tools",
                        format!("tools[{i}] has no type"),
                    ));
                }
                kind => {
                    dropped.push(kind.to_string());
                    echo.push(tool);
                }
            }
        }
        if !dropped.is_empty() {
            tracing::warn!(target: "kiln::serve", "the model is not offered tools it cannot call here: {}", dropped.join(", "));
        }
        Ok(Tools {
            chat: (!chat.is_empty()).then_some(Value::Array(chat)),
            echo: Value::Array(echo),
            namespaces,
        })
    }

    /// `tool_choice` in chat completions' shape, and as the response echoes it.
    fn tool_choice(&self) -> Result<(Option<Value>, Value), ApiError> {
        const FIELD: &str = "tool_choice";
        let Some(raw) = &self.tool_choice else {
            return Ok((None, json!("auto")));
        };
        let value = json_field(FIELD, raw)?;
        let chat = match &value {
            Value::String(_) => value.clone(),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
                match o.get("name").and_then(Value::as_str) {
                    Some(name) => json!({"type": "function", "function": {"name": name}}),
                    None => {
                        return Err(ApiError::invalid_field(
                            FIELD,
                            "tool_choice {\"type\": \"function\"} needs the function's name",
                        ));
                    }
                }
            }
            _ => {
                return Err(ApiError::invalid_field(
                    FIELD,
                    "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                ));
            }
        };
        Ok((Some(chat), value))
    }

    /// The input as messages, and as listed items (each with an id).
    fn input(
        &self,
        history: &[Message],
        next_id: &mut impl FnMut(&str) -> String,
    ) -> Result<(Vec<Message>, Vec<Value>), ApiError> {
        let Some(raw) = &self.input else {
            return Err(ApiError::invalid_field("input", "input is required"));
        };
        if raw.get().trim_start().starts_with('"') {
            let (text, parts) = content_text("input", raw, false)?;
            let item = json!({"id": next_id("msg_"), "type": "message", "role": "user",
                              "content": parts, "status": "completed"});
            return Ok((vec![message("user", text)], vec![item]));
        }
        let items: Vec<Item> = serde_json::from_str(raw.get()).map_err(|e| {
            ApiError::invalid_field(
                "input",
                format!("input must be a string or a list of items: {e}"),
            )
        })?;
        // The calls made so far (id, name), for the outputs that answer them.
        let mut calls: Vec<(String, String)> = history
            .iter()
            .flat_map(|m| m.tool_calls.iter().flatten())
            .map(|c| (c.id.clone().unwrap_or_default(), c.function.name.clone()))
            .collect();
        let mut messages: Vec<Message> = Vec::with_capacity(items.len());
        let mut listed = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            let field = format!("input[{i}]");
            let kind =
                item.kind
                    .as_deref()
                    .unwrap_or(if item.role.is_some() { "message" } else { "" });
            match kind {
                "message" => {
                    let role = item.role.as_deref().unwrap_or("");
                    if !matches!(role, "user" | "assistant" | "system" | "developer") {
                        return Err(ApiError::invalid_field(
                            "input",
                            format!(
                                "{field}.role is {role:?}: expected user, assistant, system or developer"
                            ),
                        ));
                    }
                    let assistant = role == "assistant";
                    let (text, parts) = match &item.content {
                        Some(raw) => content_text(&format!("{field}.content"), raw, assistant)?,
                        None => (String::new(), Vec::new()),
                    };
                    let id = item.id.unwrap_or_else(|| next_id("msg_"));
                    listed.push(json!({"id": id, "type": "message", "role": role,
                                       "content": parts, "status": "completed"}));
                    messages.push(message(role, text));
                }
                "function_call" => {
                    let (Some(call_id), Some(name)) = (item.call_id, item.name) else {
                        return Err(ApiError::invalid_field(
                            "input",
                            format!("{field}: a function_call item needs its call_id and name"),
                        ));
                    };
                    let arguments = item.arguments.unwrap_or_else(|| "{}".into());
                    let parsed: Value = serde_json::from_str(&arguments).map_err(|e| {
                        ApiError::invalid_field(
                            "input",
                            format!("{field}.arguments is not JSON: {e}"),
                        )
                    })?;
                    if !parsed.is_object() {
                        return Err(ApiError::invalid_field(
                            "input",
                            format!("{field}.arguments must be a JSON object"),
                        ));
                    }
                    calls.push((call_id.clone(), name.clone()));
                    let id = item.id.unwrap_or_else(|| next_id("fc_"));
                    listed.push(json!({"id": id, "type": "function_call", "call_id": call_id,
                                       "name": name, "arguments": arguments, "status": "completed"}));
                    let call = MessageToolCall {
                        id: Some(call_id),
                        function: MessageFunctionCall {
                            name,
                            arguments: Some(arguments),
                        },
                    };
                    // Calls after an assistant message (or after other calls) are its calls.
                    match messages.last_mut() {
                        Some(last) if last.role == "assistant" => {
                            last.tool_calls.get_or_insert_with(Vec::new).push(call);
                        }
                        _ => messages.push(Message {
                            tool_calls: Some(vec![call]),
                            ..message("assistant", String::new())
                        }),
                    }
                }
                "function_call_output" => {
                    let Some(call_id) = item.call_id else {
                        return Err(ApiError::invalid_field(
                            "input",
                            format!("{field}: a function_call_output item needs its call_id"),
                        ));
                    };
                    let Some((_, name)) = calls.iter().find(|(id, _)| *id == call_id) else {
                        return Err(ApiError::invalid_field(
                            "input",
                            format!(
                                "{field}: call_id {call_id:?} answers no function_call of this \
                                 conversation"
                            ),
                        ));
                    };
                    let output = output_text(&format!("{field}.output"), item.output.as_deref())?;
                    let id = item.id.unwrap_or_else(|| next_id("fco_"));
                    listed.push(
                        json!({"id": id, "type": "function_call_output", "call_id": call_id,
                                       "output": output, "status": "completed"}),
                    );
                    messages.push(Message {
                        role: "tool".into(),
                        content: Some(Content::Text(output)),
                        tool_calls: None,
                        tool_call_id: Some(call_id),
                        name: Some(name.clone()),
                    });
                }
                "reasoning" => {}
                other => {
                    return Err(ApiError::invalid_field(
                        "input",
                        format!(
                            "{field} is of type {other:?}: expected message, function_call, \
                             function_call_output or reasoning"
                        ),
                    ));
                }
            }
        }
        if messages.is_empty() {
            return Err(ApiError::invalid_field("input", "input has no message"));
        }
        Ok((messages, listed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepare(body: Value, history: &[Message]) -> Result<Prepared, ApiError> {
        let mut n = 0;
        ResponsesRequest::parse(body.to_string().as_bytes())?.prepare(history, |p| {
            n += 1;
            format!("{p}{n}")
        })
    }

    #[test]
    fn items_become_a_conversation_and_listed_items() {
        let p = prepare(
            json!({
                "instructions": "Be brief.",
                "input": [
                    {"role": "user", "content": "Weather in Oslo?"},
                    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                ],
                "max_output_tokens": 9,
                "text": {"format": {"type": "json_object"}},
            }),
            &[],
        )
        .unwrap();
        let roles: Vec<&str> = p.chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(
            p.new_messages.len(),
            3,
            "no instructions among the new messages"
        );
        assert_eq!(p.input_items.len(), 3);
        assert_eq!(p.input_items[0]["id"], "msg_1");
        assert_eq!(p.input_items[1]["type"], "function_call");
        assert_eq!(p.chat.messages[3].name.as_deref(), Some("weather"));
        assert_eq!(p.chat.generation.max_tokens, Some(9));
        assert!(matches!(
            p.chat.generation.constraint,
            Some(("text", OutputConstraint::JsonObject))
        ));
        assert_eq!(p.echo.tool_choice, json!("auto"));
        assert!(p.echo.store);
    }

    #[test]
    fn an_output_may_answer_a_call_of_the_previous_response() {
        let history = vec![Message {
            tool_calls: Some(vec![MessageToolCall {
                id: Some("call_7".into()),
                function: MessageFunctionCall {
                    name: "f".into(),
                    arguments: Some("{}".into()),
                },
            }]),
            ..message("assistant", String::new())
        }];
        let body = json!({"input": [{"type": "function_call_output", "call_id": "call_7", "output": "ok"}]});
        assert!(prepare(body.clone(), &history).is_ok());
        let e = prepare(body, &[]).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("input"));
        assert!(e.message.contains("call_7"), "{}", e.message);
    }

    #[test]
    fn namespaced_functions_are_offered_and_hosted_tools_are_not() {
        let p = prepare(
            json!({"input": "hi", "tools": [
                {"type": "web_search", "external_web_access": true},
                {"type": "namespace", "name": "agents", "tools": [
                    {"type": "function", "name": "spawn", "parameters": {"type": "object"}},
                ]},
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            ]}),
            &[],
        )
        .unwrap();
        let offered: Vec<&Value> = p
            .chat
            .tools
            .as_ref()
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|t| &t["function"]["name"])
            .collect();
        assert_eq!(offered, [&json!("spawn"), &json!("shell")]);
        assert_eq!(
            p.echo.namespaces,
            [("spawn".to_string(), "agents".to_string())]
        );
        assert_eq!(p.echo.tools.as_array().unwrap().len(), 3);
        let only_hosted = prepare(
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            &[],
        )
        .unwrap();
        assert!(only_hosted.chat.tools.is_none());
    }

    #[test]
    fn bad_fields_are_a_400_naming_them() {
        for (body, param) in [
            (
                json!({"input": "hi", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (json!({"input": [{"type": "bogus"}]}), "input"),
            (json!({"input": "hi", "tools": [{"name": "f"}]}), "tools"),
            (
                json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
                "text",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input",
            ),
            (json!({}), "input"),
        ] {
            let e = prepare(body.clone(), &[])
                .err()
                .unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }
}
