//! Peak memory of this process for `kiln bench`: the resident set's high-water mark (Linux
//! `VmHWM`), reset between cells through `/proc/self/clear_refs`. On the cpu backends that is
//! the model, cache and activations; on wgpu over lavapipe the device memory is host memory and
//! counted too. Device memory of a discrete GPU is not included.

/// Resets the high-water mark to the current resident set (Linux 4.0+; elsewhere a no-op).
pub fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The resident set's high-water mark since the last reset, in bytes, where the system says.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
