//! Llama-3's chat format (Meta's `ChatFormat`): each message as
//! `<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>` after
//! `<|begin_of_text|>`, then an open assistant header. Jinja templates from
//! `tokenizer_config.json` are rendered by the chat command; this is the format Meta's own
//! checkpoints (which carry no template) use.

/// Who said it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Instructions.
    System,
    /// The person.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role's name in the header.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// Who.
    pub role: Role,
    /// What.
    pub content: String,
}

/// The prompt text of `messages` in Llama-3's format, ending with an open assistant header
/// when `add_generation_prompt`. Encode it without adding special tokens: it starts with
/// `<|begin_of_text|>` itself.
pub fn format_llama3(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut text = String::from("<|begin_of_text|>");
    for m in messages {
        text.push_str("<|start_header_id|>");
        text.push_str(m.role.name());
        text.push_str("<|end_header_id|>\n\n");
        text.push_str(m.content.trim());
        text.push_str("<|eot_id|>");
    }
    if add_generation_prompt {
        text.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
    }
    text
}
