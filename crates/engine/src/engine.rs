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

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};

use kiln_core::kv_cache::{CacheError, HostKv, KvCache};
use kiln_core::sampling::{Sampler, Verdict};
use kiln_core::{
    BackendKind, Batch, CausalLm, CoreError, InferenceBackend, LogitsFor, Position, SeqId, TokenId,
};

use crate::beam::BeamGroup;
use crate::detok::Detokenizer;
use crate::drafter::{DraftJob, DraftModel};
use crate::error::EngineError;
use crate::generate::FinishReason;
use crate::request::{
    Completion, Event, MAX_TOP_LOGPROBS, Request, RequestId, TokenLogprobs, prompt_problem,
};
use crate::sequence::{Sequence, common_prefix};
use crate::speculate::{DraftSource, SpecCounts, Speculation};
use crate::structured::GrammarMatcher;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most rows running at once: a request takes one, a beam search one per beam
    /// ([`Request::rows`]).
    pub max_batch: usize,
    /// Most prompt tokens fed in one step, over all sequences; longer prompts are prefilled
    /// in chunks (decode tokens are not counted).
    pub max_step_tokens: usize,
    /// How a step shares its forward between prompts and decodes.
    pub policy: StepPolicy,
    /// Reuse the K/V of earlier requests' identical leading tokens (where the cache kind
    /// supports it: paged).
    pub prefix_cache: bool,
    /// Speculative decoding for every decoding sequence (`None`: off).
    pub speculation: Option<Speculation>,
    /// Most rows the running requests of one [`Request::group`] may hold (`None`:
    /// `max_batch`). A server keeps some rows free of any one HTTP request this way, so a
    /// short request from another client starts at once beside a large one.
    pub max_group_rows: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            max_step_tokens: 512,
            policy: StepPolicy::default(),
            prefix_cache: true,
            speculation: None,
            max_group_rows: None,
        }
    }
}

/// Prompt tokens looked up in the prefix cache and found there, since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompt tokens of requests started (each request counted once, at its first start).
    pub queried: u64,
    /// Of those, tokens whose K/V came from the cache instead of a forward.
    pub hits: u64,
}

/// How one step shares its forward between sequences reading their prompt (prefill) and
/// sequences that have sampled a token (decode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StepPolicy {
    /// Every decode token, then prompt chunks in admission order while `max_step_tokens`
    /// lasts; a prompt may be split across steps. A running sequence never waits for another's
    /// prompt (vLLM v1's chunked prefill). The default: what serving wants.
    #[default]
    Mixed,
    /// While any running sequence has prompt left to read, a step feeds prompts only: whole
    /// prompts in admission order while they fit in `max_step_tokens` (the first always goes,
    /// in chunks of `max_step_tokens` if it is longer), and decodes wait. Once every prompt is
    /// read, every sequence decodes together. Each step is then all prefill or all decode, as
    /// in vLLM without chunked prefill and in `llama-bench`'s separate pp / tg phases, so each
    /// phase can be timed on its own ([`crate::bench`] runs on it). A request admitted while
    /// others decode pauses them for its prefill.
    PrefillFirst,
}

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
    config: EngineConfig,
    waiting: VecDeque<Sequence>,
    /// In admission order: the last is preempted first.
    running: Vec<Sequence>,
    /// Finished requests' caches kept for a later request to continue.
    kept: HashMap<RequestId, Kept>,
    next_id: u64,
    prefix: PrefixStats,
    speculation: SpecCounts,
    /// The draft model, for [`DraftSource::Model`].
    drafter: Option<DraftModel<'a, B>>,
    /// The next cache sequence id for a beam (from [`FIRST_BEAM_SEQ`]).
    next_beam_seq: u64,
}

