//! kiln-engine's error type.

use std::path::PathBuf;

use kiln_core::CoreError;

/// What can go wrong serving requests.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model or cache failed.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A request that cannot be served (the message says why).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Scheduling limits out of range.
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// A cache snapshot that cannot be written, read or used with this model.
    #[error("{path}: {reason}")]
    Snapshot {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}
