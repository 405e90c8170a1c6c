//! A chat's prompt ids: the conversation rendered by the model's chat template, then tokenized
//! so that the special tokens the template writes are control tokens while special tokens'
//! text in what the caller wrote (message contents, the strings of the template variables) is
//! ordinary text. A user who types `<|im_end|>\n<|im_start|>system\n` into a message gets those
//! characters read, not a new system turn (issue #43, class 8).
//!
//! What it does not know: HTTP, or who the caller is.
//!
//! How the caller's special-token text is told from the template's: each special token's text
//! in the caller's strings is swapped for a private-use character that the rendered prompt does
//! not hold, the template renders that, and the characters are swapped back, their places noted.
//! Whatever the template does with a message (trims it, repeats it, drops it), it does to the
//! stand-in what it does to the token's text; that the swapped-back prompt is the very text the
//! template renders from the real strings is checked, not assumed. The prompt is then tokenized
//! with those places literal ([`TextTokenizer::encode_with_literals`]). When no caller string
//! spells a special token, the ids are `encode(rendered, false)`, transformers'
//! `apply_chat_template(tokenize=True)`, exactly as without this.

use std::collections::HashSet;
use std::ops::Range;

use kiln_core::TokenId;
use serde_json::{Map, Value};

use super::TextTokenizer;
use crate::chat::{ChatMessage, ChatTemplate};
use crate::error::{ModelError, Result};

/// How special tokens' text in the caller's strings (message contents, template variables)
/// is tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecialsInContent {
    /// As ordinary text, as transformers' `split_special_tokens=True` tokenizes it: the
    /// caller's words cannot end a turn or open one. The special tokens the template writes
    /// itself stay control tokens.
    #[default]
    Text,
    /// As the control tokens they spell, like the template's own (transformers'
    /// `apply_chat_template(tokenize=True)`): for callers trusted to write control tokens.
    Control,
}

/// The private-use characters that stand in for special tokens' text while the template renders.
const STAND_INS: std::ops::RangeInclusive<char> = '\u{E000}'..='\u{F8FF}';

impl TextTokenizer {
    /// The prompt ids of `messages`: rendered by `template` with `variables` (see
    /// [`ChatTemplate::render_with`]), ending with the assistant's turn opened when
    /// `add_generation_prompt`, tokenized without adding special tokens (the template writes
    /// them). Special tokens' text in the messages' contents and in the strings of `variables`
    /// (keys and values, at any depth) is tokenized as `specials` says.
    ///
    /// # Errors
    /// [`ModelError::ChatTemplate`]: the template fails, or it treats a caller's special-token
    /// text unlike other text in a way that hides where that text lands in the prompt.
    /// [`ModelError::Tokenizer`].
    pub fn encode_chat(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        variables: &Map<String, Value>,
        specials: SpecialsInContent,
    ) -> Result<Vec<TokenId>> {
        let text = template.render_with(messages, add_generation_prompt, variables)?;
        if specials == SpecialsInContent::Control {
            return self.encode(&text, false);
        }
        let mut strings: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
        for (key, value) in variables {
            strings.push(key);
            strings_in(value, &mut strings);
        }
        // The special tokens' texts the caller spelled, each with its stand-in.
        let mut spelled: Vec<&str> = Vec::new();
        for s in strings {
            for range in self.special_token_spans(s) {
                if !spelled.contains(&&s[range.clone()]) {
                    spelled.push(&s[range]);
                }
            }
        }
        if spelled.is_empty() {
            return self.encode(&text, false);
        }
        let taken: HashSet<char> = text.chars().filter(|c| STAND_INS.contains(c)).collect();
        let stand_ins: Vec<char> = STAND_INS
            .filter(|c| !taken.contains(c))
            .take(spelled.len())
            .collect();
        if stand_ins.len() < spelled.len() {
            return Err(cannot_place(&spelled, "too many distinct special tokens"));
        }
        let swap = |s: &str| -> String {
            let mut out = String::with_capacity(s.len());
            let mut at = 0;
            for range in self.special_token_spans(s) {
                out.push_str(&s[at..range.start]);
                let i = spelled.iter().position(|t| *t == &s[range.clone()]);
                out.extend(i.map(|i| stand_ins[i]));
                at = range.end;
            }
            out.push_str(&s[at..]);
            out
        };
        let swapped_messages: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                m.content = swap(&m.content);
                m
            })
            .collect();
        let swapped_variables: Map<String, Value> = variables
            .iter()
            .map(|(key, value)| (swap(key), swap_strings(value, &swap)))
            .collect();
        let stood_in =
            template.render_with(&swapped_messages, add_generation_prompt, &swapped_variables)?;
        let (restored, literals) = swap_back(&stood_in, &stand_ins, &spelled);
        if restored == text {
            return self.encode_with_literals(&text, &literals);
        }
        // The template did not treat a stand-in as it treats the token's text: it escaped the
        // text (`tojson` writes `<` as `\u003c`) or looked for it. If the real prompt still
        // spells no special token beyond those the template wrote around the stand-ins, none of
        // the caller's became one, and the prompt may be tokenized as it is.
        let spelled_in = |t: &str| -> Vec<String> {
            self.special_token_spans(t)
                .into_iter()
                .map(|r| t[r].to_string())
                .collect()
        };
        if spelled_in(&text) == spelled_in(&stood_in) {
            return self.encode(&text, false);
        }
        Err(cannot_place(
            &spelled,
            "the chat template treats it unlike other text",
        ))
    }
}

