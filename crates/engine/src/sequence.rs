//! One request's state inside the engine: [`SeqState`], what every request has (its context,
//! its place in the cache, its text and stop strings, its timings), and the [`Decoder`] of its
//! decoding mode, which owns everything that belongs to one mode only.

use std::time::Instant;

use kiln_core::{Position, SeqId, TokenId};

use crate::decode::Decoder;
use crate::detok::{Detokenizer, IncrementalDecoder};
use crate::finish::FinishReason;
use crate::request::{Completion, Event, Request, RequestId, Timings, TokenLogprobs};
use crate::stop::StopMatcher;

/// A request being served: its state and its decoder, kept apart so a decoder can work on the
/// state it belongs to.
pub(crate) struct Sequence {
    pub state: SeqState,
    pub decoder: Box<dyn Decoder>,
}

/// What every request being served has. Its *context* is the prompt followed by what it
/// generated; the first `in_cache` tokens of the context are in the KV cache. Each step feeds
/// the next tokens of the context (a prefill chunk, or the one token sampled last) and its
/// decoder picks what comes next when the whole context is in the cache. Preemption sets
/// `in_cache` to 0: the context is recomputed later, and the decoder's sampling state survives,
/// so the continuation is the same.
pub(crate) struct SeqState {
    pub id: RequestId,
    /// The cache's name for it: its own id's, or that of the kept request it continues.
    pub seq: SeqId,
    pub request: Request,
    pub generated: Vec<TokenId>,
    pub in_cache: usize,
    /// Most tokens it may generate (`max_tokens`, less what the context leaves).
    pub budget: usize,
    pub text: IncrementalDecoder,
    pub stops: StopMatcher,
    pub submitted: Instant,
    pub first_token: Option<Instant>,
    pub preemptions: usize,
    /// Prompt tokens found in the cache when it first started (None until then).
    pub cached_tokens: Option<usize>,
    /// The caller asked it to end ([`crate::Engine::stop`]); it ends at the next step.
    pub stop_requested: bool,
}

impl SeqState {
    pub fn new(id: RequestId, request: Request, budget: usize) -> Self {
        let stops = StopMatcher::new(&request.stop);
        Self {
            id,
            seq: SeqId(id.0),
            request,
            generated: Vec::new(),
            in_cache: 0,
            budget,
            text: IncrementalDecoder::default(),
            stops,
            submitted: Instant::now(),
            first_token: None,
            preemptions: 0,
            cached_tokens: None,
            stop_requested: false,
        }
    }

    pub fn context_len(&self) -> usize {
        self.request.prompt.len() + self.generated.len()
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

    /// Records that a step put `n` more context tokens in the cache; returns whether the
    /// whole context is there now, so that the step's rows decide what comes next (a prompt
    /// read in chunks ignores the rows of all but its last chunk).
    pub fn feed_done(&mut self, n: usize) -> bool {
        self.in_cache += n;
        self.pending() == 0
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
        let (text, stopped) = match detok {
            Some(detok) => {
                let piece = self.text.push(token, detok);
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

    /// The completion, with any held-back text flushed into `tail`; `decoder` gives its
    /// counts and any alternatives.
    pub fn finish(
        mut self,
        reason: FinishReason,
        has_text: bool,
        decoder: &mut dyn Decoder,
    ) -> (Completion, String) {
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
            stop_string: (reason == FinishReason::Stop)
                .then(|| self.stops.matched().map(str::to_string))
                .flatten(),
            timings: Timings {
                time_to_first_token: first.duration_since(self.submitted),
                decode: now.duration_since(first),
            },
            preemptions: self.preemptions,
            speculation: decoder.counts(),
            beams: decoder.take_hypotheses(),
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
