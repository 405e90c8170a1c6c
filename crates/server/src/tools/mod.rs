//! Tool calling on `/v1/chat/completions`: the request's `tools`, `tool_choice` and
//! `parallel_tool_calls` validated ([`ToolRequest`]), the conversation's tool turns made
//! [`ChatMessage`]s ([`conversation`]), what the prompt and the output's grammar become
//! ([`ToolPlan`]), and the generated text parsed back into content and calls ([`parse`]).
//!
//! The formats ([`ToolFormat`]), one module each: `hermes` (Qwen2.5, Hermes:
//! `<tool_call>{json}</tool_call>`), `llama3` (Llama 3.1/3.2: a bare
//! `{"name", "parameters"}` object), `mistral` (`[TOOL_CALLS][{...}]`) and `generic` (llama.cpp's
//! fallback for templates that know no tools: the prompt is told to answer
//! `{"tool_call": ...}` or `{"response": ...}` and the output is held to that by a grammar).
//! Which one a model speaks is read from its chat template ([`ToolFormat::detect`]) unless
//! `kiln serve --tool-parser` says ([`ToolParser`]).
//!
//! `tool_choice: "required"` or a named function is enforced by a grammar through the
//! structured-output path, in the generic JSON shape whatever the template (so the arguments
//! always validate against the function's schema); `auto` leaves the model free.
//!
//! What it does not know: HTTP bodies beyond these fields, the engine, tokens.

mod generic;
mod hermes;
mod llama3;
mod mistral;
mod stream;
#[cfg(test)]
mod tests;

use std::str::FromStr;

pub use stream::StreamSplitter;

use kiln_engine::OutputConstraint;
use kiln_models::chat::{ChatMessage, Role, ToolCall};
use serde_json::{Map, Value, json};

use crate::api::Message;
use crate::error::ApiError;

/// How a model writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks (Qwen2.5, Hermes).
    Hermes,
    /// A `{"name": ..., "parameters": {...}}` object, after `<|python_tag|>` or alone, several
    /// separated by `;` (Llama 3.1, 3.2).
    Llama3,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral Nemo, Mistral 7B v0.3).
    Mistral,
    /// `{"tool_call": {"name", "arguments"}}`, `{"tool_calls": [...]}` or
    /// `{"response": "..."}`, described to the model in a system message (templates without
    /// tools).
    Generic,
}

impl ToolFormat {
    /// The format a chat template writes calls in, from the markers it spells; templates that
    /// spell none (or never read `tools`) get the generic fallback.
    pub fn detect(template: &str) -> Self {
        if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template.contains("<|start_header_id|>") && template.contains("\"parameters\": ")
        {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }

    /// Its name, as `--tool-parser` spells it.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Generic => "generic",
        }
    }

    /// Whether the template renders the tools itself (else the generic system message does).
    fn template_renders_tools(self) -> bool {
        self != ToolFormat::Generic
    }
}

/// `kiln serve --tool-parser`: read the format from the template, name one, or turn tool
/// calling off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolParser {
    /// [`ToolFormat::detect`] on the model's chat template.
    #[default]
    Auto,
    /// This format, whatever the template.
    Format(ToolFormat),
    /// No tool calling: requests with `tools` (and a `tool_choice` other than `none`) are
    /// refused.
    Off,
}

impl ToolParser {
    /// The format the server speaks with a model whose template is `template` (`None`: off).
    pub fn format(self, template: Option<&str>) -> Option<ToolFormat> {
        match self {
            ToolParser::Auto => Some(template.map_or(ToolFormat::Generic, ToolFormat::detect)),
            ToolParser::Format(format) => Some(format),
            ToolParser::Off => None,
        }
    }
}

impl FromStr for ToolParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => ToolParser::Auto,
            "hermes" => ToolParser::Format(ToolFormat::Hermes),
            "llama3" | "llama3_json" => ToolParser::Format(ToolFormat::Llama3),
            "mistral" => ToolParser::Format(ToolFormat::Mistral),
            "generic" => ToolParser::Format(ToolFormat::Generic),
            "none" => ToolParser::Off,
            other => {
                return Err(format!(
                    "unknown tool parser {other:?}: expected auto, hermes, llama3, mistral, \
                     generic or none"
                ));
            }
        })
    }
}

/// One function the caller offers.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    /// Its name.
    pub name: String,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: the tools are not shown to the model and its text is not parsed.
    None,
    /// The model chooses: text, calls, or both.
    Auto,
    /// At least one call (grammar-enforced).
    Required,
    /// A call of this function (grammar-enforced).
    Named(String),
}

