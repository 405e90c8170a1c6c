//! Chat templates: a conversation ([`ChatMessage`]s) rendered into prompt text by the model's
//! own Jinja template ([`ChatTemplate`]), as transformers' `apply_chat_template` does: the same
//! Jinja dialect (with Python string methods such as `.strip()`), `trim_blocks` and
//! `lstrip_blocks`, and the variables `messages`, `add_generation_prompt`, `bos_token` and
//! `eos_token`.
//!
//! Meta's checkpoints carry no template; they use [`crate::loaders::LLAMA3_CHAT_TEMPLATE`].

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde::Serialize;

use crate::error::{ModelError, Result};

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
}

impl Role {
    /// The role's name in templates.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who.
    pub role: Role,
    /// What.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
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
    /// `enable_thinking`, for one.
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
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                ..minijinja::Value::from_serialize(variables),
            })
            .map_err(template_error)
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
    // Howard Hinnant's days-to-civil.
    let days = unix.div_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
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
