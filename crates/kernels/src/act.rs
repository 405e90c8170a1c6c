//! Activations quantized to 8 bits per block of 32, the form the quantized dot products read
//! (llama.cpp's `block_q8_0` / `block_q8_1`, with an f32 scale instead of an f16 one).
//!
//! Every weight type shares this one activation format: blocks of 32 are the sub-block size
//! of Q4_0/Q4_1/Q8_0 and of Q4_K, and Q6_K's 16-value groups are halves of one.

use crate::ggml::GgmlType;
use crate::tier::Tier;

/// 32 activations as `d × q`, with `q` in `[-127, 127]`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(8))]
pub struct ActBlock {
    /// The quantized values.
    pub qs: [i8; 32],
    /// The scale: the block's largest magnitude / 127 (0 for an all-zero block).
    pub d: f32,
    /// `d × Σ qs`, for the weight types with an offset (Q4_0's 8, Q4_1's and Q4_K's minimum).
    pub d_sum: f32,
    /// `Σ qs`, for integer sums taken against offset weights (Q8_0 stored as `w + 128`).
    pub sum: i32,
    /// `Σ qs` over the first 16 values, for Q6_K's offset, whose scales cover 16 values.
    pub sum_first_half: i32,
    /// `−32 × Σ qs` over each half: where the wide Q6_K tile's integer sums start (its values
    /// are stored as `q + 32`), each read by one broadcast from memory (docs/kernels.md,
    /// item 6).
    pub q6_k_starts: [i32; 2],
    /// `Σ qs` over each half as 16-bit integers side by side (each within ±2,032): the Q2_K
    /// tiles multiply a lane's two minimums by both in one `vpmaddwd`.
    pub half_sums: [i16; 2],
}

/// Values per activation block.
pub const ACT_BLOCK: usize = 32;

/// What the interleaved Q6_K layout adds to each value (stored as `q + 32`, unsigned), and so
/// what [`ActBlock::q6_k_starts`] takes off: one constant for both.
pub(crate) const Q6_K_OFFSET: i32 = 32;

/// How a quantized product quantizes its activations: in one or two 8-bit passes, or (for
/// Q8_0 weights) in one 16-bit pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ActPasses {
    /// One ([`ActBlock::quantize`]), as llama.cpp multiplies every type (`Q8_0`, `Q8_1` and
    /// `Q8_K` activations): half the integer work of [`Two`](Self::Two), within `amax / 254`
    /// of the activations (docs/kernels.md states its accuracy).
    One,
    /// Two ([`quantize_split`]): within `amax / 64516` of the activations, the precision of
    /// 16-bit activations; the products track the exact path to ~1e-7 in KL.
    #[default]
    Two,
    /// One pass of 16-bit values ([`Act16Block`]): within `amax / 65534` of the activations,
    /// [`Two`](Self::Two)'s precision in one integer product. Only interleaved Q8_0 matrices
    /// have its kernels (`vpmaddwd` on sign-free widened weights, where AVX2 multiplies bytes
    /// only through the sign trick); any other matrix given it takes [`Two`](Self::Two).
    Q16,
}

impl ActPasses {
    /// `q8` (one pass), `q8x2` (two) or `q16`.
    pub fn name(self) -> &'static str {
        match self {
            ActPasses::One => "q8",
            ActPasses::Two => "q8x2",
            ActPasses::Q16 => "q16",
        }
    }

    /// [`Two`](Self::Two)'s precision in the fastest form the active tier has for `ty`
    /// ([`Self::precise_at`]).
    pub fn precise_for(ty: GgmlType) -> ActPasses {
        Self::precise_at(ty, Tier::active())
    }

    /// [`Two`](Self::Two)'s precision in the fastest form `tier` has for `ty`: [`Q16`](Self::Q16)
    /// for Q8_0 below AVX-512 VNNI (whose `vpdpbusd` multiplies bytes at the rate `vpdpwssd`
    /// multiplies words, so the two 8-bit passes cost it no more), else two passes.
    pub fn precise_at(ty: GgmlType, tier: Tier) -> ActPasses {
        match ty {
            GgmlType::Q8_0 if tier != Tier::Avx512Vnni => ActPasses::Q16,
            _ => ActPasses::Two,
        }
    }
}

