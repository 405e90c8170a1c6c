//! Text in and out of token ids for the HTTP handlers: chat messages through the model's chat
//! template, completion prompts, and the per-token strings that log-probabilities report.

use kiln_core::TokenId;
use kiln_models::TextTokenizer;
use kiln_models::chat::{ChatMessage, ChatTemplate, Role};

use crate::api::Message;
use crate::error::ApiError;

/// The model's tokenizer and chat template.
pub struct Codec {
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
}

impl Codec {
    /// A codec over `tokenizer`, with the Jinja chat template `template` (none: the chat
    /// endpoint answers 400).
    ///
    /// # Errors
    /// A template that does not compile.
    pub fn new(
        tokenizer: TextTokenizer,
        template: Option<&str>,
        bos: Option<TokenId>,
        eos: Option<TokenId>,
    ) -> Result<Self, kiln_models::ModelError> {
        let text = |id: Option<TokenId>| {
            id.and_then(|id| tokenizer.inner().id_to_token(id.0))
                .unwrap_or_default()
        };
        let template = match template {
            Some(source) => Some(ChatTemplate::new(source, &text(bos), &text(eos))?),
            None => None,
        };
        Ok(Self {
            tokenizer,
            template,
        })
    }

    /// The prompt of a chat: the messages rendered with the generation prompt, then tokenized
    /// without adding special tokens (the template writes them).
    ///
    /// `variables` go to the template beside the messages (`chat_template_kwargs`).
    ///
    /// # Errors
    /// 400 for an unknown role, a non-text part, no template, or a template that fails.
    pub fn chat_prompt(
        &self,
        messages: &[Message],
        variables: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<TokenId>, ApiError> {
        let Some(template) = &self.template else {
            return Err(ApiError::invalid(
                "this model has no chat template: use /v1/completions",
            ));
        };
        if messages.is_empty() {
            return Err(ApiError::invalid_field("messages", "messages is empty"));
        }
        let mut turns = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let role = match m.role.as_str() {
                "system" | "developer" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                other => {
                    return Err(ApiError::invalid_field(
                        &format!("messages[{i}].role"),
                        format!(
                            "role {other:?} is not supported: use system, developer, user or assistant"
                        ),
                    ));
                }
            };
            let content = match &m.content {
                Some(c) => c.text()?,
                None => String::new(),
            };
            turns.push(ChatMessage::new(role, content));
        }
        let text = template.render_with(&turns, true, variables).map_err(|e| {
            let field = if e.to_string().contains("is set by kiln") {
                "chat_template_kwargs"
            } else {
                "messages"
            };
            ApiError::invalid_field(field, e.to_string())
        })?;
        self.encode(&text, false)
    }

    /// `text`'s ids, with the tokenizer's special tokens (BOS) when `add_special`.
    ///
    /// # Errors
    /// 400 if the tokenizer fails.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<TokenId>, ApiError> {
        self.tokenizer
            .encode(text, add_special)
            .map_err(|e| ApiError::invalid(format!("tokenizing the prompt: {e}")))
    }

    /// The text of `ids`, special tokens skipped (what the completions return).
    pub fn decode(&self, ids: &[TokenId]) -> Option<String> {
        self.tokenizer.decode(ids, true).ok()
    }

    /// The text of `ids` with special tokens written out (`/detokenize`).
    ///
    /// # Errors
    /// 400 for ids outside the vocabulary.
    pub fn decode_all(&self, ids: &[TokenId]) -> Result<String, ApiError> {
        let vocab = self.tokenizer.vocab_size();
        if let Some(t) = ids.iter().find(|t| t.0 as usize >= vocab) {
            return Err(ApiError::invalid_field(
                "tokens",
                format!("token id {t} is outside the vocabulary of {vocab}"),
            ));
        }
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| ApiError::invalid(format!("decoding the tokens: {e}")))
    }

    /// One token's text, as log-probabilities report it (its UTF-8 bytes go with it; a token
    /// that is part of a character reads as U+FFFD).
    pub fn token_text(&self, id: TokenId) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }
}
