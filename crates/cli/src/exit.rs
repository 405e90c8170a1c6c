//! Turning errors into one line on stderr and an exit code: 2 for bad arguments or input (an
//! unusable backend included), 1 for failures at run time.

use std::process::ExitCode;

use kiln_core::CoreError;
use kiln_engine::EngineError;
use kiln_models::ModelError;

/// An error caused by what the user asked for, not by kiln failing.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Whether `err` is the user's to fix (exit code 2).
fn is_usage(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause.is::<UsageError>()
            || cause
                .downcast_ref::<ModelError>()
                .is_some_and(|e| !matches!(e, ModelError::Fetch { .. } | ModelError::Io { .. }))
            || cause.is::<kiln_core::SamplingError>()
            || cause.downcast_ref::<CoreError>().is_some_and(core_is_usage)
            || cause
                .downcast_ref::<EngineError>()
                .is_some_and(|e| match e {
                    EngineError::Core(core) => core_is_usage(core),
                    EngineError::InvalidRequest(_)
                    | EngineError::InvalidConfig(_)
                    | EngineError::Snapshot { .. } => true,
                })
    })
}

/// Core errors caused by what was asked for: a backend or dtype that is not there, bad
/// sampling values, input the model cannot take.
fn core_is_usage(err: &CoreError) -> bool {
    matches!(
        err,
        CoreError::BackendUnavailable { .. }
            | CoreError::BackendNotCompiled { .. }
            | CoreError::UnknownBackend(_)
            | CoreError::UnknownDtype(_)
            | CoreError::UnsupportedDtype { .. }
            | CoreError::Sampling(_)
            | CoreError::ModelInput(_)
    )
}

/// Prints `result`'s error, if any, as one line and picks the exit code.
pub fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message: Vec<String> = err.chain().map(ToString::to_string).collect();
            eprintln!("error: {}", message.join(": "));
            ExitCode::from(if is_usage(&err) { 2 } else { 1 })
        }
    }
}
