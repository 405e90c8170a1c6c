//! Decoding modes. A request's mode is a [`Decoder`] its sequence holds: it says what the
//! sequence feeds each step and what that appends to the cache, consumes the logits rows the
//! forward gave it, reports tokens, and resets itself when the sequence is preempted. The
//! scheduler and the runner never ask which mode a sequence is in.
//!
//! A [`DecodingMode`] is the registry's entry for a mode: it says which requests it serves,
//! builds their decoders, and may work on all of its sequences together before the step's
//! cache space is reserved (speculative decoding drafts them in one batch of its draft model).
//! The engine asks the modes of its registry in order; the first that serves a request decodes
//! it ([`standard_modes`]: beam search, then speculation when the engine speculates, then plain
//! sampling, which serves everything).
//!
//! Adding a mode is a file here and a line in [`standard_modes`] (or, for a mode of one
//! engine only, [`crate::Engine::with_mode`]).

pub(crate) mod beam_search;
pub(crate) mod sampling;
#[cfg(test)]
mod second_best;
pub(crate) mod speculative;

use std::any::Any;

use kiln_core::kv_cache::{CacheBook, KvCache};
use kiln_core::sampling::Sampler;
use kiln_core::{Batch, InferenceBackend, ModelShape, SeqId, TokenId};

use crate::beam::BeamHypothesis;
use crate::config::EngineConfig;
use crate::detok::Detokenizer;
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::{Event, Request};
use crate::sequence::SeqState;
use crate::speculate::SpecCounts;

/// The logits rows one sequence's inputs produced in a step.
pub(crate) struct Rows<'r> {
    /// `[rows, vocab]`, row-major, in the order the decoder fed them; empty when the device
    /// picked each row's argmax itself (see `argmax`).
    pub logits: &'r [f32],
    /// The token the device picked for this sequence's one row, when every row of the step
    /// was a plain argmax ([`Decoder::picks_argmax`] held for every sequence).
    pub argmax: Option<TokenId>,
    pub vocab: usize,
}

/// What a decoder may use while it consumes its rows.
pub(crate) struct StepContext<'c> {
    /// The target model's cache (beam search forks and frees beams; speculation rolls back).
    pub cache: &'c mut dyn CacheBook,
    /// Decodes text for streaming and stop strings, when the engine has a tokenizer.
    pub detok: Option<&'c dyn Detokenizer>,
    /// Where the sequence reports its tokens and text.
    pub events: &'c mut Vec<Event>,
}

/// One sequence's decoding mode and that mode's state.
pub(crate) trait Decoder: Any + Send + Sync {
    /// Rows of the batch it holds while it runs (one per beam of a beam search).
    fn rows(&self) -> usize {
        1
    }

    /// Every cache sequence it may hold (all freed when it ends or is preempted).
    fn cache_seqs(&self, seq: &SeqState) -> Vec<SeqId> {
        vec![seq.seq]
    }

    /// What the step appends to each of its cache sequences when the scheduler gives it `n`
    /// context tokens, for [`kiln_core::kv_cache::CacheBook::reserve`].
    fn appends(&self, seq: &SeqState, n: usize) -> Vec<(SeqId, usize)> {
        vec![(seq.seq, n)]
    }

    /// Pushes this step's inputs, for `n` context tokens, into `batch`; returns the logits
    /// rows it wants of each batch sequence it pushed, in order.
    ///
    /// # Errors
    /// A batch that refuses the tokens (never for a well-formed sequence).
    fn feed(&self, seq: &SeqState, n: usize, batch: &mut Batch) -> Result<Vec<usize>, EngineError> {
        let (tokens, start) = seq.next_chunk(n);
        batch.push(seq.seq, &tokens, start)?;
        Ok(vec![1])
    }

    /// Whether its next token is the plain argmax of its one logits row, which a device can
    /// pick itself (only the id comes back).
    fn picks_argmax(&self, _seq: &SeqState) -> bool {
        false
    }

