//! Finds the adapter burn-wgpu would pick, without initialising burn-wgpu (which panics when
//! there is none).

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use super::Availability;

/// The graphics API burn-wgpu uses by default on this OS (`cubecl-wgpu` `AutoGraphicsApi`).
fn default_backends() -> wgpu::Backends {
    if cfg!(target_os = "macos") {
        wgpu::Backends::METAL
    } else if cfg!(target_os = "windows") {
        wgpu::Backends::DX12
    } else {
        wgpu::Backends::VULKAN
    }
}

pub(super) fn probe() -> Availability {
    let backends = default_backends();
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let adapters = block_on(instance.enumerate_adapters(backends));
    let Some(best) = adapters
        .iter()
        .map(|a| a.get_info())
        .min_by_key(|info| preference(info.device_type))
    else {
        return Availability::Unavailable {
            reason: format!(
                "no {backends:?} adapter found (install a GPU driver, or Mesa's \
                 lavapipe: `apt-get install mesa-vulkan-drivers`)"
            ),
        };
    };
    Availability::Available {
        device: format!("{} ({:?}, {:?})", best.name, best.backend, best.device_type),
    }
}

/// Lower is better: burn's default device asks for the high-performance adapter.
fn preference(kind: wgpu::DeviceType) -> u8 {
    match kind {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// wgpu's native adapter enumeration completes without waiting; poll it to completion.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}
