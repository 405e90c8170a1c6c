//! [`FinishReason`]: why a request ended, which completions, beam hypotheses and the server all
//! report. Its own module so that the request types and beam search, which both name it,
//! depend on it and not on each other.

use serde::Serialize;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// `max_tokens` reached (or the model's context).
    Length,
    /// An end-of-sequence token was sampled (it is not part of the output).
    Eos,
    /// A stop string appeared, or the caller stopped it.
    Stop,
}
