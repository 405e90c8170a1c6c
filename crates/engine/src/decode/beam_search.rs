//! Beam search as a decoding mode: each running beam is a sequence of the cache of its own,
//! one row of the batch; a step feeds every beam's last token, [`BeamGroup::advance`] picks
//! the next beams, and the cache follows: beams that run on take over their parents' cache
//! sequences, or forks of them, and dropped beams free theirs. The arithmetic of a search
//! step is in [`crate::beam`].

use std::any::Any;

use kiln_core::sampling::Sampler;
use kiln_core::{Batch, CoreError, InferenceBackend, Position, SeqId};

use super::{Decoder, DecodingMode, ModeContext, Rows, StepContext};
use crate::beam::{BeamGroup, BeamHypothesis};
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::Request;
use crate::sequence::SeqState;
use crate::speculate::SpecCounts;

/// One request's beam search.
pub(crate) struct BeamSearchDecoder {
    group: BeamGroup,
    /// The cache sequence of each running beam, in the order of the group's beams (empty
    /// before the first search step, when the prompt runs as the request's own sequence).
    running: Vec<SeqId>,
    /// The cache sequences its beams may take: the request's own and `num_beams - 1` more.
    ids: Vec<SeqId>,
    /// The hypotheses the finished search returned.
    results: Vec<BeamHypothesis>,
    counts: SpecCounts,
}

impl BeamSearchDecoder {
    /// Whether its beams are past the first search step (each feeds its own last token).
    fn is_searching(&self) -> bool {
        !self.running.is_empty()
    }

    /// One search step on the beams' logits `rows` (before the first step, the prompt's one
    /// row). When the search ends, the best hypothesis is taken as the sequence's output.
    /// Returns why it ended, if it did.
    ///
    /// # Shapes
    /// `rows`: `[beams, vocab]`, row-major.
    fn search_step(
        &mut self,
        seq: &mut SeqState,
        rows: &[f32],
        vocab: usize,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let parents = if self.is_searching() {
            std::mem::take(&mut self.running)
        } else {
            vec![seq.seq]
        };
        // The search starts when the prompt is read: its time is the decode time (the tokens
        // come out only at the end).
        seq.first_token.get_or_insert_with(std::time::Instant::now);
        let advance = self
            .group
            .advance(rows, vocab, &seq.request.eos, seq.budget);
        self.counts.tokens += 1;
        if advance.done {
            let mut results = self.group.results();
            if let Some(detok) = cx.detok {
                for hypothesis in &mut results {
                    hypothesis.text = detok.decode(&hypothesis.tokens);
                }
            }
            seq.generated.clear();
            let Some(best) = results.first().cloned() else {
                return Ok(Some(FinishReason::Length));
            };
            for &token in &best.tokens {
                seq.accept(token, None, cx.detok, cx.events);
            }
            self.results = results;
            return Ok(Some(best.finish_reason));
        }
        let mut children = vec![0usize; parents.len()];
        for &(parent, _) in &advance.next {
            children[parent] += 1;
        }
        let mut free: Vec<SeqId> = self
            .ids
            .iter()
            .copied()
            .filter(|id| !parents.contains(id))
            .collect();
        for (&id, &n) in parents.iter().zip(&children) {
            if n == 0 {
                cx.cache.release(id);
                free.push(id);
            }
        }
        let mut continued = vec![false; parents.len()];
        let mut running = Vec::with_capacity(advance.next.len());
        for &(parent, _) in &advance.next {
            if !continued[parent] {
                continued[parent] = true;
                running.push(parents[parent]);
                continue;
            }
            let child = free.pop().expect("as many sequence ids as beams");
            cx.cache
                .fork(parents[parent], child)
                .map_err(CoreError::from)?;
            running.push(child);
        }
        self.running = running;
        seq.generated = self.group.running[0].tokens.clone();
        Ok(None)
    }
}

impl Decoder for BeamSearchDecoder {
    fn rows(&self) -> usize {
        self.group.params.num_beams
    }

    fn cache_seqs(&self, _seq: &SeqState) -> Vec<SeqId> {
        self.ids.clone()
    }

