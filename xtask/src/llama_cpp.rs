//! `cargo xtask llama-cpp [--quantize MODEL.gguf [--types Q8_0,F32]]`: llama.cpp's CPU tools
//! (`llama-bench`, `llama-batched-bench`, `llama-quantize`, `llama-perplexity`, `llama-server`),
//! built once under `target/llama.cpp/` for comparisons with kiln, quantized copies of a GGUF
//! file made with them, and readers for the benchmark tools' machine output
//! ([`parse_llama_bench`], [`parse_batched_bench`]). What the numbers are compared with is
//! `bench_llama.rs`'s business, not this file's.
//!
//! There is no GitHub here, but the source distribution of `llama-cpp-python` on PyPI vendors
//! the whole llama.cpp tree (`vendor/llama.cpp`). The steps, each skipped when its result is
//! already in place:
//!
//! 1. `pip download` the sdist into `target/llama.cpp/sdist/`;
//! 2. untar it into `target/llama.cpp/src/`;
//! 3. take `cmake` and `ninja` from `PATH`, else install them with pip into a virtual
//!    environment, `target/llama.cpp/venv/`;
//! 4. configure a native Release build of the CPU backend in `target/llama.cpp/build/`;
//! 5. build the tools into `target/llama.cpp/build/bin/` (about 10 minutes on 2 cores).
//!
//! The build uses `-DGGML_NATIVE=ON`: the tools are for this machine only. AMX is left out
//! ([`NO_AMX`]): these VMs' Sapphire Rapids CPUs advertise it, but the first `tilezero` of
//! ggml's AMX kernels dies with SIGILL (the hypervisor does not grant the tile state), so a
//! native build cannot run a Q4_1 model here at all.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{run, workspace_root};

/// The `llama-cpp-python` release whose sdist provides the llama.cpp sources (ggml 0.25.3).
const VERSION: &str = "0.3.36";

/// The tools built, all CPU-only.
const TOOLS: [&str; 5] = [
    "llama-bench",
    "llama-batched-bench",
    "llama-quantize",
    "llama-perplexity",
    "llama-server",
];

const USAGE: &str = "usage: cargo xtask llama-cpp [--quantize MODEL.gguf [--types TYPE,..]] (types default: Q8_0,F32)";

