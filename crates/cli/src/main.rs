//! `kiln`: LLM inference from the command line, on a backend chosen at run time.

mod backends;
mod bandwidth;
mod bench;
mod chat;
mod device;
mod engine_args;
mod exit;
mod generate;
mod info;
mod memory;
mod model_args;
mod progress;
mod selftest;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kiln: LLM inference in Rust on burn, on CUDA, wgpu or the CPU.
///
/// Runs Llama 3, Mistral, Qwen2/2.5, Qwen3 and GPT-2 models from GGUF files, Hugging Face
/// folders or Meta checkpoints.
/// Without --model, the embedded default SmolLM2-135M-Instruct is fetched once into
/// $KILN_HOME/models (~/.cache/kiln/models).
#[derive(Debug, Parser)]
#[command(
    name = "kiln",
    version,
    about,
    after_help = "Examples:
  kiln chat \"Tell me a story\"                           ask the default model once and get its answer
  kiln chat --temperature 0.7                           talk with the default model, a line a turn
  kiln generate \"Once upon a time\"                      continue raw text (no chat template)
  echo \"Once upon a time\" | kiln generate -n 64         the prompt from stdin
  kiln generate -m model.gguf -b wgpu --dtype f16 \"Hi\"  another model, backend and precision
  kiln info -m model.gguf                               what a model is, without loading it
  kiln backends                                         which backends can run here
  kiln serve --port 8080                                an OpenAI-compatible server on the default model
  kiln bench --backend wgpu --quick                     a quick speed check

Exit codes: 0 success, 2 bad arguments or input, 1 failure at run time."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the backends compiled into this binary and whether each can run here (on the
    /// cpu backend, with the threads it computes on).
    Backends(backends::Args),
    /// Run the operations kiln relies on, on one backend, and compare them with the cpu backend.
    Selftest(selftest::Args),
    /// Continue raw text (or many prompts), streaming the new text to stdout; no chat template.
    ///
    /// For completion, base models, token ids and batches of prompts. To ask an instruct model
    /// (the default is one) a question, use `kiln chat "QUESTION"`, which applies its chat
    /// template.
    Generate(generate::Args),
    /// Ask a model (`kiln chat "MESSAGE"` answers once and exits) or talk with it: each line is
    /// a user turn, rendered with the model's chat template; the conversation stays in the KV
    /// cache between turns.
    Chat(chat::Args),
    /// Describe a model (architecture, sizes, storage, tokenizer) without loading its weights.
    Info(info::Args),
    /// Serve the model over HTTP with OpenAI's API (chat and completions, streaming, /metrics);
    /// many clients at once share the engine's batch.
    Serve(serve::Args),
    /// Measure prefill and decode speed, latency and memory over a matrix of prompt lengths
    /// and batch sizes (`cargo xtask bench` runs it).
    Bench(bench::Args),
}

impl Command {
    /// The threads a command computes on (`None`: it computes nothing).
    fn threads(&self) -> Option<engine_args::ThreadsArgs> {
        match self {
            Command::Backends(args) => Some(args.threads),
            Command::Selftest(args) => Some(args.threads),
            Command::Generate(args) => Some(args.engine.threads),
            Command::Chat(args) => Some(args.engine.threads),
            Command::Serve(args) => Some(args.engine.threads),
            Command::Bench(args) => Some(args.engine.threads),
            Command::Info(_) => None,
        }
    }
}

fn main() -> ExitCode {
    quiet_headless_vulkan();
    keep_freed_memory_for_reuse();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // clap prints help and version to stdout with status 0, usage errors with 2.
            let _ = err.print();
            return ExitCode::from(err.exit_code() as u8);
        }
    };
    // A forced kernel tier this CPU cannot run is refused up front (the kernels would
    // otherwise fall back to the best tier silently).
    if let Err(err) = kiln_kernels::Tier::from_env() {
        return exit::report(Err(anyhow::Error::new(exit::UsageError(err.to_string()))));
    }
    // The one thread count, set before anything computes: kiln's kernel pool and burn-flex's
    // rayon pool are both built here, at `--threads` (else `KILN_THREADS`, else one per core).
    if let Some(threads) = cli.command.threads()
        && let Err(err) = threads.apply()
    {
        return exit::report(Err(err.into()));
    }
    let result = match cli.command {
        Command::Backends(_) => backends::run(),
        Command::Selftest(args) => selftest::run(&args),
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Info(args) => info::run(&args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
    };
    exit::report(result)
}

/// Every tensor operation allocates its output, and glibc's malloc serves the large ones (a
/// prefill's activations are megabytes) with fresh `mmap`s and gives them back on `free`, so
/// the kernel zeroes new pages for every operation: 10-13 % of a 512-token f32 prefill went to
/// `clear_page` and page faults (docs/benchmarks.md). Serving blocks up to 64 MiB from the heap
/// and keeping up to 512 MiB of freed heap lets the next step reuse the same pages; weights and
/// caches bigger than that still get their own mappings. The peak resident set is unchanged
/// (the memory is the same; it is just not returned between steps).
fn keep_freed_memory_for_reuse() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes malloc's thresholds; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Mesa's Vulkan drivers look for a Wayland display while probing and print
/// "XDG_RUNTIME_DIR is invalid or not set" twice on headless machines; pointing the variable at
/// an existing directory silences them and changes nothing else.
fn quiet_headless_vulkan() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        // SAFETY: called first thing in main, before any other thread exists.
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
}
