//! [`EngineSpec`]: the one description of the engine a program runs (its KV cache, a
//! [`CacheSpec`], and its scheduling, an [`EngineConfig`]), validated and sized in one place.
//!
//! Three values go in, each known at a different time:
//! - [`EngineOptions`]: what the user asked for (`kiln`'s engine flags), any of it left to the
//!   defaults: [`DEFAULT_WINDOW`], [`DEFAULT_BLOCK_SIZE`], [`DEFAULT_MAX_STEP_TOKENS`];
//! - [`Workload`]: what differs between the programs that run an engine (a batch of prompts, a
//!   conversation, a server, a benchmark): the cache kind and batch by default, the kinds it
//!   can use, the step policy, prefix caching, how the cache is sized without a budget. The
//!   two give [`EngineSettings`] ([`EngineOptions::resolve`]), checked before anything loads;
//! - [`Run`]: what one run needs, known once the model is loaded (its context and KV layout,
//!   the requests and tokens to hold, the memory there is). [`EngineSettings::spec`] sizes the
//!   cache from them (the memory budget, the context, the batch) and refuses, before anything
//!   is allocated, a cache larger than an address space or than the memory available.
//!
//! The spec then builds the cache ([`EngineSpec::cache`]), an [`Engine`] on it
//! ([`EngineSpec::engine`], with a draft model's cache beside it) or a [`Session`]
//! ([`EngineSpec::session`]). It knows no command line: errors name a [`Setting`], which the
//! caller turns into its own words (a flag).

use std::fmt;

use kiln_core::kv_cache::{CacheError, CacheKind, KvCache, KvLayout};
use kiln_core::{CausalLm, InferenceBackend, KvDtype};

pub use kiln_core::kv_cache::DEFAULT_BLOCK_SIZE;

use crate::{CacheSpec, Engine, EngineConfig, EngineError, Session, StepPolicy};

/// The sliding cache's window when none is given, in tokens.
pub const DEFAULT_WINDOW: usize = 4096;

/// The most prompt tokens one step feeds when no limit is given.
pub const DEFAULT_MAX_STEP_TOKENS: usize = 512;

/// [`DefaultBudget::Capped`]'s cap: 1 GiB holds 23,000 tokens of SmolLM2-135M (45 KiB each),
/// 32 requests of 700. The pool is allocated (and zeroed) at start, so more would cost seconds
/// of start-up and resident memory that most runs never use; a budget sets any size.
pub const DEFAULT_KV_CAP: u64 = 1 << 30;

/// One setting of the spec, as errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// [`EngineOptions::window`].
    Window,
    /// [`EngineOptions::page_size`].
    PageSize,
    /// [`EngineOptions::max_batch`].
    MaxBatch,
    /// [`EngineOptions::max_step_tokens`].
    MaxStepTokens,
    /// [`EngineOptions::kv_cache_mib`].
    KvCacheMib,
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Setting::Window => "the window",
            Setting::PageSize => "the page size",
            Setting::MaxBatch => "the batch",
            Setting::MaxStepTokens => "the step's prompt tokens",
            Setting::KvCacheMib => "the KV cache budget",
        })
    }
}

/// Why a spec cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A size of zero.
    #[error("{0} must be positive")]
    Zero(Setting),
    /// A cache kind the workload cannot run on.
    #[error("a {kind} cache cannot run this workload: use {}", names(.allowed))]
    CacheKind {
        /// The kind asked for.
        kind: CacheKind,
        /// The kinds it can run on, its default first.
        allowed: &'static [CacheKind],
    },
    /// A setting the workload decides itself ([`Workload::max_batch`] `None`).
    #[error("{0} is the workload's own")]
    Fixed(Setting),
    /// A memory budget of more bytes than a `u64` counts.
    #[error("{setting} of {mib} MiB is more memory than exists")]
    Overflow {
        /// The budget's setting.
        setting: Setting,
        /// Its value, in MiB.
        mib: usize,
    },
    /// A cache larger than an address space, or than the memory available to hold it.
    #[error(
        "the KV cache ({kind} cache for {sequences} × {max_len} tokens) would take {}",
        match (.bytes, .available) {
            (Some(bytes), Some(available)) => format!(
                "{} MiB, more than the {} MiB of memory available",
                bytes >> 20,
                available >> 20
            ),
            _ => "more bytes than an address space holds".to_string(),
        }
    )]
    TooBig {
        /// The cache kind.
        kind: CacheKind,
        /// Sequences it holds.
        sequences: usize,
        /// Tokens each may hold.
        max_len: usize,
        /// Its bytes (`None`: more than an address space).
        bytes: Option<u64>,
        /// The memory available (`None` when `bytes` is `None`).
        available: Option<u64>,
    },
}

