//! Products with 16-bit float weights (GGUF's F16 and BF16) kept as the file stores them:
//! `[n, k]` rows (`[d_out, d_in]`) of little-endian 16-bit values, half the bytes of the f32
//! matrix they would widen to. Every weight is widened to f32 as it is read (exactly: both
//! types are subsets of f32) and multiplied with f32 activations, summed in f32: the exact
//! path's arithmetic, with no quantization of the activations.
//!
//! - Few activation rows (decoding, [`DOT_MAX_ROWS`] at most): each thread streams its share
//!   of the output rows, the last of them taken from the other threads' backs
//!   ([`ThreadPool::run_split`]), and takes dot products of four weight rows at a time with
//!   one or two activation rows (four or eight independent sums in eight lanes each), so the
//!   weights stream from memory once per call; the SIMD tiers differ from the scalar
//!   reference's in-order sums by rounding.
//! - More rows (a prefill): [`crate::gemm`]'s register-blocked walk, its panels widened from
//!   the 16-bit rows as they are packed, so that every tier gives the bits of the f32
//!   product [`crate::gemm::gemm_in_out`] computes on the widened matrix.

use crate::SharedOut;
use crate::gemm::{PANEL, gemm_packed_with};
use crate::ggml::GgmlType;
use crate::pool::ThreadPool;
use crate::tier::Tier;

/// Activation rows up to which the products take dot products (one stream over the
/// weights); above it the packed walk of [`crate::gemm`], as for f32 weights.
pub const DOT_MAX_ROWS: usize = 16;

/// Weight rows that share a pass over the activation rows in the dot products.
const ROW_STEP: usize = 4;

/// Steps of [`ROW_STEP`] rows a thread claims at a time in the dot products: 64 KB of a
/// 2,048-wide F16 matrix.
const SPLIT_STEPS: usize = 4;

/// Whether `ty` is a 16-bit float type these products take.
pub fn is_float16(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F16 | GgmlType::Bf16)
}

/// Which 16-bit float a matrix holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Half {
    F16,
    Bf16,
}

impl Half {
    fn of(ty: GgmlType) -> Self {
        match ty {
            GgmlType::F16 => Self::F16,
            GgmlType::Bf16 => Self::Bf16,
            other => unreachable!("{} is not a 16-bit float type", other.name()),
        }
    }

    /// The value of the 16-bit word `bits`.
    #[inline(always)]
    fn widen(self, bits: u16) -> f32 {
        match self {
            Self::F16 => half::f16::from_bits(bits).to_f32(),
            Self::Bf16 => f32::from_bits(u32::from(bits) << 16),
        }
    }
}

/// The 16-bit word at value `i` of `row` (little-endian bytes).
#[inline(always)]
fn word(row: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([row[2 * i], row[2 * i + 1]])
}

