//! Speculative decoding: before a decoding sequence's step, drafts of the tokens after its
//! last sampled one are proposed (by prompt lookup, or by a draft model for all sequences of
//! the step in one batch); the step feeds the last token and the drafts, and the target's
//! rows accept drafts in order until one is rejected (Leviathan et al., 2023). The cache is
//! rolled back to what the context really holds.

use std::any::Any;

use kiln_core::kv_cache::KvCache;
use kiln_core::sampling::{Sampler, Verdict};
use kiln_core::{Batch, CausalLm, CoreError, InferenceBackend, SeqId, TokenId};

use super::sampling::Sampling;
use super::{Decoder, DecodingMode, ModeContext, Planned, Rows, StepContext};
use crate::drafter::{DraftJob, DraftModel};
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::Request;
use crate::sequence::SeqState;
use crate::speculate::{DraftSource, SpecCounts, Speculation};

/// A sequence that samples as [`Sampling`] does and verifies drafts.
pub(crate) struct Speculative {
    base: Sampling,
    speculation: Speculation,
    /// Draft tokens this step feeds after its last sampled token.
    drafts: Vec<TokenId>,
    /// The distribution each draft was drawn from (a draft model's sampled drafts only).
    draft_q: Vec<Vec<f32>>,
    /// Most drafts it proposes next step (adaptive speculation moves it after each check).
    draft_limit: usize,
    /// Leading context tokens the draft model's cache holds for it.
    draft_in_cache: usize,
    /// Draws the draft model's proposals (with a draft model only).
    draft_sampler: Option<Sampler>,
}

impl Speculative {
    /// Checks the drafts against the target's `rows` (one for the token before the drafts, one
    /// per draft): accepted drafts and the token after them are taken in order, until a draft
    /// is rejected or the sequence ends; the cache is rolled back to what the context really
    /// holds. Returns why the sequence ended, if it did.
    ///
    /// # Shapes
    /// `rows`: `[1 + drafts, vocab]`, row-major.
    fn verify(
        &mut self,
        seq: &mut SeqState,
        rows: &[f32],
        vocab: usize,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let drafts = std::mem::take(&mut self.drafts);
        let draft_q = std::mem::take(&mut self.draft_q);
        let mut reason = None;
        let mut accepted = 0;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let Some(&draft) = drafts.get(j) else {
                // Every draft stood: the last row picks the token after them.
                reason = self.base.sample(seq, row, cx)?;
                break;
            };
            let verdict = self
                .base
                .sampler
                .verify(
                    row,
                    &self.base.history,
                    draft,
                    draft_q.get(j).map(Vec::as_slice),
                )
                .map_err(CoreError::from)?;
            let token = match verdict {
                Verdict::Accepted => draft,
                Verdict::Rejected(token) => token,
            };
            accepted += usize::from(verdict == Verdict::Accepted);
            reason = self.base.take(seq, token, row, cx);
            if reason.is_some() || verdict != Verdict::Accepted {
                break;
            }
        }
        let counts = &mut self.base.counts;
        counts.forwards += 1;
        counts.drafted += drafts.len() as u64;
        counts.accepted += accepted as u64;
        self.draft_limit = self.speculation.next_limit(accepted);
        // The forward wrote the last token and every draft; the context holds the token and
        // the accepted drafts (less an accepted EOS, which is not part of it).
        let before = seq.in_cache;
        let fed = 1 + drafts.len();
        if self.draft_sampler.is_some() {
            // The draft model fed the context and every draft but the last; the accepted ones
            // are context now.
            self.draft_in_cache = before + 1 + accepted.min(drafts.len() - 1);
        }
        let held = (before + 1 + accepted).min(seq.context_len());
        seq.in_cache = held;
        if held < before + fed && cx.cache.truncate(seq.seq, held).is_err() {
            // A cache that cannot roll back (a sliding ring) recomputes the context instead.
            cx.cache.release(seq.seq);
            seq.in_cache = 0;
        }
        Ok(reason)
    }
}

impl Decoder for Speculative {
    fn appends(&self, seq: &SeqState, n: usize) -> Vec<(SeqId, usize)> {
        vec![(seq.seq, n + self.drafts.len())]
    }

    fn feed(&self, seq: &SeqState, n: usize, batch: &mut Batch) -> Result<Vec<usize>, EngineError> {
        let (mut tokens, start) = seq.next_chunk(n);
        tokens.extend(&self.drafts);
        batch.push(seq.seq, &tokens, start)?;
        Ok(vec![1 + self.drafts.len()])
    }

    fn picks_argmax(&self, seq: &SeqState) -> bool {
        self.drafts.is_empty() && self.base.picks_argmax(seq)
    }

    fn overlap(&self, seq: &SeqState, n: usize) -> Option<Box<dyn FnOnce() + Send>> {
        self.base.overlap(seq, n)
    }