/// A request's tool fields, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// The functions, in order.
    pub functions: Vec<FunctionTool>,
    /// The `tools` list as given, for the template's `tools` variable.
    pub tools: Value,
    /// What the model may or must do.
    pub choice: ToolChoice,
    /// Whether more than one call may come back (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// The longest function name OpenAI takes.
const MAX_NAME_CHARS: usize = 64;

impl ToolRequest {
    /// The tool fields of a chat request (in OpenAI's shape, which the other APIs' tool fields
    /// are translated into); `None` when it offers no tools and chooses none.
    ///
    /// # Errors
    /// A 400 naming `tools` or `tool_choice`: a tool that is not a function with a name and
    /// an object schema, two tools of one name, a choice naming no offered function, or
    /// `required` / a named function without tools.
    pub fn from_values(
        tools: Option<Value>,
        tool_choice: Option<Value>,
        parallel_tool_calls: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or(Value::Null);
        let functions = match &tools {
            Value::Null => Vec::new(),
            Value::Array(list) => list
                .iter()
                .enumerate()
                .map(|(i, tool)| function_tool(i, tool))
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err(ApiError::invalid_field("tools", "tools must be a list")),
        };
        for (i, f) in functions.iter().enumerate() {
            if functions[..i].iter().any(|g| g.name == f.name) {
                return Err(ApiError::invalid_field(
                    &format!("tools[{i}].function.name"),
                    format!("two tools are named {:?}", f.name),
                ));
            }
        }
        let choice = match tool_choice {
            None => None,
            Some(value) => parse_choice(&value, &functions)?,
        };
        let choice = match (choice, functions.is_empty()) {
            (None, true) => return Ok(None),
            (None, false) => ToolChoice::Auto,
            (Some(ToolChoice::None | ToolChoice::Auto), true) => return Ok(None),
            (Some(c), _) => c,
        };
        Ok(Some(Self {
            functions,
            tools,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// Whether the output must be calls.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The functions a call may name (a named choice: that one).
    fn callable(&self) -> Vec<&FunctionTool> {
        match &self.choice {
            ToolChoice::Named(name) => self.functions.iter().filter(|f| &f.name == name).collect(),
            _ => self.functions.iter().collect(),
        }
    }

    /// The generic JSON shape's schema: one `tool_call` (or, parallel, a `tool_calls` list),
    /// each naming a callable function with arguments valid under its schema; `or_response`
    /// adds `{"response": "..."}` (llama.cpp's `common_chat_params_init_generic`).
    fn generic_schema(&self, or_response: bool) -> Value {
        let calls: Vec<Value> = self
            .callable()
            .into_iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": f.name},
                        "arguments": f.parameters,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let call = if calls.len() == 1 {
            calls[0].clone()
        } else {
            json!({"anyOf": calls})
        };
        let calls_schema = if self.parallel {
            json!({
                "type": "object",
                "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                "required": ["tool_calls"],
                "additionalProperties": false,
            })
        } else {
            json!({
                "type": "object",
                "properties": {"tool_call": call},
                "required": ["tool_call"],
                "additionalProperties": false,
            })
        };
        if !or_response {
            return calls_schema;
        }
        json!({"anyOf": [
            calls_schema,
            {
                "type": "object",
                "properties": {"response": {"type": "string"}},
                "required": ["response"],
                "additionalProperties": false,
            },
        ]})
    }
}

/// `tools[i]`: `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
fn function_tool(i: usize, tool: &Value) -> Result<FunctionTool, ApiError> {
    let field = |rest: &str| format!("tools[{i}]{rest}");
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid_field(
            &field(".type"),
            format!(
                "{}: only tools of type \"function\" are supported",
                field(".type")
            ),
        ));
    }
    let Some(function) = tool.get("function").filter(|f| f.is_object()) else {
        return Err(ApiError::invalid_field(
            &field(".function"),
            format!("{} must be an object", field(".function")),
        ));
    };
    let name = function.get("name").and_then(Value::as_str).unwrap_or("");
    let name_ok = !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if !name_ok {
        return Err(ApiError::invalid_field(
            &field(".function.name"),
            format!(
                "{}: a function needs a name of 1 to {MAX_NAME_CHARS} letters, digits, \
                 underscores, dashes or dots",
                field(".function.name")
            ),
        ));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema) if schema.get("type").and_then(Value::as_str) == Some("object") => {
            schema.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                &field(".function.parameters"),
                format!(
                    "{}: the parameters must be a JSON schema of \"type\": \"object\"",
                    field(".function.parameters")
                ),
            ));
        }
    };
    Ok(FunctionTool {
        name: name.to_string(),
        parameters,
    })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or
