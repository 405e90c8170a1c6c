//! The AVX-512 halves of the tile kernel: sixteen keys a register, for head widths that are a
//! multiple of 16.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{KeyChunks, KeysSeen, Row, TILE_ROWS, TileSimd};
use crate::SharedOut;
use crate::attention::{EXP_MIN, EXP_POLY, HeadKv, KvElement, LN2_HI, LN2_LO};

/// Keys per register.
const LANES: usize = 16;

/// AVX-512 F, BW and VL with FMA.
pub(in crate::attention) struct Avx512;

impl TileSimd for Avx512 {
    const LANES: usize = LANES;

    unsafe fn scores_to_probabilities<const R: usize, T: KvElement>(
        tile: &[Row],
        q: &[f32],
        kv: &HeadKv<'_, T>,
        seen: &KeysSeen<'_>,
        probs: &mut [f32],
    ) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
        // SAFETY: the trait's contract: this CPU has AVX-512 F, BW and VL and FMA, `head_dim`
        // is a multiple of 16.
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
        // SAFETY: the trait's contract: AVX-512 and FMA, `head_dim` a multiple of 16, the
        // tile's records this task's alone.
        unsafe { weighted_sum::<R, T>(tile, kv, span, probs, inv, out) }
    }
}

/// The dot products of one key row with the tile's `R` queries, lane `l` of row `r`'s
/// register summing `q_d k_d` for `d ≡ l (mod 16)`, one FMA per register of dimensions from
/// the first up.
///
/// # Safety
/// `key` holds `head_dim` values and each of `queries` `head_dim` floats; `head_dim` is a
/// multiple of 16, `W` its registers (or 0: any width).
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn key_dots<const R: usize, const W: usize, T: KvElement>(
    queries: &[*const f32; R],
    key: *const T,
    head_dim: usize,
) -> [__m512; R] {
    let mut dots = [_mm512_setzero_ps(); R];
    // A known width unrolls the loop (and keeps its registers out of memory).
    let registers = if W > 0 { W } else { head_dim / LANES };
    for d in (0..registers).map(|w| w * LANES) {
        // SAFETY: `d + 16 <= head_dim` values of the key and of each query (the caller's
        // contract).
        unsafe {
            let k = T::load16(key, d);
            for (dot, query) in dots.iter_mut().zip(queries) {
                *dot = _mm512_fmadd_ps(_mm512_loadu_ps(query.add(d)), k, *dot);
            }
        }
    }
    dots
}

/// The sums across lanes of two keys' registers `a` and `b`, halfway: within each 128-bit
/// lane, `[a0 + a2, b0 + b2, a1 + a3, b1 + b3]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_pairs(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
}

/// Two results of [`sum_pairs`] (keys `0, 1` in `x`, `2, 3` in `y`) summed on: within each
/// 128-bit lane, the four keys' sums over that lane's four values, in key order.
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_quads(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0x44>(x, y),
        _mm512_shuffle_ps::<0xEE>(x, y),
    )
}

/// The 128-bit lanes of two registers summed in neighbouring pairs: `[x0 + x1, x2 + x3,
/// y0 + y1, y2 + y3]` (lanes of four floats).
#[inline]
#[target_feature(enable = "avx512f")]
fn sum_halves(x: __m512, y: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(x, y),
        _mm512_shuffle_f32x4::<0xDD>(x, y),
    )
}

/// The sixteen keys' scores (before scaling) of the tile's `R` rows, key `l`'s in lane `l`:
/// [`key_dots`] of each key, summed across lanes by [`sum_pairs`], [`sum_quads`] and two
/// rounds of [`sum_halves`] (the tree of the module doc), four keys at a time.
///
/// # Safety
/// As [`key_dots`], for each of `keys`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn chunk_scores<const R: usize, const W: usize, T: KvElement>(
    queries: &[*const f32; R],
    keys: &[&[T]; LANES],
    head_dim: usize,
) -> [__m512; R] {
    // Four keys at a time, summed down to one register per row (plain loops: closures would
    // not inherit this function's features, and were not inlined).
    let mut quads = [[_mm512_setzero_ps(); R]; 4];
    for (g, quad) in quads.iter_mut().enumerate() {
        let mut dots = [[_mm512_setzero_ps(); R]; 4];
        for (k, dots) in dots.iter_mut().enumerate() {
            // SAFETY: each key row and query holds `head_dim` values (the caller's contract).
            *dots = unsafe { key_dots::<R, W, T>(queries, keys[4 * g + k].as_ptr(), head_dim) };
        }
        for r in 0..R {
            quad[r] = sum_quads(
                sum_pairs(dots[0][r], dots[1][r]),
                sum_pairs(dots[2][r], dots[3][r]),
            );
        }
    }
    let mut sums = [_mm512_setzero_ps(); R];
    for r in 0..R {
        sums[r] = sum_halves(
            sum_halves(quads[0][r], quads[1][r]),
            sum_halves(quads[2][r], quads[3][r]),
        );
    }
    sums
}

