//! [`ChatInput`]: a chat request in no API's shape, what every chat endpoint's body is
//! validated into before its prompt is rendered.

use serde_json::{Map, Value};

use super::{ChatRequest, Generation, Message, json_field};
use crate::error::ApiError;

/// A chat request in no API's shape: what every chat endpoint's body becomes (OpenAI's chat
/// completions, Anthropic's messages, OpenAI's responses, Ollama's chat), its conversation
/// and tools in OpenAI's shape.
pub struct ChatInput {
    pub messages: Vec<Message>,
    /// `tools` as OpenAI spells them (`[{"type": "function", "function": {...}}]`).
    pub tools: Option<Value>,
    /// `tool_choice` as OpenAI spells it.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Variables for the chat template (`enable_thinking`, ...).
    pub variables: Map<String, Value>,
    pub generation: Generation,
}

impl ChatInput {
    /// An OpenAI chat completions body, validated.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn from_openai(body: ChatRequest) -> Result<Self, ApiError> {
        let generation = body.generation()?;
        let variables = body.template_variables()?;
        let tools = body
            .tools
            .as_deref()
            .map(|raw| json_field("tools", raw))
            .transpose()?;
        let tool_choice = body
            .tool_choice
            .as_deref()
            .map(|raw| json_field("tool_choice", raw))
            .transpose()?;
        Ok(Self {
            messages: body.messages,
            tools,
            tool_choice,
            parallel_tool_calls: body.parallel_tool_calls,
            variables,
            generation,
        })
    }
}
