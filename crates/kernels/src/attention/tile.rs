//! The tile attention kernels: up to four query rows at a time against a register of keys at a
//! time, sixteen keys on AVX-512 ([`Avx512`], head widths a multiple of 16), eight on AVX2
//! ([`Avx2`], widths a multiple of 8).
//!
//! The row kernels read a KV head's keys once per query row; here a tile of query rows that
//! see the same first key shares one pass over the keys: each key row is loaded (and widened
//! to f32) once for every row of the tile, its dot products with the tile's queries taken a
//! register of dimensions at a time, and a register of keys' products summed across lanes
//! together (a tree of shuffles and adds whose result holds one key's score in each lane);
//! likewise a row of values is loaded once for every row of the tile. This file holds what
//! both widths share (which rows form a tile, which keys it covers, where its results go, how
//! the keys are walked); `avx512.rs` and `avx2.rs` the scores and the weighted sum in their
//! registers ([`TileSimd`]).
//!
//! A row's partial result for a partition (see `super`'s doc) still depends only on its
//! visible keys: every number is computed in an order fixed relative to the partition's first
//! key (`start`, a fixed distance from the row's first visible key), whatever else is in the
//! tile, the task or the cache.
//! - score of key `j`: lane `l` of a register takes `q_d k_jd` for `d ≡ l (mod LANES)`, one
//!   FMA per register of dimensions from the first up; the lanes are then summed in a fixed
//!   pairwise tree, and the sum multiplied by `1/√head_dim`;
//! - masked keys (and keys past the row's last visible one) get probability exactly 0;
//! - the denominator: `LANES` partial sums, lane `l` taking keys `start + LANES c + l` in
//!   ascending `c`, then one fixed reduction;
//! - the numerator of column `d`: `Σ_j p_j v_jd`, one FMA per key in key order; a key no row
//!   of the tile sees is skipped (adding `0 × v` would change nothing: the values past a
//!   sequence's end may be stale, and are never multiplied).
//!
//! So a prompt alone, packed beside others or beside padding gives the same bits, as the
//! property tests in `tests/attention.rs` check on each tier (the two widths round apart:
//! their sums run over different lanes).

mod avx2;
mod avx512;

use std::cell::RefCell;
use std::ops::Range;

pub(super) use avx2::Avx2;
pub(super) use avx512::Avx512;

use super::{HeadKv, KeyCursor, KvElement};
use crate::SharedOut;

/// Query rows per tile: a key row loaded once serves four rows' dot products.
const TILE_ROWS: usize = 4;

thread_local! {
    /// Per worker thread: the tile's scores / probabilities, grown as needed and kept
    /// between tasks.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One query row of a task.
#[derive(Debug, Clone)]
pub(super) struct Row {
    /// Offset of its query vector.
    pub at: usize,
    /// Its mask row: `keys` entries, `true` = masked.
    pub mask_at: usize,
    /// Its visible span (first to last visible key).
    pub visible: Range<usize>,
    /// Offset of its partial result in the sink (`head_dim + 2` values, see
    /// `super::record_len`).
    pub dest: usize,
}

/// Which partition of each row's keys a call attends over.
#[derive(Debug, Clone, Copy)]
pub(super) struct Partition {
    /// Its index, from the row's first visible key.
    pub index: usize,
    /// Keys per partition.
    pub keys: usize,
}

/// What a tile's scores are computed over.
pub(super) struct KeysSeen<'a> {
    /// As [`attend_rows`]'s.
    pub mask: &'a [bool],
    /// Keys per mask row.
    pub keys: usize,
    /// The keys the tile's rows see, first to last.
    pub span: Range<usize>,
    /// `1 / √head_dim`.
    pub scale: f32,
}

/// The parts of the tile kernel that depend on the register width. Every function needs the
/// CPU features of its implementation and a `head_dim` that is a positive multiple of
/// [`Self::LANES`] (their safety contract).
pub(super) trait TileSimd {
    /// Keys per register.
    const LANES: usize;

