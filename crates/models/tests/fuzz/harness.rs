//! A small seeded mutation fuzzer for kiln's file readers (cargo-fuzz needs nightly): take a
//! valid file, mutate it (flip and overwrite bytes, cut it short, write extreme integers into
//! its length and count fields, replace JSON values, delete and insert chunks), hand it to the
//! reader, and count a panic as a failure. A reader must answer `Ok` or `Err`, whatever it
//! is given.
//!
//! One `u64` seed makes one input, so a failure is replayed from its seed alone. The inputs
//! that failed are also written to `target/fuzz/<target>-<seed>.bin`.
//!
//! Environment:
//! - `KILN_FUZZ_SECONDS`: how long each target runs (default 10; CI uses the default).
//! - `KILN_FUZZ_SEED`: run this one seed (a replay), writing its input under `target/fuzz/`.
//! - `KILN_FUZZ_BASE`: the first seed (default 0); later seeds count up from it.
//!
//! Memory: the test binary installs [`Guard`] as its global allocator. It keeps, per thread,
//! the bytes live and their peak ([`peak_of`]), so a target can assert that a reader holds
//! memory in proportion to its input; and while an input runs, a single allocation above the
//! target's `max_alloc` is refused: the seed is written to stderr and the process aborts
//! (there is no way to fail an allocation politely), rather than asking the machine for
//! terabytes. (A low `RLIMIT_AS` would cap the whole test binary, whose other tests and GPU
//! drivers reserve far more address space than they use.)
//!
//! Shared by kiln-models' integration tests (`tests/fuzz`) and kiln-engine's unit tests
//! (`src/snapshot/tests.rs`, by `#[path]`), so it uses std alone.

#![allow(dead_code)] // each crate uses part of it

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// SplitMix64: a seed in, a stream of well-mixed `u64`s out.
pub struct Rng(u64);