/// Which of keys `j0..j0 + 16` a row masks: its mask entries, and every key at or past `end`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn masked_lanes(mask_row: &[bool], j0: usize, end: usize) -> __mmask16 {
    let in_range: __mmask16 = match end.saturating_sub(j0) {
        0 => return 0xFFFF,
        n if n >= LANES => 0xFFFF,
        n => (1u16 << n) - 1,
    };
    let mut bytes = [1u8; LANES];
    for (b, &m) in bytes.iter_mut().zip(&mask_row[j0..end.min(j0 + LANES)]) {
        *b = u8::from(m);
    }
    // SAFETY: 16 bytes from a local array.
    let loaded = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
    _mm_cmpneq_epi8_mask(loaded, _mm_setzero_si128()) | !in_range
}

/// [`TileSimd::scores_to_probabilities`] in sixteen lanes: a chunk of sixteen keys at a time
/// ([`chunk_scores`]), walked through the block table.
///
/// # Safety
/// `head_dim` must be a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn scores_to_probabilities<const R: usize, T: KvElement>(
    tile: &[Row],
    q: &[f32],
    kv: &HeadKv<'_, T>,
    seen: &KeysSeen<'_>,
    probs: &mut [f32],
) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
    let tile = &tile[..R];
    let start = seen.span.start;
    let chunks = seen.span.len().div_ceil(LANES);
    let stride = chunks * LANES;
    let head_dim = kv.head_dim;
    let queries: [*const f32; R] = std::array::from_fn(|r| q[tile[r].at..][..head_dim].as_ptr());
    let scale16 = _mm512_set1_ps(seen.scale);
    let minus_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut maxes = [minus_inf; R];
    let mut walk = KeyChunks::new(kv, seen.span.clone());
    for c in 0..chunks {
        let keys: [&[T]; LANES] = walk.next(kv);
        // SAFETY: every key row (a missing one is a row of zeros) and query holds `head_dim`
        // values, a multiple of 16 (the caller's contract).
        let sums = unsafe {
            match head_dim / LANES {
                4 => chunk_scores::<R, 4, T>(&queries, &keys, head_dim),
                8 => chunk_scores::<R, 8, T>(&queries, &keys, head_dim),
                _ => chunk_scores::<R, 0, T>(&queries, &keys, head_dim),
            }
        };
        for (r, row) in tile.iter().enumerate() {
            let mask_row = &seen.mask[row.mask_at..row.mask_at + seen.keys];
            let j0 = start + c * LANES;
            let masked = masked_lanes(mask_row, j0, row.visible.end.min(seen.span.end));
            let score = _mm512_mask_mov_ps(_mm512_mul_ps(sums[r], scale16), masked, minus_inf);
            maxes[r] = _mm512_max_ps(maxes[r], score);
            let at = r * stride + c * LANES;
            // SAFETY: 16 values (a slice of that length).
            unsafe { _mm512_storeu_ps(probs[at..][..LANES].as_mut_ptr(), score) };
        }
    }
    // Probabilities and their sums.
    let mut row_maxes = [f32::NEG_INFINITY; TILE_ROWS];
    let mut row_sums = [0f32; TILE_ROWS];
    for r in 0..R {
        let row_probs = &mut probs[r * stride..(r + 1) * stride];
        let max = _mm512_reduce_max_ps(maxes[r]);
        row_maxes[r] = max;
        if max == f32::NEG_INFINITY {
            row_probs.fill(0.0);
            continue;
        }
        let max16 = _mm512_set1_ps(max);
        let mut sums = _mm512_setzero_ps();
        for chunk in row_probs.chunks_exact_mut(LANES) {
            // SAFETY: 16 values (chunks of that length).
            let p = exp16(_mm512_sub_ps(
                unsafe { _mm512_loadu_ps(chunk.as_ptr()) },
                max16,
            ));
            sums = _mm512_add_ps(sums, p);
            // SAFETY: 16 values (a chunk of that length).
            unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), p) };
        }
        row_sums[r] = _mm512_reduce_add_ps(sums);
    }
    (row_maxes, row_sums)
}

/// Keys a pass of [`weighted_sum`] takes before the next pass over the same keys: their
/// values (4 KB in f16 at a head width of 64) stay in L1 for every pass.
const SUB_RUN: usize = 32;

/// Registers of columns [`weighted_sum`] keeps per row between its sub-runs (256 columns).
const WINDOW: usize = 16;

