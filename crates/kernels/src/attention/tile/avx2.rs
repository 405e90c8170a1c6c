//! The AVX2 halves of the tile kernel: eight keys a register, for head widths that are a
//! multiple of 8 (the AVX-512 halves' algorithm in 256-bit registers; the weighted sum keeps
//! fewer columns in registers, AVX2 having sixteen of them).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{KeyChunks, KeysSeen, Row, TILE_ROWS, TileSimd};
use crate::SharedOut;
use crate::attention::x86::exp8;
use crate::attention::{HeadKv, KvElement};
use crate::lanes::{hmax, hsum};

/// Keys per register.
const LANES: usize = 8;

/// AVX2 with FMA and F16C.
pub(in crate::attention) struct Avx2;

impl TileSimd for Avx2 {
    const LANES: usize = LANES;

    unsafe fn scores_to_probabilities<const R: usize, T: KvElement>(
        tile: &[Row],
        q: &[f32],
        kv: &HeadKv<'_, T>,
        seen: &KeysSeen<'_>,
        probs: &mut [f32],
    ) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
        // SAFETY: the trait's contract: this CPU has AVX2, FMA and F16C, `head_dim` is a
        // multiple of 8.
        unsafe { scores_to_probabilities::<R, T>(tile, q, kv, seen, probs) }
    }

    unsafe fn weighted_sum<const R: usize, T: KvElement>(
        tile: &[Row],
        kv: &HeadKv<'_, T>,
        span: Range<usize>,
        probs: &[f32],
        inv: &[f32; TILE_ROWS],
        out: &SharedOut<f32>,
    ) {
        // SAFETY: the trait's contract: AVX2, FMA and F16C, `head_dim` a multiple of 8, the
        // tile's records this task's alone.
        unsafe { weighted_sum::<R, T>(tile, kv, span, probs, inv, out) }
    }
}

/// The dot products of one key row with the tile's `R` queries, lane `l` of row `r`'s
/// register summing `q_d k_d` for `d ≡ l (mod 8)`, one FMA per register of dimensions from
/// the first up.
///
/// # Safety
/// `key` holds `head_dim` values and each of `queries` `head_dim` floats; `head_dim` is a
/// multiple of 8, `W` its registers (or 0: any width).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn key_dots<const R: usize, const W: usize, T: KvElement>(
    queries: &[*const f32; R],
    key: *const T,
    head_dim: usize,
) -> [__m256; R] {
    let mut dots = [_mm256_setzero_ps(); R];
    // A known width unrolls the loop (and keeps its registers out of memory).
    let registers = if W > 0 { W } else { head_dim / LANES };
    for d in (0..registers).map(|w| w * LANES) {
        // SAFETY: `d + 8 <= head_dim` values of the key and of each query (the caller's
        // contract).
        unsafe {
            let k = T::load8(key, d);
            for (dot, query) in dots.iter_mut().zip(queries) {
                *dot = _mm256_fmadd_ps(_mm256_loadu_ps(query.add(d)), k, *dot);
            }
        }
    }
    dots
}

/// The sums across lanes of two keys' registers `a` and `b`, halfway: within each 128-bit
/// lane, `[a0 + a2, b0 + b2, a1 + a3, b1 + b3]`.
#[inline]
#[target_feature(enable = "avx")]
fn sum_pairs(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
}

/// Two results of [`sum_pairs`] (keys `0, 1` in `x`, `2, 3` in `y`) summed on: within each
/// 128-bit lane, the four keys' sums over that lane's four values, in key order.
#[inline]
#[target_feature(enable = "avx")]
fn sum_quads(x: __m256, y: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_shuffle_ps::<0x44>(x, y),
        _mm256_shuffle_ps::<0xEE>(x, y),
    )
}

/// The two 128-bit lanes of each register summed: `[x0 + x1, y0 + y1]` (lanes of four
/// floats).
#[inline]
#[target_feature(enable = "avx")]
fn sum_halves(x: __m256, y: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(x, y),
        _mm256_permute2f128_ps::<0x31>(x, y),
    )
}

