//! What callers submit ([`Request`]) and what the engine reports back ([`Event`],
//! [`Completion`]).

use std::time::Duration;

use kiln_core::sampling::SamplingParams;
use kiln_core::{ModelShape, TokenId};
use serde::Serialize;

use crate::beam::{BeamHypothesis, BeamSearch};
use crate::finish::FinishReason;
use crate::speculate::SpecCounts;
use crate::structured::Grammar;

/// Why `prompt` cannot be run by a model of `shape`, or `None` when it can: it is empty, it
/// fills the context (at least one position must be left to generate), or it holds an id
/// outside the vocabulary. The engine refuses such prompts with this message; a server calls
/// it first to name its own field.
pub fn prompt_problem(prompt: &[TokenId], shape: &ModelShape) -> Option<String> {
    if prompt.is_empty() {
        return Some("the prompt is empty".into());
    }
    if prompt.len() >= shape.max_positions {
        return Some(format!(
            "the prompt has {} tokens; the model's context is {} tokens",
            prompt.len(),
            shape.max_positions
        ));
    }
    let t = prompt.iter().find(|t| t.0 as usize >= shape.vocab)?;
    Some(format!(
        "token id {t} is outside the vocabulary of {}",
        shape.vocab
    ))
}

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
    /// Report each sampled token's log-probability and this many most likely alternatives
    /// with it (`Some(0)`: the token's alone); `None` reports none.
    pub logprobs: Option<usize>,
    /// Keep the K/V of the prompt and output in the cache when the request ends, for a later
    /// request to continue ([`Request::continues`]); until then it takes cache space like a
    /// running sequence. [`crate::Engine::release_kept`] frees it.
    pub keep_cache: bool,
    /// Continue on the cache kept by this earlier request ([`Request::keep_cache`]): the
    /// leading tokens its prompt and output share with this prompt are not computed again
    /// (the cache is rolled back to them, or recomputed whole where it cannot roll back that
    /// far, as a sliding window). The kept cache passes to this request.
    pub continues: Option<RequestId>,
    /// Beam search instead of sampling ([`BeamSearch`]): deterministic, as transformers'
    /// `generate(num_beams=N, do_sample=False)`; the sampling settings other than the
    /// penalties and the logit bias (which it refuses) are ignored. The best hypothesis's tokens arrive as
    /// [`Event::Token`]s when the search ends (nothing streams before), all returned ones in
    /// [`Completion::beams`]. It takes no stop strings, log-probabilities or kept caches.
    pub beam: Option<BeamSearch>,
    /// Structured output: every token is one the grammar allows
    /// ([`crate::structured::GrammarCompiler::compile`]), and the request ends (as by an
    /// EOS) when the output is complete. Not with beam search.
    pub constraint: Option<Grammar>,
    /// The caller's group of requests (a server's HTTP request, whose choices or prompts are
    /// several engine requests): with [`crate::EngineConfig::max_group_rows`], the scheduler
    /// lets one group hold at most that many rows of the batch, so one large request cannot
    /// take every row while others wait. `None`: a group of its own.
    pub group: Option<u64>,
}

impl Request {
    /// Rows of the batch it takes while it runs: one per beam of a beam search, else one.
    pub fn rows(&self) -> usize {
        self.beam.map_or(1, |b| b.num_beams)
    }
}

/// The most alternatives [`Request::logprobs`] may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampled token's log-probability under the model's distribution (the log-softmax of
/// the raw logits, before temperature and every other processor: what vLLM reports by
/// default), with the most likely tokens at that position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprobs {
    /// The sampled token's log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(TokenId, f32)>,
}

impl TokenLogprobs {
    /// `token`'s log-probability under `logits`, with the `top` most likely tokens.
    ///
    /// # Shapes
    /// `logits`: `[vocab]`, and `token < vocab`.
    pub fn from_logits(logits: &[f32], token: TokenId, top: usize) -> Self {
        // log p_i = x_i - (max + ln sum exp(x_j - max)), summed in f64 so 49k terms do not
        // lose the small ones.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
        let log_norm = f64::from(max) + sum.ln();
        let logprob = |x: f32| (f64::from(x) - log_norm) as f32;
        let mut best: Vec<(TokenId, f32)> = Vec::with_capacity(top + 1);
        if top > 0 {
            for (i, &x) in logits.iter().enumerate() {
                if best.len() == top && x <= best[top - 1].1 {
                    continue;
                }
                // Ties keep the lower id first, as a stable sort by value would.
                let at = best.partition_point(|&(_, y)| y >= x);
                best.insert(at, (TokenId(i as u32), x));
                best.truncate(top);
            }
        }
        Self {
            logprob: logprob(logits[token.0 as usize]),
            top: best.into_iter().map(|(t, x)| (t, logprob(x))).collect(),
        }
    }
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
        /// Its log-probability, when the request asked ([`Request::logprobs`]).
        logprobs: Option<TokenLogprobs>,
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
    /// Prompt tokens whose K/V were already in the cache when it started, and were not
    /// computed: from the prefix cache, or kept by the request it continues.
    pub cached_tokens: usize,
    /// Every sampled token, in order (no EOS; the tokens of a stop string are included).
    pub tokens: Vec<TokenId>,
    /// The decoded output without any stop string (`None` without a detokenizer).
    pub text: Option<String>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// The stop string that ended it (with [`FinishReason::Stop`]; `None` when the caller
    /// stopped it or a decoding mode did).
    pub stop_string: Option<String>,
    /// Times, measured from submission.
    pub timings: Timings,
    /// How many times the scheduler evicted it to make room (its cache was recomputed).
    pub preemptions: usize,
    /// Forwards that produced its tokens and, with speculative decoding, the drafts proposed
    /// and accepted ([`SpecCounts::tokens_per_forward`], [`SpecCounts::acceptance_rate`]).
    pub speculation: SpecCounts,
    /// With beam search: the returned hypotheses, best first (`tokens`, `text` and
    /// `finish_reason` are the first one's); empty otherwise.
    pub beams: Vec<BeamHypothesis>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_with_the_best_tokens_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let log_norm = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        let lp = TokenLogprobs::from_logits(&logits, TokenId(2), 3);
        assert!((f64::from(lp.logprob) - (2.0 - log_norm)).abs() < 1e-6);
        // The tie between ids 1 and 3 keeps the lower id first.
        let ids: Vec<u32> = lp.top.iter().map(|(t, _)| t.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        for (t, l) in &lp.top {
            let expected = f64::from(logits[t.0 as usize]) - log_norm;
            assert!((f64::from(*l) - expected).abs() < 1e-6);
        }
        let all = TokenLogprobs::from_logits(&logits, TokenId(0), logits.len());
        let total: f64 = all.top.iter().map(|(_, l)| f64::from(*l).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(
            TokenLogprobs::from_logits(&logits, TokenId(4), 0)
                .top
                .is_empty()
        );
    }
}