impl Rng {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Where a seed file's fields are, so that mutations hit them.
#[derive(Debug, Clone, Default)]
pub struct Fields {
    /// Offsets of little-endian `u32` fields (types, ranks, 32-bit values).
    pub u32s: Vec<usize>,
    /// Offsets of little-endian `u64` fields (counts, lengths, dimensions, offsets).
    pub u64s: Vec<usize>,
    /// The bytes of a JSON document (a header, a whole `config.json`).
    pub json: Option<Range<usize>>,
    /// Where the JSON's length is stored (a `u64`), kept right when a mutation resizes it.
    pub json_len_at: Option<usize>,
    /// The header's end: most byte mutations land before it, where the parsing happens.
    pub header_end: usize,
}

/// A valid input to start from.
#[derive(Debug, Clone)]
pub struct Seed {
    /// What it is, for reports.
    pub name: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Its fields.
    pub fields: Fields,
}

/// Values written into integer fields: the edges of every width a reader might trust.
const EXTREMES: [u64; 12] = [
    0,
    1,
    2,
    0xff,
    0x7fff_ffff,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    1 << 62,
    1 << 63,
    u64::MAX,
];

/// Values written over JSON values: extreme numbers and every other type.
const JSON_VALUES: [&str; 22] = [
    "0",
    "1",
    "-1",
    "2",
    "2147483648",
    "4294967295",
    "4294967296",
    "1099511627776",
    "9223372036854775808",
    "18446744073709551615",
    "1e308",
    "-1e308",
    "1e999",
    "0.5",
    "1e-320",
    "null",
    "true",
    "\"\"",
    "\"x\"",
    "[]",
    "{}",
    "[0, 1e308]",
];

/// `seed`'s bytes after one to three mutations drawn from `rng`.
pub fn mutate(seed: &Seed, rng: &mut Rng) -> Vec<u8> {
    let mut out = seed.bytes.clone();
    let mut fields = seed.fields.clone();
    for _ in 0..1 + rng.below(3) {
        match rng.below(10) {
            0 => {
                for _ in 0..1 + rng.below(8) {
                    let at = hot_offset(&out, &fields, rng);
                    if let Some(b) = out.get_mut(at) {
                        *b ^= 1 << rng.below(8);
                    }
                }
            }
            1 => {
                let at = hot_offset(&out, &fields, rng);
                if let Some(b) = out.get_mut(at) {
                    *b = rng.next_u64() as u8;
                }
            }
            2 | 3 if !fields.u64s.is_empty() => {
                let at = *rng.pick(&fields.u64s);
                let value = match rng.below(3) {
                    0 => *rng.pick(&EXTREMES),
                    // Another field's value: a tensor's offset onto another tensor, a count
                    // onto a length.
                    1 => read_u64(&out, *rng.pick(&fields.u64s)).unwrap_or(0),
                    _ => read_u64(&out, at)
                        .unwrap_or(0)
                        .wrapping_add(rng.below(17) as u64)
                        .wrapping_sub(8),
                };
                write(&mut out, at, &value.to_le_bytes());
            }
            4 if !fields.u32s.is_empty() => {
                let at = *rng.pick(&fields.u32s);
                let value = match rng.below(2) {
                    0 => *rng.pick(&EXTREMES) as u32,
                    _ => read_u32(&out, at)
                        .unwrap_or(0)
                        .wrapping_add(rng.below(17) as u32)
                        .wrapping_sub(8),
                };
                write(&mut out, at, &value.to_le_bytes());
            }
            5 | 6 if fields.json.is_some() => replace_json_value(&mut out, &mut fields, rng),
            7 => {
                let end = if rng.below(2) == 0 {
                    hot_offset(&out, &fields, rng)
                } else {
                    rng.below(out.len() + 1)
                };
                out.truncate(end);
            }
            8 => {
                let at = hot_offset(&out, &fields, rng).min(out.len());
                let n = (1 + rng.below(64)).min(out.len() - at);
                out.drain(at..at + n);
                fields.header_end = fields.header_end.saturating_sub(n);
            }
            _ => {
                let at = hot_offset(&out, &fields, rng).min(out.len());
                let chunk: Vec<u8> = if rng.below(2) == 0 && !out.is_empty() {
                    let from = rng.below(out.len());
                    out[from..(from + 1 + rng.below(64)).min(out.len())].to_vec()
                } else {
                    (0..1 + rng.below(16))
                        .map(|_| rng.next_u64() as u8)
                        .collect()
                };
                fields.header_end += chunk.len();
                out.splice(at..at, chunk);
            }
        }
    }
    out
}

/// An offset, three times in four inside the header.
fn hot_offset(bytes: &[u8], fields: &Fields, rng: &mut Rng) -> usize {
    let hot = fields.header_end.min(bytes.len());
    if hot > 0 && rng.below(4) > 0 {
        rng.below(hot)
    } else {
        rng.below(bytes.len().max(1))
    }
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn write(bytes: &mut [u8], at: usize, value: &[u8]) {
    if let Some(slot) = bytes.get_mut(at..at + value.len()) {
        slot.copy_from_slice(value);
    }
}

/// Replaces one scalar value of the JSON (a number, string or literal that is not a key) by
/// one of [`JSON_VALUES`], keeping the stored length right.
fn replace_json_value(out: &mut Vec<u8>, fields: &mut Fields, rng: &mut Rng) {
    let Some(json) = fields.json.clone().filter(|j| j.end <= out.len()) else {
        return;
    };
    let values = json_values(&out[json.clone()]);
    if values.is_empty() {
        return;
    }
    let span = rng.pick(&values).clone();
    let new = rng.pick(&JSON_VALUES).as_bytes();
    let (start, end) = (json.start + span.start, json.start + span.end);
    out.splice(start..end, new.iter().copied());
    let grown = new.len() as isize - span.len() as isize;
    let json_end = (json.end as isize + grown) as usize;
    fields.json = Some(json.start..json_end);
    fields.header_end = (fields.header_end as isize + grown).max(0) as usize;
    if let Some(at) = fields.json_len_at {
        write(out, at, &((json_end - json.start) as u64).to_le_bytes());
    }
}

/// The spans of `json`'s scalar values (numbers, strings that are not keys, literals).
fn json_values(json: &[u8]) -> Vec<Range<usize>> {
    let mut spans = Vec::new();
    let mut i = 0;
    while i < json.len() {
        let start = i;
        match json[i] {
            b'"' => {
                i += 1;
                while i < json.len() && json[i] != b'"' {
                    i += if json[i] == b'\\' { 2 } else { 1 };
                }
                i = (i + 1).min(json.len());
                let next = json[i..].iter().find(|b| !b.is_ascii_whitespace());
                if next != Some(&b':') {
                    spans.push(start..i);
                }
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                while i < json.len() && !b",]} \n\r\t".contains(&json[i]) {
                    i += 1;
                }
                spans.push(start..i);
            }
            _ => i += 1,
        }
    }
    spans
}

/// A reader under test.
pub struct Target<'a> {
    /// Its name, for reports and failure files.
    pub name: &'static str,
    /// Valid inputs to mutate (run unchanged first).
    pub seeds: Vec<Seed>,
    /// The largest single allocation an input may make on the fuzzing thread.
    pub max_alloc: usize,
    /// Reads one input made from a seed; a panic (an assertion of the target's included) is a
    /// failure.
    pub run: &'a dyn Fn(&Seed, &[u8]),
}

/// Runs `target` on its seeds, then on mutated inputs until its time is up; panics listing
/// the seeds that failed.
pub fn fuzz(target: &Target) {
    assert!(!target.seeds.is_empty(), "{}: no seed inputs", target.name);
    if let Some(seed) = env_u64("KILN_FUZZ_SEED") {
        let (base, input) = input_for(target, seed);
        let file = save(target.name, seed, &input);
        if let Err(reason) = run_one(target, seed, base, &input) {
            panic!(
                "{}: seed {seed} ({}): {reason}",
                target.name,
                file.display()
            );
        }
        return;
    }
    for seed in &target.seeds {
        if let Err(reason) = run_one(target, u64::MAX, seed, &seed.bytes) {
            panic!(
                "{}: the unmutated seed {}: {reason}",
                target.name, seed.name
            );
        }
    }
    let seconds = std::env::var("KILN_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(10.0);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let base = env_u64("KILN_FUZZ_BASE").unwrap_or(0);
    let mut failures = Vec::new();
    let mut runs = 0u64;
    while Instant::now() < deadline && failures.len() < 8 {
        let seed = base.wrapping_add(runs);
        runs += 1;
        let (base, input) = input_for(target, seed);
        if let Err(reason) = run_one(target, seed, base, &input) {
            let file = save(target.name, seed, &input);
            failures.push(format!("seed {seed} ({}): {reason}", file.display()));
        }
    }
    eprintln!("{}: {runs} mutated inputs", target.name);
    assert!(
        failures.is_empty(),
        "{}: {} of {runs} inputs failed (replay one with KILN_FUZZ_SEED=<seed>):\n{}",
        target.name,
        failures.len(),
        failures.join("\n")
    );
}

/// The input `seed` makes: which seed file, then its mutations.
pub fn input_for<'t>(target: &'t Target, seed: u64) -> (&'t Seed, Vec<u8>) {
    let mut rng = Rng::new(seed);
    let base = rng.pick(&target.seeds);
    (base, mutate(base, &mut rng))
}

fn run_one(target: &Target, seed: u64, base: &Seed, input: &[u8]) -> Result<(), String> {
    let outer = (
        LIMIT.with(Cell::get),
        SEED.with(Cell::get),
        NAME.with(Cell::get),
    );
    SEED.with(|s| s.set(seed));
    NAME.with(|n| n.set(target.name));
    LIMIT.with(|l| l.set(target.max_alloc));
    let outcome = catch_unwind(AssertUnwindSafe(|| (target.run)(base, input)));
    LIMIT.with(|l| l.set(outer.0));
    SEED.with(|s| s.set(outer.1));
    NAME.with(|n| n.set(outer.2));
    outcome.map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a panic without a message");
        format!("panicked: {message}")
    })
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// Writes a failing input to `target/fuzz/<target>-<seed>.bin`.
fn save(name: &str, seed: u64, input: &[u8]) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let dir = target.join("fuzz");
    let path = dir.join(format!("{name}-{seed}.bin"));
    let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input));
    path
}

