//! Process-wide settings of cubecl, the runtime under the GPU backends: where compiled kernels
//! and autotune results persist across processes, and the launch log behind
//! [`LaunchCounter`].
//!
//! cubecl reads its configuration once, when the first device client is made, and keeps it for
//! the life of the process; [`configure`] must therefore run before the first GPU tensor, and
//! only its first call takes effect. Without it cubecl keeps its defaults: nothing compiled is
//! kept (every process compiles every kernel again) and autotune results go to the nearest
//! `target/` folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cubecl::config::cache::CacheConfig;
use cubecl::config::profiling::ProfilingLogLevel;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

use super::BackendKind;

/// What the GPU backends keep between processes and what they log.
#[derive(Debug, Clone, Default)]
pub struct DeviceRuntimeSettings {
    /// The folder compiled kernels (CUDA's PTX, Vulkan's SPIR-V) and autotune results persist
    /// in; `None` keeps cubecl's defaults.
    pub kernel_cache: Option<PathBuf>,
    /// Count every kernel launch ([`LaunchCounter`]).
    pub count_launches: bool,
}

/// What [`configure`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Configured {
    /// The settings took effect.
    Applied,
    /// cubecl's configuration was already fixed (set before, or read by a device made
    /// earlier in this process); nothing changed.
    AlreadyFixed,
}

/// The folder under `root` for kernels compiled for `device` on `kind`, by this build of kiln.
///
/// cubecl keys its caches by kernel and by its own version, not by the driver or the GPU
/// (PTX compiled for one architecture fails to load on another), so the folder name carries
/// kiln's version and a digest of the device's description (name, driver, architecture).
pub fn kernel_cache_dir(root: &Path, kind: BackendKind, device: &str) -> PathBuf {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in device.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    root.join(format!("kiln-{}", env!("CARGO_PKG_VERSION")))
        .join(format!("{}-{hash:016x}", kind.name()))
}

/// Applies `settings` to cubecl's process-wide configuration, on top of what a `cubecl.toml`
/// and cubecl's environment variables ask for, unless it is already fixed.
pub fn configure(settings: &DeviceRuntimeSettings) -> Configured {
    let storage = CubeClRuntimeConfig::storage();
    let mut state = storage.lock();
    if state.is_some() {
        return Configured::AlreadyFixed;
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if let Some(dir) = &settings.kernel_cache {
        config.compilation.cache = Some(CacheConfig::File(dir.join("compiled")));
        config.autotune.cache = CacheConfig::File(dir.clone());
    }
    if settings.count_launches {
        // cubecl names each launch to its profiling logger at the `minimal` level (no timing,
        // no extra sync); the `log` crate sink is where kiln counts them.
        config.profiling.logger.level = ProfilingLogLevel::Minimal;
        config.profiling.logger.log = Some(cubecl_common::config::logger::LogCrateLevel::Trace);
        LaunchCounter::install();
    }
    *state = Some(Arc::new(config));
    Configured::Applied
}

/// Counts the kernels cubecl launches, when [`DeviceRuntimeSettings::count_launches`] was on
/// before the device was made. cubecl reports each launch to its logger on its own thread, so
/// a count settles shortly after the work is submitted: read it with [`LaunchCounter::settled`].
#[derive(Debug)]
pub struct LaunchCounter;

static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// The `log` sink that counts cubecl's launch messages and forwards nothing.
struct CountingLog;

impl log::Log for CountingLog {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.target().starts_with("cubecl")
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) && record.args().to_string().starts_with("Executing") {
            LAUNCHES.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn flush(&self) {}
}

impl LaunchCounter {
    fn install() {
        // Fails only when another `log` sink was installed first; the count then stays 0 and
        // `is_active` says so.
        if log::set_logger(&CountingLog).is_ok() {
            log::set_max_level(log::LevelFilter::Trace);
        }
    }

    /// Whether launches are being counted in this process.
    pub fn is_active() -> bool {
        std::ptr::addr_eq(log::logger(), &CountingLog)
    }

    /// Launches counted so far.
    pub fn now() -> u64 {
        LAUNCHES.load(Ordering::Relaxed)
    }

    /// Launches counted so far, once the count has stopped moving for a few milliseconds
    /// (call after the work has been synchronised).
    pub fn settled() -> u64 {
        let mut last = Self::now();
        loop {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let now = Self::now();
            if now == last {
                return now;
            }
            last = now;
        }
    }
}