/// 32 activations as `d × q` with `q` in `[-32767, 32767]`: [`ActPasses::Q16`]'s form, for
/// Q8_0 weights.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(8))]
pub struct Act16Block {
    /// The quantized values.
    pub qs: [i16; ACT_BLOCK],
    /// The scale: the block's largest magnitude / 32767 (0 for an all-zero block).
    pub d: f32,
    /// `−128 × Σ qs`: where a Q8_0 tile's integer sums start, its quants being stored as
    /// `w + 128` (unsigned, what the tiles widen without a sign).
    pub q8_0_start: i32,
}

/// What the interleaved Q8_0 layout adds to each quant, and so what [`Act16Block::q8_0_start`]
/// takes off per unit of `Σ qs`.
const Q8_0_OFFSET: i32 = 128;

impl Act16Block {
    /// The all-zero block.
    pub const ZERO: Self = Self::new([0; ACT_BLOCK], 0.0, 0);

    /// The block of the values `qs` at scale `d`, whose sum is `sum`: the one place the derived
    /// field is formed, for every tier's quantizer.
    #[inline]
    pub const fn new(qs: [i16; ACT_BLOCK], d: f32, sum: i32) -> Self {
        Self {
            qs,
            d,
            q8_0_start: -Q8_0_OFFSET * sum,
        }
    }

    /// Quantizes 32 values (round to nearest, ties to even), as [`ActBlock::quantize`] does to
    /// 8 bits.
    pub fn quantize(x: &[f32; ACT_BLOCK]) -> Self {
        let (d, inv) = scale_for(x.iter().fold(0f32, |m, v| m.max(v.abs())), 32767.0);
        let mut qs = [0i16; ACT_BLOCK];
        for (q, v) in qs.iter_mut().zip(x) {
            *q = round(v * inv) as i16;
        }
        let sum = qs.iter().map(|&q| i32::from(q)).sum();
        Self::new(qs, d, sum)
    }
}

impl ActBlock {
    /// The all-zero block (`d` 0): what a product multiplies where it has no activations.
    pub const ZERO: Self = Self::new([0; ACT_BLOCK], 0.0, 0, 0);

    /// The block of the values `qs` at scale `d`, whose sum is `sum` (`sum_first_half` over
    /// the first 16): the one place the derived fields are formed, for every tier's quantizer.
    #[inline]
    pub const fn new(qs: [i8; ACT_BLOCK], d: f32, sum: i32, sum_first_half: i32) -> Self {
        Self {
            qs,
            d,
            d_sum: d * sum as f32,
            sum,
            sum_first_half,
            q6_k_starts: [
                -Q6_K_OFFSET * sum_first_half,
                -Q6_K_OFFSET * (sum - sum_first_half),
            ],
            half_sums: [sum_first_half as i16, (sum - sum_first_half) as i16],
        }
    }

    /// `Σ qs` over half `half` (0: values 0-15, 1: values 16-31), for the weight types whose
    /// scales or minimums cover 16 values (Q6_K, Q3_K, Q2_K).
    #[inline]
    pub fn half_sum(&self, half: usize) -> i32 {
        if half == 0 {
            self.sum_first_half
        } else {
            self.sum - self.sum_first_half
        }
    }

    /// Quantizes 32 values (round to nearest, as llama.cpp's `quantize_row_q8_1`, with ties to
    /// even).
    pub fn quantize(x: &[f32; ACT_BLOCK]) -> Self {
        let (d, inv) = scale_for(x.iter().fold(0f32, |m, v| m.max(v.abs())), 127.0);
        let mut qs = [0i8; ACT_BLOCK];
        for (q, v) in qs.iter_mut().zip(x) {
            *q = round(v * inv) as i8;
        }
        let sum_first_half = qs[..16].iter().map(|&q| i32::from(q)).sum();
        let sum = sum_first_half + qs[16..].iter().map(|&q| i32::from(q)).sum::<i32>();
        Self::new(qs, d, sum, sum_first_half)
    }
}