/// The eight keys' scores (before scaling) of the tile's `R` rows, key `l`'s in lane `l`:
/// [`key_dots`] of each key, summed across lanes by [`sum_pairs`], [`sum_quads`] and
/// [`sum_halves`] (the tree of the module doc), two keys at a time.
///
/// # Safety
/// As [`key_dots`], for each of `keys`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_scores<const R: usize, const W: usize, T: KvElement>(
    queries: &[*const f32; R],
    keys: &[&[T]; LANES],
    head_dim: usize,
) -> [__m256; R] {
    // Two keys at a time, summed down to one register per row (plain loops: closures would
    // not inherit this function's features, and were not inlined).
    let mut pairs = [[_mm256_setzero_ps(); R]; 4];
    for (p, pair) in pairs.iter_mut().enumerate() {
        // SAFETY: each key row and query holds `head_dim` values (the caller's contract).
        let (a, b) = unsafe {
            (
                key_dots::<R, W, T>(queries, keys[2 * p].as_ptr(), head_dim),
                key_dots::<R, W, T>(queries, keys[2 * p + 1].as_ptr(), head_dim),
            )
        };
        for r in 0..R {
            pair[r] = sum_pairs(a[r], b[r]);
        }
    }
    let mut sums = [_mm256_setzero_ps(); R];
    for r in 0..R {
        sums[r] = sum_halves(
            sum_quads(pairs[0][r], pairs[1][r]),
            sum_quads(pairs[2][r], pairs[3][r]),
        );
    }
    sums
}

/// Which of keys `j0..j0 + 8` a row masks, as lanes of all ones: its mask entries, and every
/// key at or past `end`.
#[inline]
#[target_feature(enable = "avx2")]
fn masked_lanes(mask_row: &[bool], j0: usize, end: usize) -> __m256 {
    let loaded = match end.saturating_sub(j0) {
        0 => return _mm256_castsi256_ps(_mm256_set1_epi32(-1)),
        // SAFETY: `j0 + 8 <= end <= mask_row.len()`: eight mask entries, each a byte of 0 or
        // 1, what `vmovq` loads.
        n if n >= LANES => unsafe { _mm_loadl_epi64(mask_row[j0..j0 + LANES].as_ptr().cast()) },
        n => {
            let mut bytes = [1u8; LANES];
            for (b, &m) in bytes.iter_mut().zip(&mask_row[j0..j0 + n]) {
                *b = u8::from(m);
            }
            // SAFETY: eight bytes from a local array, what `vmovq` loads.
            unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) }
        }
    };
    let wide = _mm256_cvtepu8_epi32(loaded);
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()))
}

/// [`TileSimd::scores_to_probabilities`] in eight lanes: a chunk of eight keys at a time
/// ([`chunk_scores`]), walked through the block table.
///
/// # Safety
/// `head_dim` must be a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_to_probabilities<const R: usize, T: KvElement>(
    tile: &[Row],
    q: &[f32],
    kv: &HeadKv<'_, T>,
    seen: &KeysSeen<'_>,
    probs: &mut [f32],
) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
    let tile = &tile[..R];
    let chunks = seen.span.len().div_ceil(LANES);
    let stride = chunks * LANES;
    let head_dim = kv.head_dim;
    let queries: [*const f32; R] = std::array::from_fn(|r| q[tile[r].at..][..head_dim].as_ptr());
    let mut maxes = [_mm256_set1_ps(f32::NEG_INFINITY); R];
    let mut walk = KeyChunks::new(kv, seen.span.clone());
    for c in 0..chunks {
        let keys: [&[T]; LANES] = walk.next(kv);
        // SAFETY: every key row (a missing one is a row of zeros) and query holds `head_dim`
        // values, a multiple of 8 (the caller's contract).
        let sums = unsafe {
            match head_dim / LANES {
                4 => chunk_scores::<R, 4, T>(&queries, &keys, head_dim),
                8 => chunk_scores::<R, 8, T>(&queries, &keys, head_dim),
                _ => chunk_scores::<R, 0, T>(&queries, &keys, head_dim),
            }
        };
        for (r, row) in tile.iter().enumerate() {
            let mask_row = &seen.mask[row.mask_at..row.mask_at + seen.keys];
            let at = r * stride + c * LANES;
            maxes[r] = score_chunk(
                sums[r],
                seen,
                mask_row,
                row,
                c,
                &mut probs[at..at + LANES],
                maxes[r],
            );
        }
    }
    // Probabilities and their sums.
    let mut row_maxes = [f32::NEG_INFINITY; TILE_ROWS];
    let mut row_sums = [0f32; TILE_ROWS];
    for r in 0..R {
        let row_probs = &mut probs[r * stride..(r + 1) * stride];
        let max = hmax(maxes[r]);
        row_maxes[r] = max;
        if max == f32::NEG_INFINITY {
            row_probs.fill(0.0);
            continue;
        }
        let max8 = _mm256_set1_ps(max);
        let mut sums = _mm256_setzero_ps();
        for chunk in row_probs.chunks_exact_mut(LANES) {
            // SAFETY: 8 values (chunks of that length).
            let p = exp8(_mm256_sub_ps(
                unsafe { _mm256_loadu_ps(chunk.as_ptr()) },
                max8,
            ));
            sums = _mm256_add_ps(sums, p);
            // SAFETY: 8 values (a chunk of that length).
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), p) };
        }
        row_sums[r] = hsum(sums);
    }
    (row_maxes, row_sums)
}

