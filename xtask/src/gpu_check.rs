//! `cargo xtask gpu-check`: packs what the GPU check needs into `target/gpu-check` (the
//! stripped, xz-compressed release binary and CUDA test binaries, the fixtures, the check
//! script and the transformers baseline), small enough to carry to a lent GPU machine, where
//! `bash target/gpu-check/check.sh` runs it without a Rust toolchain (scripts/gpu/check.sh says
//! what it runs).
//!
//! `cargo xtask test --backend cuda` runs the same CUDA tests on a machine with a GPU and the
//! toolchain.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, run, workspace_root};

/// The package whose integration tests (crates/models/tests, one binary) hold the `cuda`
/// tests the check runs, and the name the packed binary takes.
const TEST_PACKAGE: &str = "kiln-models";
const TEST_BINARY: &str = "models-tests";

/// The release binary with the features of the CUDA test build (every workspace member,
/// dev-dependencies included). A build of the `kiln` binary alone unifies fewer features and
/// recompiles most crates; after the test binary's build this rebuilds nothing.
const KILN_BUILD: [&str; 6] = [
    "build",
    "--release",
    "--locked",
    "--workspace",
    "--tests",
    CUDA_TESTS,
];

/// kiln-models' CUDA tests (off in `cargo xtask test`, which cannot run them).
const CUDA_TESTS: &str = "--features=kiln-models/cuda";

pub fn gpu_check(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("usage: cargo xtask gpu-check (packs target/gpu-check; no options)");
    }
    let root = workspace_root();
    let pack = root.join("target/gpu-check");
    if pack.exists() {
        std::fs::remove_dir_all(&pack).with_context(|| format!("clearing {}", pack.display()))?;
    }
    std::fs::create_dir_all(&pack)?;

    run(Command::new(cargo()).args(KILN_BUILD))?;
    compress(&root.join("target/release/kiln"), &pack.join("kiln.xz"))?;
    compress(
        &test_binary(&root)?,
        &pack.join(format!("{TEST_BINARY}.xz")),
    )?;
    for (from, to) in [
        ("scripts/gpu/check.sh", "check.sh"),
        ("scripts/gpu/quick.sh", "quick.sh"),
        ("scripts/gpu/tiles.sh", "tiles.sh"),
        ("scripts/gpu/profile_summary.py", "profile_summary.py"),
        (
            "scripts/bench/transformers_bench.py",
            "transformers_bench.py",
        ),
    ] {
        std::fs::copy(root.join(from), pack.join(to)).with_context(|| format!("copying {from}"))?;
    }
    copy_dir(
        &root.join("crates/models/tests/fixtures"),
        &pack.join("fixtures"),
    )?;
    let bytes = dir_size(&pack)?;
    println!(
        "packed {} ({:.1} MB)\nrun there: bash {}/check.sh   (results in its out/, or $OUT)",
        pack.display(),
        bytes as f64 / 1e6,
        pack.strip_prefix(&root).unwrap_or(&pack).display()
    );
    if bytes > 60 << 20 {
        bail!("the pack is {bytes} bytes, over the 60 MiB a lent GPU machine takes");
    }
    Ok(())
}

/// Builds kiln-models' integration tests in release and returns the executable.
fn test_binary(root: &Path) -> Result<PathBuf> {
    let output = Command::new(cargo())
        .current_dir(root)
        // Every backend and the CUDA tests, with the same features as KILN_BUILD.
        .args([
            "test",
            "--release",
            "--locked",
            "--workspace",
            "--no-run",
            CUDA_TESTS,
        ])
        .args(["--test", "integration", "--message-format", "json"])
        .output()
        .context("building the test binaries")?;
    if !output.status.success() {
        bail!(
            "building the test binaries failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let package = message["package_id"].as_str().unwrap_or_default();
        if let Some(path) = message["executable"].as_str()
            && message["target"]["name"] == "integration"
            // `path+file:///…#kiln-models@0.1.0`, or `kiln-models 0.1.0 (…)` from older cargo.
            && (package.contains(&format!("#{TEST_PACKAGE}@"))
                || package.starts_with(&format!("{TEST_PACKAGE} ")))
        {
            return Ok(PathBuf::from(path));
        }
    }
    bail!("cargo built no integration test binary for {TEST_PACKAGE}")
}

/// `from` stripped of its symbols and compressed with `xz -6` into `to`.
fn compress(from: &Path, to: &Path) -> Result<()> {
    let stripped = to.with_extension("stripped");
    std::fs::copy(from, &stripped).with_context(|| format!("copying {}", from.display()))?;
    // Without `strip` the binary is only larger.
    let _ = Command::new("strip").arg(&stripped).status();
    let file = std::fs::File::create(to)?;
    let status = Command::new("xz")
        .args(["-6", "-T0", "-c"])
        .arg(&stripped)
        .stdout(file)
        .status()
        .context("running xz (apt-get install xz-utils)")?;
    std::fs::remove_file(&stripped)?;
    if !status.success() {
        bail!("xz failed on {}", from.display());
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        bytes += if entry.file_type()?.is_dir() {
            dir_size(&entry.path())?
        } else {
            entry.metadata()?.len()
        };
    }
    Ok(bytes)
}

/// `cargo xtask test --backend cuda`: the CUDA tests and the selftest, required to run (a
/// missing device fails them instead of skipping).
pub fn test_cuda() -> Result<()> {
    let root = workspace_root();
    let mut command = Command::new(cargo());
    command
        .args(["test", "--release", "--locked", "--workspace", CUDA_TESTS])
        // Every crate's integration tests build; the filter runs the `cuda` ones.
        .args(["--test", "integration", "--", "cuda"])
        .env("KILN_REQUIRE_CUDA", "1");
    run(&mut command)?;
    run(Command::new(cargo()).args(KILN_BUILD))?;
    run(Command::new(root.join("target/release/kiln")).args(["selftest", "--backend", "cuda"]))
}
