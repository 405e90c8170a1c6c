//! AVX2 and AVX-512 VNNI dot products (x86-64), one body per weight type stamped out for each
//! tier by `tier_kernels!`: the tiers differ only in how 32 unsigned × signed byte products are
//! summed into eight i32 lanes (AVX2: `vpmaddubsw` then `vpmaddwd`; VNNI: one `vpdpbusd`).
//!
//! The approach follows llama.cpp's `ggml-cpu/arch/x86/quants.c`: unsigned weights (nibbles)
//! multiply signed activations directly; signed weights (Q8_0, Q6_K) use the sign trick
//! `|w| × sign(a, w)`; offsets and minimums are folded in per block through the activation
//! block's `d × Σq`.
//!
//! # Safety
//! Every function here requires its tier's CPU features ([`crate::Tier::is_supported`]) and a
//! weight row of exactly as many blocks as the activations cover; the dispatcher in
//! [`super`] checks both.

use std::arch::x86_64::*;

use crate::act::ActBlock;
use crate::ggml::{IQ4_VALUES, iq4_xs_scale, q3_k_scales, scale_min_k4};

/// f16 (little-endian at `p`) to f32 with F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// The sum of eight f32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 32 nibbles from 16 bytes at `p`: low nibbles in bytes 0-15, high nibbles in 16-31.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let raw = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load32(p: *const i8) -> __m256i {
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Σ of four u8 × i8 products in each i32 lane (AVX2). Products stay within i16: the weights
/// here are at most 127 (|Q8_0|) or 63 (Q6_K), activations at most 127 in magnitude.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The same with one VNNI instruction.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
unsafe fn dot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// IQ4's table in both 128-bit lanes, for `vpshufb` lookups of 32 indices.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn iq4_table() -> __m256i {
    let table = unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) };
    _mm256_set_m128i(table, table)
}

/// The 32 signed values of 16 bytes of IQ4 indices at `p` (low nibbles then high ones).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq4_values(table: __m256i, p: *const u8) -> __m256i {
    _mm256_shuffle_epi8(table, unsafe { nibbles(p) })
}

/// `[s0 × 4, s1 × 4]`: one scale for each 16-value half of a 32-value block's eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_scales(s0: i32, s1: i32) -> __m256i {
    _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1)
}

/// Two-bit values `2 × shift .. 2 × shift + 2` of the 32 bytes at `p` (Q2_K's and Q3_K's low
/// bits of one 32-value activation block).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn two_bits(p: *const u8, shift: i32) -> __m256i {
    let raw = unsafe { _mm256_loadu_si256(p.cast()) };
    let moved = _mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift));
    _mm256_and_si256(moved, _mm256_set1_epi8(3))
}

