//! The bodies the server sends, in OpenAI's schema (and llama.cpp's and vLLM's for
//! `/tokenize` and `/detokenize`), typed.
//!
//! Fields are declared in the order they are written, which is part of the wire format clients
//! have seen so far; a field is left out only where OpenAI leaves it out (`usage` on stream
//! chunks unless the client asked for it, a delta's missing `role` or `content`, the alternatives
//! of an alternative), and `null` is written where OpenAI writes `null` (`logprobs` when none
//! were asked for, `finish_reason` until a choice ends, `refusal`, an error's `param` and
//! `code`).
//!
//! Log-probabilities are `f32` in the engine and written as the `f64` of the same value
//! (`-0.25822144746780396`, not `-0.25822145`), as they always have been.

use kiln_core::TokenId;
use kiln_engine::{FinishReason, TokenLogprobs};
use serde::ser::{Serialize, SerializeMap, Serializer};

use crate::codec::Codec;

/// OpenAI's name for why a choice ended.
pub fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::Stop => "stop",
    }
}

/// The `finish_reason` of a chat choice that made `calls` tool calls: `tool_calls` when it
/// ended by itself with calls, else as [`finish_reason`].
pub fn chat_finish_reason(reason: FinishReason, calls: usize) -> &'static str {
    match reason {
        FinishReason::Eos | FinishReason::Stop if calls > 0 => "tool_calls",
        other => finish_reason(other),
    }
}

/// A whole answer (`chat.completion`, `text_completion`) or one chunk of a stream
/// (`chat.completion.chunk`, `text_completion`), with choices of type `C`.
#[derive(Debug, serde::Serialize)]
pub struct CompletionBody<'a, C> {
    /// The response id (`chatcmpl-…`, `cmpl-…`), the same on every chunk.
    pub id: &'a str,
    /// What this body is.
    pub object: &'static str,
    /// When the request was taken (Unix seconds).
    pub created: u64,
    /// The served model's name.
    pub model: &'a str,
    /// The choices (a stream chunk: the one it is about, or none for the usage chunk).
    pub choices: Vec<C>,
    /// A whole answer: always there. A stream chunk: absent unless the client asked for usage
    /// (`stream_options.include_usage`), then `null` but on the last chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// OpenAI's usage object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens (each prompt once, however many choices continue it).
    pub prompt_tokens: usize,
    /// Tokens generated, every choice together.
    pub completion_tokens: usize,
    /// The two together.
    pub total_tokens: usize,
    /// What of the prompt was not computed.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    /// `cached_tokens` are prompt tokens whose K/V came from the prefix cache.
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
}

/// A choice of a chat answer.
#[derive(Debug, serde::Serialize)]
pub struct ChatChoice<'a> {
    /// Which choice.
    pub index: usize,
    /// The reply.
    pub message: ChatMessage<'a>,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<ChatLogprobs>,
    /// Why it ended.
    pub finish_reason: Option<&'static str>,
}

/// The assistant's reply.
#[derive(Debug, serde::Serialize)]
pub struct ChatMessage<'a> {
    /// Always `assistant`.
    pub role: &'static str,
    /// The text (`null` when the reply is only tool calls, or ended inside its reasoning).
    pub content: Option<&'a str>,
    /// A thinking model's reasoning (`<think>…</think>`), when it is split from the answer
    /// (`--reasoning-format`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    /// The tools it calls; absent when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallBody>>,
}

/// One tool call of a reply.
#[derive(Debug, serde::Serialize)]
pub struct ToolCallBody {
    /// `call_…`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCallBody,
}

/// A call's function.
#[derive(Debug, serde::Serialize)]
pub struct FunctionCallBody {
    /// The function's name.
    pub name: String,
    /// Its arguments, JSON text.
    pub arguments: String,
}

/// A piece of one tool call in a stream chunk: the first carries `id`, `type` and the name
/// (and empty arguments), the later ones pieces of the arguments.
#[derive(Debug, serde::Serialize)]
pub struct ToolCallDelta {
    /// Which call of the choice.
    pub index: usize,
    /// `call_…`, on the call's first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, on the call's first piece.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first piece) or a piece of the arguments.
    pub function: FunctionDelta,
}

