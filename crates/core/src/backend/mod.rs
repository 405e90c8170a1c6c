//! Backends: which ones kiln knows, whether they can run here, how to run code generic over
//! `B: Backend` on the one picked at run time, and what kiln asks of each.
//!
//! kiln extends burn's own `Backend` trait ([`InferenceBackend`]) instead of shadowing it, so
//! every burn op stays available and the rest of kiln is generic over `B: InferenceBackend`.
//! Run-time selection is a `match` over monomorphised backends ([`run_on`]); see
//! `docs/adr/0001-backend-dispatch.md` for why this beat burn's `Dispatch` backend.
//!
//! Every backend is probed before its first tensor is made: burn-cuda panics inside a worker
//! thread when `libcuda.so` is missing, and burn-wgpu panics when no adapter exists, so kiln asks
//! the driver and the adapter list itself first and turns "cannot run" into a
//! [`CoreError::BackendUnavailable`](crate::CoreError::BackendUnavailable) naming the reason.
//!
//! The module is split by what each part knows:
//! - `select`: [`BackendKind`], probes, [`run_on`]: backend selection, which knows no
//!   operation and no attention;
//! - `hooks`: [`InferenceBackend`], the operations (hooks) kiln's layers and attention call,
//!   with their defaults;
//! - [`threads`]: the one thread count the CPU backends compute on;
//! - `impls`: the trait for each concrete backend (`cube` for the GPU ones).

#[cfg(feature = "gpu-runtime")]
mod cube;
#[cfg(feature = "cuda")]
mod cuda_probe;
#[cfg(feature = "gpu-runtime")]
pub mod device_runtime;
mod hooks;
mod impls;
mod quant_weight;
mod select;
pub mod threads;
#[cfg(feature = "wgpu")]
mod wgpu_probe;

pub use hooks::{
    DeviceMemory, InferenceBackend, argmax_on_host, kernel_fallbacks, launches_settled,
    linear_quantized_on_host, write_kv_one_by_one,
};
#[allow(unused_imports)] // empty when no backend feature is on
pub use impls::*;
pub use quant_weight::QuantWeight;
pub use select::{Availability, BackendKind, BackendTask, run_on};
pub use threads::{ThreadCounts, set_threads};
