//! Plain decoding: each step feeds the context's next tokens and, once the whole context is
//! in the cache, draws the next token from its one logits row with the request's sampler
//! (whose first processor is the request's grammar, for structured output).

use std::any::Any;

use kiln_core::sampling::{Sampler, TokenHistory};
use kiln_core::{CoreError, InferenceBackend, TokenId};

use super::{Decoder, DecodingMode, ModeContext, Rows, StepContext};
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::{Request, TokenLogprobs};
use crate::sequence::SeqState;
use crate::speculate::SpecCounts;
use crate::structured::GrammarMatcher;

/// How a sequence picks its tokens: its sampler, the history its penalties read, its place in
/// its grammar, and the counts of what it produced.
pub(crate) struct Sampling {
    pub sampler: Sampler,
    pub history: TokenHistory,
    /// Its position in its grammar (structured output); the sampler holds a clone as its
    /// first processor.
    pub constraint: Option<GrammarMatcher>,
    pub counts: SpecCounts,
}

impl Sampling {
    pub fn new(request: &Request, mut sampler: Sampler) -> Self {
        let constraint = request.constraint.as_ref().map(|g| g.start(&request.eos));
        if let Some(matcher) = &constraint {
            sampler.prepend_processor(Box::new(matcher.clone()));
        }
        Self {
            sampler,
            history: TokenHistory::with_prompt(&request.prompt),
            constraint,
            counts: SpecCounts::default(),
        }
    }

    /// Whether `token` ends the sequence: an EOS of the request, or of its grammar.
    fn is_end(&self, seq: &SeqState, token: TokenId) -> bool {
        seq.request.eos.contains(&token)
            || self.constraint.as_ref().is_some_and(|c| c.is_end(token))
    }

    /// Samples the next token from `logits`; returns why the sequence ended, if it did.
    ///
    /// # Errors
    /// Logits the sampler cannot draw from.
    pub fn sample(
        &mut self,
        seq: &mut SeqState,
        logits: &[f32],
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let token = self
            .sampler
            .try_sample(logits, &self.history)
            .map_err(CoreError::from)?;
        Ok(self.take(seq, token, logits, cx))
    }

    /// The sequence takes `token`, drawn from `logits`: an EOS ends it, anything else is
    /// output (and may complete a stop string or the budget). Returns why it ended, if it did.
    pub fn take(
        &mut self,
        seq: &mut SeqState,
        token: TokenId,
        logits: &[f32],
        cx: &mut StepContext<'_>,
    ) -> Option<FinishReason> {
        self.counts.tokens += 1;
        if self.is_end(seq, token) {
            return Some(FinishReason::Eos);
        }
        let logprobs = seq
            .request
            .logprobs
            .map(|top| TokenLogprobs::from_logits(logits, token, top));
        self.history.push(token);
        if seq.accept(token, logprobs, cx.detok, cx.events) {
            Some(FinishReason::Stop)
        } else if seq.generated.len() >= seq.budget {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

impl Decoder for Sampling {
    fn picks_argmax(&self, seq: &SeqState) -> bool {
        self.sampler.is_plain_greedy()
            && seq.request.logprobs.is_none()
            && self.constraint.is_none()
    }

    fn overlap(&self, seq: &SeqState, n: usize) -> Option<Box<dyn FnOnce() + Send>> {
        let matcher = self.constraint.clone().filter(|_| n == seq.pending())?;
        let generated = seq.generated.clone();
        Some(Box::new(move || matcher.prepare(&generated)))
    }

    fn consume(
        &mut self,
        seq: &mut SeqState,
        n: usize,
        rows: Rows<'_>,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        if !seq.feed_done(n) {
            return Ok(None);
        }
        self.counts.forwards += 1;
        match rows.argmax {
            Some(token) => Ok(self.take(seq, token, rows.logits, cx)),
            None => self.sample(seq, rows.logits, cx),
        }
    }

    fn counts(&self) -> SpecCounts {
        self.counts
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Plain sampling serves every request (the registry's last entry).
pub(crate) struct SamplingMode;

impl<B: InferenceBackend> DecodingMode<B> for SamplingMode {
    fn name(&self) -> &'static str {
        "sampling"
    }

    fn serves(&self, _request: &Request) -> bool {
        true
    }

    fn decoder(
        &mut self,
        seq: &SeqState,
        sampler: Sampler,
        _cx: &ModeContext<'_>,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        Ok(Box::new(Sampling::new(&seq.request, sampler)))
    }
}