    /// One token per beam; a search whose prompt ends this step also reserves its other
    /// beams' sequences, empty, so the first search step can fork into them.
    fn appends(&self, seq: &SeqState, n: usize) -> Vec<(SeqId, usize)> {
        if self.is_searching() {
            return self.running.iter().map(|&id| (id, n)).collect();
        }
        let mut step = vec![(seq.seq, n)];
        if n == seq.pending() {
            step.extend(self.ids.iter().skip(1).map(|&id| (id, 0)));
        }
        step
    }

    fn feed(&self, seq: &SeqState, n: usize, batch: &mut Batch) -> Result<Vec<usize>, EngineError> {
        if !self.is_searching() {
            let (tokens, start) = seq.next_chunk(n);
            batch.push(seq.seq, &tokens, start)?;
            return Ok(vec![1]);
        }
        let start = Position(seq.in_cache as u32);
        for (beam, &id) in self.group.running.iter().zip(&self.running) {
            let last = *beam.tokens.last().expect("a running beam has a token");
            batch.push(id, &[last], start)?;
        }
        Ok(vec![1; self.running.len()])
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
        self.search_step(seq, rows.logits, rows.vocab, cx)
    }

    /// A beam search is deterministic: it starts over and reaches the same answer.
    fn reset(&mut self, seq: &mut SeqState) {
        self.group.restart();
        self.running.clear();
        seq.generated.clear();
    }

    fn counts(&self) -> SpecCounts {
        self.counts
    }

    fn take_hypotheses(&mut self) -> Vec<BeamHypothesis> {
        std::mem::take(&mut self.results)
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Beam search for the requests that ask for it ([`Request::beam`]).
#[derive(Default)]
pub(crate) struct BeamSearchMode {
    /// Beams' extra cache sequences are numbered from [`FIRST_BEAM_SEQ`] on.
    next_beam_seq: u64,
}

/// Cache sequence ids of beams start here, far above requests' own (their request ids).
const FIRST_BEAM_SEQ: u64 = 1 << 62;

impl<B: InferenceBackend> DecodingMode<B> for BeamSearchMode {
    fn name(&self) -> &'static str {
        "beam search"
    }

    fn serves(&self, request: &Request) -> bool {
        request.beam.is_some()
    }

    fn decoder(
        &mut self,
        seq: &SeqState,
        _sampler: Sampler,
        cx: &ModeContext<'_>,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        let request = &seq.request;
        let beam = request.beam.expect("served: a beam search");
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if let Some(why) = beam.problem() {
            return invalid(why);
        }
        let rows = cx.max_rows;
        if beam.num_beams > rows {
            return invalid(format!(
                "{} beams take {} rows of the batch; at most {rows} run for one request \
                 (the engine's max_batch{})",
                beam.num_beams,
                beam.num_beams,
                if request.group.is_some() && rows < cx.config.max_batch {
                    " less the rows kept for other requests"
                } else {
                    ""
                }
            ));
        }
        let s = &request.sampling;
        let refused = if !request.stop.is_empty() {
            Some("stop strings")
        } else if request.logprobs.is_some() {
            Some("log-probabilities")
        } else if request.keep_cache || request.continues.is_some() {
            Some("kept caches")
        } else if s.repetition_penalty != 1.0
            || s.presence_penalty != 0.0
            || s.frequency_penalty != 0.0
        {
            Some("repetition, presence or frequency penalties")
        } else if !s.logit_bias.is_empty() {
            // Its scores are log-probabilities of the raw logits; where a bias would go in
            // them (transformers adds it after the log-softmax, into the beam's score) has no
            // OpenAI meaning to follow.
            Some("a logit bias")
        } else if request.constraint.is_some() {
            Some("a grammar constraint")
        } else {
            None
        };
        if let Some(what) = refused {
            return invalid(format!("beam search does not take {what}"));
        }
        if let Some(rows) = cx.cache.max_sequences().filter(|&r| r < beam.num_beams) {
            return invalid(format!(
                "{} beams need as many sequences of the KV cache, which holds {rows} \
                 ({} cache)",
                beam.num_beams,
                cx.cache.kind()
            ));
        }
        let mut ids = vec![seq.seq];
        for _ in 1..beam.num_beams {
            ids.push(SeqId(FIRST_BEAM_SEQ + self.next_beam_seq));
            self.next_beam_seq += 1;
        }
        Ok(Box::new(BeamSearchDecoder {
            group: BeamGroup::new(beam),
            running: Vec::new(),
            ids,
            results: Vec::new(),
            counts: SpecCounts::default(),
        }))
    }
}
