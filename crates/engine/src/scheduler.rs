//! The scheduler: which requests run, and what each feeds this step. It holds the waiting
//! queue and the running sequences, admits requests while their rows fit in the batch (and a
//! group's share), starts fresh sequences on cached prefixes, plans the step by the config's
//! [`StepPolicy`] as `(sequence, context tokens)` pairs, and gives up the newest sequence when
//! the cache runs out. It decides; the engine reserves the cache, the runner runs the forward
//! and each sequence's decoder consumes what it produced.

use std::collections::{HashMap, VecDeque};

use kiln_core::kv_cache::CacheBook;

use crate::config::{EngineConfig, PrefixStats, StepPolicy};
use crate::sequence::{Sequence, common_prefix};

/// The step's plan: each running sequence it feeds (by index into
/// [`Scheduler::running`]) and how many of its context tokens.
pub(crate) type StepPlan = Vec<(usize, usize)>;

pub(crate) struct Scheduler {
    pub config: EngineConfig,
    pub waiting: VecDeque<Sequence>,
    /// In admission order: the last is preempted first.
    pub running: Vec<Sequence>,
    pub prefix: PrefixStats,
}

impl Scheduler {
    pub fn new(config: EngineConfig) -> Self {
        Self {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix: PrefixStats::default(),
        }
    }

    /// Most rows the running requests of `group` may hold.
    pub fn max_rows(&self, group: Option<u64>) -> usize {
        match (group, self.config.max_group_rows) {
            (Some(_), Some(rows)) => rows.min(self.config.max_batch),
            _ => self.config.max_batch,
        }
    }

    /// Takes out every sequence, waiting or running, the caller asked to stop.
    pub fn take_stopped(&mut self) -> Vec<Sequence> {
        let stopped = |s: &Sequence| s.state.stop_requested;
        if !self.running.iter().chain(&self.waiting).any(stopped) {
            return Vec::new();
        }
        let (mut out, running): (Vec<_>, Vec<_>) = self.running.drain(..).partition(stopped);
        self.running = running;
        let (stopped_waiting, waiting): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(stopped);
        self.waiting = waiting.into();
        out.extend(stopped_waiting);
        out
    }

    /// Admits waiting requests in order while their rows fit in the batch and the cache can
    /// take their first chunk. A request whose group holds all the rows it may is passed
    /// over (later requests of other groups go first); one that needs more rows than are
    /// free stops admission, so a beam search is not starved by narrower requests behind it.
    pub fn admit(&mut self, cache: &dyn CacheBook) {
        let mut used: usize = self.running.iter().map(|s| s.decoder.rows()).sum();
        let mut held: HashMap<u64, usize> = HashMap::new();
        for seq in &self.running {
            if let Some(g) = seq.state.request.group {
                *held.entry(g).or_default() += seq.decoder.rows();
            }
        }
        let mut at = 0;
        while at < self.waiting.len() && used < self.config.max_batch {
            let next = &self.waiting[at];
            let rows = next.decoder.rows();
            if let Some(g) = next.state.request.group
                && held.get(&g).copied().unwrap_or(0) + rows > self.max_rows(Some(g))
            {
                at += 1;
                continue;
            }
            if used + rows > self.config.max_batch {
                break;
            }
            let chunk = next.state.pending().min(self.config.max_step_tokens);
            if cache.check_append(next.state.seq, chunk).is_err() && !self.running.is_empty() {
                break;
            }
            let seq = self.waiting.remove(at).expect("index in range");
            used += rows;
            if let Some(g) = seq.state.request.group {
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
    fn attach_prefixes(&mut self, cache: &mut dyn CacheBook) -> Vec<bool> {
        let mut waits = vec![false; self.running.len()];
        if !cache.prefix_cache_enabled() {
            return waits;
        }
        for (i, wait) in waits.iter_mut().enumerate() {
            let seq = &self.running[i].state;
            if !seq.is_fresh() {
                continue;
            }
            let context = seq.context();
            let cached = cache.cached_prefix(&context);
            let coming = self.running[..i]
                .iter()
                .filter(|earlier| earlier.state.wants_prefill())
                .map(|earlier| {
                    let common = common_prefix(earlier.state.context_tokens(), &context);
                    cache.shareable(common.min(context.len() - 1))
                })
                .max()
                .unwrap_or(0);
            if coming > cached {
                *wait = true;
                continue;
            }
            let held = cache.attach_prefix(seq.seq, &context);
            let seq = &mut self.running[i].state;
            seq.in_cache = held;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(held);
                self.prefix.queried += seq.request.prompt.len() as u64;
                self.prefix.hits += held.min(seq.request.prompt.len()) as u64;
            }
        }
        waits
    }

    /// The step's plan: fresh sequences attached to their cached prefixes first, then which
    /// running sequences feed how many context tokens, by the config's [`StepPolicy`].
    pub fn plan(&mut self, cache: &mut dyn CacheBook) -> StepPlan {
        let waits = self.attach_prefixes(cache);
        let mut budget = self.config.max_step_tokens;
        let running = self
            .running
            .iter()
            .map(|s| &s.state)
            .enumerate()
            .filter(|&(i, _)| !waits[i]);
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

    /// The newest running sequence, to be preempted, unless it is the only one.
    pub fn pop_newest(&mut self) -> Option<Sequence> {
        if self.running.len() <= 1 {
            return None;
        }
        self.running.pop()
    }
}