fn names(kinds: &[CacheKind]) -> String {
    let names: Vec<String> = kinds.iter().map(ToString::to_string).collect();
    names.join(" or ")
}

/// What the user asked of the engine: any `None` is left to the [`Workload`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// The cache kind.
    pub cache: Option<CacheKind>,
    /// Sliding cache: the attention window, in tokens.
    pub window: usize,
    /// Paged cache: tokens per block.
    pub page_size: usize,
    /// Requests decoded together (a beam search counts one row per beam).
    pub max_batch: Option<usize>,
    /// Most prompt tokens one step feeds ([`EngineConfig::max_step_tokens`]).
    pub max_step_tokens: usize,
    /// The paged cache's pool, in MiB (`None`: [`Workload::budget`]). Other kinds hold what
    /// the batch and the sequences' length make them hold.
    pub kv_cache_mib: Option<usize>,
    /// Reuse earlier requests' cached prompt prefixes, where the workload and the cache kind
    /// do.
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            cache: None,
            window: DEFAULT_WINDOW,
            page_size: DEFAULT_BLOCK_SIZE,
            max_batch: None,
            max_step_tokens: DEFAULT_MAX_STEP_TOKENS,
            kv_cache_mib: None,
            prefix_cache: true,
        }
    }
}

/// How a cache is sized when no budget is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultBudget {
    /// Room for every sequence whole: the batch × the longest sequence the run needs.
    Whole,
    /// Room for every sequence whole, capped at a quarter of the memory available and at
    /// [`DEFAULT_KV_CAP`]: a server's pool, allocated at start for requests not yet known,
    /// preempting the newest when it fills.
    Capped,
}

/// What differs between the programs that run an engine: their defaults, and what they
/// decide themselves. `kiln`'s commands each run one (docs/usage.md, "Engine flags").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    /// The cache kind by default.
    pub cache: CacheKind,
    /// The kinds it can run on.
    pub caches: &'static [CacheKind],
    /// Requests decoded together by default; `None`: the run decides ([`Run::requests`]) and
    /// refuses [`EngineOptions::max_batch`].
    pub max_batch: Option<usize>,
    /// How steps share prefill and decode. With [`StepPolicy::PrefillFirst`] a step also
    /// feeds at least the run's longest prompt ([`Run::longest_prompt`]), so every prompt is
    /// read in one step.
    pub policy: StepPolicy,
    /// Whether prefix caching may be on (the options can still turn it off).
    pub prefix_cache: bool,
    /// How the paged pool is sized without [`EngineOptions::kv_cache_mib`].
    pub budget: DefaultBudget,
}

/// Every cache kind, paged first.
const ALL_KINDS: &[CacheKind] = &[
    CacheKind::Paged,
    CacheKind::Static,
    CacheKind::Dynamic,
    CacheKind::Sliding,
];

impl Workload {
    /// Prompts known up front, served together (`kiln generate`): the paged cache with prefix
    /// caching, up to 8 at once, the pool sized for every sequence whole.
    pub const BATCH: Workload = Workload {
        cache: CacheKind::Paged,
        caches: ALL_KINDS,
        max_batch: Some(8),
        policy: StepPolicy::Mixed,
        prefix_cache: true,
        budget: DefaultBudget::Whole,
    };