/// One chunk's scores of one row (its dot products `sum`): scaled, its masked keys and keys
/// past its last visible one at -inf, stored in `out`; returns the running maximum `max`
/// with them.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn score_chunk(
    sum: __m256,
    seen: &KeysSeen<'_>,
    mask_row: &[bool],
    row: &Row,
    chunk: usize,
    out: &mut [f32],
    max: __m256,
) -> __m256 {
    let j0 = seen.span.start + chunk * LANES;
    let masked = masked_lanes(mask_row, j0, row.visible.end.min(seen.span.end));
    let score = _mm256_blendv_ps(
        _mm256_mul_ps(sum, _mm256_set1_ps(seen.scale)),
        _mm256_set1_ps(f32::NEG_INFINITY),
        masked,
    );
    // SAFETY: 8 values (a slice of that length, the caller's).
    unsafe { _mm256_storeu_ps(out[..LANES].as_mut_ptr(), score) };
    _mm256_max_ps(max, score)
}

/// Keys a pass of [`weighted_sum`] takes before the next pass over the same keys: their
/// values (4 KB in f16 at a head width of 64) stay in L1 for every pass.
const SUB_RUN: usize = 32;

/// Registers of columns [`weighted_sum`] keeps per row between its sub-runs (128 columns).
const WINDOW: usize = 16;

/// [`TileSimd::weighted_sum`]: `W` registers of columns a pass, at most eight accumulators in
/// all (eight registers for one row, four for two, two for three or four), so that the values
/// and the probability fit beside them in AVX2's sixteen. The keys are walked in sub-runs of
/// [`SUB_RUN`] that lie one after another, every pass over one sub-run before the next (each
/// accumulator still takes its keys in key order), and a key no row of the tile sees is
/// skipped (adding `0 × v` would change nothing: the values past a sequence's end may be
/// stale, and are never multiplied).
///
/// # Safety
/// As [`TileSimd::weighted_sum`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_sum<const R: usize, T: KvElement>(
    tile: &[Row],
    kv: &HeadKv<'_, T>,
    span: Range<usize>,
    probs: &[f32],
    inv: &[f32; TILE_ROWS],
    out: &SharedOut<f32>,
) {
    let stride = span.len().div_ceil(LANES) * LANES;
    assert!(probs.len() >= R * stride);
    let row_probs: [&[f32]; R] = std::array::from_fn(|r| &probs[r * stride..(r + 1) * stride]);
    let width = match R {
        1 => 8,
        2 => 4,
        _ => 2,
    };
    let registers = kv.head_dim / LANES;
    for window in (0..registers).step_by(WINDOW) {
        let window_registers = (registers - window).min(WINDOW);
        let mut acc = [[_mm256_setzero_ps(); WINDOW]; R];
        let mut ahead = super::ValuesAhead::new(kv, span.clone());
        for (first, at, len) in kv.runs(span.clone()) {
            let run = &kv.kv.v[at..at + len * kv.row_units];
            for sub in (0..len).step_by(SUB_RUN) {
                let keys = first + sub..first + (sub + SUB_RUN).min(len);
                ahead.past(kv, keys.end);
                let live = live_keys(&row_probs, keys.clone());
                let values = run[sub * kv.row_units..].as_ptr();
                // One pass of `W` registers of columns from `column`.
                macro_rules! pass {
                    ($w:literal, $column:expr) => {
                        pass::<R, $w, T>(
                            &mut acc,
                            $column,
                            window + $column,
                            values,
                            kv.row_units,
                            &row_probs,
                            keys.clone(),
                            live,
                        )
                    };
                }
                let mut column = 0;
                while column < window_registers {
                    // SAFETY: this function's contract; the pass's registers are the window's
                    // and the head's (it takes at most what is left of both), `values` the
                    // sub-run's rows.
                    column += unsafe {
                        match (window_registers - column).min(width) {
                            8.. => pass!(8, column),
                            4..=7 => pass!(4, column),
                            2 | 3 => pass!(2, column),
                            _ => pass!(1, column),
                        }
                    };
                }
            }
        }
        for (r, row) in tile[..R].iter().enumerate() {
            let inv8 = _mm256_set1_ps(inv[r]);
            for (w, &a) in acc[r][..window_registers].iter().enumerate() {
                // SAFETY: the row's record is this task's (the caller's contract), and its
                // eight columns from `8 (window + w)` lie inside it.
                unsafe {
                    let dest = out.slice(row.dest + (window + w) * LANES, LANES);
                    _mm256_storeu_ps(dest.as_mut_ptr(), _mm256_mul_ps(a, inv8));
                }
            }
        }
    }
}

