//! `kiln serve`: the OpenAI-compatible HTTP server (`kiln-server`) on a model and backend
//! chosen here. It listens before the model loads (`/health` answers 503 meanwhile), sizes the
//! KV cache by a memory budget, logs one line per request, and exits 0 after SIGINT / SIGTERM
//! (130 when a second one cuts the grace period short).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use kiln_core::InferenceBackend;
use kiln_core::backend::BackendTask;
use kiln_core::kv_cache::CacheKind;
use kiln_engine::EngineSettings;
use kiln_server::{
    FleetLimits, ModelEntry, ModelLoader, ServedDraft, ServedModel, Server, ServerOptions, Stopped,
};

use crate::engine_args::{self, EngineArgs, SERVE};
use crate::exit::UsageError;
use crate::model_args::{ModelArgs, SpeculationArgs, default_alias};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", help_heading = "Server")]
    host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, default_value_t = 8080, help_heading = "Server")]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize (also read
    /// from $KILN_API_KEY; trimmed; an empty key is an error); /health and /metrics stay open.
    #[arg(long, value_name = "KEY", help_heading = "Server")]
    api_key: Option<String>,
    /// Answer CORS preflights and allow any origin (for browser clients).
    #[arg(long, help_heading = "Server")]
    cors: bool,
    /// Read special-token text in chat messages (`<|im_end|>`) as the control token it spells,
    /// as older servers did; by default it is plain text, so a user cannot end their turn or
    /// open a system one.
    #[arg(long, help_heading = "Server")]
    allow_special_in_content: bool,
    /// How tool calls are read from the output: `auto` (from the chat template's markers),
    /// `hermes`, `llama3`, `mistral`, `generic`, or `none` (tool calling off).
    #[arg(
        long,
        value_name = "PARSER",
        default_value = "auto",
        help_heading = "Server"
    )]
    tool_parser: kiln_server::ToolParser,
    /// Where a thinking model's `<think>…</think>` goes: `auto` (to `reasoning_content` when
    /// the chat template speaks of `<think>`: Qwen3, QwQ, DeepSeek-R1 distills), `separate`
    /// (always; `deepseek` is llama-server's name for it) or `none` (left in `content`).
    #[arg(
        long,
        value_name = "FORMAT",
        default_value = "auto",
        help_heading = "Server"
    )]
    reasoning_format: kiln_server::ReasoningFormat,
    /// Most sequences waiting beyond the running batch (each of `n` choices and each beam
    /// counts); more get 503.
    #[arg(long, value_name = "N", default_value_t = 256, help_heading = "Server")]
    max_queue: usize,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20, help_heading = "Server")]
    max_body_bytes: usize,
    /// MiB of stored responses the Responses API keeps (`store: true`) for retrieval and
    /// `previous_response_id`; past it the least recently used are evicted. 0 stores none.
    #[arg(long, value_name = "MB", default_value_t = 64, help_heading = "Server")]
    responses_store_mb: usize,
    /// Seconds running requests may go on after SIGINT / SIGTERM before they are cancelled; a
    /// second signal cancels them at once.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        help_heading = "Server"
    )]
    shutdown_grace: f64,
    /// Seconds a client may take to send a request's head (its line and headers), counted from
    /// when the connection opens or its previous response ends; slower connections are closed.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        help_heading = "Server"
    )]
    header_timeout: f64,
    /// Seconds a client may take to send a request's whole body; a slower one gets 408.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 60.0,
        help_heading = "Server"
    )]
    body_timeout: f64,
    /// Seconds a connection with no request in progress stays open for the next one; at most
    /// --header-timeout, whose clock runs meanwhile [default: 5, or --header-timeout if shorter]
    #[arg(long, value_name = "SECONDS", help_heading = "Server")]
    keep_alive_timeout: Option<f64>,
    /// Most connections open at once; at the limit new clients wait until one closes (the
    /// open-files limit is raised to fit, or the limit lowered to fit it, with a warning).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1024,
        help_heading = "Server"
    )]
    max_connections: usize,
    /// How /v1/embeddings pools an input's final hidden states into one vector, where the
    /// model's files do not say (a sentence-transformers folder's 1_Pooling/config.json wins):
    /// `last` (the last token's state, as Qwen3-Embedding and other decoder embedders) or `mean`
    /// [default: last]
    #[arg(long, value_name = "POOLING", value_parser = ["last", "mean"], help_heading = "Server")]
    embedding_pooling: Option<String>,
    /// Whitespace JSON output may have between its tokens (response_format, a grammar's
    /// `%json`): `compact` (none), `bounded` (one space, or one or two newlines and up to 20
    /// spaces of indentation, as llama.cpp), or `free` (any, as llguidance: a small model may
    /// write blank lines until max_tokens).
    #[arg(long, value_name = "MODE", default_value = "bounded", value_parser = ["compact", "bounded", "free"], help_heading = "Server")]
    json_whitespace: String,
    /// The model's name in /v1/models and in responses (default: the file or folder name).
    /// With several models, name each with --model ALIAS=PATH instead.
    #[arg(long, value_name = "NAME", help_heading = "Server")]
    served_model_name: Option<String>,
    /// Serve every model in this folder too: each GGUF file and each model folder (with a
    /// config.json or params.json), named by its file or folder name. The first --model (or,
    /// without one, the folder's first model by name) loads at start; the others on first use.
    #[arg(long, value_name = "DIR", help_heading = "Models")]
    models_dir: Option<PathBuf>,
    /// Most MiB the loaded models may hold together (weights and KV caches): loading one more
    /// first unloads the least recently used models no request is running on [default: no
    /// limit]
    #[arg(long, value_name = "MB", help_heading = "Models")]
    models_memory_mb: Option<u64>,
    /// Most models loaded at once (llama-server's --models-max); the least recently used idle
    /// one is unloaded to load another [default: no limit]
    #[arg(long, value_name = "N", help_heading = "Models")]
    models_max: Option<usize>,
    /// Seconds a request waits for room to load its model, while the models that would have
    /// to unload are running requests; then it gets 503 `model_busy`
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        help_heading = "Models"
    )]
    models_room_wait: f64,
    /// Log lines as text or as JSON objects (one per line).
    #[arg(long, value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"], help_heading = "Server")]
    log_format: String,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    speculation: SpeculationArgs,
}