    /// The scores of the tile's `R` rows over `seen.span` (`probs[r][c × LANES + l]`, then
    /// their probabilities in place), and each row's largest score and `Σ p` (-inf and 0 for
    /// a row that sees no key).
    ///
    /// # Shapes
    /// - `probs`: `[TILE_ROWS, chunks × LANES]` (`chunks`: `seen.span`'s keys in registers)
    ///
    /// # Safety
    /// As the trait says.
    unsafe fn scores_to_probabilities<const R: usize, T: KvElement>(
        tile: &[Row],
        q: &[f32],
        kv: &HeadKv<'_, T>,
        seen: &KeysSeen<'_>,
        probs: &mut [f32],
    ) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]);

    /// `out[row.dest..] = inv[row] × Σ_j p_j v_j` over keys `span` for the tile's `R` rows.
    ///
    /// # Safety
    /// As the trait says, and no other task may write these rows' records.
    unsafe fn weighted_sum<const R: usize, T: KvElement>(
        tile: &[Row],
        kv: &HeadKv<'_, T>,
        span: Range<usize>,
        probs: &[f32],
        inv: &[f32; TILE_ROWS],
        out: &SharedOut<f32>,
    );
}

/// The partials of `rows` (one task's, all on one KV head) over one partition of their keys:
/// tiles of up to four rows with the same first visible key, in `S`'s registers.
///
/// # Shapes
/// - `q`, `mask`: as [`super::attention_blocks`]; each row reads `q[at..at + head_dim]`
/// - `sink`: each row writes `sink[dest..dest + head_dim + 2]`
///
/// # Safety
/// The CPU must support `S`'s features; `head_dim` must be a positive multiple of `S::LANES`;
/// no other task may write these rows' records.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_rows<T: KvElement, S: TileSimd>(
    rows: &[Row],
    partition: Partition,
    q: &[f32],
    kv: &HeadKv<'_, T>,
    mask: &[bool],
    keys: usize,
    scale: f32,
    sink: &SharedOut<f32>,
) {
    let head_dim = kv.head_dim;
    debug_assert!(head_dim > 0 && head_dim.is_multiple_of(S::LANES));
    let mut probs = SCRATCH.take();
    let mut r = 0;
    while r < rows.len() {
        let start = rows[r].visible.start;
        let mut n = 1;
        while n < TILE_ROWS && r + n < rows.len() && rows[r + n].visible.start == start {
            n += 1;
        }
        let tile = &rows[r..r + n];
        r += n;
        let end = tile
            .iter()
            .map(|row| row.visible.end)
            .max()
            .unwrap_or(start);
        let span = super::partition_span(&(start..end), partition.index, partition.keys);
        if span.is_empty() {
            // No row sees a key here: an empty partial, as the row kernels give.
            for row in tile {
                // SAFETY: the record is this task's (the caller's contract).
                let record = unsafe { sink.slice(row.dest, head_dim + 2) };
                record.fill(0.0);
                record[head_dim] = f32::NEG_INFINITY;
            }
            continue;
        }
        // Every value a tile reads is written first (each row's scores, then probabilities):
        // grown, never cleared.
        let needed = TILE_ROWS * span.len().div_ceil(S::LANES) * S::LANES;
        if probs.len() < needed {
            probs.resize(needed, 0.0);
        }
        let seen = KeysSeen {
            mask,
            keys,
            span: span.clone(),
            scale,
        };
        // SAFETY: `S`'s features and `head_dim` are the caller's contract.
        let (maxes, sums) = unsafe {
            match tile.len() {
                1 => S::scores_to_probabilities::<1, T>(tile, q, kv, &seen, &mut probs),
                2 => S::scores_to_probabilities::<2, T>(tile, q, kv, &seen, &mut probs),
                3 => S::scores_to_probabilities::<3, T>(tile, q, kv, &seen, &mut probs),
                _ => S::scores_to_probabilities::<4, T>(tile, q, kv, &seen, &mut probs),
            }
        };
        let inv = sums.map(|s| if s > 0.0 { 1.0 / s } else { 0.0 });
        // SAFETY: `weighted_sum` needs what this function's caller vouches for (`S`'s
        // features, `head_dim` a multiple of its lanes, the tile's records this task's alone).
        unsafe {
            match tile.len() {
                1 => S::weighted_sum::<1, T>(tile, kv, span, &probs, &inv, sink),
                2 => S::weighted_sum::<2, T>(tile, kv, span, &probs, &inv, sink),
                3 => S::weighted_sum::<3, T>(tile, kv, span, &probs, &inv, sink),
                _ => S::weighted_sum::<4, T>(tile, kv, span, &probs, &inv, sink),
            }
        };
        for (i, row) in tile.iter().enumerate() {
            // SAFETY: the record is this task's (the caller's contract).
            let tail = unsafe { sink.slice(row.dest + head_dim, 2) };
            tail[0] = maxes[i];
            tail[1] = sums[i];
        }
    }
    SCRATCH.set(probs);
}

