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

    unsafe fn transpose_keys<T: KvElement>(
        kv: &HeadKv<'_, T>,
        span: Range<usize>,
        kt: &mut Vec<f32>,
    ) {
        // SAFETY: the trait's contract: this CPU has AVX-512 F.
        unsafe { transpose_keys(kv, span, kt) }
    }

    unsafe fn scores_to_probabilities<const R: usize>(
        tile: &[Row],
        q: &[f32],
        seen: &KeysSeen<'_>,
        probs: &mut [f32],
    ) -> ([f32; TILE_ROWS], [f32; TILE_ROWS]) {
        // SAFETY: the trait's contract: this CPU has AVX-512 F, BW and VL and FMA.
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
        // SAFETY: the trait's contract: AVX-512 and FMA, `head_dim` a multiple of 16, the
        // tile's records this task's alone.
        unsafe { weighted_sum::<R, T>(tile, kv, span, probs, inv, out) }
    }
}

/// `kt[c][d][l] = k[start + 16c + l][d]` over `span`, the last chunk's missing keys 0:
/// sixteen keys by sixteen dimensions at a time through [`transpose16`], widened to f32.
#[target_feature(enable = "avx512f")]
fn transpose_keys<T: KvElement>(kv: &HeadKv<'_, T>, span: Range<usize>, kt: &mut Vec<f32>) {
    let head_dim = kv.head_dim;
    let chunks = span.len().div_ceil(LANES);
    // Every value of the chunks is written below (missing keys as zeros): grown, never
    // cleared.
    if kt.len() < chunks * head_dim * LANES {
        kt.resize(chunks * head_dim * LANES, 0.0);
    }
    let mut walk = KeyChunks::new(kv, span);
    for chunk in kt[..chunks * head_dim * LANES].chunks_exact_mut(head_dim * LANES) {
        let keys: [&[T]; LANES] = walk.next(kv);
        for d0 in (0..head_dim).step_by(LANES) {
            let mut rows = [_mm512_setzero_ps(); LANES];
            for (row, key) in rows.iter_mut().zip(&keys) {
                // SAFETY: `d0 + 16 <= head_dim`, the values of every row in `keys`.
                *row = unsafe { T::load16(key.as_ptr(), d0) };
            }
            for (dd, column) in transpose16(rows).into_iter().enumerate() {
                let at = (d0 + dd) * LANES;
                // SAFETY: 16 values (a slice of that length).
                unsafe { _mm512_storeu_ps(chunk[at..at + LANES].as_mut_ptr(), column) };
            }
        }
    }
}

/// The transpose of a 16 × 16 block held as sixteen rows: unpacks within 128-bit lanes, then
/// two rounds of 128-bit lane shuffles (64 shuffles for 256 values).
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; LANES]) -> [__m512; LANES] {
    // t: pairs of rows interleaved within each 128-bit lane.
    let t: [__m512; LANES] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4g + m]: rows 4g..4g+4 at columns 4k + m (lane k).
    let u: [__m512; LANES] = std::array::from_fn(|i| {
        let (g, m) = (i / 4, i % 4);
        let (a, b) = (t[4 * g + m / 2], t[4 * g + 2 + m / 2]);
        if m % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(a, b)
        } else {
            _mm512_shuffle_ps::<0xEE>(a, b)
        }
    });
    // v[8h + m] (m < 4): rows 8h..8h+8 at columns m and m + 8; v[8h + 4 + m]: m + 4, m + 12.
    let v: [__m512; LANES] = std::array::from_fn(|i| {
        let (h, high, m) = (i / 8, (i / 4) % 2, i % 4);
        let (a, b) = (u[8 * h + m], u[8 * h + 4 + m]);
        if high == 0 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    });
    // Column c: from v[c % 8] (rows 0..8) and v[8 + c % 8] (rows 8..16).
    std::array::from_fn(|c| {
        let m = c % 8;
        let (a, b) = (v[m], v[8 + m]);
        if c < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xDD>(a, b)
        }
    })
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