    fn consume(
        &mut self,
        seq: &mut SeqState,
        n: usize,
        rows: Rows<'_>,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        if self.drafts.is_empty() {
            self.base.consume(seq, n, rows, cx)
        } else {
            self.verify(seq, rows.logits, rows.vocab, cx)
        }
    }

    fn reset(&mut self, _seq: &mut SeqState) {
        self.draft_in_cache = 0;
        self.drafts.clear();
        self.draft_q.clear();
    }

    fn counts(&self) -> SpecCounts {
        self.base.counts
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Speculation for every request that is not a beam search, with prompt lookup or the draft
/// model the engine was given ([`crate::Engine::with_draft_model`]).
pub(crate) struct SpeculativeMode<'a, B: InferenceBackend> {
    speculation: Speculation,
    drafter: Option<DraftModel<'a, B>>,
}

impl<'a, B: InferenceBackend> SpeculativeMode<'a, B> {
    pub fn new(speculation: Speculation) -> Self {
        Self {
            speculation,
            drafter: None,
        }
    }

    /// Speculation drafting with `model` on `cache`.
    pub fn with_draft_model(
        speculation: Speculation,
        model: &'a dyn CausalLm<B>,
        cache: Box<dyn KvCache<B>>,
    ) -> Self {
        Self {
            speculation,
            drafter: Some(DraftModel::new(model, cache)),
        }
    }
}

impl<B: InferenceBackend> DecodingMode<B> for SpeculativeMode<'_, B> {
    fn name(&self) -> &'static str {
        "speculative"
    }

    fn serves(&self, _request: &Request) -> bool {
        true
    }

    fn decoder(
        &mut self,
        seq: &SeqState,
        sampler: Sampler,
        cx: &ModeContext<'_>,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        if self.speculation.source == DraftSource::Model && self.drafter.is_none() {
            return Err(EngineError::InvalidConfig(
                "speculation with a draft model, but none was given (Engine::with_draft_model)"
                    .into(),
            ));
        }
        let draft_sampler = match self.drafter {
            Some(_) => {
                // Its own stream of random numbers: the drafts must not be correlated with
                // the draws that verify them.
                let mut params = seq.request.sampling.clone();
                params.seed = params.seed.map(|s| s ^ 0x9e37_79b9_7f4a_7c15);
                Some(Sampler::new(&params, cx.shape.vocab).map_err(CoreError::from)?)
            }
            None => None,
        };
        Ok(Box::new(Speculative {
            base: Sampling::new(&seq.request, sampler),
            speculation: self.speculation,
            drafts: Vec::new(),
            draft_q: Vec::new(),
            draft_limit: usize::MAX,
            draft_in_cache: 0,
            draft_sampler,
        }))
    }

    /// Gives each decoding sequence of the planned step its drafts: the step then feeds its
    /// last sampled token and the drafts. Drafts never outrun the request's budget (the token
    /// after the last accepted draft always comes too).
    fn prepare(&mut self, planned: &mut [Planned<'_>]) -> Result<(), EngineError> {
        let speculation = self.speculation;
        let mut ours: Vec<(&SeqState, &mut Speculative)> = planned
            .iter_mut()
            .filter_map(|p| {
                let decoder = p.decoder.as_any_mut().downcast_mut::<Speculative>()?;
                Some((p.state, decoder))
            })
            .collect();
        let drafting = ours.iter().filter(|(s, _)| s.wants_decode()).count();
        // In a larger batch the verification rows would cost more than the drafts save.
        let batch_too_large = speculation.max_batch > 0 && drafting > speculation.max_batch;
        let mut limits = vec![0; ours.len()];
        for ((state, decoder), limit) in ours.iter_mut().zip(&mut limits) {
            decoder.drafts.clear();
            decoder.draft_q.clear();
            if state.wants_decode() && !batch_too_large {
                let room = state.budget.saturating_sub(state.generated.len() + 1);
                *limit = room.min(decoder.draft_limit).min(speculation.draft_tokens);
            }
        }
        match &mut self.drafter {
            Some(drafter) => {
                let mut jobs: Vec<DraftJob<'_>> = ours
                    .iter_mut()
                    .zip(&limits)
                    .filter(|&(_, &limit)| limit > 0)
                    .map(|((state, decoder), &limit)| {
                        let Speculative {
                            base,
                            drafts,
                            draft_q,
                            draft_in_cache,
                            draft_sampler,
                            ..
                        } = &mut **decoder;
                        DraftJob {
                            seq: state.seq,
                            context: state.context(),
                            in_cache: draft_in_cache,
                            limit,
                            sampler: draft_sampler.as_mut().expect("made with the drafter"),
                            history: base.history.clone(),
                            eos: &state.request.eos,
                            drafts,
                            q: draft_q,
                        }
                    })
                    .collect();
                drafter.propose(&mut jobs)?;
            }
            None => {
                for ((state, decoder), &limit) in ours.iter_mut().zip(&limits) {
                    if limit > 0 {
                        decoder.drafts = speculation.draft(&state.context(), limit);
                    }
                }
            }
        }
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(drafter) = &mut self.drafter {
            drafter.release(seq);
        }
    }

    fn own_cache(&self) -> Option<&dyn KvCache<B>> {
        self.drafter.as_ref().map(DraftModel::cache)
    }
}
