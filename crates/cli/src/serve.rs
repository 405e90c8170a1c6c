//! `kiln serve`: the OpenAI-compatible HTTP server (`kiln-server`) on a model and backend
//! chosen here. It listens before the model loads (`/health` answers 503 meanwhile), sizes the
//! KV cache by a memory budget, logs one line per request, and exits 0 after SIGINT / SIGTERM
//! (130 when a second one cuts the grace period short).

use std::time::Duration;

use anyhow::{Context, Result};
use kiln_core::InferenceBackend;
use kiln_core::backend::BackendTask;
use kiln_core::kv_cache::CacheKind;
use kiln_engine::EngineSettings;
use kiln_server::{ServedDraft, ServedModel, Server, ServerOptions, Stopped};

use crate::engine_args::{self, EngineArgs, SERVE};
use crate::exit::UsageError;
use crate::model_args::{ModelArgs, SpeculationArgs};

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
    #[arg(long, default_value = "auto", help_heading = "Server")]
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
    #[arg(long, value_name = "NAME", help_heading = "Server")]
    served_model_name: Option<String>,
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
        let backend = args.model.backend;
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
        };
        let server = Server::start(options).map_err(|e| UsageError(e.to_string()))?;
        tracing::info!(
            "listening on http://{} (loading the model)",
            server.local_addr()
        );
        let loaded = args.model.load::<B>(&device)?;
        let path = &loaded.path;
        let name = args.served_model_name.clone().unwrap_or_else(|| {
            let stem = if path.is_file() {
                path.file_stem()
            } else {
                path.file_name()
            };
            stem.map_or_else(
                || path.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            )
        });
        let dtype = args.model.kv_dtype(&loaded.model)?;
        // Requests arrive over time, each up to the full context.
        let run = engine_args::run_for(&loaded.model, dtype, backend);
        let mut spec = engine_args::spec(&settings, &run, &SERVE)?;
        spec.config.speculation = args.speculation.speculation()?;
        spec.config.max_group_rows = Some(kiln_server::rows_for_one_request(spec.config.max_batch));
        let per_token = run.layout.bytes_per_token(dtype);
        let bytes = spec.cache_bytes;
        let cache = spec
            .cache::<B>(run.layout, dtype, &device)
            .context("allocating the KV cache")?;
        let draft = args.speculation.load_draft(backend, &loaded, &device)?;
        // The draft model's cache holds as many tokens as the model's.
        let draft_cache = match &draft {
            Some(d) => {
                let layout = kiln_core::CausalLm::shape(&d.model).kv_layout();
                let dtype = kiln_core::CausalLm::dtype(&d.model);
                let cache = spec.cache::<B>(layout, dtype, &device);
                Some(cache.context("allocating the draft model's KV cache")?)
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
                    draft.path.display(),
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
        let stopped = server
            .serve(ServedModel {
                loaded: &loaded,
                name,
                cache,
                block_tokens,
                cache_bytes: bytes,
                config,
                draft: draft
                    .as_ref()
                    .zip(draft_cache)
                    .map(|(loaded, cache)| ServedDraft { loaded, cache }),
            })
            .map_err(|e| UsageError(e.to_string()))?;
        tracing::info!("stopped");
        if stopped == Stopped::Forced {
            // 128 + SIGINT, as a shell reports a program Ctrl-C ended. The server has stopped
            // and returned; `main`'s exit codes are 0, 1 and 2, so exit here.
            std::process::exit(130);
        }
        Ok(())
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
