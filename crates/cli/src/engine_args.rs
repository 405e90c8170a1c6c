//! The engine flags every command that generates shares (`generate`, `chat`, `serve`, `bench`):
//! the KV cache, the batch, prefix caching and the CPU threads, one block with one set of
//! defaults. What differs between commands is each one's [`Workload`] (`kiln generate` serves a
//! batch of prompts, `kiln chat` one conversation, `kiln serve` a server's requests, `kiln bench`
//! benchmark cells), passed into the one spec builder ([`kiln_engine::spec`]), which validates
//! the flags and sizes the cache. The defaults are tabled in docs/usage.md, "Engine flags".

use kiln_core::CausalLm;
use kiln_core::InferenceBackend;
use kiln_core::backend::{BackendKind, ThreadCounts};
use kiln_core::kv_cache::CacheKind;
use kiln_engine::spec::{
    DEFAULT_BLOCK_SIZE, DEFAULT_MAX_STEP_TOKENS, DEFAULT_WINDOW, Run, Setting, SpecError,
};
use kiln_engine::{EngineOptions, EngineSettings, EngineSpec, Workload};

use crate::exit::UsageError;

/// The most `--threads`: more threads than any machine kiln runs on has cores.
const MAX_THREADS: i64 = 1024;

/// `--threads`: the threads the CPU backends compute on, for every command that computes.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct ThreadsArgs {
    /// Threads the cpu backend computes on: kiln's kernel pool and burn-flex's pool, one count
    /// (1 to 1024) [default: $KILN_THREADS, else one per core]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=MAX_THREADS))]
    pub threads: Option<u16>,
}

impl ThreadsArgs {
    /// Sizes both pools, once, before anything computes (`main` calls it first).
    ///
    /// # Errors
    /// A pool already sized otherwise (a bug: nothing computes before this).
    pub fn apply(&self) -> kiln_core::Result<ThreadCounts> {
        kiln_core::backend::set_threads(self.threads.map(usize::from))
    }
}

/// The engine: KV cache, batching, threads.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Engine")]
pub struct EngineArgs {
    /// KV cache: paged, static, dynamic or sliding [default: paged; chat: dynamic, kept
    /// between turns and growing with the conversation; serve: paged or static only]
    #[arg(long, value_name = "KIND")]
    pub cache: Option<CacheKind>,
    /// Sliding cache: attend over the last N tokens only.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_WINDOW)]
    pub window: usize,
    /// Paged cache: tokens per block.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_BLOCK_SIZE)]
    pub page_size: usize,
    /// Most sequences decoded together (a beam search takes one per beam) [default: 8; serve:
    /// 32, one request holding at most half of them; chat runs one conversation, bench each
    /// cell's --batch-sizes]
    #[arg(long, value_name = "N")]
    pub max_batch: Option<usize>,
    /// Most prompt tokens prefilled in one step (longer prompts go in chunks, between decode
    /// steps of the others; bench feeds each cell's prompts whole).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_STEP_TOKENS)]
    pub max_step_tokens: usize,
    /// Paged cache: its memory in MiB [default: what every sequence needs whole; serve: what
    /// --max-batch sequences of the full context need, capped at a quarter of the available
    /// memory and at 1 GiB]. When it fills, the newest request is preempted and recomputed
    /// later.
    #[arg(long, value_name = "MIB")]
    pub kv_cache_mb: Option<usize>,
    /// Compute every prompt in full instead of reusing the K/V of earlier requests' identical
    /// leading tokens (prefix caching is on by default with the paged cache; bench never
    /// reuses).
    #[arg(long)]
    pub no_prefix_cache: bool,
    #[command(flatten)]
    pub threads: ThreadsArgs,
}

/// A command's engine: its workload, and its words for errors.
#[derive(Debug, Clone, Copy)]
pub struct Command {
    /// The command's name (`serve`).
    pub name: &'static str,
    /// Its defaults and what it decides itself.
    pub workload: Workload,
    /// The flags that size its cache, for "lower …" (`--max-batch or --page-size`).
    pub sized_by: &'static str,
    /// Why it takes no --max-batch, where it takes none.
    pub own_batch: &'static str,
}

