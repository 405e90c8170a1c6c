//! The OpenAI request bodies kiln reads, their validation into what the engine runs
//! ([`Generation`]), and the response bodies it writes ([`response`]).
//!
//! Unknown fields are ignored (clients send many: `user`, `store`, `metadata`, ...), `null`
//! means "not given", and every value out of range is a 400 naming its field.
//!
//! Parsing takes memory in proportion to the body: unknown fields are skipped without being
//! kept (no `#[serde(flatten)]`, which buffers every field it does not know; the common fields
//! are a second pass over the same bytes), the fields that take several forms are read by
//! visitors of their own (`de.rs`; serde's untagged enums buffer the value first), lists stop
//! at their limit, and free-form JSON (a schema, template variables) is kept as text up to
//! [`MAX_JSON_FIELD_BYTES`] before it is parsed.
//!
//! - `mod.rs`: the request types, [`parse`] and [`RequestBody`];
//! - `de.rs`: the visitors of the fields that take several forms, and the bounded lists;
//! - `generation.rs`: validation, from a body to a [`Generation`];
//! - `chat.rs`: [`ChatInput`], what every chat endpoint's body becomes;
//! - `anthropic.rs`: Anthropic's Messages API bodies, into a [`ChatInput`];
//! - `responses.rs`: OpenAI's Responses API body, into a [`ChatInput`];
//! - `ollama.rs`: Ollama's `/api/*` bodies, `options`, `format` and `keep_alive`;
//! - `embeddings.rs`: `/v1/embeddings`' body ([`EmbeddingRequest`]);
//! - `response.rs`: the bodies sent back, typed.

pub mod anthropic;
mod chat;
mod de;
mod embeddings;
mod generation;
pub mod ollama;
pub mod response;
pub mod responses;
#[cfg(test)]
mod tests;

use kiln_core::TokenId;
use kiln_core::sampling::MAX_LOGIT_BIAS_TOKENS;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::ApiError;

pub use chat::ChatInput;
pub use embeddings::{EmbeddingInput, EmbeddingRequest, EncodingFormat};
pub use generation::{Generation, PromptInput, json_field};

/// Most choices one request may ask for (`n`, times the prompts of a completions request).
pub const MAX_CHOICES: usize = 16;
/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most bytes of stop strings one request may give, all together.
pub const MAX_STOP_BYTES: usize = 4096;
/// Largest free-form JSON field (`response_format`, `chat_template_kwargs`), in bytes of its
/// text.
pub const MAX_JSON_FIELD_BYTES: usize = 1 << 20;
/// Most alternatives `/v1/completions`' integer `logprobs` may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// Fields both completion endpoints share.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CommonFields {
    /// The model to run: one of the served models' names (any name, when one model is
    /// served; none: the first).
    pub model: Option<String>,
    /// Most new tokens per choice (the old name).
    pub max_tokens: Option<u64>,
    /// Most new tokens per choice (the new name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens; 0 or -1 is off.
    pub top_k: Option<i64>,
    /// Drop tokens less likely than this times the best.
    pub min_p: Option<f32>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Hugging Face repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Sampling seed; choice `i` of `n` uses `seed + i`.
    pub seed: Option<i64>,
    /// Strings that end a choice.
    pub stop: Option<Stop>,
    /// Choices per prompt.
    pub n: Option<u64>,
    /// Server-sent events instead of one body.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, as text
    /// ([`json_field`] parses it).
    pub response_format: Option<Box<RawValue>>,
    /// Structured output (a kiln extension, vLLM's older name accepted): the output matches
    /// this regular expression.
    #[serde(alias = "guided_regex")]
    pub regex: Option<String>,
    /// Structured output (a kiln extension, vLLM's older name accepted): the output is in the
    /// language of this Lark grammar (llguidance's dialect).
    #[serde(alias = "guided_grammar")]
    pub grammar: Option<String>,
    /// OpenAI's `logit_bias`: `{"token id": bias}`, each bias added to that token's logit.
    pub logit_bias: Option<LogitBiasMap>,
}

/// `logit_bias` as read: `(token, bias)` in the body's order, at most
/// [`MAX_LOGIT_BIAS_TOKENS`] of them (`de.rs` stops reading past it); the ranges are checked
/// with the other sampling settings (`SamplingParams::validate`).
#[derive(Debug, Default)]
pub struct LogitBiasMap(pub Vec<(TokenId, f32)>);

