//! The built-in [`LogitsProcessor`]s, in the order [`super::Sampler`] chains them:
//! logit bias, penalties, temperature, top-k, top-p, min-p.

use std::fmt::Debug;

use super::{Candidates, TokenHistory};
use crate::ids::TokenId;

/// One stage of the sampling chain. Implement it to add your own (a logit bias, a grammar).
pub trait LogitsProcessor: Debug + Send + Sync {
    /// A short name for logs and `/stats`.
    fn name(&self) -> &'static str;

    /// Changes logits and/or drops candidates. Must leave at least one candidate.
    fn process(&self, candidates: &mut Candidates, history: &TokenHistory);
}

/// OpenAI's `logit_bias` (transformers' `SequenceBiasLogitsProcessor` with one-token
/// sequences, vLLM's `LogitBiasLogitsProcessor`): each listed token's logit gets its bias
/// added. First in the chain, on the raw logits, as vLLM, llama.cpp and transformers place it.
#[derive(Debug, Clone)]
pub struct LogitBias(pub Vec<(TokenId, f32)>);

impl LogitsProcessor for LogitBias {
    fn name(&self) -> &'static str {
        "logit_bias"
    }

    fn process(&self, candidates: &mut Candidates, _: &TokenHistory) {
        for &(token, bias) in &self.0 {
            candidates.update(token, |l| l + bias);
        }
    }
}

/// Hugging Face's repetition penalty (`RepetitionPenaltyLogitsProcessor`, from CTRL): every
/// token of the prompt or generated so far has its logit divided by `penalty` if positive and
/// multiplied by it if negative, once however often it occurred.
#[derive(Debug, Clone)]
pub struct RepetitionPenalty(pub f32);

impl LogitsProcessor for RepetitionPenalty {
    fn name(&self) -> &'static str {
        "repetition_penalty"
    }

    fn process(&self, candidates: &mut Candidates, history: &TokenHistory) {
        let penalty = self.0;
        for &token in history.seen() {
            candidates.update(token, |l| if l < 0.0 { l * penalty } else { l / penalty });
        }
    }
}

/// OpenAI's presence and frequency penalties (also vLLM's), over generated tokens only:
/// `logit -= presence * (count > 0) + frequency * count`.
#[derive(Debug, Clone)]
pub struct PresenceFrequencyPenalty {
    /// Subtracted once from every generated token.
    pub presence: f32,
    /// Subtracted per occurrence.
    pub frequency: f32,
}

impl LogitsProcessor for PresenceFrequencyPenalty {
    fn name(&self) -> &'static str {
        "presence_frequency_penalty"
    }

    fn process(&self, candidates: &mut Candidates, history: &TokenHistory) {
        for (&token, &count) in history.generated_counts() {
            let delta = self.presence + self.frequency * count as f32;
            candidates.update(token, |l| l - delta);
        }
    }
}

/// Divides every logit by the temperature (> 0; 0 is handled as greedy by the sampler).
#[derive(Debug, Clone)]
pub struct Temperature(pub f32);

impl LogitsProcessor for Temperature {
    fn name(&self) -> &'static str {
        "temperature"
    }

    fn process(&self, candidates: &mut Candidates, _: &TokenHistory) {
        // Dividing by a positive number keeps the order.
        for l in candidates.logits_mut() {
            *l /= self.0;
        }
    }
}

/// Keeps the `k` most likely tokens (ties with the k-th kept, as Hugging Face's `TopKLogitsWarper`).
#[derive(Debug, Clone)]
pub struct TopK(pub usize);

impl LogitsProcessor for TopK {
    fn name(&self) -> &'static str {
        "top_k"
    }

    fn process(&self, candidates: &mut Candidates, _: &TokenHistory) {
        candidates.top_k(self.0);
    }
}

/// Nucleus sampling: keeps the most likely tokens until their probability reaches `p`
/// (the token that crosses `p` is kept), as Hugging Face's `TopPLogitsWarper`.
#[derive(Debug, Clone)]
pub struct TopP(pub f32);

impl LogitsProcessor for TopP {
    fn name(&self) -> &'static str {
        "top_p"
    }

    fn process(&self, candidates: &mut Candidates, _: &TokenHistory) {
        if self.0 >= 1.0 {
            return;
        }
        candidates.sort();
        let probs = candidates.probabilities();
        let mut mass_before = 0.0f64;
        let mut keep = 0;
        for p in probs {
            if mass_before >= f64::from(self.0) {
                break;
            }
            mass_before += f64::from(p);
            keep += 1;
        }
        candidates.truncate_sorted(keep);
    }
}

/// Drops tokens whose probability is below `min_p` times the top token's, as Hugging Face's
/// `MinPLogitsWarper`.
#[derive(Debug, Clone)]
pub struct MinP(pub f32);

impl LogitsProcessor for MinP {
    fn name(&self) -> &'static str {
        "min_p"
    }

    fn process(&self, candidates: &mut Candidates, _: &TokenHistory) {
        if self.0 <= 0.0 {
            return;
        }
        let probs = candidates.probabilities();
        let top = probs.iter().copied().fold(0.0f32, f32::max);
        let threshold = self.0 * top;
        candidates.retain(|i, _| probs[i] >= threshold);
    }
}
