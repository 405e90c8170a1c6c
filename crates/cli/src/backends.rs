//! `kiln backends`: every backend kiln knows, whether it is compiled in and can run here, and
//! on the cpu backend the threads it computes on (`--threads`, else `KILN_THREADS`, else one
//! per core: the count the other commands would use).

use kiln_core::backend::{Availability, BackendKind};

use crate::engine_args::ThreadsArgs;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub(crate) threads: ThreadsArgs,
}

pub fn run() -> anyhow::Result<()> {
    println!("{:<8} {:<12} details", "backend", "status");
    for kind in BackendKind::ALL {
        let (status, details) = match kind.probe() {
            Availability::Available { device } => ("available", device),
            Availability::Unavailable { reason } => ("unavailable", reason),
            Availability::NotCompiled => (
                "not built",
                format!("rebuild with the cargo feature `{kind}`"),
            ),
        };
        println!("{:<8} {:<12} {details}", kind.name(), status);
    }
    Ok(())
}
