//! `cargo xtask bench --backend KIND [--model PATH | --shape NAME] [--dtype D] [--quick]
//! [--compare llama.cpp] [--compare transformers] [--kiln PATH]`: builds kiln (or takes the
//! binary `--kiln` names), runs `kiln bench` (the matrix, a table, JSON in
//! `target/bench/<backend>-<date>.json`), and compares:
//! - `--compare llama.cpp` (cpu, a GGUF model): llama.cpp's `llama-bench` and
//!   `llama-batched-bench` on the same file and threads, interleaved with kiln in rounds, medians
//!   and ratios per cell ([`crate::bench_llama`]); the tools are built on first use
//!   (`cargo xtask llama-cpp`);
//! - `--compare transformers`: the same matrix in Hugging Face transformers
//!   (`scripts/bench/transformers_bench.py`), then kiln's ratio to it per cell. Without Python,
//!   torch or transformers only this comparison is skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{cargo, run, workspace_root};

const USAGE: &str = "usage: cargo xtask bench --backend cuda|wgpu|cpu|ndarray [--model PATH | --shape NAME] [--dtype f32|f16|bf16] [--activations auto|q8|q8x2] [--quick] [--compare llama.cpp] [--compare transformers] [--kiln PATH] [--repeats N] [--prompt-lens N,..] [--batch-sizes N,..] [--new-tokens N] [--sampling greedy,top-p]";

/// What the command line asked for.
#[derive(Debug, Default)]
struct Options {
    backend: String,
    /// `--model`, made absolute: kiln runs in the workspace root, the other tools wherever
    /// cargo was started.
    model: Option<PathBuf>,
    shape: Option<String>,
    /// `--dtype`, passed on to kiln; without it kiln keeps a quantized GGUF's weights
    /// quantized on the cpu backend (naming a dtype dequantizes them: the exact path).
    dtype: Option<String>,
    quick: bool,
    /// `--compare transformers`.
    compare_transformers: bool,
    /// `--compare llama.cpp`.
    compare_llama: bool,
    /// `--kiln`, made absolute: a kiln binary to run instead of building one.
    kiln: Option<PathBuf>,
    /// Matrix overrides passed to kiln (transformers runs the matrix kiln's report shows;
    /// it decodes greedily only).
    matrix: Vec<(String, String)>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut options = Options::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || crate::flag_value(&mut args, arg, USAGE);
        match arg.as_str() {
            "--backend" => options.backend = value()?,
            "--model" => options.model = Some(absolute(&value()?)?),
            "--shape" => options.shape = Some(value()?),
            "--dtype" => options.dtype = Some(value()?),
            "--quick" => options.quick = true,
            "--compare" => match value()?.as_str() {
                "transformers" => options.compare_transformers = true,
                "llama.cpp" => options.compare_llama = true,
                other => bail!("--compare takes `llama.cpp` or `transformers`, not `{other}`"),
            },
            "--kiln" => options.kiln = Some(absolute(&value()?)?),
            "--repeats" | "--activations" | "--prompt-lens" | "--batch-sizes" | "--new-tokens"
            | "--sampling" => {
                options.matrix.push((arg.clone(), value()?));
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    if options.backend.is_empty() {
        bail!("--backend is required\n{USAGE}");
    }
    if options.compare_llama && options.backend != "cpu" {
        bail!("--compare llama.cpp runs llama.cpp's CPU build: use it with --backend cpu");
    }
    if options.compare_llama && options.shape.is_some() {
        bail!(
            "--compare llama.cpp needs a model file (--model, or the default model), not --shape"
        );
    }
    Ok(options)
}

/// `path` from the current folder, so that every tool, whatever folder it runs in, reads the
/// same file.
fn absolute(path: &str) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("locating {path}"))
}

/// The kiln binary to measure: `given`, or a release build of the workspace with its tests (so
/// that dev-dependencies unify features as in the test build; `cargo xtask test`'s own binary,
/// `target/ci/kiln`, has kiln's crates at opt-level 1 and is not measured).
pub(crate) fn kiln_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(kiln) = given {
        return Ok(kiln.to_path_buf());
    }
    run(Command::new(cargo()).args(["build", "--workspace", "--release", "--locked", "--tests"]))?;
    Ok(workspace_root().join("target/release/kiln"))
}

pub fn bench(args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let root = workspace_root();
    let kiln = kiln_binary(options.kiln.as_deref())?;

    let out = root.join("target/bench").join(format!(
        "{}-{}{}.json",
        options.backend,
        today(),
        if options.quick { "-quick" } else { "" }
    ));
    if options.compare_llama {
        compare_llama(&options, &kiln, &out)?;
    } else {
        run(&mut kiln_bench(&options, &kiln, &out, None))?;
    }
    println!("wrote {}", out.display());

    if options.compare_transformers {
        compare(&options, &kiln, &out)?;
    }
    Ok(())
}

