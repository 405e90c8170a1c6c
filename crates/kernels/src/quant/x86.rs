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
//! [`super`] checks both. The helpers that only work on registers are safe functions (callable
//! without `unsafe` from the kernels, whose features include theirs); those that read through
//! a pointer say how many bytes they read.

use std::arch::x86_64::*;

use crate::act::ActBlock;
use crate::ggml::{IQ4_VALUES, iq4_xs_scale, q3_k_scales, scale_min_k4};
use crate::lanes::hsum;

/// f16 (little-endian at `p`) to f32 with F16C.
///
/// # Safety
/// Two bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller's contract: two readable bytes at `p`; `read_unaligned` needs no
    // alignment.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 32 nibbles from 16 bytes at `p`: low nibbles in bytes 0-15, high nibbles in 16-31.
///
/// # Safety
/// 16 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: 16 readable bytes at `p`, the unaligned load's width.
    let raw = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// 32 bytes at `p`.
///
/// # Safety
/// 32 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: 32 readable bytes at `p`, the unaligned load's width.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The 32 quantized values of an activation block.
#[inline]
#[target_feature(enable = "avx2")]
fn act(a: &ActBlock) -> __m256i {
    // SAFETY: `qs` is `[i8; 32]`, the 32 bytes the unaligned load reads.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) }
}

/// Σ of four u8 × i8 products in each i32 lane (AVX2). Products stay within i16: the weights
/// here are at most 127 (|Q8_0|) or 63 (Q6_K), activations at most 127 in magnitude.
#[inline]
#[target_feature(enable = "avx2")]
fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The same with one VNNI instruction.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn dot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// IQ4's table in both 128-bit lanes, for `vpshufb` lookups of 32 indices.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn iq4_table() -> __m256i {
    // SAFETY: `IQ4_VALUES` is `[i8; 16]`, the 16 bytes the unaligned load reads.
    let table = unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) };
    _mm256_set_m128i(table, table)
}

/// The 32 signed values of 16 bytes of IQ4 indices at `p` (low nibbles then high ones).
///
/// # Safety
/// 16 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq4_values(table: __m256i, p: *const u8) -> __m256i {
    // SAFETY: the caller's contract: 16 readable bytes at `p`, what `nibbles` reads.
    _mm256_shuffle_epi8(table, unsafe { nibbles(p) })
}

/// `[s0 × 4, s1 × 4]`: one scale for each 16-value half of a 32-value block's eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn half_scales(s0: i32, s1: i32) -> __m256i {
    _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1)
}

/// Two-bit values `2 × shift .. 2 × shift + 2` of the 32 bytes at `p` (Q2_K's and Q3_K's low
/// bits of one 32-value activation block).
///
/// # Safety
/// 32 bytes at `p` must be readable.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn two_bits(p: *const u8, shift: i32) -> __m256i {
    // SAFETY: the caller's contract: 32 readable bytes at `p`, the unaligned load's width.
    let raw = unsafe { _mm256_loadu_si256(p.cast()) };
    let moved = _mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift));
    _mm256_and_si256(moved, _mm256_set1_epi8(3))
}