/// `kiln generate`.
pub const GENERATE: Command = Command {
    name: "generate",
    workload: Workload::BATCH,
    sized_by: "--max-batch, --num-beams, --max-tokens or --page-size",
    own_batch: "",
};

/// `kiln chat`.
pub const CHAT: Command = Command {
    name: "chat",
    workload: Workload::CONVERSATION,
    sized_by: "--context or --page-size",
    own_batch: "it runs one conversation",
};

/// `kiln serve`.
pub const SERVE: Command = Command {
    name: "serve",
    workload: Workload::SERVER,
    sized_by: "--kv-cache-mb, --max-batch or --page-size",
    own_batch: "",
};

/// `kiln bench`.
pub const BENCH: Command = Command {
    name: "bench",
    workload: Workload::BENCHMARK,
    sized_by: "--batch-sizes, --prompt-lens, --new-tokens, --kv-cache-mb or --page-size",
    own_batch: "--batch-sizes sets each cell's batch",
};

impl EngineArgs {
    /// The options these flags ask for.
    pub fn options(&self) -> EngineOptions {
        EngineOptions {
            cache: self.cache,
            window: self.window,
            page_size: self.page_size,
            max_batch: self.max_batch,
            max_step_tokens: self.max_step_tokens,
            kv_cache_mib: self.kv_cache_mb,
            prefix_cache: !self.no_prefix_cache,
        }
    }

    /// The settings `command` runs with, checked before anything loads.
    ///
    /// # Errors
    /// A [`UsageError`] naming the flag: a zero size, a cache kind the command cannot use,
    /// a flag it does not take, a budget of more bytes than exist.
    pub fn settings(&self, command: &Command) -> Result<EngineSettings, UsageError> {
        self.options()
            .resolve(&command.workload)
            .map_err(|e| usage(e, command))
    }
}

/// The facts of a run on `backend` for a model of `model`'s shape with its cache in
/// `kv_dtype`; the caller fills in the requests, rows and lengths.
pub fn run_for<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    kv_dtype: kiln_core::KvDtype,
    backend: BackendKind,
) -> Run {
    let shape = model.shape();
    Run {
        requests: None,
        rows_per_request: 1,
        max_len: shape.max_positions,
        longest_prompt: 0,
        layout: shape.kv_layout(),
        dtype: kv_dtype,
        available_memory: crate::memory::available_memory(),
        cache_in_host_memory: matches!(backend, BackendKind::Cpu | BackendKind::Ndarray),
    }
}

/// `settings`' spec for `run`.
///
/// # Errors
/// A [`UsageError`] for a cache that cannot be held, naming the flags that size it.
pub fn spec(
    settings: &EngineSettings,
    run: &Run,
    command: &Command,
) -> Result<EngineSpec, UsageError> {
    settings.spec(run).map_err(|e| usage(e, command))
}

/// The flag behind `setting`.
fn flag(setting: Setting) -> &'static str {
    match setting {
        Setting::Window => "--window",
        Setting::PageSize => "--page-size",
        Setting::MaxBatch => "--max-batch",
        Setting::MaxStepTokens => "--max-step-tokens",
        Setting::KvCacheMib => "--kv-cache-mb",
    }
}

/// `err` in the command line's words.
fn usage(err: SpecError, command: &Command) -> UsageError {
    UsageError(match err {
        SpecError::Zero(setting) => format!("{} must be positive", flag(setting)),
        SpecError::CacheKind { kind, allowed } => {
            let names: Vec<String> = allowed
                .iter()
                .map(|&k| match k == command.workload.cache {
                    true => format!("{k} (the default)"),
                    false => k.to_string(),
                })
                .collect();
            format!(
                "--cache {kind} cannot {}: use {}",
                command.name,
                names.join(" or ")
            )
        }
        SpecError::Fixed(setting) => format!(
            "{} does not apply to `kiln {}`: {}",
            flag(setting),
            command.name,
            command.own_batch
        ),
        SpecError::Overflow { setting, mib } => {
            format!("{} {mib} is more memory than exists", flag(setting))
        }
        too_big @ SpecError::TooBig { .. } => format!("{too_big}; lower {}", command.sized_by),
    })
}
