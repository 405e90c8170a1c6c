//! [`SamplingParams`]: what a user asks for, validated before any token is drawn.

use serde::{Deserialize, Serialize};

use crate::ids::TokenId;

/// Sampling settings of one sequence. The defaults change nothing: temperature 1, no
/// truncation, no penalty, a random seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits; 0 means greedy (argmax, no randomness).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = off). Larger than the vocabulary is
    /// clamped to it, as Hugging Face does.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`
    /// (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    /// Hugging Face / CTRL repetition penalty over prompt and generated tokens: a seen token's
    /// logit is divided by it when positive, multiplied when negative (1 = off).
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every token generated so far
    /// (0 = off).
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per time it was
    /// generated (0 = off).
    pub frequency_penalty: f32,
    /// Seed of this sequence's RNG; `None` draws one. Same seed, same logits: same tokens.
    pub seed: Option<u64>,
    /// OpenAI's `logit_bias`: each `(token, bias)` adds `bias` (in [-100, 100]) to that
    /// token's raw logit, before the penalties and temperature; -100 all but bans the token,
    /// +100 all but forces it. At most [`MAX_LOGIT_BIAS_TOKENS`] tokens, each once (empty =
    /// off).
    pub logit_bias: Vec<(TokenId, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0, nothing else.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether decoding is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`SamplingError::Invalid`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let invalid = |field: &'static str, value: f32, expected: &'static str| {
            Err(SamplingError::Invalid {
                field,
                value: value.to_string(),
                expected,
            })
        };
        if !(self.temperature == 0.0
            || (MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&self.temperature))
        {
            return invalid(
                "temperature",
                self.temperature,
                "0 (greedy) or a number in [1e-4, 1e4]",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid("top_p", self.top_p, "a number in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid("min_p", self.min_p, "a number in [0, 1]");
        }
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&self.repetition_penalty) {
            return invalid(
                "repetition_penalty",
                self.repetition_penalty,
                "a number in [0.01, 100]",
            );
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return invalid(field, value, "a number in [-2, 2] (OpenAI's range)");
            }
        }
        self.validate_logit_bias()
    }

    /// [`SamplingParams::logit_bias`]: at most [`MAX_LOGIT_BIAS_TOKENS`] tokens, each once,
    /// each bias within plus or minus [`MAX_LOGIT_BIAS`].
    fn validate_logit_bias(&self) -> Result<(), SamplingError> {
        let invalid = |value: String, expected: &'static str| {
            Err(SamplingError::Invalid {
                field: "logit_bias",
                value,
                expected,
            })
        };
        if self.logit_bias.len() > MAX_LOGIT_BIAS_TOKENS {
            return invalid(
                format!("{} tokens", self.logit_bias.len()),
                "at most 1024 tokens",
            );
        }
        if let Some((token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
        {
            return invalid(
                format!("{{{token}: {bias}}}"),
                "a bias in [-100, 100] for each token (OpenAI's range)",
            );
        }
        let mut tokens: Vec<TokenId> = self.logit_bias.iter().map(|&(t, _)| t).collect();
        tokens.sort_unstable();
        if let Some(pair) = tokens.windows(2).find(|w| w[0] == w[1]) {
            return invalid(
                format!("token {} given twice", pair[0]),
                "each token id once",
            );
        }
        Ok(())
    }

    /// Checks the token ids the settings name ([`SamplingParams::logit_bias`]) against a
    /// vocabulary of `vocab` tokens, which [`SamplingParams::validate`] does not know.
    ///
    /// # Errors
    /// [`SamplingError::TokenOutsideVocab`] naming the field and the first such token.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), SamplingError> {
        match self.logit_bias.iter().find(|(t, _)| t.0 as usize >= vocab) {
            Some(&(token, _)) => Err(SamplingError::TokenOutsideVocab {
                field: "logit_bias",
                token,
                vocab,
            }),
            None => Ok(()),
        }
    }
}

/// The largest logit bias, either way (OpenAI's range): enough to ban or force any token, as
/// logits rarely span more than a few tens.
pub const MAX_LOGIT_BIAS: f32 = 100.0;
/// The most tokens one [`SamplingParams::logit_bias`] may name (the server reads no more).
pub const MAX_LOGIT_BIAS_TOKENS: usize = 1024;
// The messages of `validate_logit_bias` spell these out.
const _: () = assert!(MAX_LOGIT_BIAS == 100.0 && MAX_LOGIT_BIAS_TOKENS == 1024);

/// The smallest temperature above 0: logits divided by less overflow f32 (1e-39 made every
/// score infinite), and below it sampling is greedy in all but name.
pub const MIN_TEMPERATURE: f32 = 1e-4;
/// The largest temperature: above it every distribution is uniform in all but name.
pub const MAX_TEMPERATURE: f32 = 1e4;
/// The smallest repetition penalty: dividing logits by less overflows them.
pub const MIN_REPETITION_PENALTY: f32 = 0.01;
/// The largest repetition penalty.
pub const MAX_REPETITION_PENALTY: f32 = 100.0;

/// Invalid sampling settings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplingError {
    /// A field is out of range.
    #[error("invalid sampling parameter {field} = {value}: expected {expected}")]
    Invalid {
        /// The field's name, as on the command line (with `_`).
        field: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A token id past the vocabulary.
    #[error(
        "invalid sampling parameter {field}: token id {token} is outside the vocabulary of {vocab} tokens"
    )]
    TokenOutsideVocab {
        /// The field that names it, as on the command line (with `_`).
        field: &'static str,
        /// The token id.
        token: TokenId,
        /// The vocabulary's size.
        vocab: usize,
    },
    /// Logits of the wrong width.
    #[error("logits have {got} entries, the vocabulary has {vocab}")]
    VocabMismatch {
        /// Entries given.
        got: usize,
        /// The sampler's vocabulary.
        vocab: usize,
    },
}
