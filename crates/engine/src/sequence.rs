//! One request's state inside the engine.

use std::time::Instant;

use kiln_core::sampling::{Sampler, TokenHistory};
use kiln_core::{Position, SeqId, TokenId};

use crate::beam::{BeamGroup, BeamHypothesis};
use crate::detok::{Detokenizer, IncrementalDecoder};
use crate::generate::FinishReason;
use crate::request::{Completion, Event, Request, RequestId, Timings, TokenLogprobs};
use crate::speculate::SpecCounts;
use crate::stop::StopMatcher;
use crate::structured::GrammarMatcher;

/// A request being served. Its *context* is the prompt followed by what it generated; the
/// first `in_cache` tokens of the context are in the KV cache. Each step feeds the next tokens
/// of the context (a prefill chunk, or the one token sampled last) and samples when the whole
/// context is in the cache. Preemption sets `in_cache` to 0: the context is recomputed later,
/// and the sampler's state survives, so the continuation is the same.
pub(crate) struct Sequence {
    pub id: RequestId,
    /// The cache's name for it: its own id's, or that of the kept request it continues.
    pub seq: SeqId,
    pub request: Request,
    pub generated: Vec<TokenId>,
    pub in_cache: usize,
    pub budget: usize,
    pub sampler: Sampler,
    pub history: TokenHistory,
    pub decoder: IncrementalDecoder,
    pub stops: StopMatcher,
    pub submitted: Instant,
    pub first_token: Option<Instant>,
    pub preemptions: usize,
    /// Prompt tokens found in the cache when it first started (None until then).
    pub cached_tokens: Option<usize>,
    /// The caller asked it to end ([`crate::Engine::stop`]); it ends at the next step.
    pub stop_requested: bool,
    /// Draft tokens this step feeds after its last sampled token (speculative decoding).
    pub drafts: Vec<TokenId>,
    /// Speculation's counts: drafts, accepted drafts, forwards and the tokens they produced.
    pub counts: SpecCounts,
    /// Most drafts it proposes next step (adaptive speculation moves it after each check).
    pub draft_limit: usize,
    /// The distribution each draft was drawn from (a draft model's sampled drafts only).
    pub draft_q: Vec<Vec<f32>>,
    /// Leading context tokens the draft model's cache holds for it.
    pub draft_in_cache: usize,
    /// Draws the draft model's proposals (an engine with a draft model only).
    pub draft_sampler: Option<Sampler>,
    /// Its beam search, when the request asked for one.
    pub beams: Option<BeamGroup>,
    /// The cache sequence of each running beam, in the order of the group's beams (empty
    /// before the first search step, when the prompt runs as `seq`).
    pub beam_seqs: Vec<SeqId>,
    /// The cache sequences its beams may take: `seq` and `num_beams - 1` more.
    pub beam_ids: Vec<SeqId>,
    /// The hypotheses a finished beam search returned.
    pub beam_results: Vec<BeamHypothesis>,
    /// Its position in its grammar (structured output); the sampler holds a clone as its
    /// first processor.
    pub constraint: Option<GrammarMatcher>,
}

impl Sequence {
    pub fn new(id: RequestId, request: Request, budget: usize, mut sampler: Sampler) -> Self {
        let history = TokenHistory::with_prompt(&request.prompt);
        let stops = StopMatcher::new(&request.stop);
        let constraint = request.constraint.as_ref().map(|g| g.start(&request.eos));
        if let Some(matcher) = &constraint {
            sampler.prepend_processor(Box::new(matcher.clone()));
        }
        Self {
            id,
            seq: SeqId(id.0),
            request,
            generated: Vec::new(),
            in_cache: 0,
            budget,
            sampler,
            history,
            decoder: IncrementalDecoder::default(),
            stops,
            submitted: Instant::now(),
            first_token: None,
            preemptions: 0,
            cached_tokens: None,
            stop_requested: false,
            drafts: Vec::new(),
            counts: SpecCounts::default(),
            draft_limit: usize::MAX,
            draft_q: Vec::new(),
            draft_in_cache: 0,
            draft_sampler: None,
            beams: None,
            beam_seqs: Vec::new(),
            beam_ids: Vec::new(),
            beam_results: Vec::new(),
            constraint,
        }
    }

    /// Whether its next token is the plain argmax of its logits row, which the device can
    /// pick itself: greedy without processors (no penalty, no grammar), no log-probabilities
    /// asked for, no drafts to verify and no beams.
    pub fn argmax_on_device(&self) -> bool {
        self.sampler.is_plain_greedy()
            && self.request.logprobs.is_none()
            && self.drafts.is_empty()
            && self.beams.is_none()
            && self.constraint.is_none()
    }

