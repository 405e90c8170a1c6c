//! Horizontal reductions of a 256-bit register's eight lanes (x86-64), one copy for every
//! kernel. Each folds the high 128 bits onto the low, then lanes 2-3 onto 0-1, then lane 1 onto
//! 0, so a sum rounds the same way wherever it is taken.

use std::arch::x86_64::*;

/// The sum of eight f32 lanes: `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}

/// The largest of eight f32 lanes (`maxps`' rule for NaN: the second operand of each step).
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn hmax(v: __m256) -> f32 {
    let half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
}

/// The sum of eight i32 lanes (wrapping).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_i32(v: __m256i) -> i32 {
    let half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let pair = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_match_the_scalar_fold_in_their_order() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let x = [1e8f32, 3.5, -1e8, 0.25, 7.0, -2.0, 1.0, 1e-3];
        let i = [i32::MAX, 1, 2, 3, -4, 5, 6, 7];
        // SAFETY: AVX2 (and so AVX) is supported, checked above; the loads read the arrays.
        let (sum, max, sum_i) = unsafe {
            let v = _mm256_loadu_ps(x.as_ptr());
            let w = _mm256_loadu_si256(i.as_ptr().cast());
            (hsum(v), hmax(v), hsum_i32(w))
        };
        let folded = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
        assert_eq!(sum.to_bits(), folded.to_bits());
        assert_eq!(max, 1e8);
        assert_eq!(sum_i, i.iter().fold(0i32, |s, &v| s.wrapping_add(v)));
    }
}
