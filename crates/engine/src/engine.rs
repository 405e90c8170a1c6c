//! [`Engine`]: many requests at once over one KV cache. Each [`Engine::step`] is one forward:
//! every running sequence that has a sampled token feeds it (decode), sequences still reading
//! their prompt feed their next chunk (prefill), fresh prompts run packed with a block-causal
//! mask, and new requests are admitted while there is room. [`StepPolicy`] says whether one
//! step mixes decodes with prompt chunks or keeps them apart.
//!
//! A step first starts fresh sequences on the cached blocks of any earlier request with the
//! same leading tokens (prefix caching, paged cache), then reserves the cache space of the
//! whole step ([`kiln_core::kv_cache::CacheBook::reserve`]) before the model runs: when the cache is full, the
//! newest running sequence is preempted (and later recomputed) up front, and the forward never
//! fails for lack of space.
//!
//! Everything that generates runs on this loop: [`crate::generate()`] is an engine with one
//! request on a lent cache, a [`crate::Session`] is an engine whose requests continue each
//! other's kept cache ([`Request::keep_cache`], [`Request::continues`]), and
//! [`crate::Snapshot::prefill`] keeps one prompt's cache to export it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};

use kiln_core::kv_cache::{CacheError, HostKv, KvCache};
use kiln_core::sampling::Sampler;
use kiln_core::{CausalLm, CoreError, InferenceBackend, SeqId, TokenId};

pub use crate::config::{EngineConfig, PrefixStats, StepPolicy};
use crate::decode::speculative::SpeculativeMode;
use crate::decode::{DecodingMode, ModeContext, Planned, StepContext, standard_modes};
use crate::detok::Detokenizer;
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::{Completion, Event, MAX_TOP_LOGPROBS, Request, RequestId, prompt_problem};
use crate::runner;
use crate::scheduler::{Scheduler, StepPlan};
use crate::sequence::{SeqState, Sequence, common_prefix};
use crate::speculate::{DraftSource, SpecCounts, Speculation};

/// The cache an engine works on: its own, or one the caller lends it for the engine's life.
enum EngineCache<'a, B: InferenceBackend> {
    Owned(Box<dyn KvCache<B>>),
    Lent(&'a mut dyn KvCache<B>),
}

impl<'a, B: InferenceBackend> Deref for EngineCache<'a, B> {
    type Target = dyn KvCache<B> + 'a;

    fn deref(&self) -> &Self::Target {
        match self {
            Self::Owned(cache) => cache.as_ref(),
            Self::Lent(cache) => &**cache,
        }
    }
}

impl<B: InferenceBackend> DerefMut for EngineCache<'_, B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Self::Owned(cache) => cache.as_mut(),
            Self::Lent(cache) => &mut **cache,
        }
    }
}

/// The cache a finished request kept ([`Request::keep_cache`]).
struct Kept {
    seq: SeqId,
    /// Exactly the context tokens the cache holds for `seq`, in order.
    tokens: Vec<TokenId>,
}

/// Serves requests on one model and one cache.
pub struct Engine<'a, B: InferenceBackend> {
    model: &'a dyn CausalLm<B>,
    cache: EngineCache<'a, B>,
    detok: Option<&'a dyn Detokenizer>,
    scheduler: Scheduler,
    /// The decoding modes, asked in order which one decodes a request.
    modes: Vec<Box<dyn DecodingMode<B> + 'a>>,
    /// Finished requests' caches kept for a later request to continue.
    kept: HashMap<RequestId, Kept>,
    next_id: u64,
    speculation: SpecCounts,
}

/// The prefix cache's key space for `model`: its fingerprint and dtype, so no two models (or
/// precisions) can ever share a block.
fn prefix_key_space<B: InferenceBackend>(model: &dyn CausalLm<B>) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    model.fingerprint().hash(&mut hasher);
    model.dtype().name().hash(&mut hasher);
    hasher.finish()
}

impl<'a, B: InferenceBackend> Engine<'a, B> {
    /// An engine over `model` and `cache` (which must be empty).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] for zero limits.
    pub fn new(
        model: &'a dyn CausalLm<B>,
        cache: Box<dyn KvCache<B>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::on(model, EngineCache::Owned(cache), config)
    }