// In every kernel below, `w` holds exactly one weight block per activation block (per eight,
// for the 256-value types): the `DotFn` contract, which `DotKernel` checks. So block `i` of the
// row, `b = w.as_ptr() + bytes × i` for `i` below the number of blocks, starts a whole block
// of `w`, and each SAFETY comment names the bytes of that block it reads.
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
                    // SAFETY: block `i` (34 bytes) lies in `w` (one per activation block):
                    // its f16 scale is bytes 0-1, its 32 quants bytes 2-33.
                    let (d, wv) = unsafe {
                        let b = w.as_ptr().add(34 * i);
                        (f16_at(b), load32(b.add(2)))
                    };
                    let av = act(ab);
                    let p = $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                    let scale = d * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                }
                hsum(acc)
            }

            /// Q4_0 × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_0(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut offset = 0f32;
                for (i, ab) in a.iter().enumerate() {
                    // SAFETY: block `i` (18 bytes) lies in `w` (one per activation block):
                    // its f16 scale is bytes 0-1, its 16 bytes of nibbles bytes 2-17.
                    let (d, q) = unsafe {
                        let b = w.as_ptr().add(18 * i);
                        (f16_at(b), nibbles(b.add(2)))
                    };
                    let p = $dot(q, act(ab));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * ab.d), _mm256_cvtepi32_ps(p), acc);
                    offset += d * ab.d_sum;
                }
                hsum(acc) - 8.0 * offset
            }

            /// Q4_1 × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_1(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.iter().enumerate() {
                    // SAFETY: block `i` (20 bytes) lies in `w` (one per activation block):
                    // f16 scale at bytes 0-1, f16 minimum at 2-3, 16 bytes of nibbles at 4-19.
                    let (d, m, q) = unsafe {
                        let b = w.as_ptr().add(20 * i);
                        (f16_at(b), f16_at(b.add(2)), nibbles(b.add(4)))
                    };
                    let p = $dot(q, act(ab));
                    let scale = d * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                    mins += m * ab.d_sum;
                }
                hsum(acc) + mins
            }

            /// Q4_K × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q4_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let mask = _mm256_set1_epi8(0x0F);
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    // SAFETY: super-block `i` (144 bytes) lies in `w` (one per eight
                    // activation blocks): `d` and `dmin` at bytes 0-3, 12 bytes of scales at
                    // 4-15.
                    let (b, d, dmin, scales) = unsafe {
                        let b = w.as_ptr().add(144 * i);
                        (
                            b,
                            f16_at(b),
                            f16_at(b.add(2)),
                            std::slice::from_raw_parts(b.add(4), 12),
                        )
                    };
                    for g in 0..4 {
                        // SAFETY: `g < 4`: nibbles `16 + 32 g ..` end by byte 143 of the block.
                        let raw = unsafe { load32(b.add(16 + 32 * g)) };
                        let low = _mm256_and_si256(raw, mask);
                        let high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                        for (j, q) in [(2 * g, low), (2 * g + 1, high)] {
                            let act_j = &ab[j];
                            let (sc, m) = scale_min_k4(j, scales);
                            let p = $dot(q, act(act_j));
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(d * sc * act_j.d),
                                _mm256_cvtepi32_ps(p),
                                acc,
                            );
                            mins += dmin * m * act_j.d_sum;
                        }
                    }
                }
                hsum(acc) - mins
            }

            /// IQ4_NL × activations: table values, signed, by the sign trick.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn iq4_nl(w: &[u8], a: &[ActBlock]) -> f32 {
                let table = iq4_table();
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.iter().enumerate() {
                    // SAFETY: block `i` (18 bytes) lies in `w` (one per activation block):
                    // f16 scale at bytes 0-1, 16 bytes of indices at 2-17.
                    let (d, wv) = unsafe {
                        let b = w.as_ptr().add(18 * i);
                        (f16_at(b), iq4_values(table, b.add(2)))
                    };
                    let av = act(ab);
                    let p = $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                    let scale = d * ab.d;
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(p), acc);
                }
                hsum(acc)
            }

            /// IQ4_XS × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn iq4_xs(w: &[u8], a: &[ActBlock]) -> f32 {
                let table = iq4_table();
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    // SAFETY: super-block `i` (136 bytes) lies in `w` (one per eight
                    // activation blocks).
                    let block = unsafe { w.get_unchecked(136 * i..136 * (i + 1)) };
                    // SAFETY: the block's f16 `d` is its bytes 0-1.
                    let d = unsafe { f16_at(block.as_ptr()) };
                    for (s, act_s) in ab.iter().enumerate() {
                        // SAFETY: `s < 8`: sub-block `s`'s 16 bytes of indices, `8 + 16 s ..`,
                        // end by byte 135 of the block.
                        let wv = unsafe { iq4_values(table, block.as_ptr().add(8 + 16 * s)) };
                        let av = act(act_s);
                        let p = $dot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                        let p = _mm256_mullo_epi32(p, _mm256_set1_epi32(iq4_xs_scale(block, s)));
                        acc = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * act_s.d),
                            _mm256_cvtepi32_ps(p),
                            acc,
                        );
                    }
                }
                hsum(acc)
            }

            /// Q2_K × activations: the minimums come off through the activations' half sums.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q2_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let mut acc = _mm256_setzero_ps();
                let mut mins = 0f32;
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    // SAFETY: super-block `i` (84 bytes) lies in `w` (one per eight activation
                    // blocks): `d` and `dmin` are its bytes 80-83.
                    let (b, d, dmin) = unsafe {
                        let b = w.as_ptr().add(84 * i);
                        (b, f16_at(b.add(80)), f16_at(b.add(82)))
                    };
                    for (j, act_j) in ab.iter().enumerate() {
                        // SAFETY: `j < 8`: the two scale bytes `2 j, 2 j + 1` lie in bytes
                        // 0-15, and the 32 bytes of two-bit quants at `16 + 32 (j / 4)` in
                        // 16-79.
                        let (sc0, sc1, q) = unsafe {
                            let q = two_bits(b.add(16 + 32 * (j / 4)), 2 * (j % 4) as i32);
                            (*b.add(2 * j), *b.add(2 * j + 1), q)
                        };
                        let p = $dot(q, act(act_j));
                        let scales = half_scales(i32::from(sc0 & 0xF), i32::from(sc1 & 0xF));
                        let p = _mm256_mullo_epi32(p, scales);
                        acc = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * act_j.d),
                            _mm256_cvtepi32_ps(p),
                            acc,
                        );
                        let first = act_j.sum_first_half;
                        let m =
                            i32::from(sc0 >> 4) * first + i32::from(sc1 >> 4) * (act_j.sum - first);
                        mins += dmin * act_j.d * m as f32;
                    }
                }
                hsum(acc) - mins
            }

            /// Q3_K × activations: values stored as `q + 4` (0..=7), `4 × Σ a` taken off per
            /// half block.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q3_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let one = _mm256_set1_epi8(1);
                let four = _mm256_set1_epi8(4);
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    // SAFETY: super-block `i` (110 bytes) lies in `w` (one per eight
                    // activation blocks): 32 bytes of high bits at 0-31, 12 of scales at
                    // 96-107, `d` at 108-109.
                    let (b, d, packed, hmask) = unsafe {
                        let b = w.as_ptr().add(110 * i);
                        let packed = std::slice::from_raw_parts(b.add(96), 12);
                        (b, f16_at(b.add(108)), packed, load32(b))
                    };
                    let scales = q3_k_scales(packed);
                    for (j, act_j) in ab.iter().enumerate() {
                        // SAFETY: `j < 8`: the 32 bytes of low bits at `32 + 32 (j / 4)` lie
                        // in bytes 32-95 of the block.
                        let low = unsafe { two_bits(b.add(32 + 32 * (j / 4)), 2 * (j % 4) as i32) };
                        let high = _mm256_and_si256(
                            _mm256_srl_epi16(hmask, _mm_cvtsi32_si128(j as i32)),
                            one,
                        );
                        let q = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
                        let av = act(act_j);
                        let p = _mm256_sub_epi32($dot(q, av), $dot(four, av));
                        let s = half_scales(i32::from(scales[2 * j]), i32::from(scales[2 * j + 1]));
                        let p = _mm256_mullo_epi32(p, s);
                        acc = _mm256_fmadd_ps(
                            _mm256_set1_ps(d * act_j.d),
                            _mm256_cvtepi32_ps(p),
                            acc,
                        );
                    }
                }
                hsum(acc)
            }

            /// Q6_K × activations.
            #[target_feature(enable = $features)]
            pub(in crate::quant) unsafe fn q6_k(w: &[u8], a: &[ActBlock]) -> f32 {
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x30);
                let offset = _mm256_set1_epi8(32);
                let mut acc = _mm256_setzero_ps();
                for (i, ab) in a.chunks_exact(8).enumerate() {
                    // SAFETY: super-block `i` (210 bytes) lies in `w` (one per eight
                    // activation blocks): its `d` is bytes 208-209.
                    let (b, d) = unsafe {
                        let b = w.as_ptr().add(210 * i);
                        (b, f16_at(b.add(208)))
                    };
                    for h in 0..2 {
                        // SAFETY: `h < 2`: the low bits `64 h .. 64 h + 64` lie in bytes
                        // 0-127 of the block, the high bits `128 + 32 h ..` (32 bytes) in
                        // 128-191.
                        let (lo_a, lo_b, hi) = unsafe {
                            let (ql, qh) = (b.add(64 * h), b.add(128 + 32 * h));
                            (load32(ql), load32(ql.add(32)), load32(qh))
                        };
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
                            let act_k = &ab[4 * h + k];
                            let av = act(act_k);
                            // Σ (q - 32) a per lane: lanes 0-3 are values 0-15, 4-7 are 16-31.
                            let p = _mm256_sub_epi32($dot(q, av), $dot(offset, av));
                            // SAFETY: `h < 2`, `k < 4`: the scale bytes `192 + 8 h + 2 k` and
                            // the one after lie in bytes 192-207 of the block.
                            let (s0, s1) = unsafe {
                                let s = b.add(192 + 8 * h + 2 * k);
                                (i32::from(*s as i8), i32::from(*s.add(1) as i8))
                            };
                            let scales = half_scales(s0, s1);
                            let p = _mm256_mullo_epi32(p, scales);
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(d * act_k.d),
                                _mm256_cvtepi32_ps(p),
                                acc,
                            );
                        }
                    }
                }
                hsum(acc)
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
