//! Weights repacked eight output rows at a time, so one SIMD register holds one value of each
//! of eight rows and a product yields eight outputs without horizontal sums (llama.cpp's
//! `block_q4_0x8` repack in `ggml-cpu/repack.cpp`, done here for Q4_1 and Q8_0, the types of
//! the default model).
//!
//! Layout of a group of eight rows: for each block column `b` (32 values of every row), the
//! eight f16 scales, for Q4_1 the eight f16 minimums, then the quants as 4-byte lanes: lane `r`
//! of chunk `j` holds row `r`'s values `4j..4j + 4`. For Q4_1 (4 chunks of 32 bytes) a byte
//! holds value `4j + t` in its low nibble and value `16 + 4j + t` in its high nibble; for Q8_0
//! (8 chunks) a byte is value `4j + t` plus 128 (`q ^ 0x80`), an unsigned byte like Q4_1's
//! nibbles. Broadcasting four activation bytes against a chunk then multiplies row `r`'s values
//! in lane `r`: `vpdpbusd` (unsigned weights × signed activations) sums them there, and for
//! Q8_0 `128 × Σ a` (the activation block's [`ActBlock::sum`]) is taken off the integer sum.
//!
//! Each call takes an activation row in two passes ([`crate::act::quantize_split`]): the
//! 8-bit blocks and the 8-bit blocks of what they left over, so the product is as exact as
//! 16-bit activations while every multiply stays an 8-bit one.

use half::f16;

use crate::act::ActBlock;
use crate::ggml::GgmlType;
use crate::tier::Tier;

/// Rows per group.
pub const GROUP: usize = 8;

/// What a Q8_0 quant is stored XOR-ed with: `q ^ 0x80` is `q + 128` read as an unsigned byte.
const Q8_0_OFFSET: u8 = 0x80;

/// Bytes of one block column of a group, or `None` for a type without an interleaved kernel.
pub fn group_block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_1 => Some(2 * 8 + 2 * 8 + 128),
        GgmlType::Q8_0 => Some(2 * 8 + 256),
        _ => None,
    }
}

