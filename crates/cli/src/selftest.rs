//! `kiln selftest --backend KIND`: kiln's core operations on one backend, compared with cpu.

use anyhow::bail;
use kiln_core::backend::{BackendKind, BackendTask, InferenceBackend};
use kiln_core::selftest::{self, Check};

use crate::engine_args::ThreadsArgs;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Backend to test: cuda, wgpu, cpu or ndarray.
    #[arg(long, short, default_value = "cpu")]
    backend: BackendKind,
    #[command(flatten)]
    pub(crate) threads: ThreadsArgs,
}

struct Selftest;

impl BackendTask for Selftest {
    type Output = Vec<Check>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Vec<Check> {
        selftest::run::<B>(&device)
    }
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let device = args.backend.require()?;
    println!("selftest on {} ({device}), reference: cpu", args.backend);
    let checks = crate::device::run_on(args.backend, false, Selftest)?;
    let failed = checks.iter().filter(|c| !c.passed()).count();
    for check in &checks {
        let verdict = if check.passed() { "PASS" } else { "FAIL" };
        println!(
            "{verdict}  {:<44} max |diff| {:.2e} (tolerance {:.0e})",
            check.name, check.max_abs_diff, check.tolerance
        );
    }
    println!("{} passed, {failed} failed", checks.len() - failed);
    if failed > 0 {
        bail!("{failed} selftest check(s) failed on {}", args.backend);
    }
    Ok(())
}
