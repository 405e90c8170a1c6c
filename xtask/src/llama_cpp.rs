//! `cargo xtask llama-cpp [--quantize MODEL.gguf [--types Q8_0,F32]]`: llama.cpp's CPU tools
//! (`llama-bench`, `llama-batched-bench`, `llama-quantize`, `llama-perplexity`, `llama-server`),
//! built once under `target/llama.cpp/` for comparisons with kiln, and quantized copies of a
//! GGUF file made with them.
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
//! The build uses `-DGGML_NATIVE=ON`: the tools are for this machine only.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

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
        let mut value = || {
            args.next()
                .cloned()
                .with_context(|| format!("{arg} needs a value\n{USAGE}"))
        };
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

/// The folder holding llama.cpp's tools, building them first if any is missing. Progress goes
/// to stderr.
///
/// # Errors
/// A step failed: no `python3` with pip, PyPI unreachable, no C/C++ compiler, or the build broke.
pub fn bin_dir() -> Result<PathBuf> {
    let cache = cache_dir();
    let build = cache.join("build");
    let bin = build.join("bin");
    if TOOLS.iter().all(|tool| bin.join(tool).is_file()) {
        return Ok(bin);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let sdist = download_sdist(&cache)?;
    let source = unpack(&cache, &sdist)?;
    let (cmake, ninja) = build_tools(&cache)?;

    if !build.join("build.ninja").is_file() {
        stage("configuring llama.cpp (CPU, native, Release)", || {
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
                .arg(format!("-DCMAKE_MAKE_PROGRAM={}", ninja.display())))
        })?;
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
