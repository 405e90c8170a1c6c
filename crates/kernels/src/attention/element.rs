//! The element types a KV cache holds and the attention kernels read in place: f32, or f16 and
//! bf16 widened to f32 as they are loaded (never copied to f32 as a whole).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A K/V value as the attention kernels read it: every computation is in f32; a narrower
/// element is widened exactly (f16 and bf16 are subsets of f32) when it is loaded.
pub trait KvElement: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The zero of this type (what a missing key reads).
    const ZERO: Self;

    /// The value as f32 (exact).
    fn to_f32(self) -> f32;

    /// Eight values from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `p` must point to eight readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;

    /// Sixteen values from `p`, widened to f32.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `p` must point to sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> __m512;
}

impl KvElement for f32 {
    const ZERO: Self = 0.0;

    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight readable values (the caller's contract).
        unsafe { _mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: sixteen readable values (the caller's contract).
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl KvElement for f16 {
    const ZERO: Self = f16::ZERO;

    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight readable values, 16 bytes (the caller's contract).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: sixteen readable values, 32 bytes (the caller's contract).
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
    }
}

impl KvElement for bf16 {
    const ZERO: Self = bf16::ZERO;

    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    /// bf16 is f32's upper half: each value zero-extended and shifted into place.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: eight readable values, 16 bytes (the caller's contract).
        let halves = unsafe { _mm_loadu_si128(p.cast()) };
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: sixteen readable values, 32 bytes (the caller's contract).
        let halves = unsafe { _mm256_loadu_si256(p.cast()) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::Tier;

    /// Every tier's loads widen as `to_f32` does.
    fn loads_match<T: KvElement>(from: impl Fn(f32) -> T) {
        let values: Vec<T> = (0..16).map(|i| from(i as f32 * 0.37 - 3.1)).collect();
        let expected: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
        if Tier::Avx2.is_supported() {
            let mut got = [0f32; 8];
            // SAFETY: the tier was checked; 16 values are readable.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), T::load8(values.as_ptr().add(8))) };
            assert_eq!(got[..], expected[8..]);
        }
        if Tier::Avx512Vnni.is_supported() {
            let mut got = [0f32; 16];
            // SAFETY: the tier was checked; 16 values are readable.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), T::load16(values.as_ptr())) };
            assert_eq!(got[..], expected[..]);
        }
    }

    #[test]
    fn simd_loads_widen_exactly() {
        loads_match::<f32>(|x| x);
        loads_match(f16::from_f32);
        loads_match(bf16::from_f32);
    }
}
