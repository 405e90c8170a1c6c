//! The AVX2 halves of the tile kernel: eight keys a register, for head widths that are a
//! multiple of 8 (the AVX-512 halves' algorithm in 256-bit registers; the weighted sum keeps
//! fewer columns in registers, AVX2 having sixteen of them).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{KeysSeen, Row, TILE_ROWS, TileSimd, chunk_keys};
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

    unsafe fn transpose_keys<T: KvElement>(
        kv: &HeadKv<'_, T>,
        span: Range<usize>,
        kt: &mut Vec<f32>,
    ) {
        // SAFETY: the trait's contract: this CPU has AVX2, FMA and F16C, `head_dim` is a
        // multiple of 8.
        unsafe { transpose_keys(kv, span, kt) }
    }

    unsafe fn scores_to_probabilities<const R: usize>(
        tile: &[Row],
        q: &[f32],
        seen: &KeysSeen<'_>,
        probs: &mut [f32],
    ) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
        // SAFETY: the trait's contract: this CPU has AVX2 and FMA.
        unsafe { scores_to_probabilities::<R>(tile, q, seen, probs) }
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

/// `kt[c][d][l] = k[start + 8c + l][d]` over `span`, the last chunk's missing keys 0: eight
/// keys by eight dimensions at a time through [`transpose8`], widened to f32.
///
/// # Safety
/// `head_dim` must be a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_keys<T: KvElement>(kv: &HeadKv<'_, T>, span: Range<usize>, kt: &mut Vec<f32>) {
    let head_dim = kv.head_dim;
    let chunks = span.len().div_ceil(LANES);
    // Every value of the chunks is written below (missing keys as zeros): grown, never
    // cleared.
    if kt.len() < chunks * head_dim * LANES {
        kt.resize(chunks * head_dim * LANES, 0.0);
    }
    // A missing key (past the span's end) reads zeros.
    let zeros = vec![T::ZERO; kv.row_units];
    let mut offsets = kv.offsets(span);
    for chunk in kt[..chunks * head_dim * LANES].chunks_exact_mut(head_dim * LANES) {
        let keys: [&[T]; LANES] = chunk_keys(kv, &mut offsets, &zeros);
        for d0 in (0..head_dim).step_by(LANES) {
            let mut rows = [_mm256_setzero_ps(); LANES];
            for (row, key) in rows.iter_mut().zip(&keys) {
                // SAFETY: `d0 + 8 <= head_dim` (a multiple of 8, the caller's contract), the
                // values of every row in `keys`; this function has F16C.
                *row = unsafe { T::load8(key.as_ptr(), d0) };
            }
            for (dd, column) in transpose8(rows).into_iter().enumerate() {
                let at = (d0 + dd) * LANES;
                // SAFETY: 8 values (a slice of that length).
                unsafe { _mm256_storeu_ps(chunk[at..at + LANES].as_mut_ptr(), column) };
            }
        }
    }
}

/// The transpose of an 8 × 8 block held as eight rows: unpacks and shuffles within 128-bit
/// lanes, then one round of 128-bit lane permutes (24 shuffles for 64 values).
#[inline]
#[target_feature(enable = "avx")]
fn transpose8(r: [__m256; LANES]) -> [__m256; LANES] {
    // t[2p], t[2p + 1]: rows 2p and 2p + 1 interleaved (columns 0, 1 | 4, 5 and 2, 3 | 6, 7).
    let t: [__m256; LANES] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4g + m]: rows 4g..4g + 4 at columns m (low lane) and m + 4 (high lane).
    let u: [__m256; LANES] = std::array::from_fn(|i| {
        let (g, m) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + m / 2], t[4 * g + 2 + m / 2]);
        if m % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    // Column c: rows 0..4 from u[c % 4] and rows 4..8 from u[4 + c % 4], low lanes for c < 4.
    std::array::from_fn(|c| {
        let (a, b) = (u[c % 4], u[4 + c % 4]);
        if c < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        }
    })
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

