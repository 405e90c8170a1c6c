//! Q8_0 groups times 16-bit activations ([`ActPasses::Q16`](crate::ActPasses::Q16)): the
//! scalar reference and the AVX2 tile (which the AVX-512 VNNI tier runs too).
//!
//! AVX2 has no unsigned-by-signed byte product that cannot saturate on Q8_0's `w + 128`, so
//! its 8-bit tile multiplies by the sign trick and widens every product: with two activation
//! passes, ten vector instructions per chunk and activation row. Here the stored quants
//! (`w + 128`, at most 255) are zero-extended to 16-bit words once per chunk for every row,
//! and each row multiplies them with `vpmaddwd` by its four activation words broadcast as one
//! 64-bit value: five instructions per chunk and row, and products as precise as the two
//! passes'. VNNI's `vpdpbusd` multiplies bytes at the rate `vpdpwssd` multiplies words, so
//! it gains nothing there and keeps two passes (the models' `auto` choice).
//!
//! `vpmaddwd` on a chunk's zero-extended low half (rows 0-3, four words each) leaves each
//! row's sum in two adjacent 32-bit lanes, and on the high half rows 4-7's; one `vphaddd` of
//! the two per block joins them in the lane order 0, 1, 4, 5, 2, 3, 6, 7, which the tile keeps
//! (the weights' scales are permuted to it once per block and the outputs back once per tile).
//! Integer sums are exact, so the order of lanes changes no bits: every row's float steps are
//! the scalar reference's (`acc + d_w × (d_a × sum)`, one fused multiply-add), and every tier
//! gives the same bits (the property tests compare them).

use half::f16;

use crate::act::Act16Block;
use crate::tier::Tier;

use super::{GROUP, TILE};

/// Bytes of a Q8_0 block column of a group: eight f16 `d`, then eight chunks of 32 quants.
const COLUMN: usize = 272;

/// Eight Q8_0 rows' products with `N` rows of 16-bit activations.
///
/// # Safety
/// The CPU must support the tier the function was chosen for; `w` must be one Q8_0 group
/// holding exactly `a[i].len()` block columns for every `i`.
pub(crate) type Q16TileFn<const N: usize> =
    unsafe fn(&[u8], [&[Act16Block]; N]) -> [[f32; GROUP]; N];

/// The Q8_0 × 16-bit tiles of one tier, for one to [`TILE`] activation rows.
#[derive(Clone, Copy)]
pub(crate) struct Q16Tiles {
    one: Q16TileFn<1>,
    two: Q16TileFn<2>,
    three: Q16TileFn<3>,
    four: Q16TileFn<4>,
}

macro_rules! q16_tiles {
    ($($f:ident)::+) => {
        Q16Tiles {
            one: $($f)::+::<1>,
            two: $($f)::+::<2>,
            three: $($f)::+::<3>,
            four: $($f)::+::<4>,
        }
    };
}

impl Q16Tiles {
    /// The tiles of `tier` (the best at or below it).
    pub(crate) fn new(tier: Tier) -> Self {
        match tier {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512Vnni => q16_tiles!(x86::tile),
            _ => q16_tiles!(scalar_tile),
        }
    }

    /// The most activation rows one call of [`Self::run`] takes.
    pub(crate) fn rows(&self) -> usize {
        TILE
    }

    /// The products of the group `w` with `rows` (one to [`TILE`] activation rows), handed to
    /// `out` as (index in `rows`, eight outputs).
    ///
    /// # Safety
    /// As [`Q16TileFn`] for every row.
    ///
    /// # Panics
    /// If `rows` is empty or longer than [`TILE`].
    #[inline]
    pub(crate) unsafe fn run(
        &self,
        w: &[u8],
        rows: &[&[Act16Block]],
        mut out: impl FnMut(usize, [f32; GROUP]),
    ) {
        // SAFETY: each arm calls the kernel for exactly `rows.len()` rows, under the
        // `Q16TileFn` contract this function's caller vouches for every row.
        unsafe {
            match rows.len() {
                1 => call(self.one, w, rows, &mut out),
                2 => call(self.two, w, rows, &mut out),
                3 => call(self.three, w, rows, &mut out),
                4 => call(self.four, w, rows, &mut out),
                n => panic!("a tile of {n} rows: 1 to {TILE} expected"),
            }
        }
    }
}

/// One call of `f` on `rows` (exactly `N` of them).
///
/// # Safety
/// `f`'s [`Q16TileFn`] contract for every row.
#[inline]
unsafe fn call<const N: usize>(
    f: Q16TileFn<N>,
    w: &[u8],
    rows: &[&[Act16Block]],
    out: &mut impl FnMut(usize, [f32; GROUP]),
) {
    // SAFETY: the caller vouches for `f`'s contract on these rows.
    let y = unsafe { f(w, std::array::from_fn(|i| rows[i])) };
    for (i, y) in y.into_iter().enumerate() {
        out(i, y);
    }
}

