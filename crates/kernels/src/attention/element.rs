//! The element types a KV cache holds and the attention kernels read in place: f32, f16 and
//! bf16 widened to f32 as they are loaded, and Q8_0 blocks (ggml's `block_q8_0`: 32 signed
//! bytes and their f16 scale) dequantized as they are loaded (never copied to f32 as a whole).
//!
//! A key or value row of `head_dim` values is `head_dim / VALUES` stored units: one float per
//! value, or one Q8_0 block per 32 values. The kernels address a row's values by their index;
//! the element type says where they lie.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for super::Q8_0Block {}
}

/// A stored unit of K/V as the attention kernels read it: every computation is in f32; a
/// narrower float is widened exactly (f16 and bf16 are subsets of f32), a Q8_0 block's values
/// are its bytes times its scale, each product rounded to f32 once.
pub trait KvElement: Copy + Send + Sync + 'static + sealed::Sealed {
    /// Values one unit holds (1 for a float, 32 for a Q8_0 block); a row's width is a
    /// multiple of it.
    const VALUES: usize;

    /// The unit whose values are all zero (what a missing key reads).
    const ZERO: Self;

    /// Value `d` of `row` (a row's units), as f32.
    fn value(row: &[Self], d: usize) -> f32;

    /// Values `d..d + 8` of the row at `row`, as f32.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `d` must be a multiple of 8 and the row must hold
    /// at least `d + 8` values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(row: *const Self, d: usize) -> __m256;

    /// Values `d..d + 16` of the row at `row`, as f32.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `d` must be a multiple of 16 and the row must hold at
    /// least `d + 16` values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(row: *const Self, d: usize) -> __m512;
}

/// The float elements: one value per unit, widened by `to_f32` and two vector loads.
macro_rules! float_element {
    ($t:ty, $zero:expr, $load8:expr, $load16:expr) => {
        impl KvElement for $t {
            const VALUES: usize = 1;
            const ZERO: Self = $zero;

            #[inline]
            fn value(row: &[Self], d: usize) -> f32 {
                row[d].to_f32()
            }

            #[cfg(target_arch = "x86_64")]
            #[inline]
            #[target_feature(enable = "avx2,f16c")]
            unsafe fn load8(row: *const Self, d: usize) -> __m256 {
                // SAFETY: values `d..d + 8` are readable (the caller's contract).
                unsafe { $load8(row.add(d)) }
            }

            #[cfg(target_arch = "x86_64")]
            #[inline]
            #[target_feature(enable = "avx512f")]
            unsafe fn load16(row: *const Self, d: usize) -> __m512 {
                // SAFETY: values `d..d + 16` are readable (the caller's contract).
                unsafe { $load16(row.add(d)) }
            }
        }
    };
}

trait Widen {
    fn to_f32(self) -> f32;
}

