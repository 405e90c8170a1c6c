//! `cargo xtask <task>`: kiln's chores, in Rust so they run wherever cargo does.
//!
//! - `test`: the README's test command. Makes sure the system has what the tests need (a Vulkan
//!   driver for wgpu, Mesa's lavapipe without a GPU; tmux for the terminal chat test), installing
//!   it with apt-get when run as root on Debian/Ubuntu; runs the whole workspace's tests with the
//!   `ci` profile (dependencies and kernels optimised: numeric tests crawl without) with every
//!   backend but CUDA
//!   (`test --backend cuda` builds and runs the CUDA tests on a GPU), then every example, then the
//!   `kiln serve` suite (the OpenAI Python SDK and a small load test, with pytest in a virtual
//!   environment under `target/python`). Extra arguments go to `cargo test`, and skip the
//!   examples and the server suite.
//! - `bench`: the benchmark matrix on one backend with `kiln bench`, optionally side by side
//!   with llama.cpp (interleaved rounds) and Hugging Face transformers (see `bench.rs` and `docs/benchmarks.md`).
//! - `bench-serve`: `kiln serve` against llama.cpp's `llama-server` on the same GGUF file,
//!   driven by one load generator at several concurrencies (see `bench_serve.rs`).
//! - `bench-spec`: decode at batch 1 with and without speculative decoding (prompt lookup, a
//!   draft model) on an input-grounded prompt set, interleaved (see `bench_spec.rs`).
//! - `llama-cpp`: builds llama.cpp's CPU tools (`llama-bench`, `llama-batched-bench`,
//!   `llama-quantize`, `llama-perplexity`, `llama-server`) once under `target/llama.cpp/` from
//!   the sources vendored in `llama-cpp-python`'s sdist on PyPI, prints their folder, and with
//!   `--quantize FILE` makes FILE's Q8_0 and F32 copies for comparisons (see `llama_cpp.rs`).
//! - `references`: regenerates the expected values that come from Hugging Face transformers:
//!   the sampling distributions, the model fixtures, the families' GGUF forms (llama.cpp's
//!   converter and `llama-quantize`) and the GGUF fixtures (needs `python3` with `torch`,
//!   `transformers`, `tiktoken`, `sentencepiece`, `gguf` and `accelerate`, and SmolLM2 in kiln's
//!   model cache).

mod bench;
mod bench_llama;
mod bench_serve;
mod bench_spec;
mod gpu_check;
mod llama_cpp;
mod system;

use std::process::Command;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: cargo xtask test [args passed on to cargo test]
       cargo xtask test --backend cuda   (the CUDA tests and selftest, on a machine with a GPU)
       cargo xtask gpu-check             (packs target/gpu-check for a GPU machine: bash target/gpu-check/check.sh)
       cargo xtask bench --backend KIND [--model PATH | --shape NAME] [--dtype D] [--quick] [--compare llama.cpp] [--compare transformers] [--kiln PATH]
       cargo xtask bench-serve [--kiln PATH] [--model GGUF] [--concurrency 1,8,32] [--requests N] [--max-tokens N] [--rounds N]
       cargo xtask bench-spec [--kiln PATH] [--prompts FILE] [--max-tokens N] [--rounds N] [--prompt-lookup N] [--draft-tokens K] [--draft-model PATH] [-- kiln generate flags]
       cargo xtask llama-cpp [--quantize MODEL.gguf [--types Q8_0,F32]]
       cargo xtask references";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "test" if rest == ["--backend", "cuda"] => gpu_check::test_cuda(),
        "test" => test(&rest),
        "gpu-check" => gpu_check::gpu_check(&rest),
        "references" => references(),
        "bench" => bench::bench(&rest),
        "bench-serve" => bench_serve::bench_serve(&rest),
        "bench-spec" => bench_spec::bench_spec(&rest),
        "llama-cpp" => llama_cpp::llama_cpp(&rest),
        "" | "help" | "--help" | "-h" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n{USAGE}"),
    }
}

/// The examples `cargo test` builds (it compiles examples but does not run them), with their
/// arguments.
const EXAMPLES: [(&str, &[&str]); 4] = [
    ("own_model", &[]),
    ("generate", &["The capital of France is"]),
    ("custom_processor", &[]),
    ("batch", &[]),
];

/// The features `cargo xtask test` builds with: every backend but CUDA. No CUDA test can run
/// without a GPU (they are built by `cargo xtask test --backend cuda` and `cargo xtask
/// gpu-check`), and compiling the CUDA backend into every test binary made the test build
/// minutes longer.
const TEST_FEATURES: [&str; 2] = [
    "--no-default-features",
    "--features=kiln-core/cpu,kiln-core/ndarray,kiln-core/wgpu,\
     kiln-cli/cpu,kiln-cli/ndarray,kiln-cli/wgpu,kiln-benches/wgpu",
];