/// `out = x · wᵀ` for the `[n, k]` 16-bit rows `w` of type `ty`, on `tier` and `pool`:
/// [`crate::QuantMatrix::matmul_with`] for F16 and BF16 matrices, which checks the shapes
/// and the tier.
///
/// # Shapes
/// - `w`: `n × k` words, `x`: `[m, k]` → `out`: `[m, n]`
///
/// # Panics
/// If `ty` is not F16 or BF16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_with(
    ty: GgmlType,
    w: &[u8],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
) {
    let half = Half::of(ty);
    debug_assert!(w.len() == 2 * k * n && x.len() == m * k && out.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if m > DOT_MAX_ROWS {
        gemm_packed_with(k, n, x, m, out, tier, pool, &|cols, packed| {
            pack_rows(half, w, k, cols, packed, tier)
        });
        return;
    }
    let row_bytes = 2 * k;
    let out = SharedOut::new(out);
    // Each thread streams its share of the rows, the last steps taken from the other's back
    // ([`ThreadPool::run_split`]).
    pool.run_split(n.div_ceil(ROW_STEP), SPLIT_STEPS, &|claim| {
        for r0 in claim.map(|step| step * ROW_STEP) {
            let count = (n - r0).min(ROW_STEP);
            // The slots past the last row repeat it; their sums are not written.
            let ws: [&[u8]; ROW_STEP] = std::array::from_fn(|i| {
                let r = r0 + i.min(count - 1);
                &w[r * row_bytes..(r + 1) * row_bytes]
            });
            let mut t = 0;
            while t < m {
                let pair = m - t >= 2;
                let xs: [&[f32]; 2] =
                    std::array::from_fn(|j| &x[(t + j.min(usize::from(pair))) * k..][..k]);
                let sums = match tier {
                    Tier::Scalar => dots_scalar(half, ws, xs),
                    // SAFETY: the caller checked the tier (both include AVX2, FMA and F16C);
                    // every weight row is `k` words and every activation row `k` values.
                    #[cfg(target_arch = "x86_64")]
                    Tier::Avx2 | Tier::Avx512Vnni => unsafe {
                        if pair {
                            dots_avx2::<2>(half, ws, xs)
                        } else {
                            let [one] = dots_avx2::<1>(half, ws, [xs[0]]);
                            [one, [0.0; ROW_STEP]]
                        }
                    },
                    #[allow(unreachable_patterns)]
                    _ => unreachable!("no such tier on this architecture"),
                };
                for (j, row_sums) in sums.iter().enumerate().take(1 + usize::from(pair)) {
                    // SAFETY: each (row, column) belongs to exactly one task.
                    let dst = unsafe { out.slice((t + j) * n + r0, count) };
                    dst.copy_from_slice(&row_sums[..count]);
                }
                t += 1 + usize::from(pair);
            }
        }
    });
}

/// `ws[r] · xs[j]` for four weight rows and two activation rows, each summed in order: the
/// reference.
fn dots_scalar(half: Half, ws: [&[u8]; ROW_STEP], xs: [&[f32]; 2]) -> [[f32; ROW_STEP]; 2] {
    xs.map(|x| {
        ws.map(|w| {
            x.iter()
                .enumerate()
                .map(|(i, &a)| a * half.widen(word(w, i)))
                .sum()
        })
    })
}

/// `ws[r] · xs[j]` for four weight rows and `T` activation rows, each in eight FMA lanes.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every `ws[r]` must hold `2 k` bytes and every
/// `xs[j]` `k` values, for one `k`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots_avx2<const T: usize>(
    half: Half,
    ws: [&[u8]; ROW_STEP],
    xs: [&[f32]; T],
) -> [[f32; ROW_STEP]; T] {
    use std::arch::x86_64::*;
    let k = xs[0].len();
    debug_assert!(ws.iter().all(|w| w.len() == 2 * k) && xs.iter().all(|x| x.len() == k));
    let whole = k - k % 8;
    let mut acc = [[_mm256_setzero_ps(); ROW_STEP]; T];
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= k: eight values of every activation row, eight words (16 bytes)
        // of every weight row.
        unsafe {
            let xv: [__m256; T] = std::array::from_fn(|j| _mm256_loadu_ps(xs[j].as_ptr().add(i)));
            for (r, w) in ws.iter().enumerate() {
                let wv = widen8(half, w.as_ptr().add(2 * i));
                for j in 0..T {
                    acc[j][r] = _mm256_fmadd_ps(wv, xv[j], acc[j][r]);
                }
            }
        }
    }
    std::array::from_fn(|j| {
        std::array::from_fn(|r| {
            let tail: f32 = (whole..k)
                .map(|i| xs[j][i] * half.widen(word(ws[r], i)))
                .sum();
            crate::lanes::hsum(acc[j][r]) + tail
        })
    })
}

