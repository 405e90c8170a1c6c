//! `kiln`: LLM inference from the command line, on a backend chosen at run time.

mod backends;
mod exit;
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
}

fn main() -> ExitCode {
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
    };
    exit::report(result)
}