/// Cache sequence ids of beams start here, far above requests' own (their request ids).
const FIRST_BEAM_SEQ: u64 = 1 << 62;

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
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kept: HashMap::new(),
            next_id: 0,
            prefix: PrefixStats::default(),
            speculation: SpecCounts::default(),
            drafter: None,
            next_beam_seq: FIRST_BEAM_SEQ,
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
        let source = self.config.speculation.map(|s| s.source);
        if source != Some(DraftSource::Model) {
            return Err(EngineError::InvalidConfig(
                "a draft model needs speculation with DraftSource::Model".into(),
            ));
        }
        let (ours, theirs) = (self.model.shape().vocab, model.shape().vocab);
        if ours != theirs {
            return Err(EngineError::InvalidConfig(format!(
                "the draft model's vocabulary has {theirs} tokens, the target's {ours}: a draft \
                 model must share the target's tokenizer"
            )));
        }
        let mut cache = cache;
        cache.set_attention_window(model.attention_window());
        self.drafter = Some(DraftModel::new(model, cache));
        Ok(self)
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
        self.drafter.as_ref().map(DraftModel::cache)
    }

    /// The model.
    pub fn model(&self) -> &'a dyn CausalLm<B> {
        self.model
    }

    /// The scheduling limits it was built with.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Whether nothing is waiting or running (kept caches do not count).
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Sequences running, and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// Whether requests reuse cached prefixes (the config asks for it and the cache kind
    /// supports it).
    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache.prefix_cache_enabled()
    }

    /// Prompt tokens looked up in the prefix cache and found there so far.
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix
    }

    /// Drafts proposed and accepted, target forwards and the tokens they produced, summed over
    /// the requests finished so far.
    pub fn speculation_stats(&self) -> SpecCounts {
        self.speculation
    }

    fn check(&self, request: &Request) -> Result<Sampler, EngineError> {
        let shape = self.model.shape();
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        if let Some(why) = prompt_problem(&request.prompt, &shape) {
            return invalid(why);
        }
        if !request.stop.is_empty() && self.detok.is_none() {
            return invalid("stop strings need a tokenizer to decode text".into());
        }
        let source = self.config.speculation.map(|s| s.source);
        if source == Some(DraftSource::Model) && self.drafter.is_none() {
            return Err(EngineError::InvalidConfig(
                "speculation with a draft model, but none was given (Engine::with_draft_model)"
                    .into(),
            ));
        }
        if let Some(beam) = &request.beam {
            if let Some(why) = beam.problem() {
                return invalid(why);
            }
            let rows = self.max_rows(request.group);
            if beam.num_beams > rows {
                return invalid(format!(
                    "{} beams take {} rows of the batch; at most {rows} run for one request \
                     (the engine's max_batch{})",
                    beam.num_beams,
                    beam.num_beams,
                    if request.group.is_some() && rows < self.config.max_batch {
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
            } else {
                None
            };
            if let Some(what) = refused {
                return invalid(format!("beam search does not take {what}"));
            }
            if let Some(rows) = self.cache.max_sequences().filter(|&r| r < beam.num_beams) {
                return invalid(format!(
                    "{} beams need as many sequences of the KV cache, which holds {rows} \
                     ({} cache)",
                    beam.num_beams,
                    self.cache.kind()
                ));
            }
        }
        if let Some(grammar) = &request.constraint {
            if request.beam.is_some() {
                return invalid("beam search does not take a grammar constraint".into());
            }
            if grammar.vocab() != shape.vocab {
                return invalid(format!(
                    "the grammar was compiled for a vocabulary of {} tokens; the model has {}",
                    grammar.vocab(),
                    shape.vocab
                ));
            }
        }
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return invalid(format!(
                "{n} top log-probabilities asked for; at most {MAX_TOP_LOGPROBS}"
            ));
        }
        Ok(Sampler::new(&request.sampling, shape.vocab).map_err(CoreError::from)?)
    }

    fn sequence(&mut self, request: Request) -> Result<Sequence, EngineError> {
        let sampler = self.check(&request)?;
        let budget = request
            .max_tokens
            .min(self.model.shape().max_positions - request.prompt.len());
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let mut seq = Sequence::new(id, request, budget, sampler);
        if let Some(params) = seq.request.beam {
            seq.beams = Some(BeamGroup::new(params));
            seq.beam_ids.push(seq.seq);
            for _ in 1..params.num_beams {
                seq.beam_ids.push(SeqId(self.next_beam_seq));
                self.next_beam_seq += 1;
            }
        }
        if self.drafter.is_some() && seq.beams.is_none() {
            // Its own stream of random numbers: the drafts must not be correlated with the
            // draws that verify them.
            let mut params = seq.request.sampling.clone();
            params.seed = params.seed.map(|s| s ^ 0x9e37_79b9_7f4a_7c15);
            let vocab = self.model.shape().vocab;
            seq.draft_sampler = Some(Sampler::new(&params, vocab).map_err(CoreError::from)?);
        }
        Ok(seq)
    }

    /// Queues a request; it starts at the next step with room.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`]: an empty prompt, one that fills the model's context,
    /// ids outside the vocabulary, invalid sampling values, stop strings without a
    /// detokenizer, more than [`MAX_TOP_LOGPROBS`] alternatives, a request to continue that
    /// kept no cache.
    pub fn submit(&mut self, request: Request) -> Result<RequestId, EngineError> {
        let mut seq = self.sequence(request)?;
        if let Some(earlier) = seq.request.continues {
            let kept = self.kept.remove(&earlier).ok_or_else(|| {
                EngineError::InvalidRequest(format!(
                    "request {} kept no cache to continue (it did not ask to keep it, or it \
                     was released or continued already)",
                    earlier.0
                ))
            })?;
            // The last prompt token is always fed: its logits pick the first new token.
            let prompt = &seq.request.prompt;
            let shared = common_prefix(&kept.tokens, prompt).min(prompt.len() - 1);
            let held = if shared > 0 && self.cache.truncate(kept.seq, shared).is_ok() {
                shared
            } else {
                self.cache.release(kept.seq);
                0
            };
            seq.seq = kept.seq;
            seq.in_cache = held;
            if held > 0 {
                seq.cached_tokens = Some(held);
            }
        }
        let id = seq.id;
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Ends a request, waiting or running, at the next step as if a stop string had ended it
    /// ([`FinishReason::Stop`]): it reports its completion, and keeps its cache if it asked
    /// to. Returns whether the request was still there.
    pub fn stop(&mut self, id: RequestId) -> bool {
        let found = self
            .running
            .iter_mut()
            .chain(&mut self.waiting)
            .find(|s| s.id == id);
        match found {
            Some(seq) => {
                seq.stop_requested = true;
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
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            // A waiting sequence holds cache only when it continues a kept one.
            let seq = self.waiting.remove(i).expect("the position exists");
            self.release(&seq);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(&seq);
            return true;
        }
        false
    }

    /// Frees a sequence's cache (every beam's, with beam search), and its draft model's.
    fn release(&mut self, seq: &Sequence) {
        for id in seq.cache_seqs() {
            self.cache.release(id);
        }
        if let Some(drafter) = &mut self.drafter {
            drafter.release(seq.seq);
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
        debug_assert!(held < seq.request.prompt.len(), "the last token is fed");
        if held > 0 {
            if let Err(e) = fill(&mut *self.cache, seq.seq) {
                self.cache.release(seq.seq);
                return Err(e);
            }
            seq.in_cache = held;
            seq.cached_tokens = Some(held);
        }
        let id = seq.id;
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Most rows the running requests of `group` may hold.
    fn max_rows(&self, group: Option<u64>) -> usize {
        match (group, self.config.max_group_rows) {
            (Some(_), Some(rows)) => rows.min(self.config.max_batch),
            _ => self.config.max_batch,
        }
    }

    /// Admits waiting requests in order while their rows fit in the batch and the cache can
    /// take their first chunk. A request whose group holds all the rows it may is passed
    /// over (later requests of other groups go first); one that needs more rows than are
    /// free stops admission, so a beam search is not starved by narrower requests behind it.
    fn admit(&mut self) {
        let mut used: usize = self.running.iter().map(|s| s.request.rows()).sum();
        let mut held: HashMap<u64, usize> = HashMap::new();
        for seq in &self.running {
            if let Some(g) = seq.request.group {
                *held.entry(g).or_default() += seq.request.rows();
            }
        }
        let mut at = 0;
        while at < self.waiting.len() && used < self.config.max_batch {
            let next = &self.waiting[at];
            let rows = next.request.rows();
            if let Some(g) = next.request.group
                && held.get(&g).copied().unwrap_or(0) + rows > self.max_rows(Some(g))
            {
                at += 1;
                continue;
            }
            if used + rows > self.config.max_batch {
                break;
            }
            let chunk = next.pending().min(self.config.max_step_tokens);
            if self.cache.check_append(next.seq, chunk).is_err() && !self.running.is_empty() {
                break;
            }
            let seq = self.waiting.remove(at).expect("index in range");
            used += rows;
            if let Some(g) = seq.request.group {
                *held.entry(g).or_default() += rows;
            }
            self.running.push(seq);
        }
    }

    /// Starts each fresh running sequence on the cached blocks its context begins with, and
    /// says which fresh sequences wait this step instead: those that share more whole blocks
    /// with an earlier sequence still reading its prompt than the cache holds now (siblings of
    /// an `n`-choice request, requests with one system prompt). They start next step on the
    /// blocks the earlier one has registered by then, instead of computing them too.
    fn attach_prefixes(&mut self) -> Vec<bool> {
        let mut waits = vec![false; self.running.len()];
        if !self.cache.prefix_cache_enabled() {
            return waits;
        }
        for (i, wait) in waits.iter_mut().enumerate() {
            let seq = &self.running[i];
            if !seq.is_fresh() {
                continue;
            }
            let context = seq.context();
            let cached = self.cache.cached_prefix(&context);
            let coming = self.running[..i]
                .iter()
                .filter(|earlier| earlier.wants_prefill())
                .map(|earlier| {
                    let common = common_prefix(earlier.context_tokens(), &context);
                    self.cache.shareable(common.min(context.len() - 1))
                })
                .max()
                .unwrap_or(0);
            if coming > cached {
                *wait = true;
                continue;
            }
            let seq_id = seq.seq;
            let held = self.cache.attach_prefix(seq_id, &context);
            let seq = &mut self.running[i];
            seq.in_cache = held;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(held);
                self.prefix.queried += seq.request.prompt.len() as u64;
                self.prefix.hits += held.min(seq.request.prompt.len()) as u64;
            }
        }
        waits
    }

    /// Which running sequences feed how many tokens this step, by the config's
    /// [`StepPolicy`]; sequences marked in `waits` sit this step out.
    fn plan_step(&self, waits: &[bool]) -> Vec<(usize, usize)> {
        let mut budget = self.config.max_step_tokens;
        let running = self.running.iter().enumerate().filter(|&(i, _)| !waits[i]);
        let decodes = running
            .clone()
            .filter(|(_, s)| s.wants_decode())
            .map(|(i, _)| (i, 1));
        let prefills = running.filter(|(_, s)| s.wants_prefill());
        let mut fed = Vec::new();
        match self.config.policy {
            StepPolicy::Mixed => {
                fed.extend(decodes);
                for (i, seq) in prefills {
                    if budget == 0 {
                        break;
                    }
                    let n = seq.pending().min(budget);
                    budget -= n;
                    fed.push((i, n));
                }
            }
            StepPolicy::PrefillFirst => {
                for (i, seq) in prefills {
                    let n = seq.pending();
                    if fed.is_empty() {
                        // The first prompt always goes, chunked if it is longer than a step.
                        fed.push((i, n.min(budget)));
                        budget = budget.saturating_sub(n);
                    } else if n <= budget {
                        fed.push((i, n));
                        budget -= n;
                    } else {
                        break;
                    }
                }
                if fed.is_empty() {
                    fed.extend(decodes);
                }
            }
        }
        fed
    }

    /// Evicts the newest running sequence: its cache is freed and it waits at the front of
    /// the queue to be recomputed.
    fn preempt(&mut self) -> bool {
        if self.running.len() <= 1 {
            return false;
        }
        let mut seq = self.running.pop().expect("more than one running");
        // Its draft cache too: a waiting sequence must not hold a slot of a cache whose
        // running sequences need it.
        self.release(&seq);
        if let Some(group) = &mut seq.beams {
            // A beam search is deterministic: it starts over and reaches the same answer.
            group.restart();
            seq.beam_seqs.clear();
            seq.generated.clear();
        }
        seq.draft_in_cache = 0;
        seq.drafts.clear();
        seq.draft_q.clear();
        seq.in_cache = 0;
        seq.preemptions += 1;
        self.waiting.push_front(seq);
        true
    }

    /// One forward over every sequence that can advance.
    ///
    /// # Errors
    /// A model failure, or a request that cannot fit in the cache even alone.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        self.retire_stopped(&mut events);
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        self.admit();
        let fed = loop {
            let waits = self.attach_prefixes();
            let fed = self.plan_step(&waits);
            if fed.is_empty() {
                return Ok(events);
            }
            let fed = self.draft(fed)?;
            let step = self.cache_step(&fed);
            match self.cache.reserve(&step) {
                Ok(()) => break fed,
                Err(CacheError::OutOfBlocks { .. } | CacheError::NoFreeSlot { .. })
                    if self.preempt() =>
                {
                    continue;
                }
                Err(e) => return Err(CoreError::from(e).into()),
            }
        };
        let mut batch = Batch::new();
        // Logits rows per fed sequence (a running beam search: one per beam), and per
        // sequence of the batch.
        let mut rows_of = Vec::with_capacity(fed.len());
        let mut batch_rows = Vec::with_capacity(fed.len());
        for &(i, n) in &fed {
            let seq = &self.running[i];
            if let Some(group) = seq.beams.as_ref().filter(|_| seq.beams_running()) {
                let start = Position(seq.in_cache as u32);
                for (beam, &id) in group.running.iter().zip(&seq.beam_seqs) {
                    let last = *beam.tokens.last().expect("a running beam has a token");
                    batch.push(id, &[last], start)?;
                    batch_rows.push(1);
                }
                rows_of.push(seq.beam_seqs.len());
                continue;
            }
            let drafts = seq.drafts.len();
            let (mut tokens, start) = seq.next_chunk(n - drafts);
            tokens.extend(&seq.drafts);
            batch.push(seq.seq, &tokens, start)?;
            rows_of.push(1 + drafts);
            batch_rows.push(1 + drafts);
        }
        let wanted = if batch_rows.iter().all(|&n| n == 1) {
            LogitsFor::LastOfEachSequence
        } else {
            LogitsFor::LastOfEach(batch_rows)
        };
        // The grammar masks of the sequences that sample this step do not depend on the
        // logits, so they can be computed on another thread while the forward runs. That pays
        // where the forward runs on a device (the host waits meanwhile), or on the host when
        // there are several masks; a single one is cheaper inline, in the sampler, because
        // the forward already keeps every core busy (SmolLM2 at batch 1 on 2 cores: +11 % per
        // step with the thread, +5 % inline; at batch 16 the thread hides them).
        let constrained: Vec<&Sequence> = fed
            .iter()
            .map(|&(i, n)| (&self.running[i], n))
            .filter(|(seq, n)| seq.constraint.is_some() && n - seq.drafts.len() == seq.pending())
            .map(|(seq, _)| seq)
            .collect();
        let on_host = matches!(B::KIND, BackendKind::Cpu | BackendKind::Ndarray);
        let overlap = !constrained.is_empty() && (!on_host || constrained.len() > 1);
        // Only what the second thread needs is copied, and only when it runs.
        let masks: Vec<(GrammarMatcher, Vec<TokenId>)> = constrained
            .into_iter()
            .filter(|_| overlap)
            .filter_map(|seq| Some((seq.constraint.clone()?, seq.generated.clone())))
            .collect();
        let (model, cache) = (self.model, &mut *self.cache);
        let logits = std::thread::scope(|scope| {
            let masking = (!masks.is_empty()).then(|| {
                scope.spawn(|| {
                    for (matcher, generated) in &masks {
                        matcher.prepare(generated);
                    }
                })
            });
            let logits = model.forward(&batch, cache, wanted);
            // A panic there only leaves a mask to compute again when the sampler asks.
            let _ = masking.map(std::thread::ScopedJoinHandle::join);
            logits
        })
        .inspect_err(|_| {
            // The step's K/V may be half written (and its full blocks registered):
            // nothing cached can be trusted after a failed forward.
            self.cache.clear();
            self.kept.clear();
            for seq in self.running.iter_mut().chain(&mut self.waiting) {
                seq.in_cache = 0;
            }
        })?;
        let vocab = self.model.shape().vocab;
        // Where every row's token is a plain argmax, a device picks them itself and only the
        // ids come back (one id a row instead of a vocabulary of logits).
        let argmax_ids = (!on_host
            && rows_of.iter().all(|&n| n == 1)
            && fed.iter().all(|&(i, _)| self.running[i].argmax_on_device()))
        .then(|| B::argmax_rows(logits.clone()));
        let rows = match argmax_ids {
            Some(_) => Vec::new(),
            None => kiln_core::tensor::host_f32(logits),
        };
        let mut first_row = 0;
        for (&(i, n), &n_rows) in fed.iter().zip(&rows_of) {
            let seq_rows = rows
                .get(first_row * vocab..(first_row + n_rows) * vocab)
                .unwrap_or_default();
            let argmax = argmax_ids.as_ref().map(|ids| TokenId(ids[first_row]));
            first_row += n_rows;
            let reason = if self.running[i].beams.is_some() {
                self.running[i].in_cache += n;
                if self.running[i].pending() > 0 {
                    continue;
                }
                self.running[i].counts.forwards += 1;
                self.beam_step(i, seq_rows, &mut events)?
            } else if n_rows > 1 {
                self.verify_drafts(i, seq_rows, &mut events)?
            } else {
                self.running[i].in_cache += n;
                if self.running[i].pending() > 0 {
                    continue;
                }
                self.running[i].counts.forwards += 1;
                match argmax {
                    Some(token) => self.take(i, token, seq_rows, &mut events),
                    None => self.sample(i, seq_rows, &mut events)?,
                }
            };
            if let Some(reason) = reason {
                finished.push((i, reason));
            }
        }
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in finished {
            let seq = self.running.remove(i);
            self.retire(seq, reason, &mut events);
        }
        Ok(events)
    }

    /// Ends the requests the caller stopped ([`Engine::stop`]), before anything runs.
    fn retire_stopped(&mut self, events: &mut Vec<Event>) {
        if !self
            .running
            .iter()
            .chain(&self.waiting)
            .any(|s| s.stop_requested)
        {
            return;
        }
        let (stopped, running): (Vec<_>, Vec<_>) =
            self.running.drain(..).partition(|s| s.stop_requested);
        self.running = running;
        let (stopped_waiting, waiting): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(|s| s.stop_requested);
        self.waiting = waiting.into();
        for seq in stopped.into_iter().chain(stopped_waiting) {
            self.retire(seq, FinishReason::Stop, events);
        }
    }

    /// Ends `seq`: its cache is freed or kept, and its completion reported.
    fn retire(&mut self, seq: Sequence, reason: FinishReason, events: &mut Vec<Event>) {
        self.speculation.add(&seq.counts);
        if let Some(drafter) = &mut self.drafter {
            drafter.release(seq.seq);
        }
        if seq.beams.is_some() {
            for id in seq.cache_seqs() {
                self.cache.release(id);
            }
        } else if seq.request.keep_cache {
            let tokens = seq.context_tokens().take(seq.in_cache).copied().collect();
            self.kept.insert(
                seq.id,
                Kept {
                    seq: seq.seq,
                    tokens,
                },
            );
        } else {
            self.cache.release(seq.seq);
        }
        let id = seq.id;
        let (completion, tail) = seq.finish(reason, self.detok.is_some());
        if !tail.is_empty() {
            events.push(Event::Text { id, text: tail });
        }
        events.push(Event::Finished(completion));
    }

    /// Gives each decoding sequence of the planned step its drafts, when speculation is on:
    /// the step then feeds its last sampled token and the drafts. Drafts never outrun the
    /// request's budget (the token after the last accepted draft always comes too).
    ///
    /// # Errors
    /// A failed forward of the draft model.
    fn draft(&mut self, fed: Vec<(usize, usize)>) -> Result<Vec<(usize, usize)>, EngineError> {
        let Some(speculation) = self.config.speculation else {
            return Ok(fed);
        };
        let drafting = fed
            .iter()
            .filter(|&&(i, _)| self.running[i].can_draft())
            .count();
        // In a larger batch the verification rows would cost more than the drafts save.
        let batch_too_large = speculation.max_batch > 0 && drafting > speculation.max_batch;
        let mut limits = vec![0; self.running.len()];
        for &(i, _) in &fed {
            let seq = &mut self.running[i];
            seq.drafts.clear();
            seq.draft_q.clear();
            if seq.can_draft() && !batch_too_large {
                let room = seq.budget.saturating_sub(seq.generated.len() + 1);
                limits[i] = room.min(seq.draft_limit).min(speculation.draft_tokens);
            }
        }
        match (&mut self.drafter, speculation.source) {
            (Some(drafter), DraftSource::Model) => {
                let mut jobs: Vec<DraftJob<'_>> = self
                    .running
                    .iter_mut()
                    .zip(&limits)
                    .filter(|&(_, &limit)| limit > 0)
                    .map(|(seq, &limit)| DraftJob {
                        seq: seq.seq,
                        context: seq.context(),
                        in_cache: &mut seq.draft_in_cache,
                        limit,
                        sampler: seq.draft_sampler.as_mut().expect("made with the drafter"),
                        history: seq.history.clone(),
                        eos: &seq.request.eos,
                        drafts: &mut seq.drafts,
                        q: &mut seq.draft_q,
                    })
                    .collect();
                drafter.propose(&mut jobs)?;
            }
            _ => {
                for (seq, &limit) in self.running.iter_mut().zip(&limits) {
                    if limit > 0 {
                        seq.drafts = speculation.draft(&seq.context(), limit);
                    }
                }
            }
        }
        Ok(fed
            .into_iter()
            .map(|(i, n)| (i, n + self.running[i].drafts.len()))
            .collect())
    }

    /// Checks sequence `i`'s drafts against the target's `rows` (one for the token before the
    /// drafts, one per draft): accepted drafts and the token after them are taken in order,
    /// until a draft is rejected or the sequence ends; the cache is rolled back to what the
    /// context really holds. Returns why the sequence ended, if it did.
    ///
    /// # Shapes
    /// `rows`: `[1 + drafts, vocab]`, row-major.
    fn verify_drafts(
        &mut self,
        i: usize,
        rows: &[f32],
        events: &mut Vec<Event>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let vocab = self.model.shape().vocab;
        let drafts = std::mem::take(&mut self.running[i].drafts);
        let draft_q = std::mem::take(&mut self.running[i].draft_q);
        let mut reason = None;
        let mut accepted = 0;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let Some(&draft) = drafts.get(j) else {
                // Every draft stood: the last row picks the token after them.
                reason = self.sample(i, row, events)?;
                break;
            };
            let seq = &mut self.running[i];
            let verdict = seq
                .sampler
                .verify(row, &seq.history, draft, draft_q.get(j).map(Vec::as_slice))
                .map_err(CoreError::from)?;
            let token = match verdict {
                Verdict::Accepted => draft,
                Verdict::Rejected(token) => token,
            };
            accepted += usize::from(verdict == Verdict::Accepted);
            reason = self.take(i, token, row, events);
            if reason.is_some() || verdict != Verdict::Accepted {
                break;
            }
        }
        let seq = &mut self.running[i];
        seq.counts.forwards += 1;
        seq.counts.drafted += drafts.len() as u64;
        seq.counts.accepted += accepted as u64;
        if let Some(speculation) = self.config.speculation {
            seq.draft_limit = speculation.next_limit(accepted);
        }
        // The forward wrote the last token and every draft; the context holds the token and
        // the accepted drafts (less an accepted EOS, which is not part of it).
        let before = seq.in_cache;
        let fed = 1 + drafts.len();
        if self.drafter.is_some() {
            // The draft model fed the context and every draft but the last; the accepted ones
            // are context now.
            seq.draft_in_cache = before + 1 + accepted.min(drafts.len() - 1);
        }
        let held = (before + 1 + accepted).min(seq.context_len());
        seq.in_cache = held;
        if held < before + fed && self.cache.truncate(seq.seq, held).is_err() {
            // A cache that cannot roll back (a sliding ring) recomputes the context instead.
            self.cache.release(seq.seq);
            seq.in_cache = 0;
        }
        Ok(reason)
    }

    /// What each fed sequence appends to the cache this step, for
    /// [`kiln_core::kv_cache::CacheBook::reserve`]: its tokens, or with a running beam search
    /// one token per beam. A beam search whose prompt ends this step also reserves its other
    /// beams' sequences, empty, so the first search step can fork into them.
    fn cache_step(&self, fed: &[(usize, usize)]) -> Vec<(SeqId, usize)> {
        let mut step = Vec::with_capacity(fed.len());
        for &(i, n) in fed {
            let seq = &self.running[i];
            if seq.beams_running() {
                step.extend(seq.beam_seqs.iter().map(|&id| (id, n)));
                continue;
            }
            step.push((seq.seq, n));
            if seq.beams.is_some() && n == seq.pending() {
                step.extend(seq.beam_ids.iter().skip(1).map(|&id| (id, 0)));
            }
        }
        step
    }

    /// One beam-search step of sequence `i` on its beams' logits `rows` (before the first
    /// step, the prompt's one row): the beams that run on take over their parents' cache
    /// sequences, or forks of them; dropped beams free theirs first. When the search ends, the
    /// best hypothesis is taken as the sequence's output. Returns why it ended, if it did.
    ///
    /// # Shapes
    /// `rows`: `[beams, vocab]`, row-major.
    fn beam_step(
        &mut self,
        i: usize,
        rows: &[f32],
        events: &mut Vec<Event>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let vocab = self.model.shape().vocab;
        let detok = self.detok;
        let seq = &mut self.running[i];
        let parents = if seq.beams_running() {
            std::mem::take(&mut seq.beam_seqs)
        } else {
            vec![seq.seq]
        };
        // The search starts when the prompt is read: its time is the decode time (the tokens
        // come out only at the end).
        seq.first_token.get_or_insert_with(std::time::Instant::now);
        let group = seq.beams.as_mut().expect("a beam search");
        let advance = group.advance(rows, vocab, &seq.request.eos, seq.budget);
        seq.counts.tokens += 1;
        if advance.done {
            let mut results = group.results();
            if let Some(detok) = detok {
                for hypothesis in &mut results {
                    hypothesis.text = detok.decode(&hypothesis.tokens);
                }
            }
            seq.generated.clear();
            let Some(best) = results.first().cloned() else {
                return Ok(Some(FinishReason::Length));
            };
            for &token in &best.tokens {
                seq.accept(token, None, detok, events);
            }
            seq.beam_results = results;
            return Ok(Some(best.finish_reason));
        }
        let mut children = vec![0usize; parents.len()];
        for &(parent, _) in &advance.next {
            children[parent] += 1;
        }
        let mut free: Vec<SeqId> = seq
            .beam_ids
            .iter()
            .copied()
            .filter(|id| !parents.contains(id))
            .collect();
        for (&id, &n) in parents.iter().zip(&children) {
            if n == 0 {
                self.cache.release(id);
                free.push(id);
            }
        }
        let mut continued = vec![false; parents.len()];
        let mut beam_seqs = Vec::with_capacity(advance.next.len());
        for &(parent, _) in &advance.next {
            if !continued[parent] {
                continued[parent] = true;
                beam_seqs.push(parents[parent]);
                continue;
            }
            let child = free.pop().expect("as many sequence ids as beams");
            self.cache
                .fork(parents[parent], child)
                .map_err(CoreError::from)?;
            beam_seqs.push(child);
        }
        let seq = &mut self.running[i];
        seq.beam_seqs = beam_seqs;
        let group = seq.beams.as_ref().expect("a beam search");
        seq.generated = group.running[0].tokens.clone();
        Ok(None)
    }

    /// Samples sequence `i`'s next token from `logits`; returns why it ended, if it did.
    fn sample(
        &mut self,
        i: usize,
        logits: &[f32],
        events: &mut Vec<Event>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let seq = &mut self.running[i];
        let token = seq
            .sampler
            .try_sample(logits, &seq.history)
            .map_err(CoreError::from)?;
        Ok(self.take(i, token, logits, events))
    }

    /// Sequence `i` takes `token`, sampled from `logits`: an EOS ends it, anything else is
    /// output (and may complete a stop string or the budget). Returns why it ended, if it did.
    fn take(
        &mut self,
        i: usize,
        token: TokenId,
        logits: &[f32],
        events: &mut Vec<Event>,
    ) -> Option<FinishReason> {
        let detok = self.detok;
        let seq = &mut self.running[i];
        seq.counts.tokens += 1;
        if seq.is_end(token) {
            return Some(FinishReason::Eos);
        }
        let logprobs = seq
            .request
            .logprobs
            .map(|top| TokenLogprobs::from_logits(logits, token, top));
        if seq.accept(token, logprobs, detok, events) {
            Some(FinishReason::Stop)
        } else if seq.generated.len() >= seq.budget {
            Some(FinishReason::Length)
        } else {
            None
        }
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
