//! The engine's settings ([`EngineConfig`], [`StepPolicy`]) and what it counts
//! ([`PrefixStats`]): plain values the scheduler, the decoding modes and the engine all read.

use crate::speculate::Speculation;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most rows running at once: a request takes one, a beam search one per beam
    /// ([`crate::Request::rows`]).
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
    /// Most rows the running requests of one [`crate::Request::group`] may hold (`None`:
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