/// The scalar reference, row by row.
fn scalar_tile<const N: usize>(w: &[u8], a: [&[Act16Block]; N]) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| scalar(w, a[i]))
}

/// The scalar reference for one activation row: per block column and weight row, the exact
/// integer sum Σ (w + 128) a − 128 Σ a, then `acc + d_w × (d_a × sum)` with one rounding for
/// the multiply-add, as the SIMD tile's FMA rounds.
fn scalar(w: &[u8], a: &[Act16Block]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (b, a) in a.iter().enumerate() {
        let column = &w[b * COLUMN..(b + 1) * COLUMN];
        for (r, y) in out.iter_mut().enumerate() {
            let sum = (0..32).fold(a.q8_0_start, |sum, e| {
                let stored = i32::from(column[16 + 32 * (e / 4) + 4 * r + e % 4]);
                sum + stored * i32::from(a.qs[e])
            });
            let d = f16::from_le_bytes([column[2 * r], column[2 * r + 1]]).to_f32();
            *y = d.mul_add(sum as f32 * a.d, *y);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::offset_of;

    use super::super::x86::{blocks_at, field_lanes, halves, int_field_lanes, prefetch_ahead};
    use super::{Act16Block, COLUMN, GROUP};

    /// Lanes in the order 0, 1, 4, 5, 2, 3, 6, 7 (and back: the order is its own inverse),
    /// by swapping the middle 64-bit quarters.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn swap_middle(v: __m256) -> __m256 {
        _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
    }

    /// Activation words `4j..4j + 4` of `a`, broadcast as one 64-bit value.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn words(a: &Act16Block, j: usize) -> __m256i {
        let q = &a.qs[4 * j..4 * j + 4];
        // SAFETY: `q` is four i16, the eight bytes read; unaligned read.
        _mm256_set1_epi64x(unsafe { q.as_ptr().cast::<i64>().read_unaligned() })
    }

    /// Eight Q8_0 rows × `N` rows of 16-bit activations ([`super::Q16TileFn`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const N: usize>(
        w: &[u8],
        a: [&[Act16Block]; N],
    ) -> [[f32; GROUP]; N] {
        let blocks = a[0].len();
        debug_assert!(a.iter().all(|a| a.len() == blocks));
        // In the lane order of `swap_middle`.
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: column `b < blocks` (`COLUMN` bytes: eight f16 `d`, eight chunks of 32
            // quants) lies in `w` (the `Q16TileFn` contract).
            let p = unsafe { w.as_ptr().add(COLUMN * b) };
            prefetch_ahead(p, COLUMN);
            // SAFETY: `b < blocks`, every row's length.
            let x = unsafe { blocks_at(a, b) };
            // Rows 0-3's sums (two lanes a row), rows 4-7's.
            let mut low = [_mm256_setzero_si256(); N];
            let mut high = [_mm256_setzero_si256(); N];
            for j in 0..8 {
                // SAFETY: `j < 8`: chunk `16 + 32 j ..` (32 bytes, two loads of 16) ends by
                // byte 271 of the column.
                let (w_low, w_high) = unsafe {
                    let c = p.add(16 + 32 * j);
                    (
                        _mm256_cvtepu8_epi16(_mm_loadu_si128(c.cast())),
                        _mm256_cvtepu8_epi16(_mm_loadu_si128(c.add(16).cast())),
                    )
                };
                for i in 0..N {
                    let v = words(x[i], j);
                    low[i] = _mm256_add_epi32(low[i], _mm256_madd_epi16(w_low, v));
                    high[i] = _mm256_add_epi32(high[i], _mm256_madd_epi16(w_high, v));
                }
            }
            // SAFETY: the column's first 16 bytes are the eight f16 `d`.
            let d = swap_middle(unsafe { halves(p) });
            for i in 0..N {
                let start = int_field_lanes::<_, { offset_of!(Act16Block, q8_0_start) }>(x[i]);
                let sum = _mm256_add_epi32(_mm256_hadd_epi32(low[i], high[i]), start);
                let scale = field_lanes::<_, { offset_of!(Act16Block, d) }>(x[i]);
                acc[i] = _mm256_fmadd_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale), acc[i]);
            }
        }
        std::array::from_fn(|i| {
            let mut out = [0f32; GROUP];
            // SAFETY: `out` is eight f32, the unaligned store's width.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), swap_middle(acc[i])) };
            out
        })
    }
}
