//! kiln-core's error type.

use crate::backend::BackendKind;
use crate::dtype::Dtype;
use crate::kv_cache::CacheError;
use crate::sampling::SamplingError;

/// Everything that can go wrong in kiln-core, and in a [`crate::CausalLm`] forward.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The backend was compiled in but cannot run on this machine.
    #[error("backend `{kind}` cannot run here: {reason}")]
    BackendUnavailable {
        /// The backend asked for.
        kind: BackendKind,
        /// Why it cannot run (missing driver, no adapter...).
        reason: String,
    },
    /// The backend was left out of this build by cargo features.
    #[error("backend `{kind}` is not compiled into this build (enable the cargo feature `{kind}`)")]
    BackendNotCompiled {
        /// The backend asked for.
        kind: BackendKind,
    },
    /// A backend name that kiln does not know.
    #[error("unknown backend `{0}` (expected one of: cuda, wgpu, cpu, ndarray)")]
    UnknownBackend(String),
    /// A dtype name that kiln does not know.
    #[error("unknown dtype `{0}` (expected one of: f32, f16, bf16)")]
    UnknownDtype(String),
    /// A KV cache precision that kiln does not know.
    #[error("unknown KV cache dtype `{0}` (expected one of: f32, f16, bf16, q8_0)")]
    UnknownKvDtype(String),
    /// The backend cannot compute in this dtype.
    #[error("backend `{kind}` does not support dtype {dtype}{}", hint_for(*.kind, *.dtype))]
    UnsupportedDtype {
        /// The backend in use.
        kind: BackendKind,
        /// The dtype asked for.
        dtype: Dtype,
    },
    /// The KV cache refused the step.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// Invalid sampling parameters.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// A batch that does not describe its tokens consistently.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The CPU thread pools could not be sized as asked ([`crate::backend::set_threads`]).
    #[error("{0}")]
    Threads(String),
    /// A model refused the input (for example a token id outside its vocabulary or a position
    /// past its context).
    #[error("model input rejected: {0}")]
    ModelInput(String),
}

fn hint_for(kind: BackendKind, dtype: Dtype) -> &'static str {
    match (kind, dtype) {
        (BackendKind::Wgpu, Dtype::Bf16) => " (wgpu has no bf16: use f16 or f32)",
        (BackendKind::Wgpu, Dtype::F16) => " (this adapter lacks shader-f16: use f32)",
        (BackendKind::Ndarray, _) => " (ndarray computes in f32 only: use f32 or the cpu backend)",
        _ => "",
    }
}

/// kiln-core's result type.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
