//! Peak memory of this process for `kiln bench`: the resident set's high-water mark (Linux
//! `VmHWM`), reset between cells through `/proc/self/clear_refs`. On the cpu backends that is
//! the model, cache and activations; on wgpu over lavapipe the device memory is host memory and
//! counted too. Device memory of a discrete GPU is not included.

/// `MemAvailable` from /proc/meminfo, in bytes (Linux): what the engine spec caps and checks
/// the KV cache against ([`kiln_engine::Run::available_memory`]).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

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
/// elsewhere a no-op), called once the weights are loaded; returns how many bytes the kernel
/// collapsed. A decode step streams every weight (about 100 MB for SmolLM2 in Q4_1) through 4
/// KiB pages that no TLB holds: a miss and a page walk every 4 KiB. With the weights on 2 MiB
/// pages, SmolLM2 decoding at batch 1 ran 15-32 % faster (docs/benchmarks.md). The weights
/// live in the heap (malloc serves blocks up to 64 MiB from it, `keep_freed_memory_for_reuse`
/// in main.rs), so collapsing the heap's mappings covers them ([`huge_page_spans`]). Best
/// effort: memory the kernel cannot collapse stays on small pages, and nothing else changes.
/// `KILN_NO_HUGE_PAGES` (set to anything) turns it off.
pub fn collapse_heap_into_huge_pages() -> usize {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("KILN_NO_HUGE_PAGES").is_some() {
            return 0;
        }
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
            return 0;
        };
        huge_page_spans(&maps)
            .into_iter()
            .filter(|span| {
                // SAFETY: advice on this process's own mapped range; MADV_COLLAPSE keeps the
                // contents and only changes the pages behind them.
                let done = unsafe {
                    libc::madvise(
                        span.start as *mut libc::c_void,
                        span.len(),
                        libc::MADV_COLLAPSE,
                    )
                };
                done == 0
            })
            .map(|span| span.len())
            .sum()
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    0
}

/// Size of a huge page (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Anonymous mappings smaller than this are thread stacks and scratch, not weights: left alone
/// (collapsing a stack would make its untouched pages resident).
const MIN_MAPPING: usize = 4 << 20;

/// The huge-page-aligned spans inside the private writable memory of `maps` (the text of
/// `/proc/self/maps`) that is the heap or anonymous (no file behind it) and at least
/// [`MIN_MAPPING`] long.
pub fn huge_page_spans(maps: &str) -> Vec<std::ops::Range<usize>> {
    maps.lines()
        .filter_map(|line| {
            // start-end perms offset device inode [name]
            let mut fields = line.split_whitespace();
            let (range, perms) = (fields.next()?, fields.next()?);
            let name = fields.nth(3);
            if perms != "rw-p" || name.is_some_and(|n| n != "[heap]") {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            let start = usize::from_str_radix(start, 16).ok()?;
            let end = usize::from_str_radix(end, 16).ok()?;
            let span = start.next_multiple_of(HUGE_PAGE)..end / HUGE_PAGE * HUGE_PAGE;
            (end.saturating_sub(start) >= MIN_MAPPING && !span.is_empty()).then_some(span)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spans_are_the_aligned_insides_of_the_heap_and_large_anonymous_mappings() {
        let maps = "\
55d0c0000000-55d0c0a00000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000900000 rw-p 00000000 00:00 0 
7f0001000000-7f0001200000 rw-p 00000000 00:00 0 
7f0002000000-7f0002a00000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
7f0003000000-7f0003a00000 rw-p 00000000 08:01 1234                       /tmp/weights.bin
7f0004000000-7f0004a00000 rw-s 00000000 00:05 77                         /dev/shm/x
7ffd00000000-7ffd00a00000 rw-p 00000000 00:00 0                          [stack]
";
        assert_eq!(
            huge_page_spans(maps),
            vec![
                // The heap: 10 MiB from an aligned start.
                0x55d0_c000_0000..0x55d0_c0a0_0000,
                // 8 MiB from 1 MiB in: the aligned 6 MiB inside.
                0x7f00_0020_0000..0x7f00_0080_0000,
            ]
        );
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn collapsing_keeps_the_memory_and_puts_it_on_huge_pages_where_the_kernel_can() {
        // 32 MiB: a mapping of its own (above malloc's default threshold), touched throughout.
        let data: Vec<u64> = (0..4 << 20)
            .map(|i: u64| i.wrapping_mul(0x9E37_79B9))
            .collect();
        let collapsed = collapse_heap_into_huge_pages();
        assert!(
            data.iter()
                .enumerate()
                .all(|(i, &x)| x == (i as u64).wrapping_mul(0x9E37_79B9))
        );
        // MADV_COLLAPSE exists from Linux 6.1, and not where THP is off.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut version = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse::<u32>());
        let (major, minor) = (version.next(), version.next());
        let new_enough = matches!((major, minor), (Some(Ok(a)), Some(Ok(b))) if (a, b) >= (6, 1));
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"));
        if new_enough && thp && std::env::var_os("KILN_NO_HUGE_PAGES").is_none() {
            if collapsed < 28 << 20 {
                // The one failure allowed: no free huge page to be had (memory pressure).
                let at = (data.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
                // SAFETY: advice on the aligned inside of `data`'s own allocation.
                let done =
                    unsafe { libc::madvise(at as *mut libc::c_void, 8 << 20, libc::MADV_COLLAPSE) };
                let errno = std::io::Error::last_os_error().raw_os_error();
                assert!(
                    done == -1 && matches!(errno, Some(libc::EAGAIN | libc::ENOMEM)),
                    "collapsed {collapsed} bytes, and MADV_COLLAPSE gave {done} ({errno:?})"
                );
                return;
            }
            let smaps = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
            let huge_kib: usize = smaps
                .lines()
                .find_map(|l| l.strip_prefix("AnonHugePages:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap();
            assert!(huge_kib >= 28 << 10, "AnonHugePages {huge_kib} kB");
        }
    }
}