/// The longest `--shutdown-grace`, in seconds: a day (a longer one overflows the clock's
/// arithmetic long before it means anything).
const MAX_SHUTDOWN_GRACE: f64 = 86_400.0;

/// The longest `--header-timeout`, `--body-timeout` and `--keep-alive-timeout`, in seconds: a
/// day, as for `--shutdown-grace`.
const MAX_TIMEOUT: f64 = 86_400.0;

/// `--keep-alive-timeout` when not given (capped at `--header-timeout`): five seconds, the
/// default of uvicorn (the server under vLLM and most Python OpenAI-compatible servers) and of
/// Node; an idle pooled connection gives its `--max-connections` slot back soon, and the
/// OpenAI Python SDK's pool drops idle connections after five seconds itself.
const DEFAULT_KEEP_ALIVE: f64 = 5.0;

/// The most `--max-connections`: 2^20, the usual hard limit of open files on Linux.
const MAX_CONNECTIONS: usize = 1 << 20;

pub fn run(mut args: Args) -> Result<()> {
    let settings = args.engine.settings(&SERVE)?;
    if !(args.shutdown_grace.is_finite()
        && (0.0..=MAX_SHUTDOWN_GRACE).contains(&args.shutdown_grace))
    {
        return Err(UsageError(format!(
            "--shutdown-grace must be a number of seconds from 0 to {MAX_SHUTDOWN_GRACE} (a day), got {}",
            args.shutdown_grace
        ))
        .into());
    }
    for (name, value) in [
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--models-room-wait", args.models_room_wait),
        (
            "--keep-alive-timeout",
            args.keep_alive_timeout.unwrap_or(1.0),
        ),
    ] {
        if !(value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT) {
            return Err(UsageError(format!(
                "{name} must be a number of seconds above 0 and at most {MAX_TIMEOUT} (a day), got {value}"
            ))
            .into());
        }
    }
    match args.keep_alive_timeout {
        Some(keep) if keep > args.header_timeout => {
            return Err(UsageError(format!(
                "--keep-alive-timeout {keep} is longer than --header-timeout {}: an idle connection waits under the header timeout too, so raise that as well",
                args.header_timeout
            ))
            .into());
        }
        Some(_) => {}
        None => args.keep_alive_timeout = Some(DEFAULT_KEEP_ALIVE.min(args.header_timeout)),
    }
    if !(1..=MAX_CONNECTIONS).contains(&args.max_connections) {
        return Err(UsageError(format!(
            "--max-connections must be from 1 to {MAX_CONNECTIONS}, got {}",
            args.max_connections
        ))
        .into());
    }
    args.api_key = api_key(args.api_key.take(), std::env::var("KILN_API_KEY").ok())?;
    init_logging(&args.log_format);
    args.max_connections = open_files::fit(args.max_connections);
    let backend = args.model.backend;
    crate::device::run_on(backend, false, Task(args, settings))?
}