/// `stop`: one string or several.
#[derive(Debug)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and `choices: []`).
    pub include_usage: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Report the log-probability of each token.
    pub logprobs: Option<bool>,
    /// And this many alternatives with it (0-20).
    pub top_logprobs: Option<u64>,
    /// More variables for the chat template (vLLM's field): `{"enable_thinking": false}`
    /// turns Qwen3's thinking off. As text; [`ChatRequest::template_variables`] parses it.
    pub chat_template_kwargs: Option<Box<RawValue>>,
    /// Functions the model may call (`[{"type": "function", "function": {...}}]`), as text;
    /// `crate::tools::ToolRequest` validates it.
    pub tools: Option<Box<RawValue>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`, as
    /// text.
    pub tool_choice: Option<Box<RawValue>>,
    /// Whether the model may call several tools in one turn (default true).
    pub parallel_tool_calls: Option<bool>,
    /// The fields both endpoints share (read from the same body by [`RequestBody::parse`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string, an array of text parts, or null (an assistant turn with no text).
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// A `tool` message's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A `tool` message's function name.
    #[serde(default)]
    pub name: Option<String>,
}

/// One of an assistant message's `tool_calls`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageToolCall {
    /// The call's id.
    #[serde(default)]
    pub id: Option<String>,
    /// The function called.
    pub function: MessageFunctionCall,
}

/// A call's `function`.
#[derive(Debug, Clone, Deserialize)]
pub struct MessageFunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, a JSON string (OpenAI's form).
    #[serde(default)]
    pub arguments: Option<String>,
}

/// A message's content.
#[derive(Debug, Clone)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts; only `{"type": "text", "text": ...}` is supported.
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    /// The part's kind.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text, for a text part.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    /// What to continue.
    pub prompt: Option<Prompt>,
    /// Report each token's log-probability and this many alternatives (0-5).
    pub logprobs: Option<u64>,
    /// Echo the prompt before the completion (not supported; refused when true).
    pub echo: Option<bool>,
    /// Text appended after the completion (not supported; refused when given).
    pub suffix: Option<String>,
    /// Beam search (a kiln extension): beams kept per step, as transformers'
    /// `generate(num_beams=N, do_sample=False)`; `n` hypotheses come back as the choices, best
    /// first.
    pub num_beams: Option<u64>,
    /// Beam search: a finished hypothesis's score is divided by its length to this power
    /// (default 1).
    pub length_penalty: Option<f32>,
    /// Beam search: `false` (default), `true` or `"never"`, as transformers.
    pub early_stopping: Option<EarlyStoppingField>,
    /// The fields both endpoints share (read from the same body by [`RequestBody::parse`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// `early_stopping` as transformers spells it: a boolean or `"never"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EarlyStoppingField {
    /// `true` or `false`.
    Bool(bool),
    /// `"never"` (or `"true"` / `"false"` as text).
    Text(String),
}

/// A completions prompt: text or token ids, one or several.
#[derive(Debug)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// One list of token ids.
    Tokens(Vec<u32>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several lists of token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /tokenize`: llama.cpp's `content` or vLLM's `prompt`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct TokenizeRequest {
    /// The text (llama.cpp's name).
    pub content: Option<String>,
    /// The text (vLLM's name).
    pub prompt: Option<String>,
    /// Add the tokenizer's special tokens (BOS); llama.cpp's name.
    pub add_special: Option<bool>,
    /// The same, vLLM's name.
    pub add_special_tokens: Option<bool>,
    /// Whose tokenizer (a served model's name; none: the first).
    pub model: Option<String>,
}

/// `POST /detokenize`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct DetokenizeRequest {
    /// The ids.
    pub tokens: Vec<u32>,
    /// Whose tokenizer (a served model's name; none: the first).
    pub model: Option<String>,
}

/// Parses a JSON body into `T`, naming the field at fault when a value has the wrong type.
///
/// # Errors
/// A 400 with serde's message and the field's path.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid(format!("the body is not valid JSON: {inner}"))
        } else if path == "." {
            ApiError::invalid(format!("unexpected request body: {inner}"))
        } else {
            ApiError::invalid_field(&path, format!("{path}: {inner}"))
        }
    })
}

/// A request body the handlers read: parsed from the body's bytes.
pub trait RequestBody: Sized {
    /// The request in `body`.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    fn parse(body: &[u8]) -> Result<Self, ApiError>;

    /// The model it names (`model`), if it names one.
    fn model(&self) -> Option<&str>;
}

impl RequestBody for ChatRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut request: Self = parse(body)?;
        request.common = parse(body)?;
        Ok(request)
    }
    fn model(&self) -> Option<&str> {
        self.common.model.as_deref()
    }
}

impl RequestBody for CompletionRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut request: Self = parse(body)?;
        request.common = parse(body)?;
        Ok(request)
    }
    fn model(&self) -> Option<&str> {
        self.common.model.as_deref()
    }
}

impl RequestBody for TokenizeRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl RequestBody for DetokenizeRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}