    /// Work that does not depend on this step's logits and can run on another thread while
    /// the forward runs (a grammar's next mask), when the step's `n` tokens complete the
    /// context.
    fn overlap(&self, _seq: &SeqState, _n: usize) -> Option<Box<dyn FnOnce() + Send>> {
        None
    }

    /// Consumes the rows its inputs produced (`n` context tokens were fed; their K/V are in
    /// the cache now): records what it decided in `seq` and reports it in `cx.events`.
    /// Returns why the sequence ended, if it did.
    ///
    /// # Errors
    /// A sampling failure (non-finite logits) or a cache that refuses a fork.
    fn consume(
        &mut self,
        seq: &mut SeqState,
        n: usize,
        rows: Rows<'_>,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError>;

    /// Forgets what it fed past its context, when the sequence is preempted: the engine then
    /// frees its cache sequences and sets `seq.in_cache` to 0.
    fn reset(&mut self, _seq: &mut SeqState) {}

    /// Forwards that produced its tokens, and drafts proposed and accepted.
    fn counts(&self) -> SpecCounts;

    /// The alternatives it found (a beam search's hypotheses, best first), taken when it
    /// finishes.
    fn take_hypotheses(&mut self) -> Vec<BeamHypothesis> {
        Vec::new()
    }

    /// For a [`DecodingMode`] that works on its own decoders together.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// What a mode may look at when it builds a decoder.
pub(crate) struct ModeContext<'c> {
    pub shape: &'c ModelShape,
    pub config: &'c EngineConfig,
    /// Most rows this request's group may hold.
    pub max_rows: usize,
    pub cache: &'c dyn CacheBook,
}

/// A sequence the step plan feeds, as a mode sees it before the cache space is reserved.
pub(crate) struct Planned<'p> {
    pub state: &'p SeqState,
    pub decoder: &'p mut dyn Decoder,
}

/// A decoding mode in the engine's registry.
pub(crate) trait DecodingMode<B: InferenceBackend> {
    /// Its name, to find it in the registry.
    fn name(&self) -> &'static str;

    /// Whether it decodes `request`.
    fn serves(&self, request: &Request) -> bool;

    /// The decoder of a request it serves, with `sampler` built (and checked) from the
    /// request's sampling settings.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] for what the mode does not take (a beam search with
    /// stop strings); [`EngineError::InvalidConfig`] for an engine it cannot run on.
    fn decoder(
        &mut self,
        seq: &SeqState,
        sampler: Sampler,
        cx: &ModeContext<'_>,
    ) -> Result<Box<dyn Decoder>, EngineError>;

    /// Works on the step's planned sequences (all of them, every mode's) before the cache
    /// space is reserved; called again if a preemption makes the scheduler plan again.
    ///
    /// # Errors
    /// A failed forward of a model of its own.
    fn prepare(&mut self, _planned: &mut [Planned<'_>]) -> Result<(), EngineError> {
        Ok(())
    }

    /// A sequence left the engine or was preempted: frees what the mode holds for it.
    fn release(&mut self, _seq: SeqId) {}

    /// A cache of its own (a draft model's), to inspect its use.
    fn own_cache(&self) -> Option<&dyn KvCache<B>> {
        None
    }
}

/// The registry of an engine with `config`: beam search, speculation (when configured), and
/// plain sampling, asked in that order.
pub(crate) fn standard_modes<'a, B: InferenceBackend>(
    config: &EngineConfig,
) -> Vec<Box<dyn DecodingMode<B> + 'a>> {
    let mut modes: Vec<Box<dyn DecodingMode<B> + 'a>> =
        vec![Box::new(beam_search::BeamSearchMode::default())];
    if let Some(speculation) = config.speculation {
        modes.push(Box::new(speculative::SpeculativeMode::new(speculation)));
    }
    modes.push(Box::new(sampling::SamplingMode));
    modes
}