/// `{"type": "function", "function": {"name": ...}}` naming one of `functions`.
fn parse_choice(value: &Value, functions: &[FunctionTool]) -> Result<Option<ToolChoice>, ApiError> {
    const FIELD: &str = "tool_choice";
    let choice = match value {
        Value::Null => return Ok(None),
        Value::String(s) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid_field(
                    FIELD,
                    format!(
                        "tool_choice {other:?}: expected \"none\", \"auto\", \"required\" or \
                         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                    ),
                ));
            }
        },
        Value::Object(_) => {
            let name = value
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (value.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Named(name.to_string()),
                _ => {
                    return Err(ApiError::invalid_field(
                        FIELD,
                        "tool_choice as an object is {\"type\": \"function\", \"function\": \
                         {\"name\": ...}}",
                    ));
                }
            }
        }
        _ => {
            return Err(ApiError::invalid_field(
                FIELD,
                "tool_choice must be a string or an object",
            ));
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if functions.is_empty() => {
            Err(ApiError::invalid_field(
                FIELD,
                "tool_choice asks for a tool call, but the request offers no tools",
            ))
        }
        ToolChoice::Named(name) if !functions.iter().any(|f| &f.name == name) => {
            Err(ApiError::invalid_field(
                FIELD,
                format!("tool_choice names {name:?}, which is not one of the tools"),
            ))
        }
        _ => Ok(Some(choice)),
    }
}

/// What tool calling changes in one chat request: the template's variables, a system message
/// for the generic format, the output's grammar, and how the output is read.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPlan {
    /// The parser of the output (`None`: the text is content).
    pub format: Option<ToolFormat>,
    /// Whether the output is the generic JSON shape (forced, or the generic format).
    pub generic_output: bool,
    /// At most one call.
    pub single: bool,
}

impl ToolPlan {
    /// No tool calling: the text is content.
    pub fn off() -> Self {
        Self {
            format: None,
            generic_output: false,
            single: false,
        }
    }
}

/// The text the generic format adds to the system message (llama.cpp's sentence, and the tools
/// described as minja's polyfill for templates without tools describes them).
pub fn generic_system_text(request: &ToolRequest) -> String {
    let mut tools = String::new();
    write_pretty(&request.tools, &mut tools);
    let example = if request.parallel {
        "{\n  \"tool_calls\": [\n    {\n      \"name\": \"tool_name\",\n      \"arguments\": {\n        \"arg1\": \"some_value\"\n      }\n    }\n  ]\n}"
    } else {
        "{\n  \"tool_call\": {\n    \"name\": \"tool_name\",\n    \"arguments\": {\n      \"arg1\": \"some_value\"\n    }\n  }\n}"
    };
    format!(
        "Respond in JSON format, either with `tool_call` (a request to call tools) or with \
         `response` reply to the user's request\n\nYou can call any of the following tools to \
         satisfy the user's requests: {tools}\n\nExample tool call syntax:\n\n{example}"
    )
}

fn write_pretty(value: &Value, out: &mut String) {
    out.push_str(&serde_json::to_string_pretty(value).unwrap_or_default());
}

