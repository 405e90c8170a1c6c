//! The `kiln` binary as a user runs it.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("the kiln binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn backends_lists_every_kind_and_cpu_is_available() {
    let out = kiln(&["backends"]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    for kind in ["cuda", "wgpu", "cpu", "ndarray"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(kind)),
            "{kind} missing:\n{stdout}"
        );
    }
    let cpu = stdout.lines().find(|l| l.starts_with("cpu")).unwrap();
    assert!(cpu.contains("available"), "{cpu}");
    assert!(
        text(&out.stderr).is_empty(),
        "stderr: {}",
        text(&out.stderr)
    );
}

#[test]
fn selftest_passes_on_cpu() {
    let out = kiln(&["selftest", "--backend", "cpu"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("7 passed, 0 failed"), "{stdout}");
}

#[cfg(feature = "wgpu")]
#[test]
fn selftest_passes_on_wgpu() {
    let out = kiln(&["selftest", "--backend", "wgpu"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("7 passed, 0 failed"), "{stdout}");
}

/// Without an NVIDIA driver, asking for cuda is one line naming the backend and the reason,
/// exit code 2, no panic.
#[cfg(feature = "cuda")]
#[test]
fn unavailable_cuda_is_a_one_line_error_with_exit_code_2() {
    let backends = text(&kiln(&["backends"]).stdout);
    if backends
        .lines()
        .any(|l| l.starts_with("cuda") && l.contains(" available"))
    {
        eprintln!("a CUDA device is present: nothing to check");
        return;
    }
    let out = kiln(&["selftest", "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: backend `cuda` cannot run here: "),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_unknown_backend_is_a_usage_error() {
    let out = kiln(&["selftest", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown backend `tpu`"));
}