/// The key the server requires: `--api-key`, else `$KILN_API_KEY`, trimmed (a key pasted with
/// a newline still matches). One rule for both sources: a key that is empty once trimmed is
/// a usage error, since it would lock every client out (or, read as "no key", leave a server
/// meant to be private open).
fn api_key(flag: Option<String>, env: Option<String>) -> Result<Option<String>, UsageError> {
    let (source, key) = match (flag, env) {
        (Some(key), _) => ("--api-key", key),
        (None, Some(key)) => ("$KILN_API_KEY", key),
        (None, None) => return Ok(None),
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(UsageError(format!(
            "{source} is empty: give a key, or leave it unset to serve without one"
        )));
    }
    Ok(Some(key.to_string()))
}

/// Request lines and notices on stderr, through `tracing`.
fn init_logging(format: &str) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    if format == "json" {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

struct Task(Args, EngineSettings);

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let Task(args, settings) = self;
        let options = ServerOptions {
            host: args.host.clone(),
            port: args.port,
            api_key: args.api_key.clone(),
            cors: args.cors,
            max_queue: args.max_queue,
            max_body_bytes: args.max_body_bytes,
            shutdown_grace: Duration::from_secs_f64(args.shutdown_grace),
            header_timeout: Duration::from_secs_f64(args.header_timeout),
            body_timeout: Duration::from_secs_f64(args.body_timeout),
            keep_alive_timeout: Duration::from_secs_f64(
                args.keep_alive_timeout.unwrap_or(DEFAULT_KEEP_ALIVE),
            ),
            max_connections: args.max_connections,
            special_tokens_in_content: args.allow_special_in_content,
            json_whitespace: args
                .json_whitespace
                .parse()
                .map_err(|e: kiln_engine::UnknownJsonWhitespace| UsageError(e.to_string()))?,
            embedding_pooling: args
                .embedding_pooling
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(UsageError)?,
            tool_parser: args.tool_parser,
            reasoning_format: args.reasoning_format,
            responses_store_bytes: args.responses_store_mb.saturating_mul(1 << 20),
        };
        let models = served_models(&args)?;
        let limits = FleetLimits {
            memory_bytes: args.models_memory_mb.map(|mb| mb.saturating_mul(1 << 20)),
            max_loaded: args.models_max,
            room_wait: Duration::from_secs_f64(args.models_room_wait),
        };
        let entries: Vec<ModelEntry> = models
            .iter()
            .map(|(alias, path)| ModelEntry {
                alias: alias.clone(),
                source: path.as_ref().map_or_else(
                    || "the default model (fetched once)".into(),
                    |p| p.display().to_string(),
                ),
                // Its files, and the KV cache when its size is given.
                estimated_bytes: path.as_deref().map_or(0, files_bytes).saturating_add(
                    args.engine
                        .kv_cache_mb
                        .map_or(0, |mb| (mb as u64).saturating_mul(1 << 20)),
                ),
            })
            .collect();
        if let Some(budget) = limits.memory_bytes
            && let Some(big) = entries.iter().find(|e| e.estimated_bytes > budget)
        {
            return Err(UsageError(format!(
                "{} alone needs about {:.1} MiB (its files and KV cache), more than --models-memory-mb {}",
                big.alias,
                big.estimated_bytes as f64 / f64::from(1 << 20),
                budget >> 20
            ))
            .into());
        }
        if limits.max_loaded == Some(0) {
            return Err(UsageError("--models-max must be at least 1".into()).into());
        }
        let server =
            Server::start(options, entries, limits).map_err(|e| UsageError(e.to_string()))?;
        tracing::info!(
            "listening on http://{} (loading the model)",
            server.local_addr()
        );
        if models.len() > 1 {
            let names: Vec<&str> = models.iter().map(|(alias, _)| alias.as_str()).collect();
            tracing::info!(
                "serving {} models: {} ({} loads now, the others on first use)",
                models.len(),
                names.join(", "),
                names[0]
            );
        }
        let failure = Arc::new(Mutex::new(None));
        let loader = Loader::<B> {
            args,
            settings,
            device,
            models,
            failure: failure.clone(),
        };
        let stopped = server.serve(loader).map_err(|e| match e {
            // The loader's own error, so that a usage error (flags that size a cache beyond
            // memory) still exits 2.
            kiln_server::ServerError::Load(why) => failure
                .lock()
                .ok()
                .and_then(|mut f| f.take())
                .unwrap_or_else(|| anyhow::anyhow!("{why}")),
            other => UsageError(other.to_string()).into(),
        })?;
        tracing::info!("stopped");
        if stopped == Stopped::Forced {
            // 128 + SIGINT, as a shell reports a program Ctrl-C ended. The server has stopped
            // and returned; `main`'s exit codes are 0, 1 and 2, so exit here.
            std::process::exit(130);
        }
        Ok(())
    }
}

