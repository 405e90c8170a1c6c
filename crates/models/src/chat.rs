//! Chat templates: a conversation ([`ChatMessage`]s) rendered into prompt text by the model's
//! own Jinja template ([`ChatTemplate`]), as transformers' `apply_chat_template` does: the same
//! Jinja dialect (with Python string methods such as `.strip()`), `trim_blocks` and
//! `lstrip_blocks`, transformers' `tojson` (Python's `json.dumps`), and the variables
//! `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.
//!
//! Tool calling: messages carry an assistant's `tool_calls` and a tool's result
//! ([`Role::Tool`], with `tool_call_id` and `name`) as transformers passes them to templates
//! (each call `{"id", "type": "function", "function": {"name", "arguments"}}` with the
//! arguments an object, not OpenAI's JSON string); the tools themselves are the template
//! variable `tools` ([`ChatTemplate::render_with`]). JSON objects keep their keys' order.
//!
//! Meta's checkpoints carry no template; they use [`crate::loaders::LLAMA3_CHAT_TEMPLATE`].

mod template_json;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Serialize;

use crate::error::{ModelError, Result};
use template_json::{ordered, to_template};

/// Who said it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions.
    System,
    /// The person.
    User,
    /// The model.
    Assistant,
    /// A tool's result, answering one of the assistant's `tool_calls`.
    Tool,
}

impl Role {
    /// The role's name in templates.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who.
    pub role: Role,
    /// What. An assistant turn that only calls tools has none: the template sees `none` when
    /// this is empty and `tool_calls` is not (OpenAI's `"content": null`).
    pub content: String,
    /// The tools an assistant's turn calls; the template sees no `tool_calls` key when empty
    /// (templates test `'tool_calls' in message`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// One function call of an assistant's turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    /// The call's id (`call_…`), which the tool's result names.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON (an object; templates write it with `tojson` or walk its items).
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// An assistant's turn calling `calls` (with `content`, often empty, before them).
    pub fn tool_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        Self {
            tool_calls: calls,
            ..Self::new(Role::Assistant, content)
        }
    }

    /// A tool's result for the call `tool_call_id` of the function `name`.
    pub fn tool_result(
        tool_call_id: impl Into<String>,
        name: Option<String>,
        content: impl Into<String>,
    ) -> Self {
        Self {
            tool_call_id: Some(tool_call_id.into()),
            name,
            ..Self::new(Role::Tool, content)
        }
    }

    /// The message as transformers hands it to a template: `role`, `content`, and only the
    /// tool keys it has.
    fn to_template(&self) -> Value {
        let content = if self.content.is_empty() && !self.tool_calls.is_empty() {
            Value::from(())
        } else {
            Value::from(self.content.as_str())
        };
        let mut entries = vec![
            ("role".to_string(), Value::from(self.role.name())),
            ("content".to_string(), content),
        ];
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.iter().map(|call| {
                let function = ordered(vec![
                    ("name".to_string(), Value::from(call.name.as_str())),
                    ("arguments".to_string(), to_template(&call.arguments)),
                ]);
                ordered(vec![
                    ("id".to_string(), Value::from(call.id.as_str())),
                    ("type".to_string(), Value::from("function")),
                    ("function".to_string(), function),
                ])
            });
            entries.push((
                "tool_calls".to_string(),
                Value::from(calls.collect::<Vec<_>>()),
            ));
        }
        if let Some(id) = &self.tool_call_id {
            entries.push(("tool_call_id".to_string(), Value::from(id.as_str())));
        }
        if let Some(name) = &self.name {
            entries.push(("name".to_string(), Value::from(name.as_str())));
        }
        ordered(entries)
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts templates may insert.
    ///
    /// # Errors
    /// [`ModelError::ChatTemplate`] when the template does not parse.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers' own: Python's json.dumps, keys in order, nothing HTML-escaped.
        env.add_filter("tojson", template_json::tojson);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| {
            strftime_utc(&format, now_unix())
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(template_error)?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The prompt text of `messages`, ending with the opening of the assistant's turn when
    /// `add_generation_prompt`. Encode it without adding special tokens: the template writes
    /// them itself.
    ///
    /// # Errors
    /// [`ModelError::ChatTemplate`] when rendering fails (including the template's own
    /// `raise_exception`, e.g. for roles out of order).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// [`Self::render`] with more variables for the template (transformers'
    /// `apply_chat_template(**kwargs)`, vLLM's `chat_template_kwargs`): Qwen3's
    /// `enable_thinking`, for one, or `tools` (a list of OpenAI function tools,
    /// `apply_chat_template(tools=...)`). Objects keep their keys' order.
    ///
    /// # Errors
    /// As [`Self::render`], and a variable named as one kiln sets (`messages`,
    /// `add_generation_prompt`, `bos_token`, `eos_token`).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        variables: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        const RESERVED: [&str; 4] = [
            "messages",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        if let Some(name) = variables.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(ModelError::ChatTemplate {
                reason: format!("the template variable `{name}` is set by kiln, not by the caller"),
            });
        }
        let template = self.env.get_template(NAME).map_err(template_error)?;
        let messages: Vec<Value> = messages.iter().map(ChatMessage::to_template).collect();
        let mut context = vec![
            ("messages".to_string(), Value::from(messages)),
            (
                "add_generation_prompt".to_string(),
                Value::from(add_generation_prompt),
            ),
            (
                "bos_token".to_string(),
                Value::from(self.bos_token.as_str()),
            ),
            (
                "eos_token".to_string(),
                Value::from(self.eos_token.as_str()),
            ),
        ];
        context.extend(variables.iter().map(|(k, v)| (k.clone(), to_template(v))));
        template.render(ordered(context)).map_err(template_error)
    }
}

fn template_error(e: JinjaError) -> ModelError {
    let mut reason = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(inner) = source {
        reason.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    ModelError::ChatTemplate { reason }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The UTC date `(year, month 1-12, day 1-31)` of a day counted from 1970-01-01 (Howard
/// Hinnant's days-to-civil, no date crate needed).
pub fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The few `strftime` fields chat templates use (`%d %b %Y` in Llama 3.1's), in UTC.
fn strftime_utc(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let (year, month, day) = civil_date(unix.div_euclid(86_400));
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loaders::LLAMA3_CHAT_TEMPLATE;

    #[test]
    fn llama3_template_writes_metas_chat_format() {
        let template =
            ChatTemplate::new(LLAMA3_CHAT_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let text = template
            .render(
                &[
                    ChatMessage::new(Role::System, "Be brief. "),
                    ChatMessage::new(Role::User, "Hi"),
                ],
                true,
            )
            .unwrap();
        // Meta's `ChatFormat.encode_dialog_prompt`, written out.
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_is_a_template_error() {
        let template = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let err = template
            .render(&[ChatMessage::new(Role::Assistant, "x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let template =
            ChatTemplate::new("{{ messages[0].content.strip().upper() }}", "", "").unwrap();
        let text = template
            .render(&[ChatMessage::new(Role::User, "  hi ")], false)
            .unwrap();
        assert_eq!(text, "HI");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-23 00:00:00 UTC
        assert_eq!(strftime_utc("%d %b %Y", 1_721_692_800), "23 Jul 2024");
        assert_eq!(strftime_utc("%B %m %%", 0), "January 01 %");
    }
}