impl Widen for f32 {
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Widen for f16 {
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Widen for bf16 {
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

float_element!(f32, 0.0, load8_f32, load16_f32);
float_element!(f16, f16::ZERO, load8_f16, load16_f16);
float_element!(bf16, bf16::ZERO, load8_bf16, load16_bf16);

/// # Safety
/// AVX2; eight readable values at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8_f32(p: *const f32) -> __m256 {
    // SAFETY: eight readable values (the caller's contract).
    unsafe { _mm256_loadu_ps(p) }
}

/// # Safety
/// AVX-512 F; sixteen readable values at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16_f32(p: *const f32) -> __m512 {
    // SAFETY: sixteen readable values (the caller's contract).
    unsafe { _mm512_loadu_ps(p) }
}

/// # Safety
/// AVX2 and F16C; eight readable values (16 bytes) at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8_f16(p: *const f16) -> __m256 {
    // SAFETY: eight readable values, 16 bytes (the caller's contract).
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// # Safety
/// AVX-512 F; sixteen readable values (32 bytes) at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16_f16(p: *const f16) -> __m512 {
    // SAFETY: sixteen readable values, 32 bytes (the caller's contract).
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// bf16 is f32's upper half: each value zero-extended and shifted into place.
///
/// # Safety
/// AVX2; eight readable values (16 bytes) at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8_bf16(p: *const bf16) -> __m256 {
    // SAFETY: eight readable values, 16 bytes (the caller's contract).
    let halves = unsafe { _mm_loadu_si128(p.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
}

/// # Safety
/// AVX-512 F; sixteen readable values (32 bytes) at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16_bf16(p: *const bf16) -> __m512 {
    // SAFETY: sixteen readable values, 32 bytes (the caller's contract).
    let halves = unsafe { _mm256_loadu_si256(p.cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
}

/// Values per [`Q8_0Block`].
pub const Q8_0_VALUES: usize = 32;

/// ggml's `block_q8_0` as a KV cache stores it: 32 values as signed bytes and one f16 scale,
/// value `i` being `scale × values[i]`; 34 bytes, laid out as in a GGUF file.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Q8_0Block {
    /// The block's scale: its largest magnitude / 127.
    pub scale: f16,
    /// The values, each rounded to the nearest multiple of the scale.
    pub values: [i8; Q8_0_VALUES],
}

/// f16 words a [`Q8_0Block`] spans (storage that holds blocks as f16 words: kiln's caches keep
/// them in an f16 tensor, 17 words per block).
pub const Q8_0_WORDS: usize = size_of::<Q8_0Block>() / size_of::<f16>();

const _: () = assert!(size_of::<Q8_0Block>() == 34 && align_of::<Q8_0Block>() == 2);

impl Q8_0Block {
    /// `values` (32 of them) quantized as ggml's `quantize_row_q8_0` does: the scale is the
    /// largest magnitude / 127, each value divided by it (times its f32 inverse) and rounded
    /// half away from zero; the scale is stored as f16.
    pub fn quantize(values: &[f32]) -> Self {
        debug_assert_eq!(values.len(), Q8_0_VALUES);
        let amax = values.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = amax / 127.0;
        let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        Self {
            scale: f16::from_f32(scale),
            values: std::array::from_fn(|i| (values[i] * inverse).round() as i8),
        }
    }

    /// Value `i`: `scale × values[i]`.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        self.scale.to_f32() * f32::from(self.values[i])
    }
}

/// `values` quantized 32 at a time into `out` (one block per 32 values).
///
/// # Panics
/// If `out` does not hold `values.len() / 32` blocks or the length is not a multiple of 32.
pub fn quantize_q8_0(values: &[f32], out: &mut [Q8_0Block]) {
    assert!(
        values.len() == out.len() * Q8_0_VALUES,
        "{} values do not fill {} Q8_0 blocks",
        values.len(),
        out.len()
    );
    for (block, chunk) in out.iter_mut().zip(values.chunks_exact(Q8_0_VALUES)) {
        *block = Q8_0Block::quantize(chunk);
    }
}

/// `blocks` dequantized into `out` (32 values per block).
///
/// # Panics
/// If `out` does not hold `blocks.len() * 32` values.
pub fn dequantize_q8_0(blocks: &[Q8_0Block], out: &mut [f32]) {
    assert_eq!(out.len(), blocks.len() * Q8_0_VALUES, "Q8_0 output length");
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(Q8_0_VALUES)) {
        for (i, x) in chunk.iter_mut().enumerate() {
            *x = block.get(i);
        }
    }
}

/// f16 words viewed as the Q8_0 blocks they hold ([`Q8_0_WORDS`] words each); `None` when
/// the length is not whole blocks.
pub fn q8_0_blocks(words: &[f16]) -> Option<&[Q8_0Block]> {
    if !words.len().is_multiple_of(Q8_0_WORDS) {
        return None;
    }
    // SAFETY: a block is 17 f16 words with f16's alignment (asserted above) and every bit
    // pattern is a valid block (an f16 and 32 bytes); the length is whole blocks.
    Some(unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() / Q8_0_WORDS) })
}

/// Mutable [`q8_0_blocks`].
pub fn q8_0_blocks_mut(words: &mut [f16]) -> Option<&mut [Q8_0Block]> {
    if !words.len().is_multiple_of(Q8_0_WORDS) {
        return None;
    }
    // SAFETY: as `q8_0_blocks`; any block written is 17 valid f16 words (every bit pattern
    // is an f16).
    Some(unsafe {
        std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() / Q8_0_WORDS)
    })
}

impl KvElement for Q8_0Block {
    const VALUES: usize = Q8_0_VALUES;
    const ZERO: Self = Q8_0Block {
        scale: f16::ZERO,
        values: [0; Q8_0_VALUES],
    };

    #[inline]
    fn value(row: &[Self], d: usize) -> f32 {
        row[d / Q8_0_VALUES].get(d % Q8_0_VALUES)
    }