/// The models to serve, each with its alias and path (`None`: the embedded default): every
/// `--model`, then `--models-dir`'s models.
///
/// # Errors
/// A usage error for an unreadable `--models-dir`, one with no model, `--served-model-name`
/// with several models, or a draft model with several.
fn served_models(args: &Args) -> Result<Vec<(String, Option<PathBuf>)>> {
    let mut choices = args.model.model.clone();
    if let Some(dir) = &args.models_dir {
        let found = models_in(dir)?;
        if found.is_empty() {
            return Err(UsageError(format!(
                "--models-dir {}: no GGUF file or model folder (config.json or params.json) in it",
                dir.display()
            ))
            .into());
        }
        choices.extend(found);
    }
    if choices.len() > 1 {
        if args.served_model_name.is_some() {
            return Err(UsageError(
                "--served-model-name names one model; with several, name each with --model ALIAS=PATH"
                    .into(),
            )
            .into());
        }
        if args.speculation.draft_model.is_some() {
            return Err(UsageError(
                "--draft-model drafts for one model; it cannot serve several (prompt lookup can)"
                    .into(),
            )
            .into());
        }
    }
    let default = kiln_models::default_model::SMOLLM2_135M_INSTRUCT.file_name();
    if choices.is_empty() {
        let alias = args
            .served_model_name
            .clone()
            .unwrap_or_else(|| default_alias(Path::new(default)));
        return Ok(vec![(alias, None)]);
    }
    let single = choices.len() == 1;
    Ok(choices
        .into_iter()
        .map(|c| {
            // `default` is the embedded default model (as for --draft-model).
            let path = (c.path.as_os_str() != "default").then_some(c.path);
            let file = path.as_deref().unwrap_or(Path::new(default));
            let alias = c
                .alias
                .or_else(|| args.served_model_name.clone().filter(|_| single))
                .unwrap_or_else(|| default_alias(file));
            (alias, path)
        })
        .collect())
}

/// The models in `dir`, by name: GGUF files and folders with a config.json or params.json.
fn models_in(dir: &Path) -> Result<Vec<crate::model_args::ModelChoice>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| UsageError(format!("--models-dir {}: {e}", dir.display())))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            if p.is_dir() {
                p.join("config.json").is_file() || p.join("params.json").is_file()
            } else {
                p.extension()
                    .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
            }
        })
        .collect();
    found.sort();
    Ok(found
        .into_iter()
        .map(|path| crate::model_args::ModelChoice { alias: None, path })
        .collect())
}

/// Bytes of a model's files (a file, or a folder's files, one level deep): what it is expected
/// to hold before it has loaded once.
fn files_bytes(path: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    match std::fs::read_dir(path) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .map(|p| size(&p))
            .sum(),
        Err(_) => size(path),
    }
}

/// Loads a served model on its engine thread: the flags of `kiln serve`, for one model.
struct Loader<B: InferenceBackend> {
    args: Args,
    settings: EngineSettings,
    device: B::Device,
    models: Vec<(String, Option<PathBuf>)>,
    /// The last load's error, whole (the server keeps its text).
    failure: Arc<Mutex<Option<anyhow::Error>>>,
}

impl<B: InferenceBackend> ModelLoader<B> for Loader<B> {
    fn load(&self, alias: &str) -> Result<ServedModel<B>, String> {
        let (_, path) = self
            .models
            .iter()
            .find(|(a, _)| a == alias)
            .ok_or_else(|| format!("no model is named {alias}"))?;
        self.load_model(alias, path.as_deref()).map_err(|e| {
            let text = format!("{e:#}");
            if let Ok(mut failure) = self.failure.lock() {
                *failure = Some(e);
            }
            text
        })
    }
}