/// What a [`ToolCallDelta`] adds to the call's function.
#[derive(Debug, serde::Serialize)]
pub struct FunctionDelta {
    /// The name, on the call's first piece.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A piece of the arguments' JSON text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// A choice of a chat stream chunk.
#[derive(Debug, serde::Serialize)]
pub struct ChatChunkChoice<'a> {
    /// Which choice.
    pub index: usize,
    /// What is new.
    pub delta: Delta<'a>,
    /// This chunk's token's, when the request asked for them.
    pub logprobs: Option<ChatLogprobs>,
    /// `null` until the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// What a chat stream chunk adds: the role (first chunk), some text, or nothing (last chunk).
#[derive(Debug, Default, serde::Serialize)]
pub struct Delta<'a> {
    /// `assistant`, on the first chunk of a choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// A piece of the text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    /// A piece of the reasoning, when it is split from the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<&'a str>,
    /// Pieces of tool calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A choice of a completions answer, or of a completions stream chunk.
#[derive(Debug, serde::Serialize)]
pub struct TextChoice<'a> {
    /// Which choice.
    pub index: usize,
    /// The text (a chunk: a piece of it).
    pub text: &'a str,
    /// `null` unless the request asked for `logprobs`.
    pub logprobs: Option<TextLogprobs>,
    /// Why it ended (a chunk: `null` until the last).
    pub finish_reason: Option<&'static str>,
}

/// A chat choice's `logprobs`: one entry per token.
#[derive(Debug, serde::Serialize)]
pub struct ChatLogprobs {
    /// The tokens.
    pub content: Vec<ChatLogprob>,
    /// Always `null`.
    pub refusal: Option<String>,
}

impl ChatLogprobs {
    /// The entries of `tokens`, each with its alternatives.
    pub fn new(codec: &Codec, tokens: &[(TokenId, TokenLogprobs)]) -> Self {
        Self {
            content: tokens
                .iter()
                .map(|(token, lp)| ChatLogprob::with_alternatives(codec, *token, lp))
                .collect(),
            refusal: None,
        }
    }
}

/// One token of a chat `logprobs.content`, or one of its alternatives.
#[derive(Debug, serde::Serialize)]
pub struct ChatLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability ([`finite`]).
    pub logprob: f64,
    /// The text's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position; absent on an alternative itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<ChatLogprob>>,
}

impl ChatLogprob {
    fn new(codec: &Codec, token: TokenId, logprob: f32) -> Self {
        let token = codec.token_text(token);
        Self {
            bytes: token.clone().into_bytes(),
            token,
            logprob: finite(logprob),
            top_logprobs: None,
        }
    }

    /// `token`'s entry, with its alternatives.
    pub fn with_alternatives(codec: &Codec, token: TokenId, lp: &TokenLogprobs) -> Self {
        Self {
            top_logprobs: Some(
                lp.top
                    .iter()
                    .map(|&(id, l)| Self::new(codec, id, l))
                    .collect(),
            ),
            ..Self::new(codec, token, lp.logprob)
        }
    }
}

/// The legacy completions `logprobs` object.
#[derive(Debug, serde::Serialize)]
pub struct TextLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f64>,
    /// Each token's `top` alternatives.
    pub top_logprobs: Vec<Alternatives>,
    /// Where each token's text starts in the choice's text, in bytes.
    pub text_offset: Vec<usize>,
}

impl TextLogprobs {
    /// The object for `tokens`, with `top` alternatives each; `offset` is where the first
    /// token's text starts in the choice's text.
    pub fn new(
        codec: &Codec,
        tokens: &[(TokenId, TokenLogprobs)],
        top: usize,
        offset: usize,
    ) -> Self {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        let mut at = offset;
        for (t, _) in tokens {
            let text = codec.token_text(*t);
            offsets.push(at);
            at += text.len();
            texts.push(text);
        }
        Self {
            tokens: texts,
            token_logprobs: tokens.iter().map(|(_, lp)| finite(lp.logprob)).collect(),
            top_logprobs: tokens
                .iter()
                .map(|(_, lp)| {
                    Alternatives::new(
                        lp.top
                            .iter()
                            .take(top)
                            .map(|&(id, l)| (codec.token_text(id), finite(l))),
                    )
                })
                .collect(),
            text_offset: offsets,
        }
    }
}

/// A completions token's alternatives: an object from each one's text to its log-probability,
/// most likely first. Two tokens with the same text are one key, where the first stood, with
/// the later one's value.
#[derive(Debug, Default)]
pub struct Alternatives(Vec<(String, f64)>);

impl Alternatives {
    fn new(entries: impl IntoIterator<Item = (String, f64)>) -> Self {
        let mut kept: Vec<(String, f64)> = Vec::new();
        for (text, logprob) in entries {
            match kept.iter_mut().find(|(t, _)| *t == text) {
                Some(entry) => entry.1 = logprob,
                None => kept.push((text, logprob)),
            }
        }
        Self(kept)
    }
}

impl Serialize for Alternatives {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (text, logprob) in &self.0 {
            map.serialize_entry(text, logprob)?;
        }
        map.end()
    }
}