    /// Every cache sequence it may hold: its beams' with beam search, else its own.
    pub fn cache_seqs(&self) -> Vec<SeqId> {
        if self.beams.is_some() {
            self.beam_ids.clone()
        } else {
            vec![self.seq]
        }
    }

    /// Whether it proposes drafts when speculation is on: it decodes, and is no beam search.
    pub fn can_draft(&self) -> bool {
        self.wants_decode() && self.beams.is_none()
    }

    /// Whether its beams are past the first search step (each feeds its own last token).
    pub fn beams_running(&self) -> bool {
        !self.beam_seqs.is_empty()
    }

    pub fn context_len(&self) -> usize {
        self.request.prompt.len() + self.generated.len()
    }

    /// Whether `token` ends it: an EOS of the request, or of its grammar.
    pub fn is_end(&self, token: TokenId) -> bool {
        self.request.eos.contains(&token)
            || self.constraint.as_ref().is_some_and(|c| c.is_end(token))
    }

    /// The prompt followed by what it generated, without copying.
    pub fn context_tokens(&self) -> impl Iterator<Item = &TokenId> {
        self.request.prompt.iter().chain(&self.generated)
    }

    /// The prompt followed by what it generated.
    pub fn context(&self) -> Vec<TokenId> {
        self.context_tokens().copied().collect()
    }

    /// Context tokens not yet in the cache.
    pub fn pending(&self) -> usize {
        self.context_len() - self.in_cache
    }

    /// Whether it has been fed anything yet in its current cache life.
    pub fn is_fresh(&self) -> bool {
        self.in_cache == 0
    }

    /// Whether its next step feeds the one token it sampled last (decode).
    pub fn wants_decode(&self) -> bool {
        !self.is_fresh() && self.pending() == 1
    }

    /// Whether its next step feeds prompt (or recomputed context) tokens: it is fresh, or has
    /// more than one context token left to read.
    pub fn wants_prefill(&self) -> bool {
        self.is_fresh() || self.pending() > 1
    }

    /// The next `n` context tokens to feed, and the position of the first.
    pub fn next_chunk(&self, n: usize) -> (Vec<TokenId>, Position) {
        let tokens = self
            .context_tokens()
            .skip(self.in_cache)
            .take(n)
            .copied()
            .collect();
        (tokens, Position(self.in_cache as u32))
    }

    /// Records an output token and reports it in `events` with the text it completes (after
    /// stop-string hold-back) and its `logprobs`; returns whether a stop string ended the
    /// sequence.
    pub fn accept(
        &mut self,
        token: TokenId,
        logprobs: Option<TokenLogprobs>,
        detok: Option<&dyn Detokenizer>,
        events: &mut Vec<Event>,
    ) -> bool {
        self.first_token.get_or_insert_with(Instant::now);
        self.generated.push(token);
        self.history.push(token);
        let (text, stopped) = match detok {
            Some(detok) => {
                let piece = self.decoder.push(token, detok);
                let check = self.stops.push(&piece);
                (check.emit, check.stopped)
            }
            None => (String::new(), false),
        };
        events.push(Event::Token {
            id: self.id,
            token,
            text,
            logprobs,
        });
        stopped
    }

    /// The completion, with any held-back text flushed into `tail`.
    pub fn finish(mut self, reason: FinishReason, has_text: bool) -> (Completion, String) {
        let tail = if reason == FinishReason::Stop {
            String::new()
        } else {
            self.stops.flush()
        };
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let completion = Completion {
            id: self.id,
            prompt_tokens: self.request.prompt.len(),
            tokens: self.generated,
            text: has_text.then(|| self.stops.text().to_string()),
            finish_reason: reason,
            timings: Timings {
                time_to_first_token: first.duration_since(self.submitted),
                decode: now.duration_since(first),
            },
            preemptions: self.preemptions,
            speculation: self.counts,
            beams: self.beam_results,
            cached_tokens: self
                .cached_tokens
                .unwrap_or(0)
                .min(self.request.prompt.len()),
        };
        (completion, tail)
    }
}

/// How many leading tokens `a` and `b` share.
pub(crate) fn common_prefix<'t>(
    a: impl IntoIterator<Item = &'t TokenId>,
    b: impl IntoIterator<Item = &'t TokenId>,
) -> usize {
    a.into_iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_stops_at_the_first_difference() {
        let ids = |v: &[u32]| v.iter().copied().map(TokenId).collect::<Vec<_>>();
        assert_eq!(common_prefix(&ids(&[1, 2, 3]), &ids(&[1, 2, 4, 5])), 2);
        assert_eq!(common_prefix(&ids(&[]), &ids(&[1])), 0);
        assert_eq!(common_prefix(&ids(&[1, 2]), &ids(&[1, 2, 3])), 2);
    }
}