/// Plans a chat request's tool calling on a server speaking `format` (`None`: off): the
/// template variables to add (`tools`), the constraint for the output, and the parser.
///
/// # Errors
/// A 400: tools asked of a server with tool calling off, or a tool grammar beside another
/// constraint (`response_format`, `regex`, `grammar`).
pub fn plan(
    request: Option<&ToolRequest>,
    format: Option<ToolFormat>,
    variables: &mut Map<String, Value>,
    constraint: &mut Option<(&'static str, OutputConstraint)>,
) -> Result<ToolPlan, ApiError> {
    let Some(request) = request.filter(|r| r.choice != ToolChoice::None) else {
        return Ok(ToolPlan::off());
    };
    let Some(format) = format else {
        return Err(ApiError::invalid_field(
            "tools",
            "tool calling is off on this server (kiln serve --tool-parser none)",
        ));
    };
    if format.template_renders_tools() {
        variables.insert("tools".into(), request.tools.clone());
    }
    let generic_output = request.forced() || format == ToolFormat::Generic;
    if generic_output {
        if let Some((field, _)) = constraint {
            return Err(ApiError::invalid_field(
                field,
                format!(
                    "{field} and tools both constrain the output here (tool_choice {}, tool \
                     format {}); give one",
                    if request.forced() {
                        "forces a call"
                    } else {
                        "auto"
                    },
                    format.name()
                ),
            ));
        }
        let schema = request.generic_schema(!request.forced());
        *constraint = Some(("tool_choice", OutputConstraint::JsonSchema(schema)));
    }
    Ok(ToolPlan {
        format: Some(format),
        generic_output,
        single: !request.parallel,
    })
}

/// How [`conversation`] writes tool turns for the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolTurns<'a> {
    /// As the template renders them: [`Role::Tool`] turns and the assistant's `tool_calls`.
    Native,
    /// For a template that knows no tools (the generic format): calls as the assistant's JSON
    /// text, results as user turns of JSON, as minja's polyfills write them; and, when the
    /// request offers tools, this system text first (appended to a system message, or as one).
    AsText(Option<&'a str>),
}

/// The conversation as the template takes it: tool results as [`Role::Tool`] turns, an
/// assistant's `tool_calls` with their arguments parsed, or both written as text
/// ([`ToolTurns`]).
///
/// # Errors
/// A 400 naming the message at fault: an unknown role, a call whose arguments are not a JSON
/// object, a tool message without `tool_call_id`.
pub fn conversation(
    messages: &[Message],
    tool_turns: ToolTurns<'_>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut turns = Vec::with_capacity(messages.len() + 1);
    // The calls made so far: a tool message without a name is named after its call.
    let mut called: Vec<(&str, &str)> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        called.extend(
            m.tool_calls
                .iter()
                .flatten()
                .filter_map(|c| Some((c.id.as_deref()?, c.function.name.as_str()))),
        );
        let content = match &m.content {
            Some(c) => c.text()?,
            None => String::new(),
        };
        let turn = match m.role.as_str() {
            "system" | "developer" => ChatMessage::new(Role::System, content),
            "user" => ChatMessage::new(Role::User, content),
            "assistant" => match &m.tool_calls {
                Some(calls) if !calls.is_empty() => {
                    ChatMessage::tool_calls(content, tool_calls(i, calls)?)
                }
                _ => ChatMessage::new(Role::Assistant, content),
            },
            "tool" => {
                let Some(id) = &m.tool_call_id else {
                    return Err(ApiError::invalid_field(
                        &format!("messages[{i}].tool_call_id"),
                        format!("messages[{i}]: a tool message needs its tool_call_id"),
                    ));
                };
                let name = m.name.clone().or_else(|| {
                    called
                        .iter()
                        .find(|(call, _)| call == id)
                        .map(|(_, name)| name.to_string())
                });
                ChatMessage::tool_result(id.clone(), name, content)
            }
            other => {
                return Err(ApiError::invalid_field(
                    &format!("messages[{i}].role"),
                    format!(
                        "role {other:?} is not supported: use system, developer, user, \
                         assistant or tool"
                    ),
                ));
            }
        };
        turns.push(turn);
    }
    if let ToolTurns::AsText(system_text) = tool_turns {
        turns = polyfill(turns, system_text);
    }
    Ok(turns)
}

/// The calls of `messages[i]`, their arguments parsed from OpenAI's JSON string.
fn tool_calls(i: usize, calls: &[crate::api::MessageToolCall]) -> Result<Vec<ToolCall>, ApiError> {
    calls
        .iter()
        .enumerate()
        .map(|(k, call)| {
            let field = format!("messages[{i}].tool_calls[{k}].function.arguments");
            let arguments = match &call.function.arguments {
                None => Value::Object(Map::new()),
                Some(text) if text.trim().is_empty() => Value::Object(Map::new()),
                Some(text) => serde_json::from_str(text).map_err(|e| {
                    ApiError::invalid_field(&field, format!("{field} is not JSON: {e}"))
                })?,
            };
            if !arguments.is_object() {
                return Err(ApiError::invalid_field(
                    &field,
                    format!("{field} must be a JSON object"),
                ));
            }
            Ok(ToolCall {
                id: call.id.clone().unwrap_or_default(),
                name: call.function.name.clone(),
                arguments,
            })
        })
        .collect()
}