    /// An engine over `model` working on the caller's `cache` (which must hold no sequences)
    /// for as long as the engine lives; requests that finish release their space in it, and
    /// with prefix caching their full blocks stay there for the next engine on it.
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] for zero limits.
    pub fn borrowing(
        model: &'a dyn CausalLm<B>,
        cache: &'a mut dyn KvCache<B>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::on(model, EngineCache::Lent(cache), config)
    }

    fn on(
        model: &'a dyn CausalLm<B>,
        mut cache: EngineCache<'a, B>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        if config.max_batch == 0 || config.max_step_tokens == 0 || config.max_group_rows == Some(0)
        {
            return Err(EngineError::InvalidConfig(
                "max_batch, max_step_tokens and max_group_rows must be positive".into(),
            ));
        }
        if let Some(why) = config.speculation.as_ref().and_then(Speculation::problem) {
            return Err(EngineError::InvalidConfig(why));
        }
        if config.prefix_cache {
            // Kinds without prefix caching (sliding, dense) simply decline.
            cache.enable_prefix_cache(prefix_key_space(model));
        }
        cache.set_attention_window(model.attention_window());
        Ok(Self {
            model,
            cache,
            detok: None,
            scheduler: Scheduler::new(config),
            modes: standard_modes(&config),
            kept: HashMap::new(),
            next_id: 0,
            speculation: SpecCounts::default(),
        })
    }

    /// Gives speculative decoding with [`DraftSource::Model`] its draft model and the cache it
    /// drafts on (empty, of the draft model's layout and dtype, with room for `max_batch`
    /// sequences as long as the target's).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] if the engine does not speculate with a draft model, or
    /// the draft model's vocabulary is not the target's.
    pub fn with_draft_model(
        mut self,
        model: &'a dyn CausalLm<B>,
        cache: Box<dyn KvCache<B>>,
    ) -> Result<Self, EngineError> {
        let speculation = self
            .config()
            .speculation
            .filter(|s| s.source == DraftSource::Model)
            .ok_or_else(|| {
                EngineError::InvalidConfig(
                    "a draft model needs speculation with DraftSource::Model".into(),
                )
            })?;
        let (ours, theirs) = (self.model.shape().vocab, model.shape().vocab);
        if ours != theirs {
            return Err(EngineError::InvalidConfig(format!(
                "the draft model's vocabulary has {theirs} tokens, the target's {ours}: a draft \
                 model must share the target's tokenizer"
            )));
        }
        let mut cache = cache;
        cache.set_attention_window(model.attention_window());
        let mode = SpeculativeMode::with_draft_model(speculation, model, cache);
        let at = self
            .modes
            .iter()
            .position(|m| m.name() == DecodingMode::<B>::name(&mode))
            .expect("an engine that speculates registers the mode");
        self.modes[at] = Box::new(mode);
        Ok(self)
    }

    /// The engine with one more decoding mode, asked before the others which requests it
    /// decodes.
    #[cfg(test)]
    pub(crate) fn with_mode(mut self, mode: Box<dyn DecodingMode<B> + 'a>) -> Self {
        self.modes.insert(0, mode);
        self
    }

    /// Decodes text for streaming and stop strings.
    pub fn with_detokenizer(mut self, detok: &'a dyn Detokenizer) -> Self {
        self.detok = Some(detok);
        self
    }

    /// The cache (to inspect its use).
    pub fn cache(&self) -> &dyn KvCache<B> {
        &*self.cache
    }

    /// The draft model's cache, when it has a draft model.
    pub fn draft_cache(&self) -> Option<&dyn KvCache<B>> {
        self.modes.iter().find_map(|m| m.own_cache())
    }

    /// The model.
    pub fn model(&self) -> &'a dyn CausalLm<B> {
        self.model
    }

    /// The scheduling limits it was built with.
    pub fn config(&self) -> EngineConfig {
        self.scheduler.config
    }

    /// Whether nothing is waiting or running (kept caches do not count).
    pub fn is_idle(&self) -> bool {
        self.scheduler.waiting.is_empty() && self.scheduler.running.is_empty()
    }

    /// Sequences running, and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.scheduler.running.len(), self.scheduler.waiting.len())
    }

    /// Whether requests reuse cached prefixes (the config asks for it and the cache kind
    /// supports it).
    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache.prefix_cache_enabled()
    }

    /// Prompt tokens looked up in the prefix cache and found there so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.scheduler.prefix
    }

    /// Drafts proposed and accepted, target forwards and the tokens they produced, summed over
    /// the requests finished so far.
    pub fn speculation_stats(&self) -> SpecCounts {
        self.speculation
    }

    /// What any request must satisfy, whatever decodes it; returns its sampler.
    fn check(&self, request: &Request) -> Result<Sampler, EngineError> {
        let shape = self.model.shape();
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if let Some(why) = prompt_problem(&request.prompt, &shape) {
            return invalid(why);
        }
        if !request.stop.is_empty() && self.detok.is_none() {
            return invalid("stop strings need a tokenizer to decode text".into());
        }
        if let Some(grammar) = &request.constraint
            && grammar.vocab() != shape.vocab
        {
            return invalid(format!(
                "the grammar was compiled for a vocabulary of {} tokens; the model has {}",
                grammar.vocab(),
                shape.vocab
            ));
        }
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return invalid(format!(
                "{n} top log-probabilities asked for; at most {MAX_TOP_LOGPROBS}"
            ));
        }
        Ok(Sampler::new(&request.sampling, shape.vocab).map_err(CoreError::from)?)
    }

    /// A checked request as a sequence, decoded by the first mode of the registry that
    /// serves it.
    fn sequence(&mut self, request: Request) -> Result<Sequence, EngineError> {
        let sampler = self.check(&request)?;
        let shape = self.model.shape();
        let budget = request
            .max_tokens
            .min(shape.max_positions - request.prompt.len());
        let state = SeqState::new(RequestId(self.next_id), request, budget);
        let cx = ModeContext {
            shape: &shape,
            config: &self.scheduler.config,
            max_rows: self.scheduler.max_rows(state.request.group),
            cache: &*self.cache,
        };
        let mode = self
            .modes
            .iter_mut()
            .find(|m| m.serves(&state.request))
            .expect("plain sampling serves every request");
        let decoder = mode.decoder(&state, sampler, &cx)?;
        self.next_id += 1;
        Ok(Sequence { state, decoder })
    }

    /// Queues a request; it starts at the next step with room.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`]: an empty prompt, one that fills the model's context,
    /// ids outside the vocabulary, invalid sampling values, stop strings without a
    /// detokenizer, more than [`MAX_TOP_LOGPROBS`] alternatives, a request to continue that
    /// kept no cache, or what its decoding mode does not take.
    pub fn submit(&mut self, request: Request) -> Result<RequestId, EngineError> {
        let mut seq = self.sequence(request)?;
        let state = &mut seq.state;
        if let Some(earlier) = state.request.continues {
            let kept = self.kept.remove(&earlier).ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "request {} kept no cache to continue (it did not ask to keep it, or it \
                     was released or continued already)",
                    earlier.0
                ))
            })?;
            // The last prompt token is always fed: its logits pick the first new token.
            let prompt = &state.request.prompt;
            let shared = common_prefix(&kept.tokens, prompt).min(prompt.len() - 1);
            let held = if shared > 0 && self.cache.truncate(kept.seq, shared).is_ok() {
                shared
            } else {
                self.cache.release(kept.seq);
                0
            };
            state.seq = kept.seq;
            state.in_cache = held;
            if held > 0 {
                state.cached_tokens = Some(held);
            }
        }
        let id = state.id;
        self.scheduler.waiting.push_back(seq);
        Ok(id)
    }

    /// Ends a request, waiting or running, at the next step as if a stop string had ended it
    /// ([`FinishReason::Stop`]): it reports its completion, and keeps its cache if it asked
    /// to. Returns whether the request was still there.
    pub fn stop(&mut self, id: RequestId) -> bool {
        let scheduler = &mut self.scheduler;
        let found = scheduler
            .running
            .iter_mut()
            .chain(&mut scheduler.waiting)
            .find(|s| s.state.id == id);
        match found {
            Some(seq) => {
                seq.state.stop_requested = true;
                true
            }
            None => false,
        }
    }

    /// The context tokens whose cache request `id` kept, if it did and still does.
    pub fn kept_tokens(&self, id: RequestId) -> Option<&[TokenId]> {
        self.kept.get(&id).map(|k| k.tokens.as_slice())
    }

    /// The K/V request `id` kept, on the host ([`KvCache::export`]).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] if it kept none; the cache's error if it cannot export.
    pub fn export_kept(&self, id: RequestId) -> Result<HostKv, EngineError> {
        let kept = self.kept.get(&id).ok_or_else(|| {
            EngineError::InvalidRequest(format!("request {} kept no cache", id.0))
        })?;
        Ok(self.cache.export(kept.seq).map_err(CoreError::from)?)
    }

    /// Frees the cache request `id` kept; returns whether it had kept one.
    pub fn release_kept(&mut self, id: RequestId) -> bool {
        let Some(kept) = self.kept.remove(&id) else {
            return false;
        };
        self.cache.release(kept.seq);
        true
    }

    /// Drops a request, waiting or running, at once: its cache is freed now, nothing more is
    /// reported for it, and the other requests go on as if it had never been submitted (what
    /// a server does when a client disconnects). Returns whether the request was still there
    /// (false once it has finished or was cancelled before).
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let scheduler = &mut self.scheduler;
        let seq = if let Some(i) = scheduler.waiting.iter().position(|s| s.state.id == id) {
            // A waiting sequence holds cache only when it continues a kept one.
            scheduler.waiting.remove(i)
        } else if let Some(i) = scheduler.running.iter().position(|s| s.state.id == id) {
            Some(scheduler.running.remove(i))
        } else {
            None
        };
        match seq {
            Some(seq) => {
                self.release(&seq);
                true
            }
            None => false,
        }
    }

    /// Frees every cache sequence a sequence holds, and what its modes hold for it.
    fn release(&mut self, seq: &Sequence) {
        for id in seq.decoder.cache_seqs(&seq.state) {
            self.cache.release(id);
        }
        for mode in &mut self.modes {
            mode.release(seq.state.seq);
        }
    }

    /// Queues a request whose first `held` prompt tokens are written into the cache by
    /// `fill` (for the given sequence) instead of computed (see [`crate::snapshot`]).
    pub(crate) fn submit_prefilled(
        &mut self,
        request: Request,
        held: usize,
        fill: impl FnOnce(&mut dyn KvCache<B>, SeqId) -> Result<(), EngineError>,
    ) -> Result<RequestId, EngineError> {
        if request.continues.is_some() {
            return Err(EngineError::InvalidRequest(
                "a request that starts from written K/V cannot continue another".into(),
            ));
        }
        let mut seq = self.sequence(request)?;
        let state = &mut seq.state;
        debug_assert!(held < state.request.prompt.len(), "the last token is fed");
        if held > 0 {
            if let Err(e) = fill(&mut *self.cache, state.seq) {
                self.cache.release(state.seq);
                return Err(e);
            }
            state.in_cache = held;
            state.cached_tokens = Some(held);
        }
        let id = state.id;
        self.scheduler.waiting.push_back(seq);
        Ok(id)
    }

    /// Evicts the newest running sequence: its cache is freed, its decoder forgets what it
    /// fed, and it waits at the front of the queue to be recomputed.
    fn preempt(&mut self) -> bool {
        let Some(mut seq) = self.scheduler.pop_newest() else {
            return false;
        };
        // Its modes' side caches too: a waiting sequence must not hold a slot of a cache
        // whose running sequences need it.
        self.release(&seq);
        seq.decoder.reset(&mut seq.state);
        seq.state.in_cache = 0;
        seq.state.preemptions += 1;
        self.scheduler.waiting.push_front(seq);
        true
    }

    /// The step's plan, with its cache space reserved: the scheduler plans, the decoding
    /// modes prepare the planned sequences (drafts), and the cache reserves what their
    /// decoders append; when the cache is full, the newest sequence is preempted and the step
    /// planned again. An empty plan: nothing can advance.
    ///
    /// # Errors
    /// A failed forward of a mode's own model, or a request that cannot fit in the cache
    /// even alone.
    fn plan_and_reserve(&mut self) -> Result<StepPlan, EngineError> {
        loop {
            let plan = self.scheduler.plan(&mut *self.cache);
            if plan.is_empty() {
                return Ok(plan);
            }
            let mut fed = vec![false; self.scheduler.running.len()];
            for &(i, _) in &plan {
                fed[i] = true;
            }
            // In running order, as the modes' own batches (a draft model's) have always been.
            let mut planned: Vec<Planned<'_>> = self
                .scheduler
                .running
                .iter_mut()
                .zip(&fed)
                .filter(|&(_, &fed)| fed)
                .map(|(seq, _)| Planned {
                    state: &seq.state,
                    decoder: &mut *seq.decoder,
                })
                .collect();
            for mode in &mut self.modes {
                mode.prepare(&mut planned)?;
            }
            let running = &self.scheduler.running;
            let appends: Vec<(SeqId, usize)> = plan
                .iter()
                .flat_map(|&(i, n)| running[i].decoder.appends(&running[i].state, n))
                .collect();
            match self.cache.reserve(&appends) {
                Ok(()) => return Ok(plan),
                Err(CacheError::OutOfBlocks { .. } | CacheError::NoFreeSlot { .. })
                    if self.preempt() => {}
                Err(e) => return Err(CoreError::from(e).into()),
            }
        }
    }

    /// One forward over every sequence that can advance: the scheduler admits and plans, the
    /// runner runs the forward, and each fed sequence's decoder consumes its rows.
    ///
    /// # Errors
    /// A model failure, or a request that cannot fit in the cache even alone.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        for seq in self.scheduler.take_stopped() {
            self.retire(seq, FinishReason::Stop, &mut events);
        }
        self.scheduler.admit(&*self.cache);
        let plan = self.plan_and_reserve()?;
        if plan.is_empty() {
            return Ok(events);
        }
        let output = runner::run(self.model, &mut *self.cache, &self.scheduler.running, &plan)
            .inspect_err(|_| {
                // The step's K/V may be half written (and its full blocks registered):
                // nothing cached can be trusted after a failed forward.
                self.cache.clear();
                self.kept.clear();
                let scheduler = &mut self.scheduler;
                for seq in scheduler.running.iter_mut().chain(&mut scheduler.waiting) {
                    seq.state.in_cache = 0;
                }
            })?;
        let mut cx = StepContext {
            cache: &mut *self.cache,
            detok: self.detok,
            events: &mut events,
        };
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        for (&(i, n), rows) in plan.iter().zip(output.rows()) {
            let seq = &mut self.scheduler.running[i];
            if let Some(reason) = seq.decoder.consume(&mut seq.state, n, rows, &mut cx)? {
                finished.push((i, reason));
            }
        }
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in finished {
            let seq = self.scheduler.running.remove(i);
            self.retire(seq, reason, &mut events);
        }
        Ok(events)
    }

    /// Ends `seq`: its cache is freed or kept, and its completion reported.
    fn retire(&mut self, mut seq: Sequence, reason: FinishReason, events: &mut Vec<Event>) {
        self.speculation.add(&seq.decoder.counts());
        for mode in &mut self.modes {
            mode.release(seq.state.seq);
        }
        let state = &seq.state;
        if state.request.keep_cache {
            let tokens = state
                .context_tokens()
                .take(state.in_cache)
                .copied()
                .collect();
            self.kept.insert(
                state.id,
                Kept {
                    seq: state.seq,
                    tokens,
                },
            );
        } else {
            for id in seq.decoder.cache_seqs(state) {
                self.cache.release(id);
            }
        }
        let id = state.id;
        let (completion, tail) = seq
            .state
            .finish(reason, self.detok.is_some(), &mut *seq.decoder);
        if !tail.is_empty() {
            events.push(Event::Text { id, text: tail });
        }
        events.push(Event::Finished(completion));
    }

    /// Steps until every request has finished, passing each event to `on_event`; returns the
    /// completions in request order.
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn run(
        &mut self,
        mut on_event: impl FnMut(&Event),
    ) -> Result<Vec<Completion>, EngineError> {
        let mut done = Vec::new();
        while !self.is_idle() {
            for event in self.step()? {
                on_event(&event);
                if let Event::Finished(c) = event {
                    done.push(c);
                }
            }
        }
        done.sort_by_key(|c| c.id);
        Ok(done)
    }
}