/// `cargo xtask llama-cpp`: builds the tools and prints their folder; with `--quantize FILE`,
/// also makes FILE's quantized copies (`--types`, default Q8_0 and F32) and prints their paths.
pub fn llama_cpp(args: &[String]) -> Result<()> {
    let mut quantize: Option<PathBuf> = None;
    let mut types = vec!["Q8_0".to_string(), "F32".to_string()];
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || crate::flag_value(&mut args, arg, USAGE);
        match arg.as_str() {
            "--quantize" => quantize = Some(PathBuf::from(value()?)),
            "--types" => types = value()?.split(',').map(str::to_string).collect(),
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    let bin = bin_dir()?;
    println!("{}", bin.display());
    if let Some(model) = quantize {
        for ty in &types {
            println!("{}", quantized_copy(&model, ty)?.display());
        }
    }
    Ok(())
}

/// Compiler flags of every llama.cpp build: no AMX, which faults on these VMs (module docs).
/// A build configured without them is reconfigured and rebuilt.
const NO_AMX: &str = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";

/// The folder holding llama.cpp's tools, building them first if any is missing. Progress goes
/// to stderr.
///
/// # Errors
/// A step failed: no `python3` with pip, PyPI unreachable, no C/C++ compiler, or the build broke.
pub fn bin_dir() -> Result<PathBuf> {
    let cache = cache_dir();
    let build = cache.join("build");
    let bin = build.join("bin");
    let configured = std::fs::read_to_string(build.join("CMakeCache.txt"))
        .is_ok_and(|cache| cache.contains(NO_AMX));
    if configured && TOOLS.iter().all(|tool| bin.join(tool).is_file()) {
        return Ok(bin);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let sdist = download_sdist(&cache)?;
    let source = unpack(&cache, &sdist)?;
    let (cmake, ninja) = build_tools(&cache)?;

    if !configured {
        stage(
            "configuring llama.cpp (CPU, native, no AMX, Release)",
            || {
                run(Command::new(&cmake)
                    .arg("-S")
                    .arg(&source)
                    .arg("-B")
                    .arg(&build)
                    .args([
                        "-G",
                        "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF",
                        "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF",
                    ])
                    .arg(format!("-DCMAKE_C_FLAGS={NO_AMX}"))
                    .arg(format!("-DCMAKE_CXX_FLAGS={NO_AMX}"))
                    .arg(format!("-DCMAKE_MAKE_PROGRAM={}", ninja.display())))
            },
        )?;
    }

    let jobs = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    stage(
        &format!("building {} ({jobs} jobs)", TOOLS.join(" ")),
        || {
            run(Command::new(&cmake)
                .arg("--build")
                .arg(&build)
                .arg("--target")
                .args(TOOLS)
                .args(["-j", &jobs.to_string()]))
        },
    )?;
    if let Some(missing) = TOOLS.iter().find(|tool| !bin.join(tool).is_file()) {
        bail!(
            "the llama.cpp build finished without {}",
            bin.join(missing).display()
        );
    }
    Ok(bin)
}

/// A copy of the GGUF file `src` with its weights converted to `ty` (a `llama-quantize` type
/// name such as `Q8_0` or `F32`) by `llama-quantize --allow-requantize`, made once into
/// `target/llama.cpp/models/<stem>-<ty>.gguf` and reused afterwards.
///
/// # Errors
/// `ty` is not a plain type name, the tools could not be built, or `llama-quantize` failed.
pub fn quantized_copy(src: &Path, ty: &str) -> Result<PathBuf> {
    if ty.is_empty() || !ty.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        bail!("`{ty}` is not a llama-quantize type name (Q8_0, F32, ...)");
    }
    // The tools run in the workspace root, not in the caller's folder.
    let src = std::path::absolute(src).with_context(|| format!("locating {}", src.display()))?;
    let src = src.as_path();
    let stem = src
        .file_stem()
        .with_context(|| format!("{} has no file name", src.display()))?
        .to_string_lossy();
    let models = cache_dir().join("models");
    let out = models.join(format!("{stem}-{ty}.gguf"));
    if out.is_file() {
        return Ok(out);
    }
    if !src.is_file() {
        bail!("{} is not a file", src.display());
    }
    let quantize = bin_dir()?.join("llama-quantize");
    std::fs::create_dir_all(&models).with_context(|| format!("creating {}", models.display()))?;
    // Written under another name and renamed, so an interrupted run leaves no cached copy.
    let partial = models.join(format!("{stem}-{ty}.gguf.partial"));
    stage(&format!("quantizing {} to {ty}", src.display()), || {
        run(Command::new(&quantize)
            .arg("--allow-requantize")
            .arg(src)
            .arg(&partial)
            .arg(ty))
    })?;
    std::fs::rename(&partial, &out)
        .with_context(|| format!("moving {} to {}", partial.display(), out.display()))?;
    Ok(out)
}

/// `target/llama.cpp/` in the workspace.
fn cache_dir() -> PathBuf {
    workspace_root().join("target").join("llama.cpp")
}

/// Runs one step between progress lines on stderr.
fn stage(name: &str, step: impl FnOnce() -> Result<()>) -> Result<()> {
    eprintln!("== llama.cpp: {name}");
    let start = Instant::now();
    step().with_context(|| format!("llama.cpp: {name}"))?;
    eprintln!(
        "== llama.cpp: {name}: done in {:.0} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The `llama-cpp-python` sdist in `cache/sdist/`, downloaded from PyPI when absent.
fn download_sdist(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join("sdist");
    if let Some(found) = find_sdist(&dir)? {
        return Ok(found);
    }
    stage(
        &format!("downloading the llama-cpp-python {VERSION} sdist"),
        || {
            // `--no-binary llama-cpp-python`, not `:all:`: pip prepares the sdist's metadata
            // in a build environment, and `:all:` would compile that environment's cmake from
            // source too (more than half an hour on 2 cores).
            run(Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps"])
                .args(["--no-binary", "llama-cpp-python"])
                .arg(format!("llama-cpp-python=={VERSION}"))
                .arg("-d")
                .arg(&dir))
        },
    )?;
    find_sdist(&dir)?
        .with_context(|| format!("pip left no llama-cpp-python sdist in {}", dir.display()))
}

/// The sdist of [`VERSION`] in `dir`, if there is one.
fn find_sdist(dir: &Path) -> Result<Option<PathBuf>> {
    if !dir.is_dir() {
        return Ok(None);
    }
    let wanted = [
        format!("llama_cpp_python-{VERSION}.tar.gz"),
        format!("llama-cpp-python-{VERSION}.tar.gz"),
    ];
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .with_context(|| format!("reading {}", dir.display()))?
            .path();
        if path
            .file_name()
            .is_some_and(|name| wanted.iter().any(|w| name == w.as_str()))
        {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// The vendored llama.cpp tree, untarred from `sdist` into `cache/src/` when absent.
fn unpack(cache: &Path, sdist: &Path) -> Result<PathBuf> {
    let dir = cache.join("src");
    let source = |root: &Path| {
        root.join(format!("llama_cpp_python-{VERSION}"))
            .join("vendor")
            .join("llama.cpp")
    };
    if source(&dir).join("CMakeLists.txt").is_file() {
        return Ok(source(&dir));
    }
    // Untarred beside, then renamed: a half-extracted tree is never taken for a finished one.
    let partial = cache.join("src.partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("removing {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    stage(&format!("unpacking {}", sdist.display()), || {
        run(Command::new("tar")
            .arg("-xzf")
            .arg(sdist)
            .arg("-C")
            .arg(&partial))
    })?;
    if !source(&partial).join("CMakeLists.txt").is_file() {
        bail!("{} has no vendor/llama.cpp/CMakeLists.txt", sdist.display());
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&partial, &dir)
        .with_context(|| format!("moving {} to {}", partial.display(), dir.display()))?;
    Ok(source(&dir))
}

/// `cmake` and `ninja`: from `PATH` when both are there, else from a virtual environment in
/// `cache/venv/` with pip's `cmake` and `ninja` packages (installed on first use).
fn build_tools(cache: &Path) -> Result<(PathBuf, PathBuf)> {
    if let (Some(cmake), Some(ninja)) = (on_path("cmake"), on_path("ninja")) {
        return Ok((cmake, ninja));
    }
    let venv = cache.join("venv");
    let cmake = venv.join("bin").join("cmake");
    let ninja = venv.join("bin").join("ninja");
    if cmake.is_file() && ninja.is_file() {
        return Ok((cmake, ninja));
    }
    stage(
        &format!("installing cmake and ninja into {}", venv.display()),
        || {
            run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
            run(Command::new(venv.join("bin").join("python"))
                .args(["-m", "pip", "install", "--quiet", "cmake", "ninja"]))
        },
    )?;
    if !(cmake.is_file() && ninja.is_file()) {
        bail!(
            "pip installed no cmake and ninja in {}",
            venv.join("bin").display()
        );
    }
    Ok((cmake, ninja))
}

/// `program`'s path when it is on `PATH`.
fn on_path(program: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// Runs one of the tools and returns its stdout. Its stderr (model-loading chatter) is shown
/// only when it fails.
///
/// # Errors
/// The tool could not start, failed, or printed something other than UTF-8.
pub fn tool_output(command: &mut Command, tool: &str) -> Result<String> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {tool}"))?;
    if !out.status.success() {
        bail!(
            "{tool} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("{tool} printed something not UTF-8"))
}

/// One test of `llama-bench -o json`: `n_prompt` prompt tokens (pp), or `n_gen` generated
/// tokens after a context of `n_depth` (tg), and its mean rate over the repetitions.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchTest {
    pub n_prompt: u64,
    pub n_gen: u64,
    pub n_depth: u64,
    /// Tokens per second, the mean over `-r` repetitions.
    pub avg_ts: f64,
    /// `flash_attn` as the tool printed it: 1 on, 0 off, -1 auto (a boolean in older builds).
    pub flash_attn: i64,
    /// The llama.cpp build: its git commit and build number (`1` for a build from a tarball).
    pub build_commit: String,
    pub build_number: u64,
}

/// Reads `llama-bench -o json`: a JSON array with one object per test.
///
/// # Errors
/// The text is not a JSON array, or a test lacks a field named in [`BenchTest`].
pub fn parse_llama_bench(text: &str) -> Result<Vec<BenchTest>> {
    let tests: Value = serde_json::from_str(text).context("llama-bench printed no JSON")?;
    let tests = tests
        .as_array()
        .context("llama-bench's JSON is not a list of tests")?;
    tests
        .iter()
        .enumerate()
        .map(|(i, test)| {
            let missing = |key: &str| format!("llama-bench's test {i} has no {key}");
            let int = |key: &str| test[key].as_u64().with_context(|| missing(key));
            Ok(BenchTest {
                n_prompt: int("n_prompt")?,
                n_gen: int("n_gen")?,
                n_depth: int("n_depth")?,
                avg_ts: test["avg_ts"].as_f64().with_context(|| missing("avg_ts"))?,
                flash_attn: match &test["flash_attn"] {
                    Value::Bool(on) => i64::from(*on),
                    value => value.as_i64().with_context(|| missing("flash_attn"))?,
                },
                build_commit: test["build_commit"]
                    .as_str()
                    .with_context(|| missing("build_commit"))?
                    .to_string(),
                build_number: int("build_number")?,
            })
        })
        .collect()
}

/// One line of `llama-batched-bench --output-format jsonl`: `pl` sequences of `pp` prompt
/// tokens prefilled together, then `tg` steps of one token for each.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchedTest {
    pub pp: u64,
    pub tg: u64,
    pub pl: u64,
    /// `flash_attn` as the tool printed it: 1 on, 0 off, -1 auto.
    pub flash_attn: i64,
    /// `S_PP`: all prompts' tokens over the prefill time.
    pub speed_pp: f64,
    /// `S_TG`: all sequences' generated tokens (`pl * tg`) over the generation time.
    pub speed_tg: f64,
}

/// Reads `llama-batched-bench --output-format jsonl`: one JSON object per line on stdout. Lines
/// that are not objects are skipped: the results share stdout with the tool's log.
///
/// # Errors
/// An object line is not JSON or lacks a field named in [`BatchedTest`].
pub fn parse_batched_bench(text: &str) -> Result<Vec<BatchedTest>> {
    text.lines()
        .filter(|line| line.trim_start().starts_with('{'))
        .map(|line| {
            let test: Value = serde_json::from_str(line).with_context(|| {
                format!("llama-batched-bench printed a line that is not JSON: {line}")
            })?;
            let missing = |key: &str| format!("llama-batched-bench's line has no {key}: {line}");
            let int = |key: &str| test[key].as_u64().with_context(|| missing(key));
            let float = |key: &str| test[key].as_f64().with_context(|| missing(key));
            Ok(BatchedTest {
                pp: int("pp")?,
                tg: int("tg")?,
                pl: int("pl")?,
                flash_attn: test["flash_attn"]
                    .as_i64()
                    .with_context(|| missing("flash_attn"))?,
                speed_pp: float("speed_pp")?,
                speed_tg: float("speed_tg")?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -r 1 -o json -p 32 -n 0`, then the
    /// same with `-p 0 -n 8 -d 32`, of this build: each array's one test, trimmed to a few of
    /// its 45 fields, the values as printed.
    const LLAMA_BENCH_PP: &str = r#"[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "flash_attn": -1,
    "n_prompt": 32,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-24T08:12:27Z",
    "avg_ns": 115755843,
    "stddev_ns": 0,
    "avg_ts": 276.443929,
    "stddev_ts": 0.000000,
    "samples_ns": [ 115755843 ],
    "samples_ts": [ 276.444 ]
  }
]
"#;
    const LLAMA_BENCH_TG: &str = r#"[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "flash_attn": -1,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 32,
    "test_time": "2026-11-24T08:12:28Z",
    "avg_ns": 74040943,
    "stddev_ns": 0,
    "avg_ts": 108.048327,
    "stddev_ts": 0.000000,
    "samples_ns": [ 74040943 ],
    "samples_ts": [ 108.048 ]
  }
]
"#;

    /// `llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -c 336 -npp 32 -ntg 8
    /// -npl 1,8 -fa on --output-format jsonl` of this build: its whole stdout.
    const BATCHED_BENCH: &str = r#"{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 1, "n_kv": 40, "t_pp": 0.096097, "speed_pp": 332.996857, "t_tg": 0.062868, "speed_tg": 127.250748, "t": 0.158965, "speed": 251.627731}
{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 8, "pl": 8, "n_kv": 320, "t_pp": 0.766154, "speed_pp": 334.136475, "t_tg": 0.255320, "speed_tg": 250.665817, "t": 1.021474, "speed": 313.272766}

"#;

    #[test]
    fn llama_bench_json_gives_each_test_its_rate_and_the_build() {
        let pp = parse_llama_bench(LLAMA_BENCH_PP).unwrap();
        assert_eq!(
            pp,
            [BenchTest {
                n_prompt: 32,
                n_gen: 0,
                n_depth: 0,
                avg_ts: 276.443929,
                flash_attn: -1,
                build_commit: "0c1e570".into(),
                build_number: 1,
            }]
        );
        let tg = parse_llama_bench(LLAMA_BENCH_TG).unwrap();
        assert_eq!((tg[0].n_prompt, tg[0].n_gen, tg[0].n_depth), (0, 8, 32));
        assert_eq!(tg[0].avg_ts, 108.048327);
    }

    #[test]
    fn batched_bench_jsonl_gives_each_batch_its_rates() {
        // The log sometimes shares stdout: its lines are not results.
        let text = format!("llama_batched_bench: n_kv_max = 2048\n{BATCHED_BENCH}");
        let tests = parse_batched_bench(&text).unwrap();
        assert_eq!(tests.len(), 2);
        assert_eq!(
            tests[1],
            BatchedTest {
                pp: 32,
                tg: 8,
                pl: 8,
                flash_attn: 1,
                speed_pp: 334.136475,
                speed_tg: 250.665817,
            }
        );
    }

    #[test]
    fn broken_tool_output_is_an_error_naming_the_tool_and_the_field() {
        let no_rate = LLAMA_BENCH_PP.replace("\"avg_ts\"", "\"avg\"");
        let err = parse_llama_bench(&no_rate).unwrap_err().to_string();
        assert!(
            err.contains("llama-bench") && err.contains("avg_ts"),
            "{err}"
        );
        let err = parse_llama_bench("error: unknown argument").unwrap_err();
        assert!(err.to_string().contains("llama-bench"), "{err}");
        let err = parse_llama_bench("{}").unwrap_err();
        assert!(err.to_string().contains("not a list"), "{err}");

        let no_tg = BATCHED_BENCH.replace("\"speed_tg\"", "\"s_tg\"");
        let err = parse_batched_bench(&no_tg).unwrap_err().to_string();
        assert!(
            err.contains("llama-batched-bench") && err.contains("speed_tg"),
            "{err}"
        );
        let err = parse_batched_bench("{\"pp\": 32,").unwrap_err().to_string();
        assert!(err.contains("not JSON"), "{err}");
    }
}