/// The generic format's turns for a template without tools: `system_text` (if any) in the
/// system message, calls and results written out as JSON text.
fn polyfill(turns: Vec<ChatMessage>, system_text: Option<&str>) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(turns.len() + 1);
    let mut skip = 0;
    if let Some(system_text) = system_text {
        match turns.first() {
            Some(first) if first.role == Role::System => {
                let content = if first.content.is_empty() {
                    system_text.to_string()
                } else {
                    format!("{}\n\n{system_text}", first.content)
                };
                out.push(ChatMessage::new(Role::System, content));
            }
            _ => out.push(ChatMessage::new(Role::System, system_text)),
        }
        skip = usize::from(turns.first().is_some_and(|t| t.role == Role::System));
    }
    for turn in turns.into_iter().skip(skip) {
        out.push(match turn.role {
            Role::Assistant if !turn.tool_calls.is_empty() => {
                let calls: Vec<Value> = turn
                    .tool_calls
                    .iter()
                    .map(|c| json!({"name": c.name, "arguments": c.arguments, "id": c.id}))
                    .collect();
                let body = if calls.len() == 1 {
                    json!({"tool_call": calls[0]})
                } else {
                    json!({"tool_calls": calls})
                };
                ChatMessage::new(Role::Assistant, pretty(&body))
            }
            Role::Tool => {
                let body = json!({"tool_response": {
                    "tool": turn.name.clone().unwrap_or_default(),
                    "content": turn.content,
                    "tool_call_id": turn.tool_call_id.clone().unwrap_or_default(),
                }});
                ChatMessage::new(Role::User, pretty(&body))
            }
            _ => turn,
        });
    }
    out
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// One call read from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// The function's name, as the model wrote it.
    pub name: String,
    /// Its arguments, JSON text of an object.
    pub arguments: String,
}

/// The output read: its text (what is not calls) and its calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Parsed {
    /// Text for `message.content` (`None` when there is none).
    pub content: Option<String>,
    /// The calls, in order.
    pub calls: Vec<ParsedCall>,
}

impl Parsed {
    /// All of `text` as content, no calls (what an output that does not parse gives, as vLLM's
    /// parsers do).
    fn text(text: &str) -> Self {
        Self {
            content: Some(text.to_string()),
            calls: Vec::new(),
        }
    }
}

/// A call from a JSON object with `name` and its arguments under one of `argument_keys`
/// (an object, or a JSON string of one); `None` when it is not such an object.
fn call_from(value: &Value, argument_keys: &[&str]) -> Option<ParsedCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = argument_keys
        .iter()
        .find_map(|k| value.get(*k))
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()));
    let arguments = match arguments {
        Value::Object(_) => arguments,
        Value::String(text) => serde_json::from_str::<Value>(&text)
            .ok()
            .filter(Value::is_object)?,
        _ => return None,
    };
    Some(ParsedCall {
        name,
        arguments: serde_json::to_string(&arguments).ok()?,
    })
}

/// `text` read as the plan says: content and calls (at most one when the plan says so).
pub fn parse(plan: &ToolPlan, text: &str) -> Parsed {
    let Some(format) = plan.format else {
        return Parsed::text(text);
    };
    let mut parsed = if plan.generic_output {
        generic::parse(text)
    } else {
        match format {
            ToolFormat::Hermes => hermes::parse(text),
            ToolFormat::Llama3 => llama3::parse(text),
            ToolFormat::Mistral => mistral::parse(text),
            ToolFormat::Generic => generic::parse(text),
        }
    };
    if plan.single {
        parsed.calls.truncate(1);
    }
    parsed
}

/// The id of call `k` of choice `choice` of the response `response_id`: `call_` and 24 hex
/// digits, or, for Mistral's templates (which refuse others), 9 letters and digits.
pub fn call_id(format: Option<ToolFormat>, response_id: &str, choice: usize, k: usize) -> String {
    // FNV-1a over the response id and the call's place: unique per response, as the response
    // id is per server.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in response_id
        .bytes()
        .chain(choice.to_le_bytes())
        .chain(k.to_le_bytes())
    {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    if format == Some(ToolFormat::Mistral) {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        let mut id = String::with_capacity(9);
        let mut h = hash;
        for _ in 0..9 {
            id.push(char::from(ALPHABET[(h % 62) as usize]));
            h /= 62;
            if h == 0 {
                h = hash.rotate_left(17) | 1;
            }
        }
        return id;
    }
    let counter = response_id.len().saturating_sub(8);
    let tail = response_id.get(counter..).unwrap_or_default();
    format!("call_{hash:016x}{tail}")
}
