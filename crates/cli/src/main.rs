//! `kiln`: LLM inference from the command line, on a backend chosen at run time.

mod backends;
mod chat;
mod exit;
mod generate;
mod model_args;
mod selftest;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kiln: LLM inference in Rust on burn, on CUDA, wgpu or the CPU.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the backends compiled into this binary and whether each can run here.
    Backends,
    /// Run the operations kiln relies on, on one backend, and compare them with the cpu backend.
    Selftest(selftest::Args),
    /// Continue a prompt, streaming the new text to stdout (no chat template).
    Generate(generate::Args),
    /// Talk with a model: each line you type is a user turn, rendered with the model's chat
    /// template.
    Chat(chat::Args),
}

fn main() -> ExitCode {
    quiet_headless_vulkan();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // clap prints help and version to stdout with status 0, usage errors with 2.
            let _ = err.print();
            return ExitCode::from(err.exit_code() as u8);
        }
    };
    let result = match cli.command {
        Command::Backends => backends::run(),
        Command::Selftest(args) => selftest::run(&args),
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
    };
    exit::report(result)
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
