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

/// Backs the heap's memory with 2 MiB pages where the kernel can (Linux 6.1+ `MADV_COLLAPSE`;
/// elsewhere a no-op), called once the weights are loaded. A decode step streams every weight
/// (about 100 MB for SmolLM2 in Q4_1) through 4 KiB pages that no TLB holds: a miss and a page
/// walk every 4 KiB. With the weights on 2 MiB pages, SmolLM2 decoding at batch 1 ran 15-32 %
/// faster (docs/benchmarks.md). The weights live in the heap (malloc serves blocks up to 64
/// MiB from it, `keep_freed_memory_for_reuse` in main.rs), so collapsing the heap's mappings
/// covers them; thread stacks and small mappings are left alone. Best effort: memory the
/// kernel cannot collapse stays on small pages, and nothing else changes.
pub fn collapse_heap_into_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const HUGE: usize = 2 << 20;
        // Anonymous mappings smaller than this are stacks and scratch, not weights.
        const MIN_MAPPING: usize = 4 << 20;
        if std::env::var_os("KILN_NO_HUGE_PAGES").is_some() {
            return;
        }
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
            return;
        };
        for line in maps.lines() {
            let mut fields = line.split_whitespace();
            let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
                continue;
            };
            // Private writable memory that is the heap or anonymous (no file behind it).
            let name = fields.nth(3);
            if perms != "rw-p" || name.is_some_and(|n| n != "[heap]") {
                continue;
            }
            let Some((start, end)) = range.split_once('-') else {
                continue;
            };
            let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) else {
                continue;
            };
            let (first, last) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
            if end - start < MIN_MAPPING || last <= first {
                continue;
            }
            // SAFETY: advice on this process's own mapped range; MADV_COLLAPSE keeps the
            // contents and only changes the pages behind them.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_COLLAPSE,
                );
            }
        }
    }
}