/// `kiln bench` over the matrix asked for, its JSON report to `out`; `repeats` overrides the
/// timed runs per cell.
fn kiln_bench(options: &Options, kiln: &Path, out: &Path, repeats: Option<usize>) -> Command {
    let mut command = Command::new(kiln);
    command.args(["bench", "--backend", &options.backend]);
    if let Some(dtype) = &options.dtype {
        command.args(["--dtype", dtype]);
    }
    command.arg("--json").arg(out);
    if let Some(model) = &options.model {
        command.arg("--model").arg(model);
    }
    if let Some(shape) = &options.shape {
        command.args(["--shape", shape]);
    }
    if options.quick {
        command.arg("--quick");
    }
    for (flag, value) in &options.matrix {
        if !(repeats.is_some() && flag == "--repeats") {
            command.args([flag, value]);
        }
    }
    if let Some(repeats) = repeats.filter(|_| !options.quick) {
        command.args(["--repeats", &repeats.to_string()]);
    }
    command
}

/// kiln and llama.cpp interleaved in rounds (`--repeats` of them, default 3; 1 with
/// `--quick`), each kiln round one timed run per cell.
fn compare_llama(options: &Options, kiln: &Path, out: &Path) -> Result<()> {
    let model = model_path(options, kiln)?;
    check_gguf(&model)?;
    let bin = crate::llama_cpp::bin_dir()?;
    let rounds = if options.quick {
        1
    } else {
        match options.matrix.iter().find(|(flag, _)| flag == "--repeats") {
            Some((_, n)) => crate::positive_number("--repeats", n)?,
            None => 3,
        }
    };
    struct Round<'a> {
        options: &'a Options,
        kiln: &'a Path,
    }
    impl crate::bench_llama::KilnRound for Round<'_> {
        fn run(&self, out: &Path) -> Result<()> {
            run(&mut kiln_bench(self.options, self.kiln, out, Some(1)))
        }
    }
    let settings = crate::bench_llama::Comparison {
        model: &model,
        threads: kiln_threads(),
        rounds,
        bin: &bin,
    };
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let scratch = out.with_extension("round.json");
    let report = crate::bench_llama::compare(&settings, &Round { options, kiln }, &scratch)?;
    let _ = std::fs::remove_file(&scratch);
    std::fs::write(out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", out.display()))
}

/// Fails unless `model` is a GGUF file (it starts with the magic `GGUF`), the only format
/// llama.cpp's tools read.
fn check_gguf(model: &Path) -> Result<()> {
    let mut magic = [0u8; 4];
    std::fs::File::open(model)
        .and_then(|mut file| std::io::Read::read_exact(&mut file, &mut magic))
        .with_context(|| {
            format!(
                "--compare llama.cpp needs a GGUF file: reading {}",
                model.display()
            )
        })?;
    if &magic != b"GGUF" {
        bail!(
            "--compare llama.cpp needs a GGUF file (llama.cpp reads no other format); {} is not one",
            model.display()
        );
    }
    Ok(())
}