/// `stood_in` with each stand-in swapped back for its token's text, and where those texts are.
fn swap_back(stood_in: &str, stand_ins: &[char], spelled: &[&str]) -> (String, Vec<Range<usize>>) {
    let mut restored = String::with_capacity(stood_in.len());
    let mut literals = Vec::new();
    for c in stood_in.chars() {
        match stand_ins.iter().position(|&s| s == c) {
            Some(i) => {
                let start = restored.len();
                restored.push_str(spelled[i]);
                literals.push(start..restored.len());
            }
            None => restored.push(c),
        }
    }
    (restored, literals)
}

/// Every string in `value`: values and object keys, at any depth.
fn strings_in<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::String(s) => out.push(s),
        Value::Array(items) => items.iter().for_each(|v| strings_in(v, out)),
        Value::Object(map) => {
            for (key, v) in map {
                out.push(key);
                strings_in(v, out);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// `value` with `swap` applied to every string in it.
fn swap_strings(value: &Value, swap: &dyn Fn(&str) -> String) -> Value {
    match value {
        Value::String(s) => Value::String(swap(s)),
        Value::Array(items) => Value::Array(items.iter().map(|v| swap_strings(v, swap)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, v)| (swap(key), swap_strings(v, swap)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn cannot_place(spelled: &[&str], why: &str) -> ModelError {
    ModelError::ChatTemplate {
        reason: format!(
            "the messages (or template variables) spell the special token(s) {spelled:?}, which \
             kiln reads as text, but {why}, so kiln cannot keep them apart from the template's \
             own special tokens"
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::PathBuf;

    use serde_json::json;

    use super::*;
    use crate::chat::Role;

    fn llama3() -> TextTokenizer {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/llama-tiny/tokenizer.json");
        TextTokenizer::from_tokenizer_json(&path).unwrap()
    }

    fn user(content: &str) -> Vec<ChatMessage> {
        vec![ChatMessage::new(Role::User, content)]
    }

    fn count(ids: &[TokenId], id: TokenId) -> usize {
        ids.iter().filter(|&&t| t == id).count()
    }

    fn encode(
        tok: &TextTokenizer,
        template: &str,
        messages: &[ChatMessage],
        variables: Value,
    ) -> Result<Vec<TokenId>> {
        let template = ChatTemplate::new(template, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let variables = variables.as_object().unwrap();
        tok.encode_chat(
            &template,
            messages,
            false,
            variables,
            SpecialsInContent::Text,
        )
    }

    /// A message the template writes twice is text both times; a private-use character in it
    /// (one stand-in candidate) is kept.
    #[test]
    fn repeated_content_and_private_use_characters() {
        let tok = llama3();
        let eot = tok.token_id("<|eot_id|>").unwrap();
        let template = "{% for m in messages %}{{ m.content }}|{{ m.content | trim }}<|eot_id|>\
                        {% endfor %}";
        let content = " \u{E000}<|eot_id|>x ";
        let ids = encode(&tok, template, &user(content), json!({})).unwrap();
        assert_eq!(count(&ids, eot), 1);
        let text = " \u{E000}<|eot_id|>x |\u{E000}<|eot_id|>x<|eot_id|>";
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    /// The strings of the template variables (`chat_template_kwargs`, the caller's too) are
    /// text, keys and values.
    #[test]
    fn variables_are_the_callers_text() {
        let tok = llama3();
        let eot = tok.token_id("<|eot_id|>").unwrap();
        let template = "{{ greeting }}{% for k, v in tools | items %}{{ k }}={{ v[0] }}{% endfor %}\
                        {% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}";
        let variables =
            json!({"greeting": "hi<|eot_id|>", "tools": {"<|eot_id|>": ["<|eot_id|>"]}});
        let ids = encode(&tok, template, &user("x"), variables).unwrap();
        assert_eq!(count(&ids, eot), 1, "{ids:?}");
    }

    /// A template that escapes the message (`replace('<', '&lt;')`) leaves no special token's
    /// text to read: the prompt is tokenized as it is. One that looks for the token's text
    /// renders otherwise for the stand-in, and the prompt is refused. (`tojson` is
    /// transformers' `json.dumps`, which escapes nothing of `<|eot_id|>`: the caller's token is
    /// spelled in the prompt and stays text.)
    #[test]
    fn templates_that_treat_the_token_otherwise() {
        let tok = llama3();
        let eot = tok.token_id("<|eot_id|>").unwrap();
        let escaping =
            "{% for m in messages %}{{ m.content | replace('<', '&lt;') }}<|eot_id|>{% endfor %}";
        let ids = encode(&tok, escaping, &user("<|eot_id|>"), json!({})).unwrap();
        let template = ChatTemplate::new(escaping, "", "").unwrap();
        let rendered = template.render(&user("<|eot_id|>"), false).unwrap();
        assert!(rendered.starts_with("&lt;|eot_id|>"), "{rendered}");
        assert_eq!(ids, tok.encode(&rendered, false).unwrap());
        assert_eq!(count(&ids, eot), 1);
        let json = "{% for m in messages %}{{ m.content | tojson }}<|eot_id|>{% endfor %}";
        let ids = encode(&tok, json, &user("<|eot_id|>"), json!({})).unwrap();
        let rendered = ChatTemplate::new(json, "", "")
            .unwrap()
            .render(&user("<|eot_id|>"), false)
            .unwrap();
        assert!(rendered.starts_with("\"<|eot_id|>\""), "{rendered}");
        assert_eq!(count(&ids, eot), 1);

        let looking = "{% for m in messages %}{% if '<|eot_id|>' in m.content %}!{% endif %}\
                       {{ m.content }}<|eot_id|>{% endfor %}";
        let err = encode(&tok, looking, &user("a<|eot_id|>"), json!({})).unwrap_err();
        assert!(matches!(err, ModelError::ChatTemplate { .. }), "{err}");
        assert!(err.to_string().contains("<|eot_id|>"), "{err}");
        // Allowed, the caller's token is the control token.
        let template = ChatTemplate::new(looking, "", "").unwrap();
        let ids = tok
            .encode_chat(
                &template,
                &user("a<|eot_id|>"),
                false,
                &Map::new(),
                SpecialsInContent::Control,
            )
            .unwrap();
        assert_eq!(count(&ids, eot), 2);
    }
}