/// [`TileSimd::scores_to_probabilities`] in eight lanes.
#[target_feature(enable = "avx2,fma")]
fn scores_to_probabilities<const R: usize>(
    tile: &[Row],
    q: &[f32],
    seen: &KeysSeen<'_>,
    probs: &mut [f32],
) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
    let tile = &tile[..R];
    let start = seen.span.start;
    let chunks = seen.span.len().div_ceil(LANES);
    let stride = chunks * LANES;
    let head_dim = seen.head_dim;
    let key_chunk = |c: usize, d: usize| &seen.kt[(c * head_dim + d) * LANES..][..LANES];
    let scale8 = _mm256_set1_ps(seen.scale);
    let minus_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut maxes = [minus_inf; R];
    // Scores, two chunks at a time where there are two (2R independent FMA chains).
    let mut c = 0;
    while c < chunks {
        let pair = if c + 1 < chunks { 2 } else { 1 };
        let mut s = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..head_dim {
            // SAFETY: 8 values each (slices of that length).
            let k0 = unsafe { _mm256_loadu_ps(key_chunk(c, d).as_ptr()) };
            let k1 = if pair == 2 {
                // SAFETY: 8 values (a slice of that length).
                unsafe { _mm256_loadu_ps(key_chunk(c + 1, d).as_ptr()) }
            } else {
                _mm256_setzero_ps()
            };
            for r in 0..R {
                let qd = _mm256_set1_ps(q[tile[r].at + d]);
                s[r][0] = _mm256_fmadd_ps(qd, k0, s[r][0]);
                s[r][1] = _mm256_fmadd_ps(qd, k1, s[r][1]);
            }
        }
        for r in 0..R {
            let row = &tile[r];
            let mask_row = &seen.mask[row.mask_at..row.mask_at + seen.keys];
            for (h, &sum) in s[r].iter().enumerate().take(pair) {
                let j0 = start + (c + h) * LANES;
                let masked = masked_lanes(mask_row, j0, row.visible.end.min(seen.span.end));
                let score = _mm256_blendv_ps(_mm256_mul_ps(sum, scale8), minus_inf, masked);
                maxes[r] = _mm256_max_ps(maxes[r], score);
                let at = r * stride + (c + h) * LANES;
                // SAFETY: 8 values (a slice of that length).
                unsafe { _mm256_storeu_ps(probs[at..][..LANES].as_mut_ptr(), score) };
            }
        }
        c += pair;
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

/// [`TileSimd::weighted_sum`]: `W` registers of columns a pass over the keys, at most eight
/// accumulators in all (eight registers for one row, four for two, two for three or four),
/// so that the values and the probability fit beside them in AVX2's sixteen.
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
    let widest = match R {
        1 => 8,
        2 => 4,
        _ => 2,
    };
    let mut column = 0;
    while column < kv.head_dim {
        let registers = ((kv.head_dim - column) / LANES).min(widest);
        // SAFETY: `columns` needs this function's contract, and gets the same tile; each
        // call covers `W` registers of columns that the row still has.
        unsafe {
            column += match registers {
                8.. => columns::<R, 8, T>(tile, kv, span.clone(), column, probs, inv, out),
                4..=7 => columns::<R, 4, T>(tile, kv, span.clone(), column, probs, inv, out),
                2 | 3 => columns::<R, 2, T>(tile, kv, span.clone(), column, probs, inv, out),
                _ => columns::<R, 1, T>(tile, kv, span.clone(), column, probs, inv, out),
            }
        };
    }
}

/// [`weighted_sum`] for `W` registers of columns from `column`; returns how many columns.
///
/// # Safety
/// As [`TileSimd::weighted_sum`], and `column + 8 W <= head_dim`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns<const R: usize, const W: usize, T: KvElement>(
    tile: &[Row],
    kv: &HeadKv<'_, T>,
    span: Range<usize>,
    column: usize,
    probs: &[f32],
    inv: &[f32; TILE_ROWS],
    out: &SharedOut<f32>,
) -> usize {
    let stride = span.len().div_ceil(LANES) * LANES;
    let mut acc = [[_mm256_setzero_ps(); W]; R];
    for (i, at) in kv.offsets(span).enumerate() {
        // A key no row of the tile sees adds nothing (and its values may be stale).
        if (0..R).all(|r| probs[r * stride + i] == 0.0) {
            continue;
        }
        let row = kv.value(at);
        let mut values = [_mm256_setzero_ps(); W];
        for (w, x) in values.iter_mut().enumerate() {
            // SAFETY: `column + 8 (w + 1) <= head_dim`, the row's values; this function has
            // F16C.
            *x = unsafe { T::load8(row.as_ptr(), column + w * LANES) };
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let p = _mm256_set1_ps(probs[r * stride + i]);
            for (a, &x) in acc.iter_mut().zip(&values) {
                *a = _mm256_fmadd_ps(p, x, *a);
            }
        }
    }
    for (r, row) in tile[..R].iter().enumerate() {
        let inv8 = _mm256_set1_ps(inv[r]);
        for (w, &a) in acc[r].iter().enumerate() {
            // SAFETY: the row's record is this task's (the caller's contract), and its eight
            // columns from `column + 8 w` lie inside it (`column + 8 W <= head_dim`).
            unsafe {
                let dest = out.slice(row.dest + column + w * LANES, LANES);
                _mm256_storeu_ps(dest.as_mut_ptr(), _mm256_mul_ps(a, inv8));
            }
        }
    }
    W * LANES
}