/// The threads kiln's kernels run on: `KILN_THREADS` if set to a positive number, else one
/// per core (kiln-kernels' `pool::default_threads`), so llama.cpp gets as many.
pub(crate) fn kiln_threads() -> usize {
    std::env::var("KILN_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs the transformers twin on the same matrix and prints kiln's ratios to it.
fn compare(options: &Options, kiln: &Path, out: &Path) -> Result<()> {
    let probe = Command::new("python3")
        .args(["-c", "import torch, transformers"])
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        println!(
            "transformers comparison skipped: python3 with torch and transformers is not available \
             (pip install torch transformers gguf)"
        );
        return Ok(());
    }
    let ours: Value = serde_json::from_str(&std::fs::read_to_string(out)?)?;
    let mut command = Command::new("python3");
    command.arg(workspace_root().join("scripts/bench/transformers_bench.py"));
    command.args(["--dtype", options.dtype.as_deref().unwrap_or("f32")]);
    command.args([
        "--device",
        if options.backend == "cuda" {
            "cuda"
        } else {
            "cpu"
        },
    ]);
    match &options.shape {
        Some(shape) => command.args(["--shape", shape]),
        None => command.arg("--model").arg(model_path(options, kiln)?),
    };
    // The matrix kiln ran, read back from its report.
    let cells = ours["cells"]
        .as_array()
        .context("kiln's report has cells")?;
    let join = |key: &str| {
        let mut unique: Vec<u64> = Vec::new();
        for v in cells.iter().filter_map(|c| c[key].as_u64()) {
            if !unique.contains(&v) {
                unique.push(v);
            }
        }
        unique
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    command.args(["--prompt-lens", &join("prompt_len")]);
    command.args(["--batch-sizes", &join("batch")]);
    command.args(["--new-tokens", &ours["new_tokens"].to_string()]);
    // After `--compare llama.cpp`, `repeats` is the number of rounds the medians came from.
    command.args(["--repeats", &ours["repeats"].to_string()]);
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/bench/transformers_bench.py")?;
    if !output.status.success() {
        bail!("the transformers benchmark failed");
    }
    let theirs: Value = serde_json::from_slice(&output.stdout)
        .context("reading the transformers benchmark's JSON")?;
    print_ratios(&ours, &theirs);
    let mut merged = ours.clone();
    merged["transformers"] = theirs;
    std::fs::write(out, serde_json::to_string_pretty(&merged)?)?;
    println!("wrote {} (with the transformers run)", out.display());
    Ok(())
}

/// The model file kiln ran: `--model`, or the default model's cached path (`kiln info`).
fn model_path(options: &Options, kiln: &Path) -> Result<PathBuf> {
    if let Some(model) = &options.model {
        return Ok(model.clone());
    }
    let output = Command::new(kiln)
        .args(["info", "--json"])
        .output()
        .context("running kiln info")?;
    if !output.status.success() {
        bail!(
            "kiln info failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let info: Value =
        serde_json::from_slice(&output.stdout).context("kiln info --json printed no JSON")?;
    info["path"]
        .as_str()
        .map(PathBuf::from)
        .context("kiln info --json gave no path")
}

fn print_ratios(ours: &Value, theirs: &Value) {
    println!(
        "\nkiln / transformers ({}; above 1: kiln is faster or leaner)",
        theirs["engine"].as_str().unwrap_or("?")
    );
    println!(
        "{:>6} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "prompt", "batch", "prefill", "decode", "TTFT", "ITL p50", "ITL p99", "memory"
    );
    let empty = Vec::new();
    let their_cells = theirs["cells"].as_array().unwrap_or(&empty);
    // Like with like: the device's memory when transformers ran on the GPU, else both RSS.
    let our_memory = if theirs["device"] == "cuda" {
        "peak_memory_bytes"
    } else {
        "peak_rss_bytes"
    };
    // transformers decodes greedily: only kiln's greedy cells compare (a report without the
    // field predates the setting and was greedy).
    let greedy = |c: &&Value| c["sampling"].as_str().is_none_or(|s| s == "greedy");
    for cell in ours["cells"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .filter(greedy)
    {
        let Some(other) = their_cells
            .iter()
            .find(|c| c["prompt_len"] == cell["prompt_len"] && c["batch"] == cell["batch"])
        else {
            continue;
        };
        let f = |c: &Value, key: &str| c[key].as_f64().unwrap_or(f64::NAN);
        // Rates: ours over theirs. Times and memory: theirs over ours.
        let faster = |key: &str| f(cell, key) / f(other, key);
        let shorter = |key: &str| f(other, key) / f(cell, key);
        let leaner = f(other, "peak_memory_bytes") / f(cell, our_memory);
        println!(
            "{:>6} {:>5} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            cell["prompt_len"].as_u64().unwrap_or(0),
            cell["batch"].as_u64().unwrap_or(0),
            faster("prefill_tokens_per_s"),
            faster("decode_tokens_per_s"),
            shorter("time_to_first_token_ms"),
            shorter("itl_p50_ms"),
            shorter("itl_p99_ms"),
            leaner,
        );
    }
}

/// Today's date (UTC) as `YYYY-MM-DD`, from the system clock (Howard Hinnant's
/// days-to-civil algorithm; no date crate needed for a file name).
pub(crate) fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn compare_repeats_and_llama_cpp_wants_the_cpu_and_a_file() {
        let options = parse(&args(
            "--backend cpu --compare llama.cpp --compare transformers --kiln bin/kiln",
        ))
        .unwrap();
        assert!(options.compare_llama && options.compare_transformers);
        assert!(options.kiln.is_some_and(|k| k.is_absolute()));
        let only = parse(&args("--backend cuda --compare transformers")).unwrap();
        assert!(only.compare_transformers && !only.compare_llama);

        let err = |line: &str| parse(&args(line)).unwrap_err().to_string();
        assert!(err("--backend wgpu --compare llama.cpp").contains("--backend cpu"));
        assert!(err("--backend cpu --shape gpt2 --compare llama.cpp").contains("--shape"));
        assert!(err("--backend cpu --compare vllm").contains("`vllm`"));
    }

    #[test]
    fn only_a_gguf_file_goes_to_llama_cpp() {
        let dir = std::env::temp_dir().join(format!("xtask-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gguf = dir.join("model.gguf");
        std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
        let safetensors = dir.join("model.gguf.safetensors");
        std::fs::write(&safetensors, b"{\"__metadata__\"").unwrap();
        assert!(check_gguf(&gguf).is_ok());
        let err = check_gguf(&safetensors).unwrap_err().to_string();
        assert!(err.contains("is not one"), "{err}");
        let err = format!("{:#}", check_gguf(&dir.join("absent.gguf")).unwrap_err());
        assert!(err.contains("absent.gguf"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