/// Rearranges `rows` (a multiple of [`GROUP`]) rows of `ty` blocks, `row_bytes` each, into
/// groups.
///
/// # Panics
/// If `ty` has no interleaved layout or the sizes disagree.
pub fn pack(ty: GgmlType, data: &[u8], rows: usize, row_bytes: usize) -> Vec<u8> {
    let out_block = group_block_bytes(ty).expect("a type with an interleaved layout");
    let in_block = ty.type_size();
    assert!(rows.is_multiple_of(GROUP) && data.len() == rows * row_bytes);
    let blocks = row_bytes / in_block;
    let mut out = vec![0u8; rows / GROUP * blocks * out_block];
    for g in 0..rows / GROUP {
        for b in 0..blocks {
            let dst = &mut out[(g * blocks + b) * out_block..][..out_block];
            for r in 0..GROUP {
                let src = &data[(g * GROUP + r) * row_bytes + b * in_block..][..in_block];
                match ty {
                    GgmlType::Q4_1 => {
                        dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                        dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                        let value = |e: usize| {
                            if e < 16 {
                                src[4 + e] & 0x0F
                            } else {
                                src[4 + e - 16] >> 4
                            }
                        };
                        for j in 0..4 {
                            for t in 0..4 {
                                dst[32 + 32 * j + 4 * r + t] =
                                    value(4 * j + t) | (value(16 + 4 * j + t) << 4);
                            }
                        }
                    }
                    _ => {
                        dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                        for j in 0..8 {
                            for t in 0..4 {
                                dst[16 + 32 * j + 4 * r + t] = src[2 + 4 * j + t] ^ Q8_0_OFFSET;
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Row `r` of a group (`0..GROUP`) in its original block form, appended to `out`.
pub fn unpack_row(ty: GgmlType, group: &[u8], r: usize, out: &mut Vec<u8>) {
    let size = group_block_bytes(ty).expect("a type with an interleaved layout");
    for dst in group.chunks_exact(size) {
        match ty {
            GgmlType::Q4_1 => {
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                out.extend_from_slice(&dst[16 + 2 * r..16 + 2 * r + 2]);
                let byte = |e: usize| dst[32 + 32 * (e / 4) + 4 * r + e % 4];
                // Byte `e` of the group is the original byte `e`: values `e` and `16 + e`.
                out.extend((0..16).map(byte));
            }
            _ => {
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                for j in 0..8 {
                    out.extend(
                        dst[16 + 32 * j + 4 * r..][..4]
                            .iter()
                            .map(|q| q ^ Q8_0_OFFSET),
                    );
                }
            }
        }
    }
}

/// Eight rows' products with one activation row given in two passes.
///
/// # Safety
/// The CPU must support the tier the function was chosen for; `w` must hold exactly
/// `hi.len()` block columns of the function's type, and `lo.len() == hi.len()`.
pub(crate) type GroupFn = unsafe fn(&[u8], &[ActBlock], &[ActBlock]) -> [f32; GROUP];

/// The group kernel of `ty` at `tier` (the best at or below it), if `ty` has one.
pub(crate) fn group_kernel(ty: GgmlType, tier: Tier) -> Option<GroupFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let simd: Option<GroupFn> = match (tier, ty) {
            (Tier::Avx512Vnni, GgmlType::Q4_1) => Some(x86::vnni::q4_1),
            (Tier::Avx512Vnni, GgmlType::Q8_0) => Some(x86::q8_0_offset::group),
            (Tier::Avx2, GgmlType::Q4_1) => Some(x86::avx2::q4_1),
            (Tier::Avx2, GgmlType::Q8_0) => Some(x86::q8_0_sign::group),
            _ => None,
        };
        if simd.is_some() {
            return simd;
        }
    }
    let _ = tier;
    match ty {
        GgmlType::Q4_1 => Some(q4_1_scalar),
        GgmlType::Q8_0 => Some(q8_0_scalar),
        _ => None,
    }
}

/// Activation rows a tile kernel multiplies at once.
pub const TILE: usize = 4;

/// Eight rows' products with [`TILE`] activation rows, each row's result bit for bit the
/// [`GroupFn`]'s for that row alone (the integer sums are exact in any order, and each row's
/// float steps are the same), so a sequence's outputs do not depend on its batch. The weights'
/// nibbles are unpacked once per tile instead of once per row.
///
/// # Safety
/// As [`GroupFn`], for every row of `hi` and `lo`.
pub(crate) type TileFn =
    unsafe fn(&[u8], [&[ActBlock]; TILE], [&[ActBlock]; TILE]) -> [[f32; GROUP]; TILE];

/// The tile kernel of `ty` at `tier` (the best at or below it), if `ty` has one.
pub(crate) fn tile_kernel(ty: GgmlType, tier: Tier) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    {
        let simd: Option<TileFn> = match (tier, ty) {
            (Tier::Avx512Vnni, GgmlType::Q4_1) => Some(x86::vnni::q4_1_tile),
            (Tier::Avx512Vnni, GgmlType::Q8_0) => Some(x86::q8_0_offset::tile),
            (Tier::Avx2, GgmlType::Q4_1) => Some(x86::avx2::q4_1_tile),
            (Tier::Avx2, GgmlType::Q8_0) => Some(x86::q8_0_sign::tile),
            _ => None,
        };
        if simd.is_some() {
            return simd;
        }
    }
    let _ = tier;
    match ty {
        GgmlType::Q4_1 => Some(q4_1_scalar_tile),
        GgmlType::Q8_0 => Some(q8_0_scalar_tile),
        _ => None,
    }
}

/// The scalar tile: the scalar group kernel row by row.
fn q4_1_scalar_tile(
    w: &[u8],
    hi: [&[ActBlock]; TILE],
    lo: [&[ActBlock]; TILE],
) -> [[f32; GROUP]; TILE] {
    std::array::from_fn(|i| q4_1_scalar(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar group kernel row by row.
fn q8_0_scalar_tile(
    w: &[u8],
    hi: [&[ActBlock]; TILE],
    lo: [&[ActBlock]; TILE],
) -> [[f32; GROUP]; TILE] {
    std::array::from_fn(|i| q8_0_scalar(w, hi[i], lo[i]))
}

fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// The scalar reference for Q4_1 groups.
fn q4_1_scalar(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
        let block = &w[b * 160..(b + 1) * 160];
        for (r, y) in out.iter_mut().enumerate() {
            let (mut sum_h, mut sum_l) = (0i32, 0i32);
            for e in 0..32 {
                let byte = block[32 + 32 * (e % 16 / 4) + 4 * r + e % 4];
                let q = i32::from(if e < 16 { byte & 0x0F } else { byte >> 4 });
                sum_h += q * i32::from(h.qs[e]);
                sum_l += q * i32::from(l.qs[e]);
            }
            let (d, m) = (f16_at(block, r), f16_at(&block[16..], r));
            *y += d * (h.d * sum_h as f32 + l.d * sum_l as f32) + m * (h.d_sum + l.d_sum);
        }
    }
    out
}

/// The scalar reference for Q8_0 groups.
fn q8_0_scalar(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
        let block = &w[b * 272..(b + 1) * 272];
        for (r, y) in out.iter_mut().enumerate() {
            let (mut sum_h, mut sum_l) = (0i32, 0i32);
            for e in 0..32 {
                let q = i32::from(block[16 + 32 * (e / 4) + 4 * r + e % 4]) - 128;
                sum_h += q * i32::from(h.qs[e]);
                sum_l += q * i32::from(l.qs[e]);
            }
            *y += f16_at(block, r) * (h.d * sum_h as f32 + l.d * sum_l as f32);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, TILE};
    use crate::act::ActBlock;

    /// Four activation bytes `4j..4j + 4` of `a` in every lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn broadcast(a: &ActBlock, j: usize) -> __m256i {
        let word = i32::from_le_bytes([
            a.qs[4 * j] as u8,
            a.qs[4 * j + 1] as u8,
            a.qs[4 * j + 2] as u8,
            a.qs[4 * j + 3] as u8,
        ]);
        _mm256_set1_epi32(word)
    }

    /// Eight f16 at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn halves(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    /// `acc + d_w × (d_hi × Σhi + d_lo × Σlo)` per row lane, for one block column whose
    /// integer sums are `[hi, hi, lo, lo]` (two accumulators per pass).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_block(
        acc: __m256,
        d: __m256,
        [sh, th, sl, tl]: [__m256i; 4],
        h: &ActBlock,
        l: &ActBlock,
    ) -> __m256 {
        unsafe {
            add_sums(
                acc,
                d,
                _mm256_add_epi32(sh, th),
                _mm256_add_epi32(sl, tl),
                h,
                l,
            )
        }
    }

    /// `acc + d_w × (d_hi × sum_h + d_lo × sum_l)` per row lane: the float steps of a block
    /// column, shared by the group and the tile kernels so that both round alike.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_sums(
        acc: __m256,
        d: __m256,
        sum_h: __m256i,
        sum_l: __m256i,
        h: &ActBlock,
        l: &ActBlock,
    ) -> __m256 {
        let scaled = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sum_h),
            _mm256_set1_ps(h.d),
            _mm256_mul_ps(_mm256_cvtepi32_ps(sum_l), _mm256_set1_ps(l.d)),
        );
        _mm256_fmadd_ps(d, scaled, acc)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store(v: __m256) -> [f32; GROUP] {
        let mut out = [0f32; GROUP];
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    /// `acc + Σ` of four u8 × i8 products per lane (AVX2; the u8 side is at most 128 here and
    /// the i8 side at most 127 in magnitude, so `vpmaddubsw`'s pair sums cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
        )
    }

    /// The same with VNNI.
    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn dot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, s)
    }

    macro_rules! q4_1_group {
        ($tier:ident, $features:literal, $dot:ident) => {
            pub(super) mod $tier {
                use super::*;

                /// Eight Q4_1 rows × two-pass activations.
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q4_1(
                    w: &[u8],
                    hi: &[ActBlock],
                    lo: &[ActBlock],
                ) -> [f32; GROUP] {
                    let mask = _mm256_set1_epi8(0x0F);
                    let mut acc = _mm256_setzero_ps();
                    let mut mins = _mm256_setzero_ps();
                    for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
                        let p = unsafe { w.as_ptr().add(160 * b) };
                        let (mut sh, mut sl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        let (mut th, mut tl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for j in 0..4 {
                            let raw = unsafe { _mm256_loadu_si256(p.add(32 + 32 * j).cast()) };
                            let low = _mm256_and_si256(raw, mask);
                            let high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                            unsafe {
                                sh = $dot(sh, low, broadcast(h, j));
                                th = $dot(th, high, broadcast(h, 4 + j));
                                sl = $dot(sl, low, broadcast(l, j));
                                tl = $dot(tl, high, broadcast(l, 4 + j));
                            }
                        }
                        let d = unsafe { halves(p) };
                        acc = unsafe { add_block(acc, d, [sh, th, sl, tl], h, l) };
                        let m = unsafe { halves(p.add(16)) };
                        mins = _mm256_fmadd_ps(m, _mm256_set1_ps(h.d_sum + l.d_sum), mins);
                    }
                    unsafe { store(_mm256_add_ps(acc, mins)) }
                }

                /// [`q4_1`] for [`TILE`] activation rows: each chunk of nibbles is unpacked
                /// once for all of them.
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q4_1_tile(
                    w: &[u8],
                    hi: [&[ActBlock]; TILE],
                    lo: [&[ActBlock]; TILE],
                ) -> [[f32; GROUP]; TILE] {
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mask = _mm256_set1_epi8(0x0F);
                    let mut acc = [_mm256_setzero_ps(); TILE];
                    let mut mins = [_mm256_setzero_ps(); TILE];
                    for b in 0..blocks {
                        let p = unsafe { w.as_ptr().add(160 * b) };
                        // SAFETY: every row holds `blocks` blocks (the caller's contract).
                        let h: [&ActBlock; TILE] =
                            std::array::from_fn(|i| unsafe { hi[i].get_unchecked(b) });
                        let l: [&ActBlock; TILE] =
                            std::array::from_fn(|i| unsafe { lo[i].get_unchecked(b) });
                        let mut sh = [_mm256_setzero_si256(); TILE];
                        let mut sl = [_mm256_setzero_si256(); TILE];
                        for j in 0..4 {
                            let raw = unsafe { _mm256_loadu_si256(p.add(32 + 32 * j).cast()) };
                            let low = _mm256_and_si256(raw, mask);
                            let high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                            for i in 0..TILE {
                                unsafe {
                                    sh[i] = $dot(sh[i], low, broadcast(h[i], j));
                                    sh[i] = $dot(sh[i], high, broadcast(h[i], 4 + j));
                                    sl[i] = $dot(sl[i], low, broadcast(l[i], j));
                                    sl[i] = $dot(sl[i], high, broadcast(l[i], 4 + j));
                                }
                            }
                        }
                        let d = unsafe { halves(p) };
                        let m = unsafe { halves(p.add(16)) };
                        for i in 0..TILE {
                            acc[i] = unsafe { add_sums(acc[i], d, sh[i], sl[i], h[i], l[i]) };
                            mins[i] = _mm256_fmadd_ps(
                                m,
                                _mm256_set1_ps(h[i].d_sum + l[i].d_sum),
                                mins[i],
                            );
                        }
                    }
                    let mut out = [[0f32; GROUP]; TILE];
                    for ((out, acc), mins) in out.iter_mut().zip(acc).zip(mins) {
                        *out = unsafe { store(_mm256_add_ps(acc, mins)) };
                    }
                    out
                }
            }
        };
    }

    q4_1_group!(avx2, "avx2,fma,f16c", dot_avx2);
    q4_1_group!(
        vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        dot_vnni
    );

    /// Q8_0 on AVX2 with the sign trick: `vpmaddubsw` multiplies unsigned by signed bytes, so
    /// the weights go in as `|w|` and the activations as `sign(a, w)` (`|-128|` is 128 read
    /// unsigned, activations never reach -128): pair sums of at most 2 × 128 × 127 fit its
    /// 16-bit lanes.
    pub(super) mod q8_0_sign {
        use super::*;

        /// A chunk of 32 stored quants at `p` back as signed bytes.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn signed(p: *const u8) -> __m256i {
            let stored = unsafe { _mm256_loadu_si256(p.cast()) };
            _mm256_xor_si256(stored, _mm256_set1_epi8(i8::MIN))
        }

        /// Eight Q8_0 rows × two-pass activations.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) unsafe fn group(
            w: &[u8],
            hi: &[ActBlock],
            lo: &[ActBlock],
        ) -> [f32; GROUP] {
            let mut acc = _mm256_setzero_ps();
            for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
                let p = unsafe { w.as_ptr().add(272 * b) };
                let (mut sh, mut sl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                let (mut th, mut tl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in (0..8).step_by(2) {
                    unsafe {
                        let w0 = signed(p.add(16 + 32 * j));
                        let w1 = signed(p.add(48 + 32 * j));
                        let (h0, h1) = (broadcast(h, j), broadcast(h, j + 1));
                        let (l0, l1) = (broadcast(l, j), broadcast(l, j + 1));
                        let (u0, u1) = (_mm256_abs_epi8(w0), _mm256_abs_epi8(w1));
                        sh = dot_avx2(sh, u0, _mm256_sign_epi8(h0, w0));
                        th = dot_avx2(th, u1, _mm256_sign_epi8(h1, w1));
                        sl = dot_avx2(sl, u0, _mm256_sign_epi8(l0, w0));
                        tl = dot_avx2(tl, u1, _mm256_sign_epi8(l1, w1));
                    }
                }
                let d = unsafe { halves(p) };
                acc = unsafe { add_block(acc, d, [sh, th, sl, tl], h, l) };
            }
            unsafe { store(acc) }
        }

        /// [`group`] for [`TILE`] activation rows: each chunk's magnitudes are taken
        /// once for all of them.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) unsafe fn tile(
            w: &[u8],
            hi: [&[ActBlock]; TILE],
            lo: [&[ActBlock]; TILE],
        ) -> [[f32; GROUP]; TILE] {
            let blocks = hi[0].len();
            debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); TILE];
            for b in 0..blocks {
                let p = unsafe { w.as_ptr().add(272 * b) };
                // SAFETY: every row holds `blocks` blocks (the caller's contract).
                let h: [&ActBlock; TILE] =
                    std::array::from_fn(|i| unsafe { hi[i].get_unchecked(b) });
                let l: [&ActBlock; TILE] =
                    std::array::from_fn(|i| unsafe { lo[i].get_unchecked(b) });
                let mut sh = [_mm256_setzero_si256(); TILE];
                let mut sl = [_mm256_setzero_si256(); TILE];
                for j in 0..8 {
                    let w0 = unsafe { signed(p.add(16 + 32 * j)) };
                    let u0 = _mm256_abs_epi8(w0);
                    for i in 0..TILE {
                        unsafe {
                            let (hj, lj) = (broadcast(h[i], j), broadcast(l[i], j));
                            sh[i] = dot_avx2(sh[i], u0, _mm256_sign_epi8(hj, w0));
                            sl[i] = dot_avx2(sl[i], u0, _mm256_sign_epi8(lj, w0));
                        }
                    }
                }
                let d = unsafe { halves(p) };
                for i in 0..TILE {
                    acc[i] = unsafe { add_sums(acc[i], d, sh[i], sl[i], h[i], l[i]) };
                }
            }
            let mut out = [[0f32; GROUP]; TILE];
            for (out, acc) in out.iter_mut().zip(acc) {
                *out = unsafe { store(acc) };
            }
            out
        }
    }

    /// Q8_0 on VNNI without the sign trick: the stored quants are already the unsigned bytes
    /// `w + 128` that `vpdpbusd` takes, so a chunk multiplies the broadcast activations as it
    /// is (as Q4_1's nibbles do, the broadcast folded into the instruction), and
    /// Σ (w + 128) a = Σ w a + 128 Σ a: the activation block's `128 × sum` comes off each
    /// row's integer sum. The sums are the sign trick's exactly, so the float steps and the
    /// bits are too.
    pub(super) mod q8_0_offset {
        use super::*;

        /// `sum - 128 × Σ a` in every lane.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn unoffset(sum: __m256i, a: &ActBlock) -> __m256i {
            _mm256_sub_epi32(sum, _mm256_set1_epi32(a.sum << 7))
        }

        /// Eight Q8_0 rows × two-pass activations.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(in crate::interleaved) unsafe fn group(
            w: &[u8],
            hi: &[ActBlock],
            lo: &[ActBlock],
        ) -> [f32; GROUP] {
            let mut acc = _mm256_setzero_ps();
            for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
                let p = unsafe { w.as_ptr().add(272 * b) };
                let (mut sh, mut sl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                let (mut th, mut tl) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in (0..8).step_by(2) {
                    unsafe {
                        let w0 = _mm256_loadu_si256(p.add(16 + 32 * j).cast());
                        let w1 = _mm256_loadu_si256(p.add(48 + 32 * j).cast());
                        sh = dot_vnni(sh, w0, broadcast(h, j));
                        th = dot_vnni(th, w1, broadcast(h, j + 1));
                        sl = dot_vnni(sl, w0, broadcast(l, j));
                        tl = dot_vnni(tl, w1, broadcast(l, j + 1));
                    }
                }
                let sum_h = unsafe { unoffset(_mm256_add_epi32(sh, th), h) };
                let sum_l = unsafe { unoffset(_mm256_add_epi32(sl, tl), l) };
                acc = unsafe { add_sums(acc, halves(p), sum_h, sum_l, h, l) };
            }
            unsafe { store(acc) }
        }

        /// [`group`] for [`TILE`] activation rows: each chunk is loaded once for all of them.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(in crate::interleaved) unsafe fn tile(
            w: &[u8],
            hi: [&[ActBlock]; TILE],
            lo: [&[ActBlock]; TILE],
        ) -> [[f32; GROUP]; TILE] {
            let blocks = hi[0].len();
            debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); TILE];
            for b in 0..blocks {
                let p = unsafe { w.as_ptr().add(272 * b) };
                // SAFETY: every row holds `blocks` blocks (the caller's contract).
                let h: [&ActBlock; TILE] =
                    std::array::from_fn(|i| unsafe { hi[i].get_unchecked(b) });
                let l: [&ActBlock; TILE] =
                    std::array::from_fn(|i| unsafe { lo[i].get_unchecked(b) });
                let mut sh = [_mm256_setzero_si256(); TILE];
                let mut sl = [_mm256_setzero_si256(); TILE];
                for j in 0..8 {
                    let w0 = unsafe { _mm256_loadu_si256(p.add(16 + 32 * j).cast()) };
                    for i in 0..TILE {
                        unsafe {
                            sh[i] = dot_vnni(sh[i], w0, broadcast(h[i], j));
                            sl[i] = dot_vnni(sl[i], w0, broadcast(l[i], j));
                        }
                    }
                }
                let d = unsafe { halves(p) };
                for i in 0..TILE {
                    let (sum_h, sum_l) = unsafe { (unoffset(sh[i], h[i]), unoffset(sl[i], l[i])) };
                    acc[i] = unsafe { add_sums(acc[i], d, sum_h, sum_l, h[i], l[i]) };
                }
            }
            let mut out = [[0f32; GROUP]; TILE];
            for (out, acc) in out.iter_mut().zip(acc) {
                *out = unsafe { store(acc) };
            }
            out
        }
    }
}