macro_rules! tier_kernels {
    ($tier:ident, $features:literal, $dot:ident) => {
        /// The dot products of this tier.
        pub(super) mod $tier {
            use super::*;

            /// Q8_0 × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q8_0(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.iter().enumerate() {
                    let b = unsafe { w.as_ptr().add(34 * i) };
                    let wv = unsafe { load32(b.add(2).cast()) };
                    let av = unsafe { load32(ab.qs.as_ptr()) };
                    let p = unsafe { $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv)) };
                    let scale = unsafe { f16_at(b) } * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                }
                unsafe { hsum(acc) }
            }

            /// Q4_0 × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_0(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut offset = 0f32;
                for (i, ab) in a.iter().enumerate() {
                    let b = unsafe { w.as_ptr().add(18 * i) };
                    let d = unsafe { f16_at(b) };
                    let p = unsafe { $dot(nibbles(b.add(2)), load32(ab.qs.as_ptr())) };
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), _mm256_cvtepi32_ps(p), acc);
                    offset += d * ab.d_sum;
                }
                (unsafe { hsum(acc) }) - 8.0 * offset
            }

            /// Q4_1 × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_1(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.iter().enumerate() {
                    let b = unsafe { w.as_ptr().add(20 * i) };
                    let p = unsafe { $dot(nibbles(b.add(4)), load32(ab.qs.as_ptr())) };
                    let scale = unsafe { f16_at(b) } * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                    mins += unsafe { f16_at(b.add(2)) } * ab.d_sum;
                }
                (unsafe { hsum(acc) }) + mins
            }

            /// Q4_K × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let mask = _mm256_set1_epi8(0x0F);
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    let b = unsafe { w.as_ptr().add(144 * i) };
                    let (d, dmin) = unsafe { (f16_at(b), f16_at(b.add(2))) };
                    let scales = unsafe { std::slice::from_raw_parts(b.add(4), 12) };
                    for g in 0..4 {
                        let raw = unsafe { _mm256_loadu_si256(b.add(16 + 32 * g).cast()) };
                        let low = _mm256_and_si256(raw, mask);
                        let high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                        for (j, q) in [(2 * g, low), (2 * g + 1, high)] {
                            let act = &ab[j];
                            let (sc, m) = scale_min_k4(j, scales);
                            let p = unsafe { $dot(q, load32(act.qs.as_ptr())) };
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(d * sc * act.d),
                                _mm256_cvtepi32_ps(p),
                                acc,
                            );
                            mins += dmin * m * act.d_sum;
                        }
                    }
                }
                (unsafe { hsum(acc) }) - mins
            }

            /// IQ4_NL × activations: table values, signed, by the sign trick.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn iq4_nl(w: &[u8], a: &[ActBlock]) -> f32 {
                let table = unsafe { iq4_table() };
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.iter().enumerate() {
                    let b = unsafe { w.as_ptr().add(18 * i) };
                    let wv = unsafe { iq4_values(table, b.add(2)) };
                    let av = unsafe { load32(ab.qs.as_ptr()) };
                    let p = unsafe { $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv)) };
                    let scale = unsafe { f16_at(b) } * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                }
                unsafe { hsum(acc) }
            }

            /// IQ4_XS × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn iq4_xs(w: &[u8], a: &[ActBlock]) -> f32 {
                let table = unsafe { iq4_table() };
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    let block = unsafe { std::slice::from_raw_parts(w.as_ptr().add(136 * i), 136) };
                    let d = unsafe { f16_at(block.as_ptr()) };
                    for (s, act) in ab.iter().enumerate() {
                        let wv = unsafe { iq4_values(table, block.as_ptr().add(8 + 16 * s)) };
                        let av = unsafe { load32(act.qs.as_ptr()) };
                        let p = unsafe { $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv)) };
                        let p = _mm256_mullo_epi32(p, _mm256_set1_epi32(iq4_xs_scale(block, s)));
                        acc =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * act.d), _mm256_cvtepi32_ps(p), acc);
                    }
                }
                unsafe { hsum(acc) }
            }

            /// Q2_K × activations: the minimums come off through the activations' half sums.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q2_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    let b = unsafe { w.as_ptr().add(84 * i) };
                    let (d, dmin) = unsafe { (f16_at(b.add(80)), f16_at(b.add(82))) };
                    for (j, act) in ab.iter().enumerate() {
                        let (sc0, sc1) = unsafe { (*b.add(2 * j), *b.add(2 * j + 1)) };
                        let q = unsafe { two_bits(b.add(16 + 32 * (j / 4)), 2 * (j % 4) as i32) };
                        let p = unsafe { $dot(q, load32(act.qs.as_ptr())) };
                        let scales =
                            unsafe { half_scales(i32::from(sc0 & 0xF), i32::from(sc1 & 0xF)) };
                        let p = _mm256_mullo_epi32(p, scales);
                        acc =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * act.d), _mm256_cvtepi32_ps(p), acc);
                        let first = act.sum_first_half;
                        let m =
                            i32::from(sc0 >> 4) * first + i32::from(sc1 >> 4) * (act.sum - first);
                        mins += dmin * act.d * m as f32;
                    }
                }
                (unsafe { hsum(acc) }) - mins
            }

            /// Q3_K × activations: values stored as `q + 4` (0..=7), `4 × Σ a` taken off per
            /// half block.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q3_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let one = _mm256_set1_epi8(1);
                let four = _mm256_set1_epi8(4);
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    let b = unsafe { w.as_ptr().add(110 * i) };
                    let d = unsafe { f16_at(b.add(108)) };
                    let scales = q3_k_scales(unsafe { std::slice::from_raw_parts(b.add(96), 12) });
                    let hmask = unsafe { _mm256_loadu_si256(b.cast()) };
                    for (j, act) in ab.iter().enumerate() {
                        let low = unsafe { two_bits(b.add(32 + 32 * (j / 4)), 2 * (j % 4) as i32) };
                        let high = _mm256_and_si256(
                            _mm256_srl_epi16(hmask, _mm_cvtsi32_si128(j as i32)),
                            one,
                        );
                        let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
                        let av = unsafe { load32(act.qs.as_ptr()) };
                        let p = _mm256_sub_epi32(unsafe { $dot(q, av) }, unsafe { $dot(four, av) });
                        let s = unsafe {
                            half_scales(i32::from(scales[2 * j]), i32::from(scales[2 * j + 1]))
                        };
                        let p = _mm256_mullo_epi32(p, s);
                        acc =
                            _mm256_fmadd_ps(_mm256_set1_ps(d * act.d), _mm256_cvtepi32_ps(p), acc);
                    }
                }
                unsafe { hsum(acc) }
            }

            /// Q6_K × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q6_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                let offset = _mm256_set1_epi8(32);
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    let b = unsafe { w.as_ptr().add(210 * i) };
                    let d = unsafe { f16_at(b.add(208)) };
                    for h in 0..2 {
                        let (ql, qh) = unsafe { (b.add(64 * h), b.add(128 + 32 * h)) };
                        let lo_a = unsafe { _mm256_loadu_si256(ql.cast()) };
                        let lo_b = unsafe { _mm256_loadu_si256(ql.add(32).cast()) };
                        let hi = unsafe { _mm256_loadu_si256(qh.cast()) };
                        // values l + 32k, k = 0..4, as unsigned 6-bit numbers.
                        let q = [
                            _mm256_or_si256(
                                _mm256_and_si256(lo_a, m4),
                                _mm256_and_si256(_mm256_slli_epi16(hi, 4), m2),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(lo_b, m4),
                                _mm256_and_si256(_mm256_slli_epi16(hi, 2), m2),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(lo_a, 4), m4),
                                _mm256_and_si256(hi, m2),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(lo_b, 4), m4),
                                _mm256_and_si256(_mm256_srli_epi16(hi, 2), m2),
                            ),
                        ];
                        for (k, q) in q.into_iter().enumerate() {
                            let act = &ab[4 * h + k];
                            let av = unsafe { load32(act.qs.as_ptr()) };
                            // Σ (q - 32) a per lane: lanes 0-3 are values 0-15, 4-7 are 16-31.
                            let p = _mm256_sub_epi32(unsafe { $dot(q, av) }, unsafe {
                                $dot(offset, av)
                            });
                            let s0 = i32::from(unsafe { *b.add(192 + 8 * h + 2 * k) } as i8);
                            let s1 = i32::from(unsafe { *b.add(192 + 8 * h + 2 * k + 1) } as i8);
                            let scales = _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1);
                            let p = _mm256_mullo_epi32(p, scales);
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(d * act.d),
                                _mm256_cvtepi32_ps(p),
                                acc,
                            );
                        }
                    }
                }
                unsafe { hsum(acc) }
            }
        }
    };
}

tier_kernels!(avx2, "avx2,fma,f16c", dot_avx2);
tier_kernels!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    dot_vnni
);