/// Eight 16-bit values at `p` widened to f32 lanes.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `p` must point at 16 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn widen8(half: Half, p: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: 16 readable bytes at `p` (the contract); unaligned loads.
    let words = unsafe { _mm_loadu_si128(p.cast()) };
    match half {
        Half::F16 => _mm256_cvtph_ps(words),
        // A bfloat16 is the high half of the f32 with the same value.
        Half::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16)),
    }
}

/// Packs the weight rows `cols` (the product's output columns) into `packed`'s `[panel][k]
/// [PANEL]` panels for [`crate::gemm`]'s walk, widened to f32, zero past the last row.
fn pack_rows(
    half: Half,
    w: &[u8],
    k: usize,
    cols: std::ops::Range<usize>,
    packed: &mut [f32],
    tier: Tier,
) {
    #[cfg(target_arch = "x86_64")]
    if tier != Tier::Scalar {
        // SAFETY: the tier includes AVX2 and F16C (checked by the caller); `w` holds the
        // rows `cols` of `k` words and `packed` their panels.
        unsafe { pack_rows_avx2(half, w, k, cols, packed) };
        return;
    }
    let _ = tier;
    let row_bytes = 2 * k;
    for (p, panel) in packed.chunks_exact_mut(k * PANEL).enumerate() {
        let start = cols.start + p * PANEL;
        let width = (cols.end - start).min(PANEL);
        for (i, dst) in panel.chunks_exact_mut(PANEL).enumerate() {
            for (c, d) in dst.iter_mut().enumerate() {
                *d = if c < width {
                    half.widen(word(&w[(start + c) * row_bytes..], i))
                } else {
                    0.0
                };
            }
        }
    }
}

/// [`pack_rows`] in eight-by-eight blocks: eight rows' next eight values widened, transposed
/// in registers and stored as eight steps of eight adjacent columns.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `w` must hold rows `cols` of `k` words and `packed`
/// be `cols.len().div_ceil(PANEL) × k × PANEL` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn pack_rows_avx2(
    half: Half,
    w: &[u8],
    k: usize,
    cols: std::ops::Range<usize>,
    packed: &mut [f32],
) {
    use std::arch::x86_64::*;
    let row_bytes = 2 * k;
    let whole = k - k % 8;
    for (p, panel) in packed.chunks_exact_mut(k * PANEL).enumerate() {
        let start = cols.start + p * PANEL;
        let width = (cols.end - start).min(PANEL);
        for c0 in (0..PANEL).step_by(8) {
            let present = width.saturating_sub(c0).min(8);
            let rows: [&[u8]; 8] = std::array::from_fn(|j| {
                let r = start + c0 + j.min(present.max(1) - 1);
                if present == 0 {
                    &[][..]
                } else {
                    &w[r * row_bytes..(r + 1) * row_bytes]
                }
            });
            for i0 in (0..whole).step_by(8) {
                let values: [__m256; 8] = std::array::from_fn(|j| {
                    if j < present {
                        // SAFETY: i0 + 8 <= k: 16 bytes of row j.
                        unsafe { widen8(half, rows[j].as_ptr().add(2 * i0)) }
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                for (u, steps) in transpose8(values).into_iter().enumerate() {
                    let at = (i0 + u) * PANEL + c0;
                    // SAFETY: at + 8 <= k × PANEL, the panel's length (c0 + 8 <= PANEL).
                    unsafe { _mm256_storeu_ps(panel.as_mut_ptr().add(at), steps) };
                }
            }
            for i in whole..k {
                for j in 0..8 {
                    panel[i * PANEL + c0 + j] = if j < present {
                        half.widen(word(rows[j], i))
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// The 8 × 8 transpose of `rows`: lane `j` of the result's vector `i` is lane `i` of
/// `rows[j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
fn transpose8(rows: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(rows[0], rows[1]);
    let t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
    let t2 = _mm256_unpacklo_ps(rows[2], rows[3]);
    let t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
    let t4 = _mm256_unpacklo_ps(rows[4], rows[5]);
    let t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
    let t6 = _mm256_unpacklo_ps(rows[6], rows[7]);
    let t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}