/// JSON has no infinities; a token the model rules out entirely reads as -9999 (as vLLM).
pub fn finite(logprob: f32) -> f64 {
    if logprob.is_finite() {
        f64::from(logprob)
    } else {
        -9999.0
    }
}

/// `GET /v1/models`.
#[derive(Debug, serde::Serialize)]
pub struct ModelList<'a> {
    /// Always `list`.
    pub object: &'static str,
    /// Every served model.
    pub data: Vec<Model<'a>>,
}

/// A served model.
#[derive(Debug, serde::Serialize)]
pub struct Model<'a> {
    /// Its served name.
    pub id: &'a str,
    /// Always `model`.
    pub object: &'static str,
    /// When it last finished loading (Unix seconds; 0 before its first load).
    pub created: u64,
    /// Always `kiln`.
    pub owned_by: &'static str,
    /// Its context, in tokens (vLLM's field), once it has loaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
    /// `loaded`, `loading`, `unloading` or `unloaded` (a model loads on first use).
    pub status: &'static str,
}

/// `GET /health`.
#[derive(Debug, serde::Serialize)]
pub struct Health {
    /// Always `ok` (a model still loading answers 503).
    pub status: &'static str,
}

/// `POST /tokenize`.
#[derive(Debug, serde::Serialize)]
pub struct Tokens {
    /// The ids.
    pub tokens: Vec<TokenId>,
    /// How many.
    pub count: usize,
    /// The model's context.
    pub max_model_len: usize,
}

/// `POST /detokenize`: the text under both servers' names (llama.cpp `content`, vLLM `prompt`).
#[derive(Debug, serde::Serialize)]
pub struct Text<'a> {
    /// The text (llama.cpp's name).
    pub content: &'a str,
    /// The same (vLLM's name).
    pub prompt: &'a str,
}

/// Every error: `{"error": {...}}`, sent alone or as a stream's data event.
#[derive(Debug, serde::Serialize)]
pub struct ErrorBody<'a> {
    /// What went wrong.
    pub error: ErrorDetail<'a>,
}

/// OpenAI's error object.
#[derive(Debug, serde::Serialize)]
pub struct ErrorDetail<'a> {
    /// For a person.
    pub message: &'a str,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, or `null`.
    pub param: Option<&'a str>,
    /// A machine-readable code, or `null`.
    pub code: Option<&'static str>,
}

/// `/v1/embeddings`' answer: `{"object": "list", "data": [...], "model", "usage"}`.
#[derive(Debug, serde::Serialize)]
pub struct EmbeddingList<'a> {
    /// Always `"list"`.
    pub object: &'static str,
    /// One entry per input, in input order.
    pub data: Vec<EmbeddingData>,
    /// The served model's name.
    pub model: &'a str,
    /// The tokens embedded.
    pub usage: EmbeddingUsage,
}

/// One input's embedding.
#[derive(Debug, serde::Serialize)]
pub struct EmbeddingData {
    /// Always `"embedding"`.
    pub object: &'static str,
    /// The input's place in the request's list.
    pub index: usize,
    /// The vector: a list of numbers, or its little-endian f32 bytes in base64.
    pub embedding: EmbeddingVector,
}

/// An embedding as `encoding_format` asked.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// `"float"`.
    Float(Vec<f32>),
    /// `"base64"`.
    Base64(String),
}

/// An embeddings answer's usage: every input's tokens (nothing is generated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EmbeddingUsage {
    /// Tokens of every input together.
    pub prompt_tokens: usize,
    /// The same.
    pub total_tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternatives_with_one_text_keep_the_first_place_and_the_last_value() {
        let alternatives = Alternatives::new([
            ("a".to_string(), -0.5),
            ("b".to_string(), -1.0),
            ("a".to_string(), -2.0),
        ]);
        let json = serde_json::to_string(&alternatives).expect("serializes");
        assert_eq!(json, r#"{"a":-2.0,"b":-1.0}"#);
    }

    #[test]
    fn chunks_carry_usage_only_when_asked_and_logprobs_as_f64() {
        let chunk = |usage| CompletionBody {
            id: "cmpl-1",
            object: "text_completion",
            created: 7,
            model: "m",
            choices: vec![TextChoice {
                index: 0,
                text: "",
                logprobs: None,
                finish_reason: None,
            }],
            usage,
        };
        assert_eq!(
            serde_json::to_string(&chunk(None)).expect("serializes"),
            r#"{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}"#
        );
        assert!(
            serde_json::to_string(&chunk(Some(None)))
                .expect("serializes")
                .ends_with(r#""usage":null}"#)
        );
        assert_eq!(finite(f32::NEG_INFINITY), -9999.0);
        assert_eq!(
            serde_json::to_string(&finite(-0.258_221_45)).expect("serializes"),
            "-0.25822144746780396"
        );
    }
}
