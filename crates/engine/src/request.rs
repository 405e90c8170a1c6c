//! What callers submit ([`Request`]) and what the engine reports back ([`Event`],
//! [`Completion`]).

use std::time::Duration;

use kiln_core::TokenId;
use kiln_core::sampling::SamplingParams;
use serde::Serialize;

use crate::generate::FinishReason;

/// The engine's name for a submitted request, in submission order from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

/// One prompt to continue.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// The prompt's token ids (BOS included if the model wants one); not empty.
    pub prompt: Vec<TokenId>,
    /// Most new tokens (fewer if the model's context ends first).
    pub max_tokens: usize,
    /// How to pick each token.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence (a model may have several); not part of the output. The
    /// engine adds none of its own: left empty, with no `stop` strings either, a request
    /// generates exactly `max_tokens` (what vLLM's and llama.cpp's `ignore_eos` do; the
    /// benchmark relies on it).
    pub eos: Vec<TokenId>,
    /// Strings that end the sequence when they appear in the decoded text; the output stops
    /// before them. Needs a detokenizer.
    pub stop: Vec<String>,
}

/// Something that happened during a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token of a running request, with the text it completed (empty while a
    /// multi-byte character or a possible stop string is pending; no detokenizer, no text).
    Token {
        /// Whose.
        id: RequestId,
        /// The token.
        token: TokenId,
        /// Text safe to show now.
        text: String,
    },
    /// Text held back for a possible stop string, released when the request ended otherwise;
    /// comes just before its `Finished`.
    Text {
        /// Whose.
        id: RequestId,
        /// The text.
        text: String,
    },
    /// A request ended.
    Finished(Completion),
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    /// Which request.
    pub id: RequestId,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Every sampled token, in order (no EOS; the tokens of a stop string are included).
    pub tokens: Vec<TokenId>,
    /// The decoded output without any stop string (`None` without a detokenizer).
    pub text: Option<String>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Times, measured from submission.
    pub timings: Timings,
    /// How many times the scheduler evicted it to make room (its cache was recomputed).
    pub preemptions: usize,
}

/// A request's times.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Timings {
    /// Submission to the first token (queueing and prefill).
    #[serde(serialize_with = "millis")]
    pub time_to_first_token: Duration,
    /// First token to the last.
    #[serde(serialize_with = "millis")]
    pub decode: Duration,
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}