    /// One conversation whose cache is kept between turns (`kiln chat`): one sequence as long
    /// as the context, in a dynamic cache that grows with it.
    pub const CONVERSATION: Workload = Workload {
        cache: CacheKind::Dynamic,
        caches: ALL_KINDS,
        max_batch: None,
        ..Self::BATCH
    };

    /// Requests arriving over time (`kiln serve`): 32 at once over a paged pool (or static
    /// rows) of the full context, the pool capped ([`DefaultBudget::Capped`]).
    pub const SERVER: Workload = Workload {
        caches: &[CacheKind::Paged, CacheKind::Static],
        max_batch: Some(32),
        budget: DefaultBudget::Capped,
        ..Self::BATCH
    };

    /// Benchmark cells (`kiln bench`): each cell's batch at once, prefill apart from decode
    /// ([`StepPolicy::PrefillFirst`]) and no prefix caching, since a cell's runs repeat their
    /// prompts and time computing them.
    pub const BENCHMARK: Workload = Workload {
        max_batch: None,
        policy: StepPolicy::PrefillFirst,
        prefix_cache: false,
        ..Self::BATCH
    };
}

/// The engine's settings once options and workload are put together: everything but what
/// depends on the model and the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSettings {
    /// The cache kind.
    pub cache: CacheKind,
    /// Sliding: the window.
    pub window: usize,
    /// Paged: tokens per block.
    pub page_size: usize,
    /// Requests decoded together (`None`: as many as the run has).
    pub max_batch: Option<usize>,
    /// Most prompt tokens per step.
    pub max_step_tokens: usize,
    /// The paged pool's bytes (`None`: the workload's default).
    pub budget: Option<u64>,
    /// How the pool is sized without a budget.
    pub default_budget: DefaultBudget,
    /// How steps share prefill and decode.
    pub policy: StepPolicy,
    /// Prefix caching (on the paged cache).
    pub prefix_cache: bool,
}

impl EngineOptions {
    /// The settings these options give `workload`.
    ///
    /// # Errors
    /// [`SpecError`]: a zero size, a cache kind the workload cannot use, a batch it sets
    /// itself, a budget of more bytes than exist.
    pub fn resolve(&self, workload: &Workload) -> Result<EngineSettings, SpecError> {
        for (setting, value) in [
            (Setting::Window, Some(self.window)),
            (Setting::PageSize, Some(self.page_size)),
            (Setting::MaxBatch, self.max_batch),
            (Setting::MaxStepTokens, Some(self.max_step_tokens)),
            (Setting::KvCacheMib, self.kv_cache_mib),
        ] {
            if value == Some(0) {
                return Err(SpecError::Zero(setting));
            }
        }
        let cache = self.cache.unwrap_or(workload.cache);
        if !workload.caches.contains(&cache) {
            return Err(SpecError::CacheKind {
                kind: cache,
                allowed: workload.caches,
            });
        }
        let max_batch = match (self.max_batch, workload.max_batch) {
            (Some(_), None) => return Err(SpecError::Fixed(Setting::MaxBatch)),
            (asked, default) => asked.or(default),
        };
        let budget =
            match self.kv_cache_mib {
                Some(mib) => Some((mib as u64).checked_mul(1 << 20).ok_or(
                    SpecError::Overflow {
                        setting: Setting::KvCacheMib,
                        mib,
                    },
                )?),
                None => None,
            };
        Ok(EngineSettings {
            cache,
            window: self.window,
            page_size: self.page_size,
            max_batch,
            max_step_tokens: self.max_step_tokens,
            budget,
            default_budget: workload.budget,
            policy: workload.policy,
            prefix_cache: self.prefix_cache && workload.prefix_cache,
        })
    }
}

