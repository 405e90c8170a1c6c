//! [`InferenceBackend`] for each burn backend kiln supports, each behind its cargo feature.

#[allow(unused_imports)]
use super::{BackendKind, InferenceBackend};

/// burn-flex, kiln's `cpu` backend.
#[cfg(feature = "cpu")]
pub type CpuBackend = burn::backend::Flex;

#[cfg(feature = "cpu")]
impl InferenceBackend for burn::backend::Flex {
    const KIND: BackendKind = BackendKind::Cpu;

    fn inference_device() -> Self::Device {
        burn::backend::flex::FlexDevice
    }
}

/// burn-ndarray, kiln's `ndarray` backend.
#[cfg(feature = "ndarray")]
pub type NdarrayBackend = burn::backend::NdArray;

#[cfg(feature = "ndarray")]
impl InferenceBackend for burn::backend::NdArray {
    const KIND: BackendKind = BackendKind::Ndarray;

    fn inference_device() -> Self::Device {
        burn::backend::ndarray::NdArrayDevice::Cpu
    }
}

/// burn-wgpu, kiln's `wgpu` backend.
#[cfg(feature = "wgpu")]
pub type WgpuBackend = burn::backend::Wgpu;

#[cfg(feature = "wgpu")]
impl InferenceBackend for burn::backend::Wgpu {
    const KIND: BackendKind = BackendKind::Wgpu;

    fn inference_device() -> Self::Device {
        burn::backend::wgpu::WgpuDevice::DefaultDevice
    }
}

/// burn-cuda, kiln's `cuda` backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda;

#[cfg(feature = "cuda")]
impl InferenceBackend for burn::backend::Cuda {
    const KIND: BackendKind = BackendKind::Cuda;

    fn inference_device() -> Self::Device {
        burn::backend::cuda::CudaDevice::new(0)
    }
}