thread_local! {
    /// Bytes this thread has allocated and not freed (const-initialised: allocates nothing).
    static LIVE: Cell<usize> = const { Cell::new(0) };
    /// The most [`LIVE`] has been since [`peak_of`] reset it.
    static PEAK: Cell<usize> = const { Cell::new(0) };
    /// Bytes this thread has ever allocated.
    static TOTAL: Cell<usize> = const { Cell::new(0) };
    /// The largest allocation allowed on this thread now.
    static LIMIT: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The input running on this thread, for the report of a refused allocation.
    static SEED: Cell<u64> = const { Cell::new(0) };
    static NAME: Cell<&'static str> = const { Cell::new("") };
}

/// Bytes `work` holds at its peak on this thread, beyond what was live before. Only what
/// this thread allocates counts: readers measured with it must not hand work to others.
pub fn peak_of<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let out = work();
    (out, PEAK.with(Cell::get).saturating_sub(before))
}

/// Bytes `work` allocates on this thread in all, whether or not it frees them: work done
/// again and again (a header parsed for every tensor) shows here, and the count does not
/// depend on timing.
pub fn allocated_during<T>(work: impl FnOnce() -> T) -> (T, usize) {
    let before = TOTAL.with(Cell::get);
    let out = work();
    (out, TOTAL.with(Cell::get) - before)
}