/// What one run needs of its engine, known once the model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Requests that may run at once (a prompts file's prompts; a benchmark cell's batch; a
    /// conversation's one); `None`: unknown (a server's), as many as the settings' batch.
    pub requests: Option<usize>,
    /// Rows (cache sequences) each request takes: a beam search's beams, else 1.
    pub rows_per_request: usize,
    /// Tokens one sequence may hold: at most the model's context.
    pub max_len: usize,
    /// The longest prompt, where known (0 otherwise): see [`Workload::policy`].
    pub longest_prompt: usize,
    /// The K/V layout of the model.
    pub layout: KvLayout,
    /// The cache's precision.
    pub dtype: KvDtype,
    /// The host memory available now, where known: a quarter of it caps
    /// [`DefaultBudget::Capped`] (1 GiB when unknown).
    pub available_memory: Option<u64>,
    /// Whether the cache lives in that memory (the cpu backends): it must then fit in it.
    pub cache_in_host_memory: bool,
}

/// The engine a run gets: its cache and its scheduling, and what the cache takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSpec {
    /// The KV cache.
    pub cache: CacheSpec,
    /// The scheduling limits (speculation and group limits are the caller's to add).
    pub config: EngineConfig,
    /// Bytes the cache allocates for [`Run::layout`] in [`Run::dtype`].
    pub cache_bytes: u64,
}

impl EngineSettings {
    /// The spec for `run`, the cache sized here and nowhere else: a paged pool holds the
    /// budget ([`EngineOptions::kv_cache_mib`]) or, without one, every sequence whole
    /// ([`DefaultBudget`]); a static or sliding cache holds the batch's rows; a dynamic cache
    /// grows from nothing.
    ///
    /// # Errors
    /// [`SpecError::TooBig`] for a cache of more bytes than an address space holds, or than
    /// the host memory available when the cache lives there; [`SpecError::Fixed`] when
    /// neither the settings nor the run give a batch.
    pub fn spec(&self, run: &Run) -> Result<EngineSpec, SpecError> {
        let requests = match (self.max_batch, run.requests) {
            (Some(most), Some(requests)) => most.min(requests),
            (Some(most), None) => most,
            (None, Some(requests)) => requests,
            (None, None) => return Err(SpecError::Fixed(Setting::MaxBatch)),
        }
        .max(1);
        let rows = requests.saturating_mul(run.rows_per_request.max(1));
        let max_step_tokens = match self.policy {
            StepPolicy::PrefillFirst => self.max_step_tokens.max(run.longest_prompt),
            StepPolicy::Mixed => self.max_step_tokens,
        };
        let max_len = run.max_len.max(1);
        let per_token = run.layout.bytes_per_token(run.dtype).max(1) as u64;
        let blocks = match (self.cache, self.budget, self.default_budget) {
            (CacheKind::Paged, Some(budget), _) => Some(budget),
            (CacheKind::Paged, None, DefaultBudget::Capped) => {
                let whole = (rows as u64)
                    .saturating_mul(max_len as u64)
                    .saturating_mul(per_token);
                let quarter = run.available_memory.map_or(1 << 30, |m| m / 4);
                Some(whole.min(quarter).min(DEFAULT_KV_CAP))
            }
            _ => None,
        }
        .map(|budget| {
            usize::try_from(budget / per_token / self.page_size as u64)
                .unwrap_or(usize::MAX)
                .max(1)
        });
        let cache = CacheSpec {
            kind: self.cache,
            max_sequences: rows,
            max_len,
            window: self.window,
            max_step: max_step_tokens,
            page_size: self.page_size,
            blocks,
        };
        let too_big = |bytes, available| SpecError::TooBig {
            kind: self.cache,
            sequences: rows,
            max_len,
            bytes,
            available,
        };
        let cache_bytes = cache
            .bytes(run.layout, run.dtype)
            .filter(|&b| b <= isize::MAX as u64)
            .ok_or_else(|| too_big(None, None))?;
        if run.cache_in_host_memory
            && let Some(available) = run.available_memory
            && cache_bytes > available
        {
            return Err(too_big(Some(cache_bytes), Some(available)));
        }
        let config = EngineConfig {
            max_batch: rows,
            max_step_tokens,
            policy: self.policy,
            prefix_cache: self.prefix_cache,
            speculation: None,
            max_group_rows: None,
        };
        Ok(EngineSpec {
            cache,
            config,
            cache_bytes,
        })
    }
}