/// The scores of the tile's `R` rows over `seen.span` (`probs[r][c * 16 + l]`, then their
/// probabilities in place), and each row's largest score and `Σ p` (-inf and 0 for a row
/// that sees no key).
///
/// # Shapes
/// - `seen.kt`: `[chunks ≥ span / 16, head_dim, 16]` from [`transpose_keys`]
/// - `probs`: `[TILE_ROWS, chunks * 16]`
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
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
    let scale16 = _mm512_set1_ps(seen.scale);
    let minus_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut maxes = [minus_inf; R];
    // Scores, two chunks at a time where there are two (2R independent FMA chains).
    let mut c = 0;
    while c < chunks {
        let pair = if c + 1 < chunks { 2 } else { 1 };
        let mut s = [[_mm512_setzero_ps(); 2]; R];
        for d in 0..head_dim {
            // SAFETY: 16 values each (slices of that length).
            let k0 = unsafe { _mm512_loadu_ps(key_chunk(c, d).as_ptr()) };
            let k1 = if pair == 2 {
                // SAFETY: 16 values (a slice of that length).
                unsafe { _mm512_loadu_ps(key_chunk(c + 1, d).as_ptr()) }
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                let qd = _mm512_set1_ps(q[tile[r].at + d]);
                s[r][0] = _mm512_fmadd_ps(qd, k0, s[r][0]);
                s[r][1] = _mm512_fmadd_ps(qd, k1, s[r][1]);
            }
        }
        for r in 0..R {
            let row = &tile[r];
            let mask_row = &seen.mask[row.mask_at..row.mask_at + seen.keys];
            for (h, &sum) in s[r].iter().enumerate().take(pair) {
                let j0 = start + (c + h) * LANES;
                let masked = masked_lanes(mask_row, j0, row.visible.end.min(seen.span.end));
                let score = _mm512_mask_mov_ps(_mm512_mul_ps(sum, scale16), masked, minus_inf);
                maxes[r] = _mm512_max_ps(maxes[r], score);
                let at = r * stride + (c + h) * LANES;
                // SAFETY: 16 values (a slice of that length).
                unsafe { _mm512_storeu_ps(probs[at..][..LANES].as_mut_ptr(), score) };
            }
        }
        c += pair;
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

/// `out[row.dest..] = inv[row] × Σ_j p_j v_j` over keys `span`, 64 columns at a time (four
/// registers per row: sixteen accumulators for a full tile), fewer for the last columns.
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
    let mut column = 0;
    while column < kv.head_dim {
        // SAFETY: `columns` needs this function's contract (`TileSimd::weighted_sum`'s:
        // AVX-512, the tile's records this task's alone), and gets the same tile.
        unsafe {
            column += match (kv.head_dim - column) / LANES {
                1 => columns::<R, 1, T>(tile, kv, span.clone(), column, probs, inv, out),
                2 => columns::<R, 2, T>(tile, kv, span.clone(), column, probs, inv, out),
                3 => columns::<R, 3, T>(tile, kv, span.clone(), column, probs, inv, out),
                _ => columns::<R, 4, T>(tile, kv, span.clone(), column, probs, inv, out),
            }
        };
    }
}

/// [`weighted_sum`] for `W` registers of columns from `column`; returns how many columns.
///
/// # Safety
/// As [`TileSimd::weighted_sum`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
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
    let mut acc = [[_mm512_setzero_ps(); W]; R];
    for (i, at) in kv.offsets(span).enumerate() {
        // A key no row of the tile sees adds nothing (and its values may be stale).
        if (0..R).all(|r| probs[r * stride + i] == 0.0) {
            continue;
        }
        let row = kv.value(at);
        let mut values = [_mm512_setzero_ps(); W];
        for (w, x) in values.iter_mut().enumerate() {
            // SAFETY: `column + (w + 1) 16 <= head_dim`, the row's values.
            *x = unsafe { T::load16(row.as_ptr(), column + w * LANES) };
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let p = _mm512_set1_ps(probs[r * stride + i]);
            for (a, &x) in acc.iter_mut().zip(&values) {
                *a = _mm512_fmadd_ps(p, x, *a);
            }
        }
    }
    for (r, row) in tile[..R].iter().enumerate() {
        let inv16 = _mm512_set1_ps(inv[r]);
        for (w, &a) in acc[r].iter().enumerate() {
            let mut lanes = [0f32; LANES];
            // SAFETY: 16 values into a local array.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_mul_ps(a, inv16)) };
            for (l, &x) in lanes.iter().enumerate() {
                // SAFETY: the row is this task's (the caller's contract).
                unsafe { out.write(row.dest + column + w * LANES + l, x) };
            }
        }
    }
    W * LANES
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
