//! The draft model of speculative decoding ([`crate::DraftSource::Model`]): a second model,
//! sharing the target's vocabulary, proposes each decoding sequence's drafts one token per
//! forward on a cache of its own, all sequences of a step in one batch per draft position.
//!
//! Its cache follows each sequence's context lazily: a sequence's draft cache holds some
//! leading part of its context (`in_cache` tokens, kept by the engine in the sequence) and
//! possibly drafts fed after it; before proposing, anything past the trusted part is cut, and
//! the first draft forward feeds the context tokens it has not seen (after a plain step,
//! the one sampled token; after a check that accepted drafts, nothing it did not already feed
//! but the token after them).

use kiln_core::kv_cache::KvCache;
use kiln_core::sampling::{Sampler, TokenHistory};
use kiln_core::{
    Batch, CausalLm, CoreError, InferenceBackend, LogitsFor, Position, SeqId, TokenId,
};

use crate::error::EngineError;

/// A draft model and its cache.
pub(crate) struct DraftModel<'a, B: InferenceBackend> {
    model: &'a dyn CausalLm<B>,
    cache: Box<dyn KvCache<B>>,
}

/// One sequence's drafting in a step.
pub(crate) struct DraftJob<'s> {
    /// The sequence's name in the draft cache (the same as in the target's).
    pub seq: SeqId,
    /// Its context: prompt and generated tokens.
    pub context: Vec<TokenId>,
    /// Leading context tokens the draft cache holds for it; the caller keeps it between steps.
    pub in_cache: &'s mut usize,
    /// Most drafts to propose.
    pub limit: usize,
    /// Draws (or picks) each draft under the request's sampling settings.
    pub sampler: &'s mut Sampler,
    /// The request's token history, which grows with the drafts.
    pub history: TokenHistory,
    /// Tokens that end the request: drafting stops after proposing one.
    pub eos: &'s [TokenId],
    /// The proposed drafts.
    pub drafts: &'s mut Vec<TokenId>,
    /// The distribution each draft was drawn from (empty for greedy requests).
    pub q: &'s mut Vec<Vec<f32>>,
}

impl<'a, B: InferenceBackend> DraftModel<'a, B> {
    pub fn new(model: &'a dyn CausalLm<B>, cache: Box<dyn KvCache<B>>) -> Self {
        Self { model, cache }
    }

    pub fn cache(&self) -> &dyn KvCache<B> {
        &*self.cache
    }

    /// Frees a sequence's draft cache.
    pub fn release(&mut self, seq: SeqId) {
        self.cache.release(seq);
    }

    /// Proposes up to each job's limit of drafts: one forward catches each sequence's draft
    /// cache up with its context and proposes the first draft, then one forward per further
    /// draft. A cache too full for a step ends drafting early (fewer drafts, never an error).
    /// Afterwards the draft cache holds each context and all of its drafts but the last.
    ///
    /// # Errors
    /// A failed draft forward (the draft cache is then cleared).
    pub fn propose(&mut self, jobs: &mut [DraftJob<'_>]) -> Result<(), EngineError> {
        let max_positions = self.model.shape().max_positions;
        for job in jobs.iter_mut() {
            job.limit = job
                .limit
                .min(max_positions.saturating_sub(job.context.len()));
            self.trust_only_context(job);
        }
        let mut active: Vec<usize> = (0..jobs.len()).filter(|&j| jobs[j].limit > 0).collect();
        let mut catching_up = true;
        while !active.is_empty() {
            let mut batch = Batch::new();
            let mut step = Vec::with_capacity(active.len());
            for &j in &active {
                let job = &jobs[j];
                let (tokens, start) = if catching_up {
                    (&job.context[*job.in_cache..], *job.in_cache)
                } else {
                    let last = job.drafts.len() - 1;
                    (&job.drafts[last..], job.context.len() + last)
                };
                batch.push(job.seq, tokens, Position(start as u32))?;
                step.push((job.seq, tokens.len()));
            }
            if self.cache.reserve(&step).is_err() {
                break;
            }
            let logits = self
                .model
                .forward(&batch, &mut *self.cache, LogitsFor::LastOfEachSequence)
                .inspect_err(|_| {
                    self.cache.clear();
                    for job in jobs.iter_mut() {
                        *job.in_cache = 0;
                        job.drafts.clear();
                        job.q.clear();
                    }
                })?;
            let rows = kiln_core::tensor::host_f32(logits);
            let vocab = self.model.shape().vocab;
            for (row, &j) in rows.chunks_exact(vocab).zip(&active) {
                let job = &mut jobs[j];
                if catching_up {
                    *job.in_cache = job.context.len();
                }
                let (token, q) = job
                    .sampler
                    .propose(row, &job.history)
                    .map_err(CoreError::from)?;
                job.history.push(token);
                job.drafts.push(token);
                job.q.extend(q);
            }
            active.retain(|&j| {
                let job = &jobs[j];
                job.drafts.len() < job.limit && !job.eos.contains(&job.drafts[job.drafts.len() - 1])
            });
            catching_up = false;
        }
        Ok(())
    }

    /// Cuts the job's draft cache back to context tokens it can trust, always leaving the
    /// last context token to feed (its logits propose the first draft).
    fn trust_only_context(&mut self, job: &mut DraftJob<'_>) {
        let keep = (*job.in_cache)
            .min(job.context.len() - 1)
            .min(self.cache.seq_len(job.seq));
        if self.cache.seq_len(job.seq) > keep
            && (keep == 0 || self.cache.truncate(job.seq, keep).is_err())
        {
            // A ring that cannot roll back starts over.
            self.cache.release(job.seq);
            *job.in_cache = 0;
        } else {
            *job.in_cache = keep;
        }
    }
}