/// Which of `keys` (at most 32, from the first) some row sees with a probability other than
/// zero, one bit per key: eight keys of every row compared at once.
#[inline]
#[target_feature(enable = "avx2")]
fn live_keys<const R: usize>(row_probs: &[&[f32]; R], keys: Range<usize>) -> u32 {
    let mut live = 0u32;
    let mut i = keys.start;
    while i < keys.end {
        let bit = i - keys.start;
        if keys.end - i >= LANES {
            let mut seen = _mm256_setzero_ps();
            for p in row_probs {
                // SAFETY: eight probabilities (a slice of that length).
                let p = unsafe { _mm256_loadu_ps(p[i..i + LANES].as_ptr()) };
                // Unordered: a NaN counts as seen, as `!=` has it.
                seen = _mm256_or_ps(seen, _mm256_cmp_ps::<_CMP_NEQ_UQ>(p, _mm256_setzero_ps()));
            }
            live |= (_mm256_movemask_ps(seen) as u32) << bit;
            i += LANES;
        } else {
            if row_probs.iter().any(|p| p[i] != 0.0) {
                live |= 1 << bit;
            }
            i += 1;
        }
    }
    live
}

/// One pass of [`weighted_sum`] over one sub-run: registers `column..column + W` of the
/// window's accumulators (`from..from + W` of the head) take keys `keys` (`values` the first
/// one's row, `row_units` apart), those whose bit in `live` is set; returns `W`.
///
/// # Safety
/// As [`TileSimd::weighted_sum`]; `column + W <= WINDOW`, `8 (from + W) <= head_dim`, and
/// `values` the start of `keys.len()` rows one after another.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass<const R: usize, const W: usize, T: KvElement>(
    acc: &mut [[__m256; WINDOW]; R],
    column: usize,
    from: usize,
    values: *const T,
    row_units: usize,
    row_probs: &[&[f32]; R],
    keys: Range<usize>,
    live: u32,
) -> usize {
    let mut a: [[__m256; W]; R] =
        std::array::from_fn(|r| std::array::from_fn(|w| acc[r][column + w]));
    debug_assert!((1..=32).contains(&keys.len()));
    let all = live == u32::MAX >> (32 - keys.len());
    let probs: [*const f32; R] = std::array::from_fn(|r| row_probs[r][keys.clone()].as_ptr());
    for key in 0..keys.len() {
        if !all && live & (1 << key) == 0 {
            continue;
        }
        // SAFETY: row `key` of the sub-run, its values `8 from..8 (from + W)` (the caller's
        // contract); one probability of each row's `keys`.
        unsafe {
            let row = values.add(key * row_units);
            let v: [__m256; W] = std::array::from_fn(|w| T::load8(row, (from + w) * LANES));
            for r in 0..R {
                let p = _mm256_broadcast_ss(&*probs[r].add(key));
                for w in 0..W {
                    a[r][w] = _mm256_fmadd_ps(p, v[w], a[r][w]);
                }
            }
        }
    }
    for r in 0..R {
        acc[r][column..column + W].copy_from_slice(&a[r]);
    }
    W
}