/// The cargo profile of the test build (Cargo.toml: release for dependencies and kernels, kiln's
/// own crates at opt-level 1), and where it puts its binaries.
const TEST_PROFILE: &str = "ci";

fn test_build() -> std::path::PathBuf {
    workspace_root().join("target").join(TEST_PROFILE)
}

fn test(extra: &[String]) -> Result<()> {
    system::ensure_test_packages()?;
    run(Command::new(cargo())
        .args(["test", "--workspace", "--profile", TEST_PROFILE, "--locked"])
        .args(TEST_FEATURES)
        .args(extra))?;
    if !extra.is_empty() {
        return Ok(());
    }
    let examples = test_build().join("examples");
    for (name, args) in EXAMPLES {
        eprintln!("\n== example {name}");
        run(Command::new(examples.join(name)).args(args))?;
    }
    eprintln!("\n== kiln serve with the OpenAI Python SDK (crates/server/tests/python)");
    server_tests()
}

/// The Python packages of the server suite, pinned so a new SDK release cannot change a run.
const PYTHON_TEST_PACKAGES: [&str; 7] = [
    "openai==3.57.0",
    "pytest==9.2.0",
    "jsonschema==4.26.0",
    "lark==1.3.1",
    // test_tools.py: a multi-step agent loop against `kiln serve`.
    "openai-agents==0.24.0",
    // test_anthropic.py: the Messages API through Anthropic's own SDK.
    "anthropic==2.17.0",
    // test_ollama.py: Ollama's API through its own client.
    "ollama==0.6.3",
];

/// The Codex CLI that test_codex.py runs against `kiln serve`, pinned as the Python packages
/// are.
const CODEX_PACKAGE: &str = "@openai/codex@0.171.0";

/// Installs the Codex CLI under `target/codex` with npm (once), when npm is on the machine;
/// without it test_codex.py is skipped, and says why.
fn install_codex() {
    let folder = workspace_root().join("target/codex");
    if folder.join("node_modules/.bin/codex").exists() {
        return;
    }
    let installed = Command::new("npm")
        .args(["install", "--no-audit", "--no-fund", "--silent", "--prefix"])
        .arg(&folder)
        .arg(CODEX_PACKAGE)
        .status();
    match installed {
        Ok(status) if status.success() => {}
        Ok(status) => eprintln!(
            "npm install {CODEX_PACKAGE} failed ({status}): test_codex.py will be skipped"
        ),
        Err(e) => eprintln!("npm is not available ({e}): test_codex.py will be skipped"),
    }
}

/// `kiln serve` driven by the official OpenAI SDK and the small load test, with pytest in a
/// virtual environment under `target/python` (made once).
fn server_tests() -> Result<()> {
    let python = python_env(&PYTHON_TEST_PACKAGES)?;
    install_codex();
    run(Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "crates/server/tests/python",
        ])
        .env("KILN_BIN", test_build().join("kiln")))
}

/// The Python of kiln's virtual environment (`target/python`, made on first use) with
/// `packages` installed.
fn python_env(packages: &[&str]) -> Result<std::path::PathBuf> {
    let venv = workspace_root().join("target/python");
    let python = venv.join("bin/python");
    if !python.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv)).context(
            "making a Python virtual environment (Debian: apt-get install python3-venv)",
        )?;
    }
    run(Command::new(&python)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(packages))?;
    Ok(python)
}

fn references() -> Result<()> {
    let root = workspace_root();
    run(Command::new("python3").arg(root.join("scripts/reference/make_model_fixtures.py")))?;
    // The families' GGUF forms: llama.cpp's own converter, and its llama-quantize (built here on
    // first use, as `cargo xtask llama-cpp` builds it).
    let quantize = crate::llama_cpp::bin_dir()?.join("llama-quantize");
    run(Command::new("python3")
        .arg(root.join("scripts/reference/make_family_ggufs.py"))
        .arg("--quantize")
        .arg(quantize))?;
    // SmolLM2 comes from kiln's model cache; `kiln generate` without --model fills it.
    run(Command::new("python3").arg(root.join("scripts/reference/make_gguf_fixtures.py")))?;
    let script = root.join("scripts/reference/sampling_reference.py");
    let out = root.join("crates/core/tests/fixtures/sampling_hf.json");
    let output = Command::new("python3")
        .arg(&script)
        .output()
        .context("running python3 (install it with torch and transformers)")?;
    if !output.status.success() {
        bail!(
            "{} failed:\n{}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    std::fs::write(&out, output.stdout).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The value that follows `flag` on the command line, or an error that shows `usage`.
fn flag_value(args: &mut std::slice::Iter<'_, String>, flag: &str, usage: &str) -> Result<String> {
    args.next()
        .cloned()
        .with_context(|| format!("{flag} needs a value\n{usage}"))
}

/// `value`, the value given to `flag`, as a positive number.
fn positive_number(flag: &str, value: &str) -> Result<usize> {
    value
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| format!("{flag} takes a positive number, not `{value}`"))
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}