/// [`TileSimd::weighted_sum`]: `W` registers of columns a pass, at most sixteen accumulators
/// in all (eight registers for one or two rows, four for three or four), so that the values
/// and the probability fit beside them in AVX-512's 32. The keys are walked in sub-runs of
/// [`SUB_RUN`] that lie one after another, every pass over one sub-run before the next (each
/// accumulator still takes its keys in key order), the values of the keys
/// [`VALUES_AHEAD`](super::VALUES_AHEAD) on prefetched; a key no row of the tile sees is
/// skipped (adding `0 × v` would change nothing: the values past a sequence's end may be
/// stale, and are never multiplied).
///
/// # Safety
/// As [`TileSimd::weighted_sum`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
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
    let row_probs: [&[f32]; R] = std::array::from_fn(|r| &probs[r * stride..][..span.len()]);
    let width = match R {
        1 | 2 => 8,
        _ => 4,
    };
    let registers = kv.head_dim / LANES;
    for window in (0..registers).step_by(WINDOW) {
        let window_registers = (registers - window).min(WINDOW);
        let mut acc = [[_mm512_setzero_ps(); WINDOW]; R];
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
            let inv16 = _mm512_set1_ps(inv[r]);
            for (w, &a) in acc[r][..window_registers].iter().enumerate() {
                // SAFETY: the row's record is this task's (the caller's contract), and its
                // sixteen columns from `16 (window + w)` lie inside it.
                unsafe {
                    let dest = out.slice(row.dest + (window + w) * LANES, LANES);
                    _mm512_storeu_ps(dest.as_mut_ptr(), _mm512_mul_ps(a, inv16));
                }
            }
        }
    }
}

/// Which of `keys` (at most 32, from the first) some row sees with a probability other than
/// zero, one bit per key: sixteen keys of every row compared at once.
#[inline]
#[target_feature(enable = "avx512f")]
fn live_keys<const R: usize>(row_probs: &[&[f32]; R], keys: Range<usize>) -> u32 {
    let mut live = 0u32;
    let mut i = keys.start;
    while i < keys.end {
        let bit = i - keys.start;
        if keys.end - i >= LANES {
            let mut seen: __mmask16 = 0;
            for p in row_probs {
                // SAFETY: sixteen probabilities (a slice of that length).
                let p = unsafe { _mm512_loadu_ps(p[i..i + LANES].as_ptr()) };
                // Unordered: a NaN counts as seen, as `!=` has it.
                seen |= _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(p, _mm512_setzero_ps());
            }
            live |= u32::from(seen) << bit;
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
/// As [`TileSimd::weighted_sum`]; `column + W <= WINDOW`, `16 (from + W) <= head_dim`, and
/// `values` the start of `keys.len()` rows one after another.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn pass<const R: usize, const W: usize, T: KvElement>(
    acc: &mut [[__m512; WINDOW]; R],
    column: usize,
    from: usize,
    values: *const T,
    row_units: usize,
    row_probs: &[&[f32]; R],
    keys: Range<usize>,
    live: u32,
) -> usize {
    let mut a: [[__m512; W]; R] =
        std::array::from_fn(|r| std::array::from_fn(|w| acc[r][column + w]));
    debug_assert!((1..=32).contains(&keys.len()));
    let all = live == u32::MAX >> (32 - keys.len());
    let probs: [*const f32; R] = std::array::from_fn(|r| row_probs[r][keys.clone()].as_ptr());
    for key in 0..keys.len() {
        if !all && live & (1 << key) == 0 {
            continue;
        }
        // SAFETY: row `key` of the sub-run, its values `16 from..16 (from + W)` (the caller's
        // contract); one probability of each row's `keys`.
        unsafe {
            let row = values.add(key * row_units);
            let v: [__m512; W] = std::array::from_fn(|w| T::load16(row, (from + w) * LANES));
            for r in 0..R {
                let p = _mm512_set1_ps(*probs[r].add(key));
                for w in 0..W {
                    a[r][w] = _mm512_fmadd_ps(p, v[w], a[r][w]);
                }
            }
        }
    }
    for r in 0..R {
        acc[r][column..column + W].copy_from_slice(&a[r]);
    }
    W
}

/// [`crate::attention::x86::exp8`] on sixteen lanes: the same operations in the same order,
/// so the same value for each lane.
#[inline]
#[target_feature(enable = "avx512f,fma")]
fn exp16(x: __m512) -> __m512 {
    let min = _mm512_set1_ps(EXP_MIN);
    let underflow = _mm512_cmp_ps_mask(x, min, _CMP_LT_OQ);
    let x = _mm512_max_ps(x, min);
    let n = _mm512_roundscale_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let e_r = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    )));
    _mm512_maskz_mov_ps(!underflow, _mm512_mul_ps(e_r, two_n))
}
