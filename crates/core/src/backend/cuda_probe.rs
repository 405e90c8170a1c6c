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
    let nvrtc = match open_any(NVRTC_NAMES) {
        Some(_) => String::new(),
        None => match preload_pip_nvrtc() {
            Some(path) => format!(", NVRTC from {}", path.display()),
            None => {
                return Err(format!(
                    "found {device}, but NVRTC (libnvrtc.so) is missing: install the CUDA \
                     runtime compiler, or point KILN_NVRTC_DIR at the folder holding it (looked \
                     on the loader's path and in Python's `nvidia` packages)"
                ));
            }
        },
    };
    let include = cuda_include_dir().ok_or(format!(
        "found {device}, but no CUDA headers: set CUDA_PATH to a CUDA toolkit \
         (looked in $CUDA_PATH, /usr/local/cuda, /opt/cuda)"
    ))?;
    Ok(format!(
        "{device} (headers in {}{nvrtc})",
        include.display()
    ))
}

/// Loads NVRTC from `KILN_NVRTC_DIR` or from the CUDA wheels pip installs beside PyTorch
/// (`nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib`), by full path, and keeps it loaded: cudarc
/// later asks the loader for `libnvrtc.so.N` by name, and the loader hands back the library
/// already loaded under that soname. Returns the file loaded.
fn preload_pip_nvrtc() -> Option<PathBuf> {
    let mut folders: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("KILN_NVRTC_DIR") {
        folders.push(PathBuf::from(dir));
    }
    folders.extend(pip_nvidia_lib_folders());
    for folder in folders {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        let named = |prefix: &str| {
            files
                .iter()
                .find(|f| {
                    f.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(prefix))
                })
                .cloned()
        };
        let Some(nvrtc) = named("libnvrtc.so.") else {
            continue;
        };
        // NVRTC opens its builtins by name at its first compile; loaded first, they are found.
        if let Some(builtins) = named("libnvrtc-builtins.so.") {
            // SAFETY: NVIDIA's library; loading it runs its initialisers only.
            if let Ok(lib) = unsafe { Library::new(&builtins) } {
                std::mem::forget(lib);
            }
        }
        // SAFETY: NVIDIA's NVRTC, found in the same vendor folder as its builtins; loading it
        // runs its initialisers only, and it is kept loaded (`forget`) for burn to use.
        if let Ok(lib) = unsafe { Library::new(&nvrtc) } {
            std::mem::forget(lib);
            return Some(nvrtc);
        }
    }
    None
}

/// The `lib` folders of Python's `nvidia` namespace packages (pip's CUDA wheels), found by
/// asking `python3` where they are; empty when there is no such Python.
fn pip_nvidia_lib_folders() -> Vec<PathBuf> {
    let Ok(output) = std::process::Command::new("python3")
        .args(["-c", "import nvidia\nfor p in nvidia.__path__: print(p)"])
        .stderr(std::process::Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let mut folders = Vec::new();
    for root in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(packages) = std::fs::read_dir(root) else {
            continue;
        };
        for package in packages.flatten() {
            let lib = package.path().join("lib");
            if lib.is_dir() {
                folders.push(lib);
            }
        }
    }
    folders.sort();
    folders
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
type CuDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> c_int;
type CuDeviceGetAttribute =
    unsafe extern "C" fn(value: *mut c_int, attr: c_int, dev: c_int) -> c_int;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` and `_MINOR` (cuda.h).
const COMPUTE_CAPABILITY: [c_int; 2] = [75, 76];

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
        // The driver version and the architecture key the kernel cache: PTX built for one
        // architecture does not load on another.
        let mut details = vec![format!("{count} device(s)")];
        if let Ok(version) = driver.get::<CuDriverGetVersion>(b"cuDriverGetVersion\0") {
            let mut v: c_int = 0;
            if version(&mut v) == 0 {
                details.push(format!("CUDA driver {}.{}", v / 1000, v % 1000 / 10));
            }
        }
        if let Ok(attribute) = driver.get::<CuDeviceGetAttribute>(b"cuDeviceGetAttribute\0") {
            let [mut major, mut minor]: [c_int; 2] = [0, 0];
            if attribute(&mut major, COMPUTE_CAPABILITY[0], 0) == 0
                && attribute(&mut minor, COMPUTE_CAPABILITY[1], 0) == 0
            {
                details.push(format!("sm_{major}{minor}"));
            }
        }
        Ok(format!("{name} ({})", details.join(", ")))
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