impl<B: InferenceBackend> Loader<B> {
    fn load_model(&self, name: &str, path: Option<&Path>) -> Result<ServedModel<B>> {
        let args = &self.args;
        let device = &self.device;
        let model_args = args.model.for_model(path);
        let backend = model_args.backend;
        let loaded = model_args.load::<B>(device)?;
        if self.models.len() == 1 {
            model_args.refuse_idle_activations(&loaded)?;
        }
        let dtype = model_args.kv_dtype(&loaded.model)?;
        // Requests arrive over time, each up to the full context.
        let run = engine_args::run_for(&loaded.model, dtype, backend);
        let mut spec = engine_args::spec(&self.settings, &run, &SERVE)?;
        spec.config.speculation = args.speculation.speculation()?;
        spec.config.max_group_rows = Some(kiln_server::rows_for_one_request(spec.config.max_batch));
        let per_token = run.layout.bytes_per_token(dtype);
        let bytes = spec.cache_bytes;
        let cache = spec
            .cache::<B>(run.layout, dtype, device)
            .context("allocating the KV cache")?;
        let draft = args.speculation.load_draft(backend, &loaded, device)?;
        // The draft model's cache holds as many tokens as the model's.
        let draft = match draft {
            Some(d) => {
                let layout = kiln_core::CausalLm::shape(&d.model).kv_layout();
                let dtype = kiln_core::CausalLm::dtype(&d.model);
                let cache = spec.cache::<B>(layout, dtype, device);
                let cache = cache.context("allocating the draft model's KV cache")?;
                Some(ServedDraft { loaded: d, cache })
            }
            None => None,
        };
        let config = spec.config;
        let tokens = kiln_core::kv_cache::CacheBook::usage(cache.as_ref()).capacity;
        let weights: Vec<String> = loaded
            .model
            .weight_summary()
            .into_iter()
            .map(|(kind, count, _)| format!("{count} {kind}"))
            .collect();
        tracing::info!(
            "serving {name} on {} (weights: {}): max batch {}, KV cache {} MiB = {tokens} tokens ({} cache, {dtype}, {} KiB per token), prefix caching {}, speculative decoding {}",
            backend.name(),
            weights.join(", "),
            config.max_batch,
            bytes >> 20,
            spec.cache.kind,
            per_token / 1024,
            if spec.prefix_caching() { "on" } else { "off" },
            match (&config.speculation, &draft) {
                (Some(s), Some(draft)) => format!(
                    "draft model {} ({} drafts)",
                    draft.loaded.path.display(),
                    s.draft_tokens
                ),
                (Some(s), None) => format!(
                    "prompt lookup (n-grams of up to {}, {} drafts)",
                    args.speculation.prompt_lookup.unwrap_or_default(),
                    s.draft_tokens
                ),
                (None, _) => "off".into(),
            },
        );
        let block_tokens = if spec.cache.kind == CacheKind::Paged {
            spec.cache.page_size
        } else {
            1
        };
        // The draft's cache is sized as the model's.
        let memory_bytes = loaded.model.held_weight_bytes() as u64
            + bytes
            + draft
                .as_ref()
                .map_or(0, |d| d.loaded.model.held_weight_bytes() as u64 + bytes);
        Ok(ServedModel {
            loaded,
            cache,
            block_tokens,
            cache_bytes: bytes,
            memory_bytes,
            config,
            draft,
        })
    }
}

/// The open-files limit against `--max-connections`: each connection is a descriptor.
mod open_files {
    /// Descriptors the server needs besides its connections: standard streams, the listener,
    /// the runtime's epoll and signal pipes, model files being read, the blocking pool's work.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    const RESERVED: u64 = 64;

    /// `max_connections`, after raising the soft open-files limit towards the hard one to fit
    /// it; lowered, with a warning, when even the hard limit cannot.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    pub fn fit(max_connections: usize) -> usize {
        let need = max_connections as u64 + RESERVED;
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `getrlimit` writes into the struct it is given and reads nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
            return max_connections;
        }
        if limit.rlim_cur >= need {
            return max_connections;
        }
        let soft = limit.rlim_cur;
        let raised = libc::rlimit {
            rlim_cur: need.min(limit.rlim_max),
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `setrlimit` reads the struct it is given; a soft limit up to the hard one
        // needs no privilege.
        if raised.rlim_cur > soft && unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = raised.rlim_cur;
            tracing::info!(
                "raised the open-files limit from {soft} to {} for --max-connections {max_connections}",
                limit.rlim_cur
            );
        }
        if limit.rlim_cur >= need {
            return max_connections;
        }
        let fits = usize::try_from(limit.rlim_cur.saturating_sub(RESERVED))
            .unwrap_or(usize::MAX)
            .clamp(1, max_connections);
        tracing::warn!(
            "the open-files limit ({}, hard limit {}) leaves room for {fits} connections: serving at most {fits}, not --max-connections {max_connections} (raise it with `ulimit -n`)",
            limit.rlim_cur,
            limit.rlim_max
        );
        fits
    }

    /// Elsewhere the limit is not checked.
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    pub fn fit(max_connections: usize) -> usize {
        max_connections
    }
}