/// The system allocator, counting each thread's live bytes and refusing, while an input
/// runs, any single allocation above the target's `max_alloc`.
pub struct Guard;

impl Guard {
    /// Counts `size` new bytes; `false` (after reporting) when they are over the limit.
    fn admit(size: usize) -> bool {
        let limit = LIMIT.try_with(Cell::get).unwrap_or(usize::MAX);
        if size > limit {
            let _ = LIMIT.try_with(|l| l.set(usize::MAX));
            report_refusal(size, limit);
            return false;
        }
        let _ = TOTAL.try_with(|total| total.set(total.get().wrapping_add(size)));
        let _ = LIVE.try_with(|live| {
            live.set(live.get() + size);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
        });
        true
    }

    fn release(size: usize) {
        let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(size)));
    }
}

/// Writes which input asked for too much, without allocating (the allocator is asking).
fn report_refusal(size: usize, limit: usize) {
    use std::fmt::Write as _;
    use std::io::Write as _;
    struct Stack {
        bytes: [u8; 512],
        len: usize,
    }
    impl std::fmt::Write for Stack {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.bytes.len() - self.len);
            self.bytes[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut message = Stack {
        bytes: [0; 512],
        len: 0,
    };
    let seed = SEED.try_with(Cell::get).unwrap_or(0);
    let name = NAME.try_with(Cell::get).unwrap_or("?");
    let _ = writeln!(
        message,
        "\nfuzz target {name}, seed {seed}: one allocation of {size} bytes, over the limit of \
         {limit}; the process aborts. Replay with KILN_FUZZ_SEED={seed} (the input is written \
         to target/fuzz/)."
    );
    let _ = std::io::stderr().write_all(&message.bytes[..message.len]);
}

// SAFETY: every call goes to `System` with the caller's layout and pointer; the counters only
// read and write thread-local cells, which allocate nothing, and a refusal returns null as
// `GlobalAlloc` allows.
unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc_zeroed` requires.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        Self::release(layout.size());
        // SAFETY: `ptr` came from this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !Self::admit(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr` came from this allocator with `layout`; `new_size` is the caller's.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if moved.is_null() {
            Self::release(new_size);
        } else {
            Self::release(layout.size());
        }
        moved
    }
}
