//! Backend selection: which backends kiln knows ([`BackendKind`]), whether each can run here
//! ([`BackendKind::probe`]: the CUDA driver, a wgpu adapter; never panics, never starts a
//! runtime), and running code generic over the backend on the kind picked at run time
//! ([`run_on`], a `match` over monomorphised backends; see
//! `docs/adr/0001-backend-dispatch.md`).
//!
//! It knows nothing of the operations a backend runs ([`super::InferenceBackend`]'s hooks) or
//! of attention; it only names the concrete types that implement them.

use std::fmt;
use std::str::FromStr;

use crate::error::{CoreError, Result};

use super::InferenceBackend;

/// The backends kiln can be built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackendKind {
    /// NVIDIA GPUs through burn-cuda (driver and NVRTC needed at run time).
    Cuda,
    /// Any GPU through burn-wgpu (Vulkan, Metal, DX12; Mesa lavapipe runs it on a CPU).
    Wgpu,
    /// burn-flex, the fast CPU backend and kiln's default.
    Cpu,
    /// burn-ndarray, the legacy CPU backend.
    Ndarray,
}

impl BackendKind {
    /// Every kind, in the order `kiln backends` lists them.
    pub const ALL: [BackendKind; 4] = [
        BackendKind::Cuda,
        BackendKind::Wgpu,
        BackendKind::Cpu,
        BackendKind::Ndarray,
    ];

    /// The name used on the command line and in cargo features.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cpu => "cpu",
            BackendKind::Ndarray => "ndarray",
        }
    }

    /// Whether this build includes the backend (its cargo feature was on).
    pub fn is_compiled(self) -> bool {
        match self {
            BackendKind::Cuda => cfg!(feature = "cuda"),
            BackendKind::Wgpu => cfg!(feature = "wgpu"),
            BackendKind::Cpu => cfg!(feature = "cpu"),
            BackendKind::Ndarray => cfg!(feature = "ndarray"),
        }
    }

    /// The kinds compiled into this build.
    pub fn compiled() -> Vec<BackendKind> {
        Self::ALL.into_iter().filter(|k| k.is_compiled()).collect()
    }

    /// Whether the backend can run here, and on what. Never panics and never initialises the
    /// backend's runtime.
    pub fn probe(self) -> Availability {
        match self {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => super::cuda_probe::probe(),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => super::wgpu_probe::probe(),
            #[cfg(feature = "cpu")]
            BackendKind::Cpu => Availability::Available {
                device: flex_description(),
            },
            #[cfg(feature = "ndarray")]
            BackendKind::Ndarray => Availability::Available {
                device: ndarray_description(),
            },
            #[allow(unreachable_patterns)]
            _ => Availability::NotCompiled,
        }
    }

    /// `Ok` if the backend can run here, else the error a user should see.
    ///
    /// # Errors
    /// [`CoreError::BackendNotCompiled`] or [`CoreError::BackendUnavailable`].
    pub fn require(self) -> Result<String> {
        match self.probe() {
            Availability::Available { device } => Ok(device),
            Availability::Unavailable { reason } => {
                Err(CoreError::BackendUnavailable { kind: self, reason })
            }
            Availability::NotCompiled => Err(CoreError::BackendNotCompiled { kind: self }),
        }
    }
}

/// What the cpu backend really runs on: the threads of kiln's kernel pool (linear layers,
/// attention, row kernels) and of rayon's pool (the rest of burn-flex's ops), one count unless
/// something sized them apart ([`super::threads`]), and the kernels' SIMD tier.
#[cfg(feature = "cpu")]
fn flex_description() -> String {
    let threads = super::threads::in_use();
    let tier = kiln_kernels::Tier::active();
    format!("burn-flex on the host CPU ({threads}, {tier} kernels)")
}

/// burn-ndarray as kiln builds it (without its `rayon` feature) runs on one thread.
#[cfg(feature = "ndarray")]
fn ndarray_description() -> String {
    "burn-ndarray on the host CPU (1 thread)".to_string()
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "cuda" => Ok(BackendKind::Cuda),
            "wgpu" => Ok(BackendKind::Wgpu),
            "cpu" | "flex" => Ok(BackendKind::Cpu),
            "ndarray" => Ok(BackendKind::Ndarray),
            _ => Err(CoreError::UnknownBackend(s.to_string())),
        }
    }
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// The backend can run; `device` describes what it will run on.
    Available {
        /// Adapter or driver description, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Cpu)`.
        device: String,
    },
    /// Compiled in but unable to run here.
    Unavailable {
        /// Why, in words a user can act on.
        reason: String,
    },
    /// Left out of this build by cargo features.
    NotCompiled,
}

/// Code generic over the backend, to be run on a kind chosen at run time. Rust has no generic
/// closures, so a task is a value whose `run` is generic.
pub trait BackendTask {
    /// What the task returns.
    type Output;

    /// Runs the task on backend `B` and its device.
    fn run<B: InferenceBackend>(self, device: B::Device) -> Self::Output;
}

/// Probes `kind` and, if it can run here, runs `task` on it.
///
/// # Errors
/// [`CoreError::BackendNotCompiled`] or [`CoreError::BackendUnavailable`]; the task itself is
/// not run then.
pub fn run_on<T: BackendTask>(kind: BackendKind, task: T) -> Result<T::Output> {
    kind.require()?;
    match kind {
        #[cfg(feature = "cpu")]
        BackendKind::Cpu => Ok(run_with::<super::impls::CpuBackend, T>(task)),
        #[cfg(feature = "ndarray")]
        BackendKind::Ndarray => Ok(run_with::<super::impls::NdarrayBackend, T>(task)),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(run_with::<super::impls::WgpuBackend, T>(task)),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(run_with::<super::impls::CudaBackend, T>(task)),
        #[allow(unreachable_patterns)]
        _ => {
            drop(task);
            Err(CoreError::BackendNotCompiled { kind })
        }
    }
}

#[cfg(any(
    feature = "cpu",
    feature = "ndarray",
    feature = "wgpu",
    feature = "cuda"
))]
fn run_with<B: InferenceBackend, T: BackendTask>(task: T) -> T::Output {
    task.run::<B>(B::inference_device())
}