    /// The eight bytes sign-extended, converted and multiplied by the broadcast scale (the
    /// same single f32 product as [`Q8_0Block::get`]).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(row: *const Self, d: usize) -> __m256 {
        // SAFETY: values `d..d + 8` lie in block `d / 32` (d is a multiple of 8), which the
        // row holds (the caller's contract).
        unsafe {
            let block = &*row.add(d / Q8_0_VALUES);
            let bytes = _mm_loadl_epi64(block.values.as_ptr().add(d % Q8_0_VALUES).cast());
            let values = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            // The scale widened in a register (`f16::to_f32` would test for F16C each call).
            let scale = _mm256_cvtph_ps(_mm_set1_epi16(block.scale.to_bits() as i16));
            _mm256_mul_ps(scale, values)
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(row: *const Self, d: usize) -> __m512 {
        // SAFETY: values `d..d + 16` lie in block `d / 32` (d is a multiple of 16), which the
        // row holds (the caller's contract).
        unsafe {
            let block = &*row.add(d / Q8_0_VALUES);
            let bytes = _mm_loadu_si128(block.values.as_ptr().add(d % Q8_0_VALUES).cast());
            let values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
            let scale = _mm512_cvtph_ps(_mm256_set1_epi16(block.scale.to_bits() as i16));
            _mm512_mul_ps(scale, values)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tier's loads give the values `value` gives, for every offset of a 64-value row.
    #[cfg(target_arch = "x86_64")]
    fn loads_match<T: KvElement>(row: &[T]) {
        use crate::Tier;
        let n = row.len() * T::VALUES;
        let expected: Vec<f32> = (0..n).map(|d| T::value(row, d)).collect();
        if Tier::Avx2.is_supported() {
            for d in (0..n).step_by(8) {
                let mut got = [0f32; 8];
                // SAFETY: the tier was checked; values `d..d + 8` are in the row.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), T::load8(row.as_ptr(), d)) };
                assert_eq!(got[..], expected[d..d + 8]);
            }
        }
        if Tier::Avx512Vnni.is_supported() {
            for d in (0..n).step_by(16) {
                let mut got = [0f32; 16];
                // SAFETY: the tier was checked; values `d..d + 16` are in the row.
                unsafe { _mm512_storeu_ps(got.as_mut_ptr(), T::load16(row.as_ptr(), d)) };
                assert_eq!(got[..], expected[d..d + 16]);
            }
        }
    }

    fn row() -> Vec<f32> {
        (0..64).map(|i| i as f32 * 0.37 - 3.1).collect()
    }

    fn q8_0(values: &[f32]) -> Vec<Q8_0Block> {
        let mut blocks = vec![Q8_0Block::ZERO; values.len() / Q8_0_VALUES];
        quantize_q8_0(values, &mut blocks);
        blocks
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_loads_give_the_scalar_values() {
        let x = row();
        loads_match::<f32>(&x);
        loads_match(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>());
        loads_match(&x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
        loads_match(&q8_0(&x));
    }

    #[test]
    fn floats_widen_exactly() {
        let x = row();
        let halves: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        for (d, h) in halves.iter().enumerate() {
            assert_eq!(f16::value(&halves, d), h.to_f32());
            assert_eq!(f32::value(&x, d), x[d]);
        }
    }

    /// ggml's rounding: scale = amax / 127, each value rounded half away from zero; the
    /// largest magnitude is ±127; every value within half a step (plus the f16 scale's
    /// rounding) of the original; a block of zeros has a zero scale.
    #[test]
    fn q8_0_blocks_quantize_as_ggml_does() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.25).collect();
        let block = Q8_0Block::quantize(&x);
        assert_eq!(block.scale, f16::from_f32(4.0 / 127.0));
        assert_eq!(block.values[0], -127);
        // -3.75 * 127 / 4 = -119.06 -> -119; 0.25 * 127 / 4 = 7.9375 -> 8.
        assert_eq!(block.values[1], -119);
        assert_eq!(block.values[17], 8);
        let step = block.scale.to_f32();
        for (i, &v) in x.iter().enumerate() {
            assert!((block.get(i) - v).abs() <= step * 0.5 + 4.0 * 1e-3, "{i}");
        }
        let zero = Q8_0Block::quantize(&[0.0; 32]);
        assert_eq!(zero, Q8_0Block::ZERO);
        let blocks = q8_0(&row());
        let mut back = vec![0f32; 64];
        dequantize_q8_0(&blocks, &mut back);
        for (d, v) in back.iter().enumerate() {
            assert_eq!(*v, Q8_0Block::value(&blocks, d));
            assert!(
                (v - row()[d]).abs() <= blocks[d / 32].scale.to_f32() * 0.51,
                "{d}"
            );
        }
    }

    #[test]
    fn blocks_are_seventeen_f16_words() {
        let words = vec![f16::from_bits(0x3c00); 2 * Q8_0_WORDS];
        let blocks = q8_0_blocks(&words).expect("whole blocks");
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[1].scale, f16::ONE);
        assert!(q8_0_blocks(&words[1..]).is_none());
    }
}