/// The scale of a block whose largest magnitude is `amax`, quantized to `±q_max`, and its
/// inverse (both 0 for an all-zero block): every tier's quantizers form them this way.
#[inline(always)]
fn scale_for(amax: f32, q_max: f32) -> (f32, f32) {
    let d = amax / q_max;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// `x` rounded to the nearest integer, ties to even, for `|x| ≤ 2²²`: adding and taking away
/// 1.5 × 2²³ leaves no fraction bits. A plain add compiles to vector code, where `f32::round`
/// is a call to libm's `roundf` per value (a tenth of a decode step's time on one thread).
#[inline(always)]
fn round(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Quantizes `x` (`rows × k` values, row-major, `k` a multiple of 32) into `out`, which is
/// resized to `rows × k / 32` blocks.
///
/// # Panics
/// If `k` is not a multiple of 32 or `x.len() != rows × k`.
pub fn quantize_rows(x: &[f32], k: usize, out: &mut Vec<ActBlock>) {
    assert!(
        k.is_multiple_of(ACT_BLOCK),
        "row length {k} is not a multiple of 32"
    );
    out.clear();
    out.extend(x.chunks_exact(ACT_BLOCK).map(|chunk| {
        let block: &[f32; ACT_BLOCK] = chunk.try_into().expect("chunks of 32");
        ActBlock::quantize(block)
    }));
}

/// The two-pass form of 32 activations: `hi` quantizes them, `lo` quantizes what `hi` left
/// over (`x - d_hi q_hi`, at most `d_hi / 2` per value), so `hi + lo` is within
/// `amax / (2 × 127 × 254)` of `x`: the precision of 16-bit activations from two 8-bit
/// products. Dot products are linear in the activations, so a product with `hi` plus one with
/// `lo` is the product with their sum.
pub fn quantize_split(x: &[f32; ACT_BLOCK]) -> (ActBlock, ActBlock) {
    let hi = ActBlock::quantize(x);
    let mut rest = [0f32; ACT_BLOCK];
    for ((r, v), q) in rest.iter_mut().zip(x).zip(&hi.qs) {
        *r = v - hi.d * f32::from(*q);
    }
    (hi, ActBlock::quantize(&rest))
}

/// [`quantize_split`] over a row: `x` (`32 × hi.len()` values) into `hi` and `lo`, block by
/// block, on `tier`.
///
/// The AVX-512 and AVX2 tiers do in registers (two 16-lane or four 8-lane ones a block) what
/// the scalar code does value by value, with the same IEEE operations in the same order (a
/// maximum does not depend on the order, the rounding of `cvtps2dq` is the scalar's
/// ties-to-even, the sums are integers), so they give the scalar bits for finite input; a test
/// asserts it. (Before AVX2 had its own, it ran the scalar code: the same source compiled for
/// AVX2 or AVX-512 was slower than the plain build, the compiler's vectorization of the byte
/// conversions being poor; docs/benchmarks.md, "Figures that were in code comments".)
///
/// # Panics
/// If `x.len() != 32 × hi.len()`, `lo.len() != hi.len()`, or this CPU cannot run `tier`.
pub fn quantize_split_row(x: &[f32], hi: &mut [ActBlock], lo: &mut [ActBlock], tier: Tier) {
    assert!(
        x.len() == hi.len() * ACT_BLOCK && lo.len() == hi.len(),
        "{} activations for {} and {} blocks",
        x.len(),
        hi.len(),
        lo.len()
    );
    assert!(
        tier.is_supported(),
        "kernel tier {tier} is not supported on this CPU"
    );
    match tier {
        // SAFETY: the tier's features were checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni => unsafe { x86::split_row(x, hi, lo) },
        // SAFETY: the tier's features were checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { x86::avx2::split_row(x, hi, lo) },
        _ => {
            for ((chunk, h), l) in x.chunks_exact(ACT_BLOCK).zip(hi).zip(lo) {
                (*h, *l) = quantize_split(chunk.try_into().expect("chunks of 32"));
            }
        }
    }
}

/// The first pass of [`quantize_split_row`] alone: `x` (`32 × hi.len()` values) into `hi`,
/// the same bits as that function's `hi`, for [`ActPasses::One`].
///
/// # Panics
/// If `x.len() != 32 × hi.len()` or this CPU cannot run `tier`.
pub fn quantize_row(x: &[f32], hi: &mut [ActBlock], tier: Tier) {
    check_row(x.len(), hi.len(), tier);
    match tier {
        // SAFETY: the tier's features were checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni => unsafe { x86::first_pass_row(x, hi) },
        // SAFETY: the tier's features were checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { x86::avx2::first_pass_row(x, hi) },
        _ => {
            for (chunk, h) in x.chunks_exact(ACT_BLOCK).zip(hi) {
                *h = ActBlock::quantize(chunk.try_into().expect("chunks of 32"));
            }
        }
    }
}

/// [`Act16Block::quantize`] over a row: `x` (`32 × out.len()` values) into `out`, on `tier`
/// (AVX2 and AVX-512 VNNI run the AVX2 code: the scalar code's operations in its order, so
/// its bits for finite input; a test asserts it).
///
/// # Panics
/// If `x.len() != 32 × out.len()` or this CPU cannot run `tier`.
pub fn quantize_row_16(x: &[f32], out: &mut [Act16Block], tier: Tier) {
    check_row(x.len(), out.len(), tier);
    match tier {
        // SAFETY: both tiers have AVX2, checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 | Tier::Avx512Vnni => unsafe { x86::avx2::row_16(x, out) },
        _ => {
            for (chunk, o) in x.chunks_exact(ACT_BLOCK).zip(out) {
                *o = Act16Block::quantize(chunk.try_into().expect("chunks of 32"));
            }
        }
    }
}

/// The one-pass quantizers' checks: `values` activations fill `blocks` blocks, and this CPU
/// can run `tier`.
fn check_row(values: usize, blocks: usize, tier: Tier) {
    assert!(
        values == blocks * ACT_BLOCK,
        "{values} activations for {blocks} blocks"
    );
    assert!(
        tier.is_supported(),
        "kernel tier {tier} is not supported on this CPU"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{ACT_BLOCK, ActBlock};

    /// [`super::quantize_split_row`] on AVX-512: each block as two 16-lane registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL; the lengths are checked by the caller.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn split_row(x: &[f32], hi: &mut [ActBlock], lo: &mut [ActBlock]) {
        for ((chunk, h), l) in x.chunks_exact(ACT_BLOCK).zip(hi).zip(lo) {
            // SAFETY: a chunk holds 32 f32 values; unaligned loads.
            let (a, b) = unsafe {
                (
                    _mm512_loadu_ps(chunk.as_ptr()),
                    _mm512_loadu_ps(chunk.as_ptr().add(16)),
                )
            };
            let (block, ra, rb) = quantize(a, b);
            *h = block;
            *l = quantize(ra, rb).0;
        }
    }

    /// [`super::quantize_row`] on AVX-512: [`split_row`]'s first pass.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VL; the lengths are checked by the caller.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn first_pass_row(x: &[f32], hi: &mut [ActBlock]) {
        for (chunk, h) in x.chunks_exact(ACT_BLOCK).zip(hi) {
            // SAFETY: a chunk holds 32 f32 values; unaligned loads.
            let (a, b) = unsafe {
                (
                    _mm512_loadu_ps(chunk.as_ptr()),
                    _mm512_loadu_ps(chunk.as_ptr().add(16)),
                )
            };
            *h = quantize(a, b).0;
        }
    }

    /// [`ActBlock::quantize`] of the 32 values `a ‖ b`, and what it leaves over (`x - d q`,
    /// a multiply then a subtraction, as the scalar code rounds them).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn quantize(a: __m512, b: __m512) -> (ActBlock, __m512, __m512) {
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let (d, inv) = super::scale_for(amax, 127.0);
        let inv = _mm512_set1_ps(inv);
        // Round to nearest, ties to even (the default MXCSR mode), as the scalar code does.
        let qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        let qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        let sum_first_half = _mm512_reduce_add_epi32(qa);
        let sum = sum_first_half + _mm512_reduce_add_epi32(qb);
        let mut qs = [0i8; ACT_BLOCK];
        // SAFETY: two 16-byte stores into the 32 bytes of `qs`.
        unsafe {
            _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(qb));
        }
        let dv = _mm512_set1_ps(d);
        let ra = _mm512_sub_ps(a, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(qa)));
        let rb = _mm512_sub_ps(b, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(qb)));
        (ActBlock::new(qs, d, sum, sum_first_half), ra, rb)
    }

    /// The AVX2 twins of the functions above: a block as four 8-lane registers.
    pub(super) mod avx2 {
        use std::arch::x86_64::*;

        use super::super::{ACT_BLOCK, Act16Block, ActBlock};
        use crate::lanes::{hmax, hsum_i32};

        /// [`super::super::quantize_row_16`] on AVX2.
        ///
        /// # Safety
        /// The CPU must have AVX2; the lengths are checked by the caller.
        #[target_feature(enable = "avx2")]
        pub(in crate::act) unsafe fn row_16(x: &[f32], out: &mut [Act16Block]) {
            for (chunk, o) in x.chunks_exact(ACT_BLOCK).zip(out) {
                *o = quantize_16(load(chunk));
            }
        }

        /// [`Act16Block::quantize`] of the 32 values `v`.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn quantize_16(v: [__m256; 4]) -> Act16Block {
            let (d, q) = scale_and_round(v, 32767.0);
            let sum = hsum_i32(_mm256_add_epi32(
                _mm256_add_epi32(q[0], q[1]),
                _mm256_add_epi32(q[2], q[3]),
            ));
            // Finite values quantize within ±32767, so the saturating packs keep them; each
            // packs the 128-bit halves apart (values 0-3, 8-11, 4-7, 12-15 of its sixteen),
            // which the 64-bit permutation undoes.
            let order = |a, b| _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(a, b));
            let mut qs = [0i16; ACT_BLOCK];
            // SAFETY: two 32-byte stores into the 64 bytes of `qs`.
            unsafe {
                _mm256_storeu_si256(qs.as_mut_ptr().cast(), order(q[0], q[1]));
                _mm256_storeu_si256(qs.as_mut_ptr().add(16).cast(), order(q[2], q[3]));
            }
            Act16Block::new(qs, d, sum)
        }

        /// [`super::super::quantize_split_row`] on AVX2.
        ///
        /// # Safety
        /// The CPU must have AVX2; the lengths are checked by the caller.
        #[target_feature(enable = "avx2")]
        pub(in crate::act) unsafe fn split_row(
            x: &[f32],
            hi: &mut [ActBlock],
            lo: &mut [ActBlock],
        ) {
            for ((chunk, h), l) in x.chunks_exact(ACT_BLOCK).zip(hi).zip(lo) {
                let (block, rest) = quantize(load(chunk));
                *h = block;
                *l = quantize(rest).0;
            }
        }

        /// [`super::super::quantize_row`] on AVX2: [`split_row`]'s first pass.
        ///
        /// # Safety
        /// The CPU must have AVX2; the lengths are checked by the caller.
        #[target_feature(enable = "avx2")]
        pub(in crate::act) unsafe fn first_pass_row(x: &[f32], hi: &mut [ActBlock]) {
            for (chunk, h) in x.chunks_exact(ACT_BLOCK).zip(hi) {
                *h = quantize(load(chunk)).0;
            }
        }

        /// A block's 32 values as four registers.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn load(chunk: &[f32]) -> [__m256; 4] {
            assert_eq!(chunk.len(), ACT_BLOCK);
            // SAFETY: the chunk holds 32 f32 values (asserted); unaligned loads of 8 each.
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(chunk.as_ptr().add(8 * i)) })
        }

        /// The scale of the 32 values `v` (their largest magnitude over `q_max`) and the values
        /// over it rounded to integers, as [`super::super::scale_for`] and the scalar
        /// quantizers' rounding do.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn scale_and_round(v: [__m256; 4], q_max: f32) -> (f32, [__m256i; 4]) {
            let sign = _mm256_set1_ps(-0.0);
            let abs = v.map(|x| _mm256_andnot_ps(sign, x));
            let amax = hmax(_mm256_max_ps(
                _mm256_max_ps(abs[0], abs[1]),
                _mm256_max_ps(abs[2], abs[3]),
            ));
            let (d, inv) = super::super::scale_for(amax, q_max);
            let inv = _mm256_set1_ps(inv);
            // Round to nearest, ties to even (the default MXCSR mode), as the scalar code does.
            (d, v.map(|x| _mm256_cvtps_epi32(_mm256_mul_ps(x, inv))))
        }

        /// [`ActBlock::quantize`] of the 32 values `v`, and what it leaves over (`x - d q`,
        /// a multiply then a subtraction, as the scalar code rounds them).
        #[inline]
        #[target_feature(enable = "avx2")]
        fn quantize(v: [__m256; 4]) -> (ActBlock, [__m256; 4]) {
            let (d, q) = scale_and_round(v, 127.0);
            let sum_first_half = hsum_i32(_mm256_add_epi32(q[0], q[1]));
            let sum = sum_first_half + hsum_i32(_mm256_add_epi32(q[2], q[3]));
            // Finite values quantize within ±127, so the saturating packs keep them; they come
            // out in 32-bit lanes of the order 0, 2, 4, 6, 1, 3, 5, 7 (each 128-bit half packed
            // apart), which the permutation undoes.
            let bytes = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let mut qs = [0i8; ACT_BLOCK];
            // SAFETY: one 32-byte store into the 32 bytes of `qs`.
            unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), bytes) };
            let dv = _mm256_set1_ps(d);
            let rest = std::array::from_fn(|i| {
                _mm256_sub_ps(v[i], _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q[i])))
            });
            (ActBlock::new(qs, d, sum, sum_first_half), rest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_passes_precision_is_one_16_bit_pass_for_q8_0_below_vnni_only() {
        for tier in Tier::ALL {
            let q8_0 = ActPasses::precise_at(GgmlType::Q8_0, tier);
            let q16 = tier != Tier::Avx512Vnni;
            assert_eq!(q8_0 == ActPasses::Q16, q16, "{tier:?}");
            assert!(matches!(q8_0, ActPasses::Q16 | ActPasses::Two), "{tier:?}");
            for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
                assert_eq!(
                    ActPasses::precise_at(ty, tier),
                    ActPasses::Two,
                    "{ty:?} {tier:?}"
                );
            }
        }
    }

    #[test]
    fn quantization_keeps_the_largest_value_exact_and_sums_what_it_stores() {
        let mut x = [0f32; 32];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 10.0) * 0.25;
        }
        let b = ActBlock::quantize(&x);
        assert_eq!(b.qs[31], 127);
        assert!((b.d * 127.0 - 5.25).abs() < 1e-6);
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        assert_eq!((b.sum, b.d_sum), (sum, b.d * sum as f32));
        let first: i32 = b.qs[..16].iter().map(|&q| i32::from(q)).sum();
        assert_eq!(b.sum_first_half, first);
        assert_eq!(b.q6_k_starts, [-32 * first, -32 * (sum - first)]);
        for (q, v) in b.qs.iter().zip(&x) {
            assert!((f32::from(*q) * b.d - v).abs() <= b.d / 2.0 + 1e-6);
        }
        let zero = ActBlock::quantize(&[0.0; 32]);
        assert_eq!((zero.d, zero.qs), (0.0, [0; 32]));
    }

    #[test]
    fn the_second_pass_takes_the_error_down_by_254() {
        let mut x = [0f32; 32];
        for (i, v) in x.iter_mut().enumerate() {
            *v = ((i * 37 % 29) as f32 - 14.3) * 0.173;
        }
        let (hi, lo) = quantize_split(&x);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, v) in x.iter().enumerate() {
            let y = hi.d * f32::from(hi.qs[i]) + lo.d * f32::from(lo.qs[i]);
            assert!(
                (y - v).abs() <= amax / (2.0 * 127.0 * 254.0) * 1.01,
                "{i}: {y} vs {v}"
            );
        }
    }
}