/// How far ahead (in keys) the weighted sums prefetch values into L1: the scores' walk
/// prefetched them only to L2.
const VALUES_AHEAD: usize = 32;

/// A weighted sum's prefetch of the values ahead of it over a span of keys.
pub(super) struct ValuesAhead {
    /// The next key whose values are not prefetched yet.
    cursor: KeyCursor,
    /// Keys (from the span's first) whose values are prefetched.
    done: usize,
}

impl ValuesAhead {
    /// The prefetch over `span`, its first [`VALUES_AHEAD`] keys' values prefetched.
    pub(super) fn new<T: KvElement>(kv: &HeadKv<'_, T>, span: Range<usize>) -> Self {
        let mut ahead = Self {
            cursor: kv.cursor(span),
            done: 0,
        };
        ahead.past(kv, 0);
        ahead
    }

    /// The walk has reached key `at` (counted from the span's first): the values up to
    /// [`VALUES_AHEAD`] keys on are prefetched.
    pub(super) fn past<T: KvElement>(&mut self, kv: &HeadKv<'_, T>, at: usize) {
        let wanted = (at + VALUES_AHEAD).saturating_sub(self.done);
        self.done += kv.prefetch_next(&mut self.cursor, wanted, HeadKv::prefetch_values);
    }
}

/// How far ahead (in keys) the scores' walk prefetches keys and values: the hardware
/// prefetcher follows a short run of keys late (and not at all across a paged cache's
/// blocks, which lie apart).
const KEYS_AHEAD: usize = 32;

/// The scores' walk over a span of keys, a chunk at a time: each chunk's rows are found
/// once (a cursor over the block table; a chunk inside one block as one run), so the loads
/// after it are plain loads the core can overlap; the rows [`KEYS_AHEAD`] keys on are
/// prefetched (a second cursor), their values too.
pub(super) struct KeyChunks<T> {
    cursor: KeyCursor,
    /// The first key not prefetched yet.
    ahead: KeyCursor,
    /// What a missing key (past the span's end) reads.
    zeros: Vec<T>,
}

impl<T: KvElement> KeyChunks<T> {
    /// The walk over `span`, its first [`KEYS_AHEAD`] keys' rows prefetched (no earlier chunk
    /// did).
    pub(super) fn new(kv: &HeadKv<'_, T>, span: Range<usize>) -> Self {
        let mut ahead = kv.cursor(span.clone());
        kv.prefetch_next(&mut ahead, KEYS_AHEAD, HeadKv::prefetch_run);
        Self {
            cursor: kv.cursor(span),
            ahead,
            zeros: vec![T::ZERO; kv.row_units],
        }
    }

    /// The next chunk's `N` key rows (a zero row for each missing one).
    pub(super) fn next<'s, const N: usize>(&'s mut self, kv: &HeadKv<'s, T>) -> [&'s [T]; N] {
        let units = kv.row_units;
        let keys: [&[T]; N] = match kv.next_run(&mut self.cursor, N) {
            Some((at, n)) if n == N => {
                let run = &kv.kv.k[at..at + N * units];
                std::array::from_fn(|i| &run[i * units..(i + 1) * units])
            }
            first => {
                // The chunk crosses a block (or the span's end): row by row.
                let (cursor, zeros) = (&mut self.cursor, &self.zeros);
                let mut first = first.map(|(at, n)| (at, n, 0));
                std::array::from_fn(|_| match &mut first {
                    Some((at, n, i)) if *i < *n => {
                        *i += 1;
                        kv.key(*at + (*i - 1) * units)
                    }
                    _ => kv.next_key(cursor).unwrap_or(zeros.as_slice()),
                })
            }
        };
        kv.prefetch_next(&mut self.ahead, N, HeadKv::prefetch_run);
        keys
    }
}
