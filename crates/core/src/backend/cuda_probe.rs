//! Checks what burn-cuda needs at run time, without touching burn-cuda: the driver library with
//! at least one device, NVRTC, and the CUDA headers (cubecl-cuda compiles kernels at run time
//! and panics when it cannot find `include/`).

use std::ffi::{CStr, c_char, c_int};
use std::path::{Path, PathBuf};

use libloading::{Library, Symbol};

use super::Availability;

const DRIVER_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so", "nvcuda.dll"];
const NVRTC_NAMES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11.2",
    "nvrtc64_120_0.dll",
];

pub(super) fn probe() -> Availability {
    match check() {
        Ok(device) => Availability::Available { device },
        Err(reason) => Availability::Unavailable { reason },
    }
}

fn check() -> Result<String, String> {
    let driver = open_any(DRIVER_NAMES)
        .ok_or("the NVIDIA driver library (libcuda.so) was not found".to_string())?;
    let device = first_device_name(&driver)?;
    if open_any(NVRTC_NAMES).is_none() {
        return Err(format!(
            "found {device}, but NVRTC (libnvrtc.so) is missing: install the CUDA runtime \
             compiler"
        ));
    }
    let include = cuda_include_dir().ok_or(format!(
        "found {device}, but no CUDA headers: set CUDA_PATH to a CUDA toolkit \
         (looked in $CUDA_PATH, /usr/local/cuda, /opt/cuda)"
    ))?;
    Ok(format!("{device} (headers in {})", include.display()))
}

fn open_any(names: &[&str]) -> Option<Library> {
    // SAFETY: these are the vendor's libraries; loading them runs their initialisers only.
    names
        .iter()
        .find_map(|name| unsafe { Library::new(name) }.ok())
}

type CuInit = unsafe extern "C" fn(flags: u32) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(name: *mut c_char, len: c_int, dev: c_int) -> c_int;

fn first_device_name(driver: &Library) -> Result<String, String> {
    // SAFETY: the signatures are those of the CUDA driver API (cuda.h); the buffer outlives the
    // call and its length is passed.
    unsafe {
        let init: Symbol<CuInit> = driver
            .get(b"cuInit\0")
            .map_err(|e| format!("libcuda has no cuInit: {e}"))?;
        let status = init(0);
        if status != 0 {
            return Err(format!(
                "the NVIDIA driver failed to initialise (cuInit error {status})"
            ));
        }
        let count_fn: Symbol<CuDeviceGetCount> = driver
            .get(b"cuDeviceGetCount\0")
            .map_err(|e| format!("libcuda has no cuDeviceGetCount: {e}"))?;
        let mut count: c_int = 0;
        if count_fn(&mut count) != 0 || count == 0 {
            return Err("the NVIDIA driver reports no CUDA device".to_string());
        }
        let name_fn: Symbol<CuDeviceGetName> = driver
            .get(b"cuDeviceGetName\0")
            .map_err(|e| format!("libcuda has no cuDeviceGetName: {e}"))?;
        let mut name = [0 as c_char; 256];
        if name_fn(name.as_mut_ptr(), name.len() as c_int, 0) != 0 {
            return Ok(format!("{count} CUDA device(s)"));
        }
        let name = CStr::from_ptr(name.as_ptr()).to_string_lossy();
        Ok(format!("{name} ({count} device(s))"))
    }
}

/// Mirrors cubecl-cuda 0.10's search for the toolkit (`CUDA_PATH`, `/usr/local/cuda`,
/// `/opt/cuda`, `/usr` when `/usr/bin/nvcc` exists).
fn cuda_include_dir() -> Option<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("CUDA_PATH") {
        roots.push(PathBuf::from(path));
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    roots.push(PathBuf::from("/opt/cuda"));
    if Path::new("/usr/bin/nvcc").exists() {
        roots.push(PathBuf::from("/usr"));
    }
    roots
        .into_iter()
        .map(|root| root.join("include"))
        .find(|include| include.join("cuda.h").exists())
}
