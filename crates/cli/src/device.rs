//! Running a command on the backend the user picked: the GPU backends first get their kernel
//! cache ($KILN_HOME/kernels, so a second process compiles nothing), then
//! [`kiln_core::backend::run_on`] runs the task.

use kiln_core::backend::{BackendKind, BackendTask};

/// Probes `kind`, points a GPU backend's compiled kernels and autotune results at kiln's
/// kernel cache, and runs `task` there. `count_launches` makes cubecl report every kernel
/// launch to [`kiln_core::backend::device_runtime::LaunchCounter`] (`kiln bench --verbose`).
///
/// # Errors
/// The backend is not compiled in or cannot run here.
pub fn run_on<T: BackendTask>(
    kind: BackendKind,
    count_launches: bool,
    task: T,
) -> kiln_core::Result<T::Output> {
    prepare(kind, count_launches)?;
    kiln_core::backend::run_on(kind, task)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn prepare(kind: BackendKind, count_launches: bool) -> kiln_core::Result<()> {
    use kiln_core::backend::device_runtime::{self, DeviceRuntimeSettings};
    if !matches!(kind, BackendKind::Cuda | BackendKind::Wgpu) {
        return Ok(());
    }
    let device = kind.require()?;
    // With no writable home, kernels are compiled again in every process: slower, not wrong.
    let kernel_cache = kiln_models::default_model::kiln_home()
        .ok()
        .map(|home| device_runtime::kernel_cache_dir(&home.join("kernels"), kind, &device));
    device_runtime::configure(&DeviceRuntimeSettings {
        kernel_cache,
        count_launches,
    });
    Ok(())
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn prepare(_kind: BackendKind, _count_launches: bool) -> kiln_core::Result<()> {
    Ok(())
}