impl EngineSpec {
    /// Whether prefix caching is on: asked for, and the cache kind keeps prefixes (paged).
    pub fn prefix_caching(&self) -> bool {
        self.config.prefix_cache && self.cache.kind == CacheKind::Paged
    }

    /// The cache for a model of `layout`, in `dtype`, on `device` (the run's model, or a
    /// draft model beside it, which holds as many tokens in its own layout and precision).
    ///
    /// # Errors
    /// As [`CacheSpec::build`].
    pub fn cache<B: InferenceBackend>(
        &self,
        layout: KvLayout,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Result<Box<dyn KvCache<B>>, CacheError> {
        self.cache.build(layout, dtype, device)
    }

    /// An engine over `model` with its cache in `kv_dtype` and, when `draft` is given, the
    /// draft model's cache beside it (in the draft's own dtype); the config needs speculation
    /// from a draft model then.
    ///
    /// # Errors
    /// A cache that cannot be built; the engine's [`EngineError::InvalidConfig`].
    pub fn engine<'a, B: InferenceBackend>(
        &self,
        model: &'a dyn CausalLm<B>,
        kv_dtype: impl Into<KvDtype>,
        draft: Option<&'a dyn CausalLm<B>>,
    ) -> Result<Engine<'a, B>, EngineError> {
        let device = model.device();
        let cache = self.cache(model.shape().kv_layout(), kv_dtype, &device);
        let mut engine = Engine::new(
            model,
            cache.map_err(kiln_core::CoreError::from)?,
            self.config,
        )?;
        if let Some(draft) = draft {
            let cache = self.cache(draft.shape().kv_layout(), draft.dtype(), &device);
            engine = engine.with_draft_model(draft, cache.map_err(kiln_core::CoreError::from)?)?;
        }
        Ok(engine)
    }

    /// A conversation over `model` with its cache in `kv_dtype`.
    ///
    /// # Errors
    /// As [`Self::engine`].
    pub fn session<'a, B: InferenceBackend>(
        &self,
        model: &'a dyn CausalLm<B>,
        kv_dtype: impl Into<KvDtype>,
    ) -> Result<Session<'a, B>, EngineError> {
        let cache = self.cache(model.shape().kv_layout(), kv_dtype, &model.device());
        Session::new(
            model,
            cache.map_err(kiln_core::CoreError::from)?,
            self.config,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: KvLayout = KvLayout {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 16,
    };

    /// 512 bytes a token in f32.
    fn run(requests: Option<usize>, max_len: usize) -> Run {
        Run {
            requests,
            rows_per_request: 1,
            max_len,
            longest_prompt: 0,
            layout: LAYOUT,
            dtype: KvDtype::F32,
            available_memory: Some(1 << 30),
            cache_in_host_memory: true,
        }
    }

    fn settings(options: EngineOptions, workload: Workload) -> EngineSettings {
        options.resolve(&workload).expect("valid options")
    }

    #[test]
    fn a_batch_holds_its_prompts_whole_and_never_more_rows_than_prompts() {
        let spec = settings(EngineOptions::default(), Workload::BATCH)
            .spec(&Run {
                rows_per_request: 4,
                ..run(Some(3), 100)
            })
            .unwrap();
        // 3 prompts of 4 beams each, under the batch of 8.
        assert_eq!(spec.config.max_batch, 12);
        assert_eq!(spec.cache.max_sequences, 12);
        assert_eq!(spec.cache.blocks, None);
        assert_eq!(spec.cache.pool_blocks(), 12 * 7);
        assert_eq!(spec.cache_bytes, 12 * 7 * 16 * 512);
        assert!(spec.prefix_caching());
        let two = EngineOptions {
            max_batch: Some(2),
            ..EngineOptions::default()
        };
        let spec = settings(two, Workload::BATCH)
            .spec(&run(Some(3), 100))
            .unwrap();
        assert_eq!(spec.config.max_batch, 2);
    }

    #[test]
    fn a_server_pool_is_its_budget_or_the_whole_batch_capped() {
        let server = settings(EngineOptions::default(), Workload::SERVER);
        // 32 × 100 tokens × 512 bytes: under a quarter of 1 GiB.
        let spec = server.spec(&run(None, 100)).unwrap();
        assert_eq!(spec.config.max_batch, 32);
        assert_eq!(spec.cache.blocks, Some(32 * 100 / 16));
        // A quarter of 64 MiB caps it.
        let small = Run {
            available_memory: Some(64 << 20),
            ..run(None, 8192)
        };
        let spec = server.spec(&small).unwrap();
        assert_eq!(spec.cache.blocks, Some((16 << 20) / 512 / 16));
        let budget = EngineOptions {
            kv_cache_mib: Some(2),
            ..EngineOptions::default()
        };
        let spec = settings(budget, Workload::SERVER)
            .spec(&run(None, 8192))
            .unwrap();
        assert_eq!(spec.cache_bytes, 2 << 20);
    }

    #[test]
    fn a_conversation_and_a_benchmark_set_their_own_batch() {
        let chat = settings(EngineOptions::default(), Workload::CONVERSATION);
        let spec = chat.spec(&run(Some(1), 128)).unwrap();
        assert_eq!(spec.cache.kind, CacheKind::Dynamic);
        assert_eq!((spec.config.max_batch, spec.cache_bytes), (1, 0));
        let bench = settings(EngineOptions::default(), Workload::BENCHMARK);
        let spec = bench
            .spec(&Run {
                longest_prompt: 600,
                ..run(Some(4), 700)
            })
            .unwrap();
        assert_eq!(spec.config.policy, StepPolicy::PrefillFirst);
        assert_eq!(spec.config.max_step_tokens, 600);
        assert!(!spec.config.prefix_cache);
        assert_eq!(
            bench.spec(&run(None, 10)),
            Err(SpecError::Fixed(Setting::MaxBatch))
        );
        let batch = EngineOptions {
            max_batch: Some(2),
            ..EngineOptions::default()
        };
        for workload in [Workload::CONVERSATION, Workload::BENCHMARK] {
            assert_eq!(
                batch.resolve(&workload),
                Err(SpecError::Fixed(Setting::MaxBatch))
            );
        }
    }

    #[test]
    fn zero_sizes_kinds_a_workload_cannot_use_and_caches_too_big_are_refused() {
        let zero = EngineOptions {
            page_size: 0,
            ..EngineOptions::default()
        };
        assert_eq!(
            zero.resolve(&Workload::BATCH),
            Err(SpecError::Zero(Setting::PageSize))
        );
        let sliding = EngineOptions {
            cache: Some(CacheKind::Sliding),
            ..EngineOptions::default()
        };
        assert!(matches!(
            sliding.resolve(&Workload::SERVER),
            Err(SpecError::CacheKind {
                kind: CacheKind::Sliding,
                ..
            })
        ));
        let huge = EngineOptions {
            kv_cache_mib: Some(usize::MAX),
            ..EngineOptions::default()
        };
        assert!(matches!(
            huge.resolve(&Workload::SERVER),
            Err(SpecError::Overflow { .. })
        ));
        let statics = EngineOptions {
            cache: Some(CacheKind::Static),
            ..EngineOptions::default()
        };
        let err = settings(statics, Workload::BATCH)
            .spec(&run(Some(8), 1 << 20))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the KV cache (static cache for 8 × 1048576 tokens) would take 4096 MiB, more than \
             the 1024 MiB of memory available"
        );
        let pages = EngineOptions {
            page_size: 1 << 62,
            ..EngineOptions::default()
        };
        let err = settings(pages, Workload::BATCH)
            .spec(&run(Some(1), 10))
            .unwrap_err();
        assert!(
            err.to_string()
                .ends_with("more bytes than an address space holds")
        );
    }
}
