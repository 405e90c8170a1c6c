//! Weights repacked eight output rows at a time, so one SIMD register holds one value of each
//! of eight rows and a product yields eight outputs without horizontal sums (llama.cpp's
//! `block_q4_0x8` and `block_q4_Kx8` repacks in `ggml-cpu/repack.cpp`), done here for Q4_1
//! and Q8_0 (the default model's types), Q4_0 (Q4_1's layout without the minimums), Q5_0 and
//! Q5_1 (Q4_0's and Q4_1's with Q5_K's fifth bits after the nibbles: the fallbacks
//! llama-quantize writes for matrices whose width is not a multiple of 256, most of a small
//! model's Q4_K_M or Q5_K_M file), IQ4_NL (Q4_0's layout, its nibbles indices into ggml's
//! table) and IQ4_XS, and for the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (the types of the
//! Q2_K, Q3_K_M, Q4_K_M, Q5_K_M and Q6_K files users download).
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
//! The K-quants keep their 256-value super-blocks as block columns; each 32-value sub-block
//! (one activation block) is laid out as a Q4_1 block's nibbles are:
//! - Q4_K: the eight f16 `d`, the eight f16 `dmin`, the 6-bit scales unpacked to one byte
//!   each (`[sub-block][row]`, 64 bytes), the minimums likewise, then eight sub-blocks of 128
//!   bytes of nibbles. `d × scale` and `dmin × min` are exact in f32, so the products are the
//!   row kernel's exactly, to the order of the float sums.
//! - Q5_K: as Q4_K, each sub-block followed by 32 bytes of fifth bits: lane `r`'s byte `t`
//!   holds, for chunk `j`, value `4j + t`'s bit at `2j` and value `16 + 4j + t`'s at `2j + 1`
//!   (1,440 bytes for GGUF's 1,408).
//! - Q6_K: the eight f16 `d`, the 16 i8 scales (`[scale][row]`, 128 bytes), then per
//!   sub-block 128 bytes of the low four bits (as Q4_1's nibbles) and 64 of the high two: lane
//!   `r` of chunk `c` holds, for `j = 2c + k`, value `4j + t`'s two bits at bit `4k` and value
//!   `16 + 4j + t`'s at `4k + 2`. A chunk's low nibbles are the sub-block's first 16 values and
//!   its high nibbles the last 16, the halves Q6_K scales apart; the stored values are `q + 32`
//!   (unsigned), and `32 × Σ a` over each half ([`ActBlock::sum_first_half`]) comes off.
//! - Q3_K: Q6_K's `d` and scales, then per sub-block 128 bytes of Q4_1-ordered nibbles holding
//!   `q + 4` (three bits; `4 × Σ a` per half comes off).
//! - Q2_K: the eight f16 `d`, the eight `dmin`, GGUF's scale-and-minimum bytes (scale in the
//!   low nibble, minimum in the high) as `[sub-block][row][half]` (128 bytes), then per
//!   sub-block 64 bytes of two-bit values laid out as Q6_K's high pairs: lane `r` of vector
//!   `k` holds, for chunk `j = 2k + i`, value `4j + t`'s two bits at bit `4i` and value
//!   `16 + 4j + t`'s at `4i + 2` (672 bytes, GGUF's 8 × 84). A row's two half-scales and two
//!   minimums then sit side by side in one 32-bit lane once widened to 16 bits.
//! - IQ4_XS: the eight `d`, the sub-block scales `ls − 32` as signed bytes (`[sub-block][row]`,
//!   64 bytes), then eight sub-blocks of 128 bytes of Q4_1-ordered table indices.
//!
//! All are the GGUF bytes rearranged, and read back exactly ([`unpack_row`]).
//!
//! Each call takes an activation row in two passes ([`crate::act::quantize_split`]): the
//! 8-bit blocks and the 8-bit blocks of what they left over, so the product is as exact as
//! 16-bit activations while every multiply stays an 8-bit one.

use half::f16;

use crate::SharedOut;
use crate::act::{ActBlock, ActPasses};
use crate::ggml::{
    GgmlType, IQ4_VALUES, iq4_xs_scale, pack_scale_min_k4, q2_k_sub, q3_k_scales, q3_k_value,
    scale_min_k4_bits,
};
use crate::pool::ThreadPool;
use crate::tier::Tier;

mod q16;
mod wide;

pub(crate) use q16::Q16Tiles;
pub(crate) use wide::{WIDE_ROWS, WideKernels};

/// Rows per group.
pub const GROUP: usize = 8;

/// What a Q8_0 quant is stored XOR-ed with: `q ^ 0x80` is `q + 128` read as an unsigned byte.
const Q8_0_OFFSET: u8 = 0x80;

/// Where Q4_K's and Q5_K's eight sub-blocks start in a block column, after `d`, `dmin`, the
/// scales and the minimums.
const K_QUANTS: usize = 2 * 8 + 2 * 8 + 64 + 64;
/// Bytes of one Q4_K sub-block of a group: 128 of nibbles.
const Q4_K_SUB: usize = 128;
/// Bytes of one Q5_K sub-block of a group: 128 of nibbles, 32 of fifth bits.
const Q5_K_SUB: usize = 160;

/// Bytes of a Q4_K (`fifth` false) or Q5_K block column and of one of its sub-blocks.
const fn k_sizes(fifth: bool) -> (usize, usize) {
    let sub = if fifth { Q5_K_SUB } else { Q4_K_SUB };
    (K_QUANTS + 8 * sub, sub)
}
/// Bytes of Q6_K's block column: `d`, scales, eight sub-blocks of low nibbles and high bits.
const Q6_K_BYTES: usize = 2 * 8 + 16 * 8 + 8 * Q6_K_SUB;
/// Where Q6_K's sub-blocks start in a block column.
const Q6_K_QUANTS: usize = 144;
/// Bytes of one Q6_K sub-block of a group: 128 of low nibbles, 64 of high bits.
const Q6_K_SUB: usize = 192;
/// Bytes of one Q3_K sub-block of a group: 128 of nibbles holding `q + 4` (three bits).
const Q3_K_SUB: usize = 128;
/// Bytes of Q3_K's block column: Q6_K's header (`d`, the 16 scales as signed bytes), eight
/// sub-blocks of nibbles: 1,168 bytes for GGUF's 880.
const Q3_K_BYTES: usize = Q6_K_QUANTS + 8 * Q3_K_SUB;

/// Where Q2_K's eight sub-blocks start in a block column, after the eight `d`, the eight
/// `dmin` and the scale-and-minimum bytes (`[sub-block][row][half]`).
const Q2_K_QUANTS: usize = 2 * 8 + 2 * 8 + 16 * 8;
/// Bytes of one Q2_K sub-block of a group: two 32-byte vectors of two-bit values.
const Q2_K_SUB: usize = 64;
/// Bytes of Q2_K's block column: 672, GGUF's 8 × 84.
const Q2_K_BYTES: usize = Q2_K_QUANTS + 8 * Q2_K_SUB;

/// Q6_K's (`q3` false) or Q3_K's block column and sub-block bytes, and the offset their
/// stored values carry.
const fn half_scaled_sizes(q3: bool) -> (usize, usize, i32) {
    if q3 {
        (Q3_K_BYTES, Q3_K_SUB, 4)
    } else {
        (Q6_K_BYTES, Q6_K_SUB, crate::act::Q6_K_OFFSET)
    }
}

/// Bytes of a Q4_0 (`min` false, `fifth` false), Q4_1 (`min`), Q5_0 (`fifth`) or Q5_1 (both)
/// block column, and where its nibbles start: the eight `d` (f16), the eight minimums (Q4_1,
/// Q5_1), 128 bytes of nibbles, and for Q5_0/Q5_1 32 bytes of fifth bits laid out as a Q5_K
/// sub-block's ([`fifth_bit_at`]).
const fn q4_sizes(min: bool, fifth: bool) -> (usize, usize) {
    let quants = if min { 32 } else { 16 };
    let sub = if fifth { Q5_K_SUB } else { Q4_K_SUB };
    (quants + sub, quants)
}

/// Where IQ4_XS's eight sub-blocks start in a block column, after the eight `d` and the
/// scales (`[sub-block][row]`, one signed byte each, `ls − 32`).
const IQ4_XS_QUANTS: usize = 2 * 8 + 64;
/// Bytes of IQ4_XS's block column: 1,104 for GGUF's 1,088.
const IQ4_XS_BYTES: usize = IQ4_XS_QUANTS + 8 * 128;

/// The offset of Q4_0 (8) and Q5_0 (16) values: `q − offset` is the signed value.
const fn q_offset(fifth: bool) -> f32 {
    if fifth { 16.0 } else { 8.0 }
}

/// Bytes of one block column of a group, or `None` for a type without an interleaved kernel.
pub fn group_block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 => Some(q4_sizes(false, false).0),
        GgmlType::Q4_1 => Some(q4_sizes(true, false).0),
        GgmlType::Q5_0 => Some(q4_sizes(false, true).0),
        GgmlType::Q5_1 => Some(q4_sizes(true, true).0),
        GgmlType::Iq4Nl => Some(q4_sizes(false, false).0),
        GgmlType::Iq4Xs => Some(IQ4_XS_BYTES),
        GgmlType::Q8_0 => Some(2 * 8 + 256),
        GgmlType::Q4K => Some(k_sizes(false).0),
        GgmlType::Q5K => Some(k_sizes(true).0),
        GgmlType::Q6K => Some(Q6_K_BYTES),
        GgmlType::Q3K => Some(Q3_K_BYTES),
        GgmlType::Q2K => Some(Q2_K_BYTES),
        _ => None,
    }
}

/// Value `e` (0..32) of a Q4_1-ordered 128-byte nibble block (Q4_1's quants, a Q4_K or Q6_K
/// sub-block) for row `r`: the byte that holds it and whether it is the high nibble.
fn nibble_at(e: usize, r: usize) -> (usize, bool) {
    (32 * (e % 16 / 4) + 4 * r + e % 4, e >= 16)
}

/// Where the fifth bit of value `e` (0..32) of a Q5_K sub-block of a group sits for row `r`:
/// the byte (from the sub-block's start) and the bit. Lane `r`'s byte `t` holds, for chunk
/// `j`, value `4j + t`'s bit at `2j` and value `16 + 4j + t`'s at `2j + 1`.
fn fifth_bit_at(e: usize, r: usize) -> (usize, u32) {
    let j = e % 16 / 4;
    let bit = 2 * j + usize::from(e >= 16);
    (Q4_K_SUB + 4 * r + e % 4, bit as u32)
}

/// Sets value `v` (0..256) of a GGUF Q6_K block (whose bits for it are zero) to `q` (its six
/// bits, `q + 32`): value `v = 128 half + 32 k + l` keeps its low nibble in nibble `k / 2` of
/// byte `64 half + 32 (k % 2) + l` and its high pair at bit `2 k` of byte `128 + 32 half + l`.
fn set_q6_k_value(block: &mut [u8], v: usize, q: u8) {
    let (half, k, l) = (v / 128, v % 128 / 32, v % 32);
    let low = &mut block[64 * half + l + 32 * (k % 2)];
    *low |= if k < 2 { q & 0xF } else { (q & 0xF) << 4 };
    block[128 + 32 * half + l] |= (q >> 4) << (2 * k);
}

/// Where two bits of value `e` (0..32) of a sub-block sit for row `r` in 64 bytes of bit
/// pairs (Q6_K's high bits, Q2_K's values): the byte and the shift. Lane `r`'s byte `t` of
/// vector `k` holds, for chunk `j = 2k + i`, value `4j + t`'s pair at bit `4i` and value
/// `16 + 4j + t`'s at `4i + 2`.
fn bit_pair_at(e: usize, r: usize) -> (usize, u32) {
    let j = e % 16 / 4;
    let shift = 4 * (j % 2) + if e >= 16 { 2 } else { 0 };
    (32 * (j / 2) + 4 * r + e % 4, shift as u32)
}

/// Where the high two bits of value `e` (0..32) of a Q6_K sub-block of a group sit for row
/// `r`: the byte (from the sub-block's start) and the shift.
fn q6_k_high_bits_at(e: usize, r: usize) -> (usize, u32) {
    let (at, shift) = bit_pair_at(e, r);
    (128 + at, shift)
}

/// Input bytes [`pack`] repacks between two calls of its `consumed` callback: a few
/// groups' worth, so that a loader can drop a mapped file's pages as it goes (a whole
/// tensor's would sit in memory next to its repacked copy).
const PACK_CHUNK_BYTES: usize = 8 << 20;

/// Rearranges `rows` (a multiple of [`GROUP`]) rows of `ty` blocks, `row_bytes` each, into
/// groups on the global thread pool, handing `consumed` each span of `data` (a byte range, in
/// order, the spans covering it) once every byte of it has been read: groups are repacked a
/// chunk of about 8 MiB of `data` at a time, the chunk's groups split over the threads.
///
/// # Panics
/// If `ty` has no interleaved layout or the sizes disagree.
pub fn pack(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    row_bytes: usize,
    consumed: &mut dyn FnMut(std::ops::Range<usize>),
) -> Vec<u8> {
    assert_eq!(data.len(), rows * row_bytes);
    pack_parts(ty, &[data], row_bytes, &mut |_, span| consumed(span))
}

/// [`pack`] for several matrices of one type and width stacked (their rows one after the
/// other) into one buffer, each repacked once from its own blocks: `consumed` gets the index
/// of the part with each span of it.
///
/// # Panics
/// If `ty` has no interleaved layout, or a part is not a whole number of groups of rows of
/// `row_bytes`.
pub fn pack_parts(
    ty: GgmlType,
    parts: &[&[u8]],
    row_bytes: usize,
    consumed: &mut dyn FnMut(usize, std::ops::Range<usize>),
) -> Vec<u8> {
    let out_block = group_block_bytes(ty).expect("a type with an interleaved layout");
    let group_in = GROUP * row_bytes;
    if group_in == 0 {
        // Rows of no values: nothing to repack.
        return Vec::new();
    }
    assert!(
        parts.iter().all(|p| p.len().is_multiple_of(group_in)),
        "parts of whole groups of rows"
    );
    let group_out = row_bytes / ty.type_size() * out_block;
    let groups: usize = parts.iter().map(|p| p.len() / group_in).sum();
    let mut out = zeroed_on_huge_pages(groups * group_out);
    let groups_per_chunk = (PACK_CHUNK_BYTES / group_in).max(1);
    let pool = ThreadPool::global();
    let shared = SharedOut::new(&mut out);
    let mut first_out = 0;
    for (index, data) in parts.iter().enumerate() {
        let part_groups = data.len() / group_in;
        for first in (0..part_groups).step_by(groups_per_chunk) {
            let chunk = first..(first + groups_per_chunk).min(part_groups);
            let per_task = chunk.len().div_ceil(pool.threads() * 4).max(1);
            pool.run(chunk.len().div_ceil(per_task), &|task| {
                let start = chunk.start + task * per_task;
                for g in start..(start + per_task).min(chunk.end) {
                    // SAFETY: each group's output span is written by exactly one task.
                    let dst = unsafe { shared.slice((first_out + g) * group_out, group_out) };
                    pack_group(ty, &data[g * group_in..(g + 1) * group_in], row_bytes, dst);
                }
            });
            consumed(index, chunk.start * group_in..chunk.end * group_in);
        }
        first_out += part_groups;
    }
    out
}

/// `len` zero bytes for weights, their whole 2 MiB pages to be backed by huge pages as they
/// are first written (`MADV_HUGEPAGE`; THP's default "madvise" mode honours it). The weights
/// are streamed once per decoded token, and on 4 KiB pages each page is a TLB miss; backing
/// them when they are written costs nothing more than zeroing, where collapsing them
/// afterwards (`MADV_COLLAPSE`, which the CLI still does for what this missed) copies every
/// byte. A hint: where THP is off, or the allocator handed out memory already touched,
/// nothing changes.
pub(crate) fn zeroed_on_huge_pages(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    #[cfg(target_os = "linux")]
    {
        const HUGE_PAGE: usize = 2 << 20;
        let start = (buf.as_mut_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let end = (buf.as_mut_ptr() as usize + buf.len()) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: advice on whole pages inside `buf`, memory this process owns; it changes
            // only which pages back the range, never its contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    buf
}

/// Row `r`'s 32 values of a block or sub-block (`value(e)`, four bits each) as Q4_1-ordered
/// nibbles in `dst`: values `e` and `16 + e` share the byte [`nibble_at`] names. Generic, not
/// `&dyn Fn`, so that each type's reading of its values is inlined: loading an 8B file ran a
/// dynamic call per weight.
#[inline(always)]
fn put_nibbles(dst: &mut [u8], r: usize, value: impl Fn(usize) -> u8) {
    for e in 0..16 {
        dst[nibble_at(e, r).0] = value(e) | (value(16 + e) << 4);
    }
}

/// Four bytes of `src` from `at`, as a little-endian word.
#[inline(always)]
fn word(src: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]])
}

/// [`put_nibbles`] for values that are nibble `shift / 4` of `src[e]` (the K-quants' and
/// Q6_K's low bits), a chunk lane's four bytes at a time.
#[inline(always)]
fn put_nibble_words(dst: &mut [u8], r: usize, src: &[u8], shift: u32) {
    for j in 0..4 {
        let first = (word(src, 4 * j) >> shift) & 0x0F0F_0F0F;
        let second = (word(src, 16 + 4 * j) >> shift) & 0x0F0F_0F0F;
        dst[32 * j + 4 * r..][..4].copy_from_slice(&(first | second << 4).to_le_bytes());
    }
}

/// One group: `src` its [`GROUP`] rows of `row_bytes`, `out` its repacked bytes.
fn pack_group(ty: GgmlType, src_rows: &[u8], row_bytes: usize, out: &mut [u8]) {
    let out_block = group_block_bytes(ty).expect("a type with an interleaved layout");
    let in_block = ty.type_size();
    let blocks = row_bytes / in_block;
    for b in 0..blocks {
        let dst = &mut out[b * out_block..][..out_block];
        for r in 0..GROUP {
            let src = &src_rows[r * row_bytes + b * in_block..][..in_block];
            match ty {
                GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Iq4Nl => {
                    // IQ4_NL's indices are laid out as Q4_0's nibbles.
                    let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                    let fifth = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
                    let (_, quants) = q4_sizes(min, fifth);
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    if min {
                        dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    // GGUF's scales (`quants / 8` bytes), Q5's u32 of fifth bits (bit `e`
                    // for value `e`), then the nibbles.
                    let scales = quants / 8;
                    let (qh, qs) = if fifth {
                        let qh = &src[scales..scales + 4];
                        (
                            u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]),
                            &src[scales + 4..],
                        )
                    } else {
                        (0, &src[scales..])
                    };
                    let value = |e: usize| {
                        if e < 16 {
                            qs[e] & 0x0F
                        } else {
                            qs[e - 16] >> 4
                        }
                    };
                    let sub = &mut dst[quants..];
                    put_nibbles(sub, r, value);
                    if fifth {
                        for e in 0..32 {
                            let (at, bit) = fifth_bit_at(e, r);
                            sub[at] |= (((qh >> e) & 1) as u8) << bit;
                        }
                    }
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    let fifth = ty == GgmlType::Q5K;
                    let (_, sub_bytes) = k_sizes(fifth);
                    let (qh, qs) = if fifth {
                        (&src[16..48], &src[48..176])
                    } else {
                        (&src[..0], &src[16..144])
                    };
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                    for s in 0..8 {
                        let (sc, m) = scale_min_k4_bits(s, &src[4..16]);
                        dst[32 + 8 * s + r] = sc;
                        dst[96 + 8 * s + r] = m;
                        let sub = &mut dst[K_QUANTS + sub_bytes * s..][..sub_bytes];
                        // Sub-block `s`: nibble `s % 2` of the 32 bytes of group `s / 2`,
                        // and for Q5_K bit `s` of each `qh` byte.
                        put_nibble_words(sub, r, &qs[32 * (s / 2)..], 4 * (s % 2) as u32);
                        if fifth {
                            // Lane `r`'s byte `t` takes value `4 j + t`'s bit at `2 j` and
                            // value `16 + 4 j + t`'s at `2 j + 1` ([`fifth_bit_at`]).
                            let bits = |e: usize| (word(qh, e) >> s) & 0x0101_0101;
                            let lane = (0..4).fold(0, |lane, j| {
                                lane | bits(4 * j) << (2 * j) | bits(16 + 4 * j) << (2 * j + 1)
                            });
                            sub[Q4_K_SUB + 4 * r..][..4].copy_from_slice(&lane.to_le_bytes());
                        }
                    }
                }
                GgmlType::Iq4Xs => {
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    for s in 0..8 {
                        dst[16 + 8 * s + r] = iq4_xs_scale(src, s) as i8 as u8;
                        let qs = &src[8 + 16 * s..8 + 16 * s + 16];
                        let value = |e: usize| {
                            if e < 16 {
                                qs[e] & 0x0F
                            } else {
                                qs[e - 16] >> 4
                            }
                        };
                        put_nibbles(&mut dst[IQ4_XS_QUANTS + 128 * s..], r, value);
                    }
                }
                GgmlType::Q3K => {
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[108..110]);
                    for (i, scale) in q3_k_scales(&src[96..108]).into_iter().enumerate() {
                        dst[16 + 8 * i + r] = scale as u8;
                    }
                    for s in 0..8 {
                        let sub = &mut dst[Q6_K_QUANTS + Q3_K_SUB * s..][..Q3_K_SUB];
                        let value = |e: usize| (q3_k_value(src, 32 * s + e) + 4) as u8;
                        put_nibbles(sub, r, value);
                    }
                }
                GgmlType::Q2K => {
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[80..82]);
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[82..84]);
                    for s in 0..8 {
                        // The scale-and-minimum bytes of the sub-block's two halves.
                        dst[32 + 16 * s + 2 * r..][..2].copy_from_slice(&src[2 * s..2 * s + 2]);
                        // Half `half`'s values `4 j ..` as GGUF keeps them ([`q2_k_sub`]):
                        // four bytes from `at + 4 j`, two bits each at `shift`.
                        let pairs = |half: usize, j: usize| {
                            let (_, _, at, shift) = q2_k_sub(src, 2 * s + half);
                            (word(src, at + 4 * j) >> shift) & 0x0303_0303
                        };
                        for k in 0..2 {
                            let lane = (0..2).fold(0, |lane, i| {
                                let j = 2 * k + i;
                                lane | pairs(0, j) << (4 * i) | pairs(1, j) << (4 * i + 2)
                            });
                            dst[Q2_K_QUANTS + Q2_K_SUB * s + 32 * k + 4 * r..][..4]
                                .copy_from_slice(&lane.to_le_bytes());
                        }
                    }
                }
                GgmlType::Q6K => {
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
                    for i in 0..16 {
                        dst[16 + 8 * i + r] = src[192 + i];
                    }
                    for s in 0..8 {
                        let sub = &mut dst[Q6_K_QUANTS + Q6_K_SUB * s..][..Q6_K_SUB];
                        // Values `32 s ..` as [`set_q6_k_value`] places them: low nibbles in
                        // nibble `k / 2` of `ql`, high bit pairs at bit `2 k` of `qh`.
                        let (half, k) = (s / 4, s % 4);
                        let ql = &src[64 * half + 32 * (k % 2)..][..32];
                        let qh = &src[128 + 32 * half..][..32];
                        put_nibble_words(sub, r, ql, 4 * (k / 2) as u32);
                        // Lane `r`'s byte `t` of high-bit word `p` holds, from bit 0, the
                        // pairs of values `8 p + t`, `16 + 8 p + t`, `8 p + 4 + t` and
                        // `16 + 8 p + 4 + t` ([`q6_k_high_bits_at`]).
                        let pairs = |e: usize| (word(qh, e) >> (2 * k)) & 0x0303_0303;
                        for p in 0..2 {
                            let e = 8 * p;
                            let lane = pairs(e)
                                | pairs(16 + e) << 2
                                | pairs(e + 4) << 4
                                | pairs(16 + e + 4) << 6;
                            sub[128 + 32 * p + 4 * r..][..4].copy_from_slice(&lane.to_le_bytes());
                        }
                    }
                }
                GgmlType::Q8_0 => {
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    for j in 0..8 {
                        for t in 0..4 {
                            dst[16 + 32 * j + 4 * r + t] = src[2 + 4 * j + t] ^ Q8_0_OFFSET;
                        }
                    }
                }
                _ => unreachable!("group_block_bytes admits only the types above"),
            }
        }
    }
}

/// Row `r` of a group (`0..GROUP`) in its original block form, appended to `out`.
pub fn unpack_row(ty: GgmlType, group: &[u8], r: usize, out: &mut Vec<u8>) {
    let size = group_block_bytes(ty).expect("a type with an interleaved layout");
    for dst in group.chunks_exact(size) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Iq4Nl => {
                let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                let fifth = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
                let (_, quants) = q4_sizes(min, fifth);
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                if min {
                    out.extend_from_slice(&dst[16 + 2 * r..16 + 2 * r + 2]);
                }
                if fifth {
                    let qh = (0..32).fold(0u32, |qh, e| {
                        let (at, bit) = fifth_bit_at(e, r);
                        qh | (u32::from((dst[quants + at] >> bit) & 1) << e)
                    });
                    out.extend_from_slice(&qh.to_le_bytes());
                }
                // The byte of value `e` also holds value `16 + e`, as GGUF's byte `e` does.
                out.extend((0..16).map(|e| dst[quants + nibble_at(e, r).0]));
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                let fifth = ty == GgmlType::Q5K;
                let (_, sub_bytes) = k_sizes(fifth);
                let sub = |s: usize| &dst[K_QUANTS + sub_bytes * s..][..sub_bytes];
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                out.extend_from_slice(&dst[16 + 2 * r..16 + 2 * r + 2]);
                let sc = std::array::from_fn(|s| dst[32 + 8 * s + r]);
                let m = std::array::from_fn(|s| dst[96 + 8 * s + r]);
                out.extend_from_slice(&pack_scale_min_k4(sc, m));
                if fifth {
                    out.extend((0..32).map(|e| {
                        let (at, bit) = fifth_bit_at(e, r);
                        (0..8).fold(0u8, |qh, s| qh | (((sub(s)[at] >> bit) & 1) << s))
                    }));
                }
                for g in 0..4 {
                    out.extend(
                        (0..32).map(|l| {
                            nibble(sub(2 * g), l, r) | (nibble(sub(2 * g + 1), l, r) << 4)
                        }),
                    );
                }
            }
            GgmlType::Iq4Xs => {
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                // The stored scales are `ls − 32`; `ls` is six bits, split as GGUF keeps it.
                let ls: [u8; 8] =
                    std::array::from_fn(|s| (i32::from(dst[16 + 8 * s + r] as i8) + 32) as u8);
                let scales_h = (0..8).fold(0u16, |h, s| h | (u16::from(ls[s] >> 4) << (2 * s)));
                out.extend_from_slice(&scales_h.to_le_bytes());
                out.extend((0..4).map(|k| (ls[2 * k] & 0xF) | ((ls[2 * k + 1] & 0xF) << 4)));
                for s in 0..8 {
                    let sub = &dst[IQ4_XS_QUANTS + 128 * s..][..128];
                    out.extend((0..16).map(|e| sub[nibble_at(e, r).0]));
                }
            }
            GgmlType::Q3K => {
                let mut block = [0u8; 110];
                for v in 0..256 {
                    let sub = &dst[Q6_K_QUANTS + Q3_K_SUB * (v / 32)..][..Q3_K_SUB];
                    let q = nibble(sub, v % 32, r);
                    // As `q3_k_value` reads them: two low bits in `qs`, the third in `hmask`.
                    let s = v / 16;
                    block[32 + 32 * (s / 8) + 16 * (s % 2) + v % 16] |=
                        (q & 3) << (2 * (s / 2 % 4));
                    block[v % 32] |= (q >> 2) << (v / 32);
                }
                for i in 0..16 {
                    let scale = (i32::from(dst[16 + 8 * i + r] as i8) + 32) as u8;
                    if i < 8 {
                        block[96 + i] |= scale & 0xF;
                    } else {
                        block[96 + i - 8] |= (scale & 0xF) << 4;
                    }
                    block[104 + i % 4] |= (scale >> 4) << (2 * (i / 4));
                }
                block[108..110].copy_from_slice(&dst[2 * r..2 * r + 2]);
                out.extend_from_slice(&block);
            }
            GgmlType::Q2K => {
                let mut block = [0u8; 84];
                for s in 0..8 {
                    block[2 * s..2 * s + 2].copy_from_slice(&dst[32 + 16 * s + 2 * r..][..2]);
                    let sub = &dst[Q2_K_QUANTS + Q2_K_SUB * s..][..Q2_K_SUB];
                    for e in 0..32 {
                        let (_, _, at, shift) = q2_k_sub(&block, 2 * s + e / 16);
                        block[at + e % 16] |= q2_k_group_value(sub, e, r) << shift;
                    }
                }
                block[80..82].copy_from_slice(&dst[2 * r..2 * r + 2]);
                block[82..84].copy_from_slice(&dst[16 + 2 * r..16 + 2 * r + 2]);
                out.extend_from_slice(&block);
            }
            GgmlType::Q6K => {
                let mut block = [0u8; 210];
                for s in 0..8 {
                    let sub = &dst[Q6_K_QUANTS + Q6_K_SUB * s..][..Q6_K_SUB];
                    for e in 0..32 {
                        set_q6_k_value(&mut block, 32 * s + e, q6_k_group_value(sub, e, r));
                    }
                }
                for i in 0..16 {
                    block[192 + i] = dst[16 + 8 * i + r];
                }
                block[208..210].copy_from_slice(&dst[2 * r..2 * r + 2]);
                out.extend_from_slice(&block);
            }
            GgmlType::Q8_0 => {
                out.extend_from_slice(&dst[2 * r..2 * r + 2]);
                for j in 0..8 {
                    out.extend(
                        dst[16 + 32 * j + 4 * r..][..4]
                            .iter()
                            .map(|q| q ^ Q8_0_OFFSET),
                    );
                }
            }
            _ => unreachable!("group_block_bytes admits only the types above"),
        }
    }
}

/// Activation rows a tile kernel multiplies at most at once.
pub const TILE: usize = 4;

/// The most rows a tile takes where a type and tier have tiles of five and six rows
/// ([`TileKernels::rows`]).
pub(crate) const MAX_TILE: usize = 6;

/// Eight rows' products with `N` activation rows, each given in two passes (`hi[i]`, `lo[i]`).
/// Each row's result is bit for bit the same whatever `N` and whichever rows it comes with (the
/// integer sums are exact in any order, and each row's float steps are the same), so a
/// sequence's outputs do not depend on its batch. The weights' nibbles are unpacked once per
/// tile instead of once per row.
///
/// # Safety
/// The CPU must support the tier the function was chosen for; `w` must hold exactly the block
/// columns of the function's type that `hi[i].len()` activation blocks cover (one per block,
/// one per eight for the 256-value K-quants and IQ4_XS) for every `i`, and
/// `lo[i].len() == hi[i].len()`.
pub(crate) type TileFn<const N: usize> = AnyTileFn<N, GROUP>;

/// The tile kernels of one weight type on one tier, for one to [`TILE`] activation rows.
#[derive(Clone, Copy)]
pub(crate) struct TileKernels {
    one: TileFn<1>,
    two: TileFn<2>,
    three: TileFn<3>,
    four: TileFn<4>,
    /// Tiles of five and six rows, where they are faster than a four-row tile: AVX2's Q6_K
    /// with one activation pass, whose six rows share a sub-block's unpacking (long for
    /// Q6_K's high bits). Q4_K's unpacking is short, and six rows measured no faster there.
    five_six: Option<(TileFn<5>, TileFn<6>)>,
}

/// [`TileKernels`] from one kernel generic over its row count: a SIMD tile, also over `SPLIT`
/// (two activation passes), taken from the calling function's generics as `wide_kernels!`
/// does; or (`scalar f`) the scalar reference, which multiplies whatever `lo` holds.
macro_rules! tile_kernels {
    (scalar $f:ident) => {
        TileKernels {
            one: $f::<1>,
            two: $f::<2>,
            three: $f::<3>,
            four: $f::<4>,
            five_six: None,
        }
    };
    ($($f:ident)::+) => {
        TileKernels {
            one: $($f)::+::<1, SPLIT>,
            two: $($f)::+::<2, SPLIT>,
            three: $($f)::+::<3, SPLIT>,
            four: $($f)::+::<4, SPLIT>,
            five_six: None,
        }
    };
    // With five- and six-row tiles for one activation pass.
    ($($f:ident)::+, six) => {
        TileKernels {
            five_six: (!SPLIT).then_some(($($f)::+::<5, SPLIT>, $($f)::+::<6, SPLIT>)),
            ..tile_kernels!($($f)::+)
        }
    };
}

impl TileKernels {
    /// The kernels of `ty` at `tier` (the best at or below it) for activations in `passes`,
    /// if `ty` has them. With one pass the `lo` rows must be zero blocks: the SIMD tiles skip
    /// their products (their float steps still run, so the outputs are the two-pass kernels'
    /// bits for a zero second pass), and the scalar reference multiplies them.
    pub(crate) fn new(ty: GgmlType, tier: Tier, passes: ActPasses) -> Option<Self> {
        match passes {
            ActPasses::One => Self::select::<false>(ty, tier),
            ActPasses::Two => Self::select::<true>(ty, tier),
            // Its tiles take other activations: `Q16Tiles`.
            ActPasses::Q16 => None,
        }
    }

    /// [`Self::new`], `SPLIT` for two passes.
    fn select<const SPLIT: bool>(ty: GgmlType, tier: Tier) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let simd = match (tier, ty) {
                (Tier::Avx512Vnni, GgmlType::Q4_0) => Some(tile_kernels!(x86::vnni::q4_0_tile)),
                (Tier::Avx512Vnni, GgmlType::Q4_1) => Some(tile_kernels!(x86::vnni::q4_1_tile)),
                (Tier::Avx512Vnni, GgmlType::Q5_0) => Some(tile_kernels!(x86::vnni::q5_0_tile)),
                (Tier::Avx512Vnni, GgmlType::Q5_1) => Some(tile_kernels!(x86::vnni::q5_1_tile)),
                (Tier::Avx512Vnni, GgmlType::Iq4Nl) => Some(tile_kernels!(x86::vnni::iq4_nl_tile)),
                (Tier::Avx512Vnni, GgmlType::Iq4Xs) => Some(tile_kernels!(x86::vnni::iq4_xs_tile)),
                (Tier::Avx512Vnni, GgmlType::Q4K) => Some(tile_kernels!(x86::vnni::q4_k_tile)),
                (Tier::Avx512Vnni, GgmlType::Q5K) => Some(tile_kernels!(x86::vnni::q5_k_tile)),
                (Tier::Avx512Vnni, GgmlType::Q6K) => Some(tile_kernels!(x86::vnni::q6_k_tile)),
                (Tier::Avx512Vnni, GgmlType::Q3K) => Some(tile_kernels!(x86::vnni::q3_k_tile)),
                (Tier::Avx512Vnni, GgmlType::Q2K) => Some(tile_kernels!(x86::vnni::q2_k_tile)),
                (Tier::Avx512Vnni, GgmlType::Q8_0) => Some(tile_kernels!(x86::q8_0_offset::tile)),
                (Tier::Avx2, GgmlType::Q4_0) => Some(tile_kernels!(x86::avx2::q4_0_tile)),
                (Tier::Avx2, GgmlType::Q4_1) => Some(tile_kernels!(x86::avx2::q4_1_tile)),
                (Tier::Avx2, GgmlType::Q5_0) => Some(tile_kernels!(x86::avx2::q5_0_tile)),
                (Tier::Avx2, GgmlType::Q5_1) => Some(tile_kernels!(x86::avx2::q5_1_tile)),
                (Tier::Avx2, GgmlType::Iq4Nl) => Some(tile_kernels!(x86::avx2::iq4_nl_tile)),
                (Tier::Avx2, GgmlType::Iq4Xs) => Some(tile_kernels!(x86::avx2::iq4_xs_tile)),
                (Tier::Avx2, GgmlType::Q4K) => Some(tile_kernels!(x86::avx2::q4_k_tile)),
                (Tier::Avx2, GgmlType::Q5K) => Some(tile_kernels!(x86::avx2::q5_k_tile)),
                (Tier::Avx2, GgmlType::Q6K) => Some(tile_kernels!(x86::q6_k_one_pass::tile, six)),
                (Tier::Avx2, GgmlType::Q3K) => Some(tile_kernels!(x86::avx2::q3_k_tile)),
                (Tier::Avx2, GgmlType::Q2K) => Some(tile_kernels!(x86::avx2::q2_k_tile)),
                (Tier::Avx2, GgmlType::Q8_0) => Some(tile_kernels!(x86::q8_0_sign::tile)),
                _ => None,
            };
            if simd.is_some() {
                return simd;
            }
        }
        let _ = tier;
        match ty {
            GgmlType::Q4_0 => Some(tile_kernels!(scalar scalar_tile_q4_0)),
            GgmlType::Q4_1 => Some(tile_kernels!(scalar scalar_tile_q4_1)),
            GgmlType::Q5_0 => Some(tile_kernels!(scalar scalar_tile_q5_0)),
            GgmlType::Q5_1 => Some(tile_kernels!(scalar scalar_tile_q5_1)),
            GgmlType::Iq4Nl => Some(tile_kernels!(scalar scalar_tile_iq4_nl)),
            GgmlType::Iq4Xs => Some(tile_kernels!(scalar scalar_tile_iq4_xs)),
            GgmlType::Q4K => Some(tile_kernels!(scalar scalar_tile_q4_k)),
            GgmlType::Q5K => Some(tile_kernels!(scalar scalar_tile_q5_k)),
            GgmlType::Q6K => Some(tile_kernels!(scalar scalar_tile_q6_k)),
            GgmlType::Q3K => Some(tile_kernels!(scalar scalar_tile_q3_k)),
            GgmlType::Q2K => Some(tile_kernels!(scalar scalar_tile_q2_k)),
            GgmlType::Q8_0 => Some(tile_kernels!(scalar scalar_tile_q8_0)),
            _ => None,
        }
    }

    /// The most activation rows one call of [`Self::run`] takes: [`MAX_TILE`] where there are
    /// five- and six-row tiles, else [`TILE`].
    pub(crate) fn rows(&self) -> usize {
        if self.five_six.is_some() {
            MAX_TILE
        } else {
            TILE
        }
    }

    /// The products of the group `w` with `rows` (one to [`Self::rows`] activation rows, each
    /// as its `(hi, lo)` passes), handed to `out` as (index in `rows`, eight outputs).
    ///
    /// # Safety
    /// As [`TileFn`] for every row.
    ///
    /// # Panics
    /// If `rows` is empty or longer than [`Self::rows`].
    #[inline]
    pub(crate) unsafe fn run(
        &self,
        w: &[u8],
        rows: &[(&[ActBlock], &[ActBlock])],
        mut out: impl FnMut(usize, [f32; GROUP]),
    ) {
        // SAFETY: each arm calls the kernel for exactly `rows.len()` rows, under the `TileFn`
        // contract this function's caller vouches for every row.
        unsafe {
            match rows.len() {
                1 => call_tile(self.one, w, rows, &mut out),
                2 => call_tile(self.two, w, rows, &mut out),
                3 => call_tile(self.three, w, rows, &mut out),
                4 => call_tile(self.four, w, rows, &mut out),
                n @ (5 | 6) if let Some((five, six)) = self.five_six => match n {
                    5 => call_tile(five, w, rows, &mut out),
                    _ => call_tile(six, w, rows, &mut out),
                },
                n => panic!("a tile of {n} rows: 1 to {} expected", self.rows()),
            }
        }
    }
}

/// A tile kernel's signature with `N` activation rows and `W` outputs a row: [`TileFn`]'s
/// (`W` = [`GROUP`]) or the wide tiles' (`W` = 16).
type AnyTileFn<const N: usize, const W: usize> =
    unsafe fn(&[u8], [&[ActBlock]; N], [&[ActBlock]; N]) -> [[f32; W]; N];

/// One call of a tile kernel `f` (narrow, `W` = 8 outputs a row, or wide, 16) on `rows`
/// (exactly `N` of them), its outputs handed to `out` as (index in `rows`, `W` outputs).
///
/// # Safety
/// `f`'s contract ([`TileFn`] or [`wide`]'s `WideFn`) for every row.
#[inline]
unsafe fn call_tile<const N: usize, const W: usize>(
    f: AnyTileFn<N, W>,
    w: &[u8],
    rows: &[(&[ActBlock], &[ActBlock])],
    out: &mut impl FnMut(usize, [f32; W]),
) {
    let hi = std::array::from_fn(|i| rows[i].0);
    let lo = std::array::from_fn(|i| rows[i].1);
    // SAFETY: `f`'s contract is this function's, and `hi`/`lo` are the rows it covers.
    let y = unsafe { f(w, hi, lo) };
    for (i, y) in y.into_iter().enumerate() {
        out(i, y);
    }
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q4_0<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q4_scalar::<false, false>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q4_1<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q4_scalar::<true, false>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q5_0<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q4_scalar::<false, true>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q5_1<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q4_scalar::<true, true>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_iq4_nl<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| iq4_nl_scalar(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_iq4_xs<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| iq4_xs_scalar(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q4_k<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| k_quant_scalar::<false>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q5_k<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| k_quant_scalar::<true>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q6_k<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| half_scaled_scalar::<false>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q3_k<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| half_scaled_scalar::<true>(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q2_k<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q2_k_scalar(w, hi[i], lo[i]))
}

/// The scalar tile: the scalar reference row by row.
fn scalar_tile_q8_0<const N: usize>(
    w: &[u8],
    hi: [&[ActBlock]; N],
    lo: [&[ActBlock]; N],
) -> [[f32; GROUP]; N] {
    std::array::from_fn(|i| q8_0_scalar(w, hi[i], lo[i]))
}

fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// Value `e` of row `r` in a Q4_1-ordered 128-byte block of nibbles.
fn nibble(quants: &[u8], e: usize, r: usize) -> u8 {
    let (at, high) = nibble_at(e, r);
    if high {
        quants[at] >> 4
    } else {
        quants[at] & 0xF
    }
}

/// Value `e` of row `r` (six bits, `q + 32`) in a Q6_K sub-block of a group.
fn q6_k_group_value(sub: &[u8], e: usize, r: usize) -> u8 {
    let (at, shift) = q6_k_high_bits_at(e, r);
    nibble(sub, e, r) | (((sub[at] >> shift) & 3) << 4)
}

/// Value `e` of row `r` (two bits) in a Q2_K sub-block of a group.
fn q2_k_group_value(sub: &[u8], e: usize, r: usize) -> u8 {
    let (at, shift) = bit_pair_at(e, r);
    (sub[at] >> shift) & 3
}

/// The integer sums of the 32 values `value(e)` with both activation passes.
fn value_sums<V: Into<i32>>(value: impl Fn(usize) -> V, h: &ActBlock, l: &ActBlock) -> (i32, i32) {
    (0..32).fold((0, 0), |(sum_h, sum_l), e| {
        let q: i32 = value(e).into();
        (
            sum_h + q * i32::from(h.qs[e]),
            sum_l + q * i32::from(l.qs[e]),
        )
    })
}

/// The scalar reference for Q4_0 (`MIN` false: the minimum is `-8 d`), Q4_1, Q5_0 (`FIFTH`,
/// minimum `-16 d`) and Q5_1 groups.
fn q4_scalar<const MIN: bool, const FIFTH: bool>(
    w: &[u8],
    hi: &[ActBlock],
    lo: &[ActBlock],
) -> [f32; GROUP] {
    let (bytes, quants) = q4_sizes(MIN, FIFTH);
    let mut out = [0f32; GROUP];
    for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
        let block = &w[b * bytes..(b + 1) * bytes];
        for (r, y) in out.iter_mut().enumerate() {
            let sub = &block[quants..];
            let value = |e: usize| {
                let fifth = if FIFTH {
                    let (at, bit) = fifth_bit_at(e, r);
                    ((sub[at] >> bit) & 1) << 4
                } else {
                    0
                };
                nibble(sub, e, r) | fifth
            };
            let (sum_h, sum_l) = value_sums(value, h, l);
            let d = f16_at(block, r);
            let m = if MIN {
                f16_at(&block[16..], r)
            } else {
                -q_offset(FIFTH) * d
            };
            *y += d * (h.d * sum_h as f32 + l.d * sum_l as f32) + m * (h.d_sum + l.d_sum);
        }
    }
    out
}

/// The table value of entry `e` of row `r` in a Q4_0-ordered block of IQ4 indices.
fn iq4_value(quants: &[u8], e: usize, r: usize) -> i8 {
    IQ4_VALUES[usize::from(nibble(quants, e, r))]
}

/// The scalar reference for IQ4_NL groups (Q4_0's layout, table values, no offset).
fn iq4_nl_scalar(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let (bytes, quants) = q4_sizes(false, false);
    let mut out = [0f32; GROUP];
    for (b, (h, l)) in hi.iter().zip(lo).enumerate() {
        let block = &w[b * bytes..(b + 1) * bytes];
        for (r, y) in out.iter_mut().enumerate() {
            let (sum_h, sum_l) = value_sums(|e| iq4_value(&block[quants..], e, r), h, l);
            *y += f16_at(block, r) * (h.d * sum_h as f32 + l.d * sum_l as f32);
        }
    }
    out
}

/// The scalar reference for IQ4_XS groups.
fn iq4_xs_scalar(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (c, (hs, ls)) in hi.chunks_exact(8).zip(lo.chunks_exact(8)).enumerate() {
        let column = &w[c * IQ4_XS_BYTES..(c + 1) * IQ4_XS_BYTES];
        for (r, y) in out.iter_mut().enumerate() {
            let d = f16_at(column, r);
            for (s, (h, l)) in hs.iter().zip(ls).enumerate() {
                let sub = &column[IQ4_XS_QUANTS + 128 * s..][..128];
                let (sum_h, sum_l) = value_sums(|e| iq4_value(sub, e, r), h, l);
                let scale = d * f32::from(column[16 + 8 * s + r] as i8);
                *y += scale * (h.d * sum_h as f32 + l.d * sum_l as f32);
            }
        }
    }
    out
}

/// The scalar reference for Q4_K (`FIFTH` false) and Q5_K groups.
fn k_quant_scalar<const FIFTH: bool>(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let (column_bytes, sub_bytes) = k_sizes(FIFTH);
    let mut out = [0f32; GROUP];
    for (c, (hs, ls)) in hi.chunks_exact(8).zip(lo.chunks_exact(8)).enumerate() {
        let column = &w[c * column_bytes..(c + 1) * column_bytes];
        for (r, y) in out.iter_mut().enumerate() {
            let (d, dmin) = (f16_at(column, r), f16_at(&column[16..], r));
            for (s, (h, l)) in hs.iter().zip(ls).enumerate() {
                let sub = &column[K_QUANTS + sub_bytes * s..][..sub_bytes];
                let value = |e: usize| {
                    let fifth = if FIFTH {
                        let (at, bit) = fifth_bit_at(e, r);
                        ((sub[at] >> bit) & 1) << 4
                    } else {
                        0
                    };
                    nibble(sub, e, r) | fifth
                };
                let (sum_h, sum_l) = value_sums(value, h, l);
                let scale = d * f32::from(column[32 + 8 * s + r]);
                let min = dmin * f32::from(column[96 + 8 * s + r]);
                *y += scale * (h.d * sum_h as f32 + l.d * sum_l as f32) - min * (h.d_sum + l.d_sum);
            }
        }
    }
    out
}

/// The scalar reference for Q6_K (`Q3` false) and Q3_K groups: one signed scale per 16
/// values, stored values `q + 32` (Q6_K) or `q + 4` (Q3_K).
fn half_scaled_scalar<const Q3: bool>(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let (column_bytes, sub_bytes, offset) = half_scaled_sizes(Q3);
    let mut out = [0f32; GROUP];
    for (c, (hs, ls)) in hi.chunks_exact(8).zip(lo.chunks_exact(8)).enumerate() {
        let column = &w[c * column_bytes..(c + 1) * column_bytes];
        for (r, y) in out.iter_mut().enumerate() {
            let d = f16_at(column, r);
            for (s, (h, l)) in hs.iter().zip(ls).enumerate() {
                let sub = &column[Q6_K_QUANTS + sub_bytes * s..][..sub_bytes];
                // [half][pass]: the stored `q + offset` times the activations.
                let mut sums = [[0i32; 2]; 2];
                for e in 0..32 {
                    let q = if Q3 {
                        nibble(sub, e, r)
                    } else {
                        q6_k_group_value(sub, e, r)
                    };
                    let q = i32::from(q);
                    sums[e / 16][0] += q * i32::from(h.qs[e]);
                    sums[e / 16][1] += q * i32::from(l.qs[e]);
                }
                for (half, [sum_h, sum_l]) in sums.into_iter().enumerate() {
                    let scale = d * f32::from(column[16 + 8 * (2 * s + half) + r] as i8);
                    let (sum_h, sum_l) = (
                        sum_h - offset * h.half_sum(half),
                        sum_l - offset * l.half_sum(half),
                    );
                    *y += scale * (h.d * sum_h as f32 + l.d * sum_l as f32);
                }
            }
        }
    }
    out
}

/// The scalar reference for Q2_K groups: per half of a sub-block, `d × scale × Σ q a −
/// dmin × min × Σ a` with the scale and minimum 4-bit integers, both sums over the
/// sub-block's halves kept in integers until one float step per pass.
fn q2_k_scalar(w: &[u8], hi: &[ActBlock], lo: &[ActBlock]) -> [f32; GROUP] {
    let mut out = [0f32; GROUP];
    for (c, (hs, ls)) in hi.chunks_exact(8).zip(lo.chunks_exact(8)).enumerate() {
        let column = &w[c * Q2_K_BYTES..(c + 1) * Q2_K_BYTES];
        for (r, y) in out.iter_mut().enumerate() {
            let (d, dmin) = (f16_at(column, r), f16_at(&column[16..], r));
            for (s, (h, l)) in hs.iter().zip(ls).enumerate() {
                let sub = &column[Q2_K_QUANTS + Q2_K_SUB * s..][..Q2_K_SUB];
                // Per pass: Σ scale × Σ q a and Σ min × Σ a over the two halves.
                let (mut scaled, mut mins) = ([0i32; 2], [0i32; 2]);
                for half in 0..2 {
                    let byte = column[32 + 16 * s + 2 * r + half];
                    let (scale, min) = (i32::from(byte & 0xF), i32::from(byte >> 4));
                    for (pass, a) in [h, l].into_iter().enumerate() {
                        let sum: i32 = (16 * half..16 * half + 16)
                            .map(|e| i32::from(q2_k_group_value(sub, e, r)) * i32::from(a.qs[e]))
                            .sum();
                        scaled[pass] += scale * sum;
                        mins[pass] += min * a.half_sum(half);
                    }
                }
                *y += d * (h.d * scaled[0] as f32 + l.d * scaled[1] as f32)
                    - dmin * (h.d * mins[0] as f32 + l.d * mins[1] as f32);
            }
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
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::mem::offset_of;

    use super::GROUP;
    use crate::act::ActBlock;

    /// Four activation bytes `4j..4j + 4` of `a` in every lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn broadcast(a: &ActBlock, j: usize) -> __m256i {
        let word = i32::from_le_bytes([
            a.qs[4 * j] as u8,
            a.qs[4 * j + 1] as u8,
            a.qs[4 * j + 2] as u8,
            a.qs[4 * j + 3] as u8,
        ]);
        _mm256_set1_epi32(word)
    }

    /// Eight f16 at `p` as f32.
    ///
    /// # Safety
    /// 16 bytes at `p` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn halves(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract: 16 readable bytes at `p`, the unaligned load's width.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
    }

    /// `acc + d_w × (d_hi × sum_h + d_lo × sum_l)` per row lane (`SPLIT`; without it
    /// `acc + d_w × d_hi × sum_h`): the float steps of a block column, shared by every kernel
    /// so that all round alike.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn add_sums<const SPLIT: bool>(
        acc: __m256,
        d: __m256,
        sum_h: __m256i,
        sum_l: __m256i,
        h: &ActBlock,
        l: &ActBlock,
    ) -> __m256 {
        let high = _mm256_cvtepi32_ps(sum_h);
        let scaled = if SPLIT {
            _mm256_fmadd_ps(
                high,
                scale_lanes(h),
                _mm256_mul_ps(_mm256_cvtepi32_ps(sum_l), scale_lanes(l)),
            )
        } else {
            _mm256_mul_ps(high, scale_lanes(h))
        };
        _mm256_fmadd_ps(d, scaled, acc)
    }

    /// `acc + d_a × (scales[0] × first + scales[1] × second)` per row lane: a sub-block of
    /// Q6_K or Q3_K (two halves, one weight scale each) with one activation pass. The halves
    /// meet before the activation's scale multiplies them, one product per row and sub-block
    /// fewer than [`add_sums`] on each half; the wide tiles round the same way.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn one_pass_halves(
        acc: __m256,
        scales: [__m256; 2],
        first: __m256i,
        second: __m256i,
        a: &ActBlock,
    ) -> __m256 {
        let halves = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(second),
            scales[1],
            _mm256_mul_ps(_mm256_cvtepi32_ps(first), scales[0]),
        );
        _mm256_fmadd_ps(halves, scale_lanes(a), acc)
    }

    /// `d × Σ a` of a block's passes (its first alone without `SPLIT`), for the offsets and
    /// minimums; every kernel forms it alike.
    #[inline(always)]
    pub(super) fn d_sum<const SPLIT: bool>(h: &ActBlock, l: &ActBlock) -> f32 {
        if SPLIT { h.d_sum + l.d_sum } else { h.d_sum }
    }

    /// [`d_sum`] in every lane: one `vbroadcastss` from the block without `SPLIT`
    /// ([`field_lanes`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn d_sum_lanes<const SPLIT: bool>(h: &ActBlock, l: &ActBlock) -> __m256 {
        if SPLIT {
            _mm256_set1_ps(d_sum::<SPLIT>(h, l))
        } else {
            field_lanes::<_, { offset_of!(ActBlock, d_sum) }>(h)
        }
    }

    /// The f32 field `OFFSET` bytes into `a` in every lane, by one `vbroadcastss` from memory
    /// (a load, no shuffle). Written as `_mm256_set1_ps(a.d)` beside `a.d_sum`, LLVM loads the
    /// two adjacent floats as one 64-bit value and splits and broadcasts them in three
    /// shuffles per activation row and block (as it did in the wide tiles: docs/kernels.md,
    /// item 6).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn field_lanes<T, const OFFSET: usize>(a: &T) -> __m256 {
        const { assert!(OFFSET + 4 <= size_of::<T>()) };
        let out;
        // SAFETY: reads four bytes inside `*a` (the assertion above), a valid reference;
        // writes only `out`.
        unsafe {
            asm!(
                "vbroadcastss {out}, dword ptr [{a} + {offset}]",
                out = lateout(ymm_reg) out,
                a = in(reg) a,
                offset = const OFFSET,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        out
    }

    /// The i32 field `OFFSET` bytes into `a` in every lane: [`field_lanes`]'s broadcast, whose
    /// bits are the field's whatever their type (LLVM would join adjacent i32 fields into one
    /// load too, and split them in general registers).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn int_field_lanes<T, const OFFSET: usize>(a: &T) -> __m256i {
        _mm256_castps_si256(field_lanes::<T, OFFSET>(a))
    }

    /// `a.d` in every lane ([`field_lanes`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_lanes(a: &ActBlock) -> __m256 {
        field_lanes::<_, { offset_of!(ActBlock, d) }>(a)
    }

    /// The eight lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn store(v: __m256) -> [f32; GROUP] {
        let mut out = [0f32; GROUP];
        // SAFETY: `out` is eight f32 (`GROUP`), the unaligned store's width.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
        out
    }

    /// `acc + Σ` of four u8 × i8 products per lane (AVX2; the u8 side is at most 128 here and
    /// the i8 side at most 127 in magnitude, so `vpmaddubsw`'s pair sums cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
        )
    }

    /// The same with VNNI.
    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    fn dot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, s)
    }

    /// `acc + ` the pair sums of `u` × `s` in sixteen 16-bit lanes (AVX2's `vpmaddubsw` alone:
    /// a narrow sum, widened once by [`widen_avx2`] after up to [`i16_fit`] products instead of
    /// after each, which halves the tile's multiplies). The caller keeps the sum within `i16`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn dot_avx2_i16(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
    }

    /// A [`dot_avx2_i16`] sum as eight 32-bit lanes (each the sum of its two 16-bit lanes).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn widen_avx2(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }

    /// VNNI's sums are 32-bit already.
    #[inline(always)]
    fn widen_vnni(acc: __m256i) -> __m256i {
        acc
    }

    /// Any number of products fits VNNI's 32-bit sums.
    const fn vnni_fit(_max_weight: i32) -> usize {
        usize::MAX
    }

    /// How many `vpmaddubsw` products of unsigned weights up to `max_weight` and activations
    /// within ±127 one 16-bit lane can add without passing `i16::MAX` (each product's lane is a
    /// pair: at most `2 × max_weight × 127`): 8 for nibbles (15), 4 for five bits (31), 18 for
    /// Q3_K's three (7).
    pub(super) const fn i16_fit(max_weight: i32) -> usize {
        (i16::MAX as i32 / (2 * max_weight * 127)) as usize
    }

    /// The partial sums per activation row and pass of a VNNI tile of `n` rows. `vpdpbusd`
    /// takes four cycles and issues two a cycle (Zen 4, 256-bit), so eight independent sums
    /// keep it busy; one sum per row and pass made a one-row tile wait on chains twice as
    /// long as its work, and a four-row tile on chains of eight products a block. (Its sums
    /// are 32-bit: `fit` does not bind.)
    const fn vnni_parts(n: usize, _fit: usize) -> usize {
        if n == 1 { 4 } else { 2 }
    }

    /// AVX2's products end in an add of one cycle, so one sum per row and pass suffices (and
    /// its 16 registers hold no more), unless the eight products of a sub-block would pass
    /// what a 16-bit sum holds (`fit` of them): then the fewest sums that hold them.
    pub(super) const fn avx2_parts(_: usize, fit: usize) -> usize {
        8_usize.div_ceil(fit)
    }

    /// The sum of a row's partial sums (the unused ones are zero, and vanish when compiled).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn total([a, b, c, d]: [__m256i; 4]) -> __m256i {
        _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d))
    }

    /// How far ahead of the block being multiplied a tile asks for weights: about a dozen
    /// Q4_1 blocks. The hardware prefetchers stop at each 4 KB page, and a tile then waits on
    /// the next page's first lines; asking this far ahead keeps the stream going across
    /// pages. The distance and the T0 hint were chosen on whole forwards of 3 to 8 rows
    /// (docs/benchmarks.md, "Figures that were in code comments"); tiles of one and two rows
    /// prefetch too since the 1B and 8B shapes decoded 16-22 % faster with it (SmolLM2 8-14
    /// %; docs/kernels.md). Prefetching a whole group ahead at once was slower: the burst
    /// fills the miss queue that the tile's own loads need.
    const PREFETCH_AHEAD: usize = 2048;

    /// Asks for the `block_bytes` from `PREFETCH_AHEAD` bytes past `p`, the start of a block,
    /// a line (64 bytes) at a time: consecutive blocks' requests cover the stream (a hint: an
    /// address past the weights is harmless, `prefetcht0` does not fault).
    #[inline(always)]
    pub(super) fn prefetch_ahead(p: *const u8, block_bytes: usize) {
        let ahead = p.wrapping_add(PREFETCH_AHEAD);
        for line in 0..block_bytes.div_ceil(64) {
            // SAFETY: SSE is part of x86_64; a prefetch reads nothing and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast()) };
        }
    }

    /// Eight bytes at `p` as f32 (unsigned).
    ///
    /// # Safety
    /// Eight bytes at `p` must be readable.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn u8_lanes(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract: eight readable bytes at `p`, what `vmovq` loads.
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) }))
    }

    /// Eight bytes at `p` as f32 (signed).
    ///
    /// # Safety
    /// Eight bytes at `p` must be readable.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn i8_lanes(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract: eight readable bytes at `p`, what `vmovq` loads.
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(p.cast()) }))
    }

    /// The fifth bits of chunk `j`'s values (a Q5_K sub-block's bits at `bits`, laid out as
    /// [`super::fifth_bit_at`] says) moved to bit 4 of their bytes: those of the low nibbles'
    /// values (bits `2j`), then the high nibbles' (bits `2j + 1`). The 16-bit shifts carry
    /// bits across bytes only into bits that the mask clears.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) fn fifth_bits_at_4(bits: __m256i, j: usize) -> (__m256i, __m256i) {
        let (first, second) = match j {
            0 => (_mm256_slli_epi16(bits, 4), _mm256_slli_epi16(bits, 3)),
            1 => (_mm256_slli_epi16(bits, 2), _mm256_slli_epi16(bits, 1)),
            2 => (bits, _mm256_srli_epi16(bits, 1)),
            _ => (_mm256_srli_epi16(bits, 2), _mm256_srli_epi16(bits, 3)),
        };
        let bit = _mm256_set1_epi8(0x10);
        (_mm256_and_si256(first, bit), _mm256_and_si256(second, bit))
    }

    /// Chunk `j`'s values of a Q6_K sub-block of a group (`q + 32`, six bits): its 32 bytes
    /// of low nibbles `raw` and the 32 bytes of high bits `bits` that hold them
    /// ([`super::q6_k_high_bits_at`]), as the first half's values (the low nibbles) and the
    /// second's. Bits `4k` and `4k + 2` of `bits` (`k = j % 2`) move to bit 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q6_k_values(raw: __m256i, bits: __m256i, j: usize) -> [__m256i; 2] {
        let (mask, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let (high_first, high_second) = if j.is_multiple_of(2) {
            (_mm256_slli_epi16(bits, 4), _mm256_slli_epi16(bits, 2))
        } else {
            (bits, _mm256_srli_epi16(bits, 2))
        };
        let first = _mm256_and_si256(raw, mask);
        let second = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        [
            _mm256_or_si256(first, _mm256_and_si256(high_first, top)),
            _mm256_or_si256(second, _mm256_and_si256(high_second, top)),
        ]
    }

    /// Block `b` of each of the rows, unchecked.
    ///
    /// # Safety
    /// `b` must be below every row's length.
    #[inline(always)]
    pub(super) unsafe fn blocks_at<T, const N: usize>(rows: [&[T]; N], b: usize) -> [&T; N] {
        // SAFETY: `b` is below every row's length (the caller's contract).
        std::array::from_fn(|i| unsafe { rows[i].get_unchecked(b) })
    }

    // The tiles below run under the `TileFn` contract: every row of `hi` and `lo` has
    // `blocks = hi[0].len()` activation blocks, and `w` holds exactly the block columns they
    // cover, so the column of block (or super-block) `b < blocks` (`< blocks / 8`) starts
    // `bytes × b` into `w` and ends inside it. Their SAFETY comments name the bytes of a
    // column each read touches.
    macro_rules! nibble_tiles {
        (
            $tier:ident,
            $features:literal,
            $dot:ident,
            $dot16:ident,
            $widen:ident,
            $fit:ident,
            $parts:ident
        ) => {
            pub(super) mod $tier {
                use super::*;
                use crate::interleaved::{
                    IQ4_XS_BYTES, IQ4_XS_QUANTS, K_QUANTS, Q2_K_BYTES, Q2_K_QUANTS, Q2_K_SUB,
                    Q6_K_QUANTS, half_scaled_sizes, k_sizes, q_offset, q4_sizes,
                };

                /// The integer sums of `N` two-pass activation rows with a Q4_1-ordered block
                /// of nibbles of eight rows at `p` (four chunks of 32 bytes), with `FIFTH` the
                /// Q5_K fifth bits after them: per row, the `hi` and the `lo` pass's. Each
                /// chunk is unpacked once for all the rows.
                ///
                /// # Safety
                /// 128 bytes at `p` must be readable, 160 with `FIFTH`.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn nibble_sums<const N: usize, const FIFTH: bool, const SPLIT: bool>(
                    p: *const u8,
                    h: [&ActBlock; N],
                    l: [&ActBlock; N],
                ) -> [(__m256i, __m256i); N] {
                    let parts = const { $parts(N, $fit(if FIFTH { 31 } else { 15 })) };
                    let mask = _mm256_set1_epi8(0x0F);
                    let fifth_bits = if FIFTH {
                        // SAFETY: with `FIFTH` the caller vouches for 160 bytes: the fifth
                        // bits are the last 32.
                        unsafe { _mm256_loadu_si256(p.add(128).cast()) }
                    } else {
                        _mm256_setzero_si256()
                    };
                    let mut sh = [[_mm256_setzero_si256(); 4]; N];
                    let mut sl = [[_mm256_setzero_si256(); 4]; N];
                    for j in 0..4 {
                        // SAFETY: `j < 4`: chunk `j` is bytes `32 j .. 32 j + 32` of the 128
                        // the caller vouches for.
                        let raw = unsafe { _mm256_loadu_si256(p.add(32 * j).cast()) };
                        let mut low = _mm256_and_si256(raw, mask);
                        let mut high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                        if FIFTH {
                            let (first, second) = fifth_bits_at_4(fifth_bits, j);
                            low = _mm256_or_si256(low, first);
                            high = _mm256_or_si256(high, second);
                        }
                        let (k_low, k_high) = ((2 * j) % parts, (2 * j + 1) % parts);
                        // Each of the `parts` sums takes at most `8 / parts` products,
                        // which `$parts` keeps within what `$dot16`'s sums hold.
                        for i in 0..N {
                            sh[i][k_low] = $dot16(sh[i][k_low], low, broadcast(h[i], j));
                            sh[i][k_high] = $dot16(sh[i][k_high], high, broadcast(h[i], 4 + j));
                            if SPLIT {
                                sl[i][k_low] = $dot16(sl[i][k_low], low, broadcast(l[i], j));
                                sl[i][k_high] = $dot16(sl[i][k_high], high, broadcast(l[i], 4 + j));
                            }
                        }
                    }
                    let widen = |sums: [__m256i; 4]| {
                        let mut total = $widen(sums[0]);
                        for &sum in &sums[1..parts] {
                            total = _mm256_add_epi32(total, $widen(sum));
                        }
                        total
                    };
                    let mut sums = [(_mm256_setzero_si256(), _mm256_setzero_si256()); N];
                    for i in 0..N {
                        sums[i] = (widen(sh[i]), widen(sl[i]));
                    }
                    sums
                }

                /// The integer sums of `N` two-pass activation rows with a Q4_0-ordered block
                /// of IQ4 indices of eight rows at `p`: each chunk's indices become table
                /// values with one `vpshufb` per half, once for all the rows, and multiply by
                /// the sign trick (`|w|` unsigned, the activations given `w`'s sign; the
                /// table's values are within ±127, so `vpmaddubsw`'s pair sums fit).
                ///
                /// # Safety
                /// 128 bytes at `p` must be readable.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn iq4_sums<const N: usize, const SPLIT: bool>(
                    p: *const u8,
                    h: [&ActBlock; N],
                    l: [&ActBlock; N],
                ) -> [(__m256i, __m256i); N] {
                    // 32-bit sums (`$dot`), which any number of products fits: the table's
                    // magnitudes reach 127, so a 16-bit sum would hold a single product.
                    let parts = const { $parts(N, usize::MAX) };
                    let mask = _mm256_set1_epi8(0x0F);
                    let table = crate::quant::iq4_table();
                    let mut sh = [[_mm256_setzero_si256(); 4]; N];
                    let mut sl = [[_mm256_setzero_si256(); 4]; N];
                    for j in 0..4 {
                        // SAFETY: `j < 4`: chunk `j` is bytes `32 j .. 32 j + 32` of the 128
                        // the caller vouches for.
                        let raw = unsafe { _mm256_loadu_si256(p.add(32 * j).cast()) };
                        let low = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, mask));
                        let high = _mm256_shuffle_epi8(
                            table,
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                        );
                        let (low_abs, high_abs) = (_mm256_abs_epi8(low), _mm256_abs_epi8(high));
                        let (k_low, k_high) = ((2 * j) % parts, (2 * j + 1) % parts);
                        for i in 0..N {
                            let (hl, hh) = (broadcast(h[i], j), broadcast(h[i], 4 + j));
                            sh[i][k_low] = $dot(sh[i][k_low], low_abs, _mm256_sign_epi8(hl, low));
                            sh[i][k_high] =
                                $dot(sh[i][k_high], high_abs, _mm256_sign_epi8(hh, high));
                            if SPLIT {
                                let (ll, lh) = (broadcast(l[i], j), broadcast(l[i], 4 + j));
                                sl[i][k_low] =
                                    $dot(sl[i][k_low], low_abs, _mm256_sign_epi8(ll, low));
                                sl[i][k_high] =
                                    $dot(sl[i][k_high], high_abs, _mm256_sign_epi8(lh, high));
                            }
                        }
                    }
                    let mut sums = [(_mm256_setzero_si256(), _mm256_setzero_si256()); N];
                    for i in 0..N {
                        sums[i] = (total(sh[i]), total(sl[i]));
                    }
                    sums
                }

                /// Eight IQ4_NL rows × `N` two-pass activation rows
                /// ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn iq4_nl_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let (bytes, quants) = q4_sizes(false, false);
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); N];
                    for b in 0..blocks {
                        // SAFETY: column `b < blocks` of `bytes` lies in `w`.
                        let p = unsafe { w.as_ptr().add(bytes * b) };
                        prefetch_ahead(p, bytes);
                        // SAFETY: `b < blocks`, every row's length (the `TileFn` contract).
                        let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                        // SAFETY: the column's last 128 bytes, from `quants`, are its indices.
                        let sums = unsafe { iq4_sums::<N, SPLIT>(p.add(quants), h, l) };
                        // SAFETY: the column's first 16 bytes are the eight f16 `d`.
                        let d = unsafe { halves(p) };
                        for i in 0..N {
                            let (sum_h, sum_l) = sums[i];
                            acc[i] = add_sums::<SPLIT>(acc[i], d, sum_h, sum_l, h[i], l[i]);
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for (out, acc) in out.iter_mut().zip(acc) {
                        *out = store(acc);
                    }
                    out
                }

                /// Eight IQ4_XS rows × `N` two-pass activation rows
                /// ([`super::super::TileFn`]): IQ4_NL's integer work per sub-block, scaled
                /// by `d × scale` (exact in f32).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn iq4_xs_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); N];
                    for c in 0..blocks / 8 {
                        // SAFETY: column `c < blocks / 8` of `IQ4_XS_BYTES` lies in `w`; its
                        // first 16 bytes are the eight f16 `d`.
                        let (p, d) = unsafe {
                            let p = w.as_ptr().add(IQ4_XS_BYTES * c);
                            (p, halves(p))
                        };
                        for s in 0..8 {
                            let eighth = IQ4_XS_BYTES / 8;
                            prefetch_ahead(p.wrapping_add(eighth * s), eighth);
                            let b = 8 * c + s;
                            // SAFETY: `b = 8 c + s < blocks`, every row's length (the `TileFn`
                            // contract).
                            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                            // SAFETY: `s < 8`: sub-block `s`'s 128 bytes of indices at
                            // `IQ4_XS_QUANTS + 128 s` end at the column's end, and its eight
                            // scales at `16 + 8 s` lie before `IQ4_XS_QUANTS` (16 + 64).
                            let (sums, scales) = unsafe {
                                let sub = p.add(IQ4_XS_QUANTS + 128 * s);
                                (iq4_sums::<N, SPLIT>(sub, h, l), i8_lanes(p.add(16 + 8 * s)))
                            };
                            let scale = _mm256_mul_ps(d, scales);
                            for i in 0..N {
                                let (sum_h, sum_l) = sums[i];
                                acc[i] = add_sums::<SPLIT>(acc[i], scale, sum_h, sum_l, h[i], l[i]);
                            }
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for (out, acc) in out.iter_mut().zip(acc) {
                        *out = store(acc);
                    }
                    out
                }

                /// Eight Q4_0 rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q4_0_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `q4_tile` needs, for the same type.
                    unsafe { q4_tile::<N, false, false, SPLIT>(w, hi, lo) }
                }

                /// Eight Q4_1 rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q4_1_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `q4_tile` needs, for the same type.
                    unsafe { q4_tile::<N, true, false, SPLIT>(w, hi, lo) }
                }

                /// Eight Q5_0 rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q5_0_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `q4_tile` needs, for the same type.
                    unsafe { q4_tile::<N, false, true, SPLIT>(w, hi, lo) }
                }

                /// Eight Q5_1 rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q5_1_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `q4_tile` needs, for the same type.
                    unsafe { q4_tile::<N, true, true, SPLIT>(w, hi, lo) }
                }

                /// Eight Q4_0 (`MIN` false: the minimum is `-8 d`), Q4_1, Q5_0 (`FIFTH`,
                /// minimum `-16 d`) or Q5_1 rows × `N` two-pass activation rows.
                ///
                /// # Safety
                /// As [`super::super::TileFn`], for the type the parameters name.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn q4_tile<
                    const N: usize,
                    const MIN: bool,
                    const FIFTH: bool,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let (bytes, quants) = q4_sizes(MIN, FIFTH);
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); N];
                    let mut mins = [_mm256_setzero_ps(); N];
                    for b in 0..blocks {
                        // SAFETY: column `b < blocks` of `bytes` lies in `w`.
                        let p = unsafe { w.as_ptr().add(bytes * b) };
                        prefetch_ahead(p, bytes);
                        // SAFETY: `b < blocks`, every row's length (the `TileFn` contract).
                        let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                        // SAFETY: from `quants` to its end the column holds the 128 bytes of
                        // nibbles (and with `FIFTH` the 32 of fifth bits) `nibble_sums` reads.
                        let sums = unsafe { nibble_sums::<N, FIFTH, SPLIT>(p.add(quants), h, l) };
                        // SAFETY: the column's first 16 bytes are the eight f16 `d`.
                        let d = unsafe { halves(p) };
                        let m = if MIN {
                            // SAFETY: with `MIN` bytes 16-31 of the column are the minimums.
                            unsafe { halves(p.add(16)) }
                        } else {
                            _mm256_mul_ps(d, _mm256_set1_ps(-q_offset(FIFTH)))
                        };
                        for i in 0..N {
                            let (sum_h, sum_l) = sums[i];
                            acc[i] = add_sums::<SPLIT>(acc[i], d, sum_h, sum_l, h[i], l[i]);
                            mins[i] = _mm256_fmadd_ps(m, d_sum_lanes::<SPLIT>(h[i], l[i]), mins[i]);
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for ((out, acc), mins) in out.iter_mut().zip(acc).zip(mins) {
                        *out = store(_mm256_add_ps(acc, mins));
                    }
                    out
                }

                /// Eight Q4_K rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q4_k_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `k_tile` needs, for the same type.
                    unsafe { k_tile::<N, false, SPLIT>(w, hi, lo) }
                }

                /// Eight Q5_K rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q5_k_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `k_tile` needs, for the same type.
                    unsafe { k_tile::<N, true, SPLIT>(w, hi, lo) }
                }

                /// Eight Q4_K (`FIFTH` false) or Q5_K rows × `N` two-pass activation rows:
                /// each sub-block as a Q4_1 block (with Q5_K's fifth bits joined to the
                /// nibbles) whose scale and minimum are `d × scale` and `dmin × min`.
                ///
                /// # Safety
                /// As [`super::super::TileFn`], for the type the parameters name.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn k_tile<const N: usize, const FIFTH: bool, const SPLIT: bool>(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let (column_bytes, sub_bytes) = k_sizes(FIFTH);
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mut acc = [_mm256_setzero_ps(); N];
                    let mut mins = [_mm256_setzero_ps(); N];
                    for c in 0..blocks / 8 {
                        // SAFETY: column `c < blocks / 8` of `column_bytes` lies in `w`; its
                        // first 32 bytes are the eight f16 `d`, then the eight `dmin`.
                        let (p, d, dmin) = unsafe {
                            let p = w.as_ptr().add(column_bytes * c);
                            (p, halves(p), halves(p.add(16)))
                        };
                        for s in 0..8 {
                            // An eighth of the column per sub-block covers the stream.
                            let eighth = column_bytes / 8;
                            prefetch_ahead(p.wrapping_add(eighth * s), eighth);
                            let b = 8 * c + s;
                            // SAFETY: `b = 8 c + s < blocks`, every row's length (the `TileFn`
                            // contract).
                            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                            // SAFETY: `s < 8`: sub-block `s` (`sub_bytes`: 128 of nibbles, with
                            // `FIFTH` 32 of fifth bits) at `K_QUANTS + sub_bytes s` ends by the
                            // column's end; its eight scales at `32 + 8 s` and minimums at
                            // `96 + 8 s` lie before `K_QUANTS` (32 + 64 + 64).
                            let (sums, scales, mins_s) = unsafe {
                                let sub = p.add(K_QUANTS + sub_bytes * s);
                                (
                                    nibble_sums::<N, FIFTH, SPLIT>(sub, h, l),
                                    u8_lanes(p.add(32 + 8 * s)),
                                    u8_lanes(p.add(96 + 8 * s)),
                                )
                            };
                            let scale = _mm256_mul_ps(d, scales);
                            let min = _mm256_mul_ps(dmin, mins_s);
                            for i in 0..N {
                                let (sum_h, sum_l) = sums[i];
                                acc[i] = add_sums::<SPLIT>(acc[i], scale, sum_h, sum_l, h[i], l[i]);
                                let d_sum = d_sum_lanes::<SPLIT>(h[i], l[i]);
                                if SPLIT {
                                    mins[i] = _mm256_fmadd_ps(min, d_sum, mins[i]);
                                } else {
                                    // One pass: the minimums come off as they go, which
                                    // frees a register per row (`mins` stays zero).
                                    acc[i] = _mm256_fnmadd_ps(min, d_sum, acc[i]);
                                }
                            }
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for ((out, acc), mins) in out.iter_mut().zip(acc).zip(mins) {
                        *out = store(_mm256_sub_ps(acc, mins));
                    }
                    out
                }

                /// Eight Q6_K rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q6_k_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `half_scaled_tile` needs, for the same type.
                    unsafe { half_scaled_tile::<N, false, SPLIT>(w, hi, lo) }
                }

                /// Eight Q3_K rows × `N` two-pass activation rows ([`super::super::TileFn`]).
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q3_k_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    // SAFETY: this function's `TileFn` contract (tier, `w` the columns of
                    // the rows' blocks) is the one `half_scaled_tile` needs, for the same type.
                    unsafe { half_scaled_tile::<N, true, SPLIT>(w, hi, lo) }
                }

                /// Eight Q6_K (`Q3` false) or Q3_K rows × `N` two-pass activation rows: a
                /// chunk's values (Q6_K: low nibbles and high bits joined; Q3_K: the nibbles)
                /// are formed once for all the rows, and each sub-block's halves are summed
                /// apart for their two scales.
                ///
                /// # Safety
                /// As [`super::super::TileFn`], for the type the parameters name.
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn half_scaled_tile<const N: usize, const Q3: bool, const SPLIT: bool>(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let (column_bytes, sub_bytes, offset) = half_scaled_sizes(Q3);
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mask = _mm256_set1_epi8(0x0F);
                    let mut acc = [_mm256_setzero_ps(); N];
                    for c in 0..blocks / 8 {
                        // SAFETY: column `c < blocks / 8` of `column_bytes` lies in `w`; its
                        // first 16 bytes are the eight f16 `d`.
                        let (p, d) = unsafe {
                            let p = w.as_ptr().add(column_bytes * c);
                            (p, halves(p))
                        };
                        for s in 0..8 {
                            let eighth = column_bytes / 8;
                            prefetch_ahead(p.wrapping_add(eighth * s), eighth);
                            let b = 8 * c + s;
                            // SAFETY: `b = 8 c + s < blocks`, every row's length (the `TileFn`
                            // contract).
                            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                            // SAFETY: `s < 8`: sub-block `s` (`sub_bytes`) at
                            // `Q6_K_QUANTS + sub_bytes s` ends by the column's end.
                            let q = unsafe { p.add(Q6_K_QUANTS + sub_bytes * s) };
                            // The four chunks' values formed first, in straight-line code:
                            // one loop forming and multiplying them compiled to a rolled loop
                            // with branches and bounds checks (docs/kernels.md, Q6_K).
                            let values: [[__m256i; 2]; 4] = std::array::from_fn(|j| {
                                // SAFETY: `j < 4`: the chunk `32 j ..` lies in the sub-block's
                                // first 128 bytes, its nibbles.
                                let raw = unsafe { _mm256_loadu_si256(q.add(32 * j).cast()) };
                                if Q3 {
                                    [
                                        _mm256_and_si256(raw, mask),
                                        _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                                    ]
                                } else {
                                    // SAFETY: Q6_K's sub-block is 192 bytes; with `j < 4` the
                                    // high bits `128 + 32 (j / 2) ..` end by its byte 191.
                                    let bits = unsafe {
                                        _mm256_loadu_si256(q.add(128 + 32 * (j / 2)).cast())
                                    };
                                    q6_k_values(raw, bits, j)
                                }
                            });
                            // Per row: [first half, second half] of the hi pass, then the lo's;
                            // `narrow` holds the last `fit` or fewer products of each (Q3_K's
                            // four a half fit AVX2's 16-bit sums, Q6_K's two).
                            let fit = const { $fit(if Q3 { 7 } else { 63 }) };
                            let mut sums = [[_mm256_setzero_si256(); 4]; N];
                            let mut narrow = [[_mm256_setzero_si256(); 4]; N];
                            for (j, [first, second]) in values.into_iter().enumerate() {
                                for i in 0..N {
                                    let [f_h, s_h, f_l, s_l] = &mut narrow[i];
                                    *f_h = $dot16(*f_h, first, broadcast(h[i], j));
                                    *s_h = $dot16(*s_h, second, broadcast(h[i], 4 + j));
                                    if SPLIT {
                                        *f_l = $dot16(*f_l, first, broadcast(l[i], j));
                                        *s_l = $dot16(*s_l, second, broadcast(l[i], 4 + j));
                                    }
                                }
                                if (j + 1) % fit == 0 || j == 3 {
                                    let used = if SPLIT { 4 } else { 2 };
                                    for i in 0..N {
                                        for k in 0..used {
                                            sums[i][k] =
                                                _mm256_add_epi32(sums[i][k], $widen(narrow[i][k]));
                                            narrow[i][k] = _mm256_setzero_si256();
                                        }
                                    }
                                }
                            }
                            // SAFETY: `s < 8`: the scales of halves `2 s` and `2 s + 1` (eight
                            // bytes each at `16 + 8 (2 s + half)`) lie in bytes 16-143, before
                            // `Q6_K_QUANTS`.
                            let scales = unsafe {
                                [
                                    _mm256_mul_ps(d, i8_lanes(p.add(16 + 8 * (2 * s)))),
                                    _mm256_mul_ps(d, i8_lanes(p.add(16 + 8 * (2 * s + 1)))),
                                ]
                            };
                            for i in 0..N {
                                let [f_h, s_h, f_l, s_l] = sums[i];
                                // The stored values are `q + offset`: `offset × Σ a` per half
                                // comes off.
                                let unoffset = |sum: __m256i, a: &ActBlock, half: usize| {
                                    let off = offset * a.half_sum(half);
                                    _mm256_sub_epi32(sum, _mm256_set1_epi32(off))
                                };
                                if !SPLIT {
                                    let first = unoffset(f_h, h[i], 0);
                                    let second = unoffset(s_h, h[i], 1);
                                    acc[i] = one_pass_halves(acc[i], scales, first, second, h[i]);
                                    continue;
                                }
                                let halves = [(f_h, f_l), (s_h, s_l)];
                                for (half, (sum_h, sum_l)) in halves.into_iter().enumerate() {
                                    let (sum_h, sum_l) =
                                        (unoffset(sum_h, h[i], half), unoffset(sum_l, l[i], half));
                                    acc[i] = add_sums::<SPLIT>(
                                        acc[i],
                                        scales[half],
                                        sum_h,
                                        sum_l,
                                        h[i],
                                        l[i],
                                    );
                                }
                            }
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for (out, acc) in out.iter_mut().zip(acc) {
                        *out = store(acc);
                    }
                    out
                }

                /// Eight Q2_K rows × `N` two-pass activation rows ([`super::super::TileFn`]):
                /// a chunk's two-bit values are formed once for all the rows (a shift and a
                /// mask each), and each half's 16-bit sums meet the half's scale in the
                /// `vpmaddwd` that widens them; the minimums' term `Σ min × Σ a` is one more
                /// `vpmaddwd` of the row's two minimums with the block's two half sums. Both
                /// stay integers until the block's float steps. Every tier runs these
                /// 16-bit sums (at most 8 × 3 × 127 a lane), so they agree bit for bit.
                #[target_feature(enable = $features)]
                pub(in crate::interleaved) unsafe fn q2_k_tile<
                    const N: usize,
                    const SPLIT: bool,
                >(
                    w: &[u8],
                    hi: [&[ActBlock]; N],
                    lo: [&[ActBlock]; N],
                ) -> [[f32; GROUP]; N] {
                    let blocks = hi[0].len();
                    debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
                    let mask = _mm256_set1_epi8(0x03);
                    let nibble = _mm256_set1_epi16(0x0F);
                    // Copies each lane's first (second) 16-bit scale into both its halves.
                    let (first_scale, second_scale) = (
                        _mm256_setr_epi8(
                            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5,
                            4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                        ),
                        _mm256_setr_epi8(
                            2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6,
                            7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                        ),
                    );
                    let half_sums =
                        |a: &ActBlock| int_field_lanes::<_, { offset_of!(ActBlock, half_sums) }>(a);
                    let mut acc = [_mm256_setzero_ps(); N];
                    for c in 0..blocks / 8 {
                        // SAFETY: column `c < blocks / 8` of `Q2_K_BYTES` lies in `w`; its
                        // first 32 bytes are the eight f16 `d`, then the eight `dmin`.
                        let (p, d, dmin) = unsafe {
                            let p = w.as_ptr().add(Q2_K_BYTES * c);
                            (p, halves(p), halves(p.add(16)))
                        };
                        // `−dmin` (exactly), so that the minimums' step is `add_sums`' too.
                        let neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0));
                        for s in 0..8 {
                            let eighth = Q2_K_BYTES / 8;
                            prefetch_ahead(p.wrapping_add(eighth * s), eighth);
                            let b = 8 * c + s;
                            // SAFETY: `b = 8 c + s < blocks`, every row's length (the `TileFn`
                            // contract).
                            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                            // SAFETY: `s < 8`: the sub-block's 16 scale-and-minimum bytes at
                            // `32 + 16 s` lie before `Q2_K_QUANTS`, and its 64 bytes of values
                            // at `Q2_K_QUANTS + 64 s` end by the column's end.
                            let (bytes, q) = unsafe {
                                (
                                    _mm256_cvtepu8_epi16(_mm_loadu_si128(
                                        p.add(32 + 16 * s).cast(),
                                    )),
                                    [
                                        _mm256_loadu_si256(
                                            p.add(Q2_K_QUANTS + Q2_K_SUB * s).cast(),
                                        ),
                                        _mm256_loadu_si256(
                                            p.add(Q2_K_QUANTS + Q2_K_SUB * s + 32).cast(),
                                        ),
                                    ],
                                )
                            };
                            // Lane `r`: its halves' scales, each in both 16-bit halves, and
                            // its two minimums side by side.
                            let scales = _mm256_and_si256(bytes, nibble);
                            let scales = [
                                _mm256_shuffle_epi8(scales, first_scale),
                                _mm256_shuffle_epi8(scales, second_scale),
                            ];
                            let mins = _mm256_srli_epi16(bytes, 4);
                            // Per row: [first half, second half] of the hi pass, then the lo's.
                            let mut sums = [[_mm256_setzero_si256(); 4]; N];
                            for j in 0..4 {
                                let shifted = if j % 2 == 0 {
                                    q[j / 2]
                                } else {
                                    _mm256_srli_epi16(q[j / 2], 4)
                                };
                                let first = _mm256_and_si256(shifted, mask);
                                let second = _mm256_and_si256(_mm256_srli_epi16(shifted, 2), mask);
                                for i in 0..N {
                                    let [f_h, s_h, f_l, s_l] = &mut sums[i];
                                    *f_h = dot_avx2_i16(*f_h, first, broadcast(h[i], j));
                                    *s_h = dot_avx2_i16(*s_h, second, broadcast(h[i], 4 + j));
                                    if SPLIT {
                                        *f_l = dot_avx2_i16(*f_l, first, broadcast(l[i], j));
                                        *s_l = dot_avx2_i16(*s_l, second, broadcast(l[i], 4 + j));
                                    }
                                }
                            }
                            let scaled = |first: __m256i, second: __m256i| {
                                _mm256_add_epi32(
                                    _mm256_madd_epi16(first, scales[0]),
                                    _mm256_madd_epi16(second, scales[1]),
                                )
                            };
                            for i in 0..N {
                                let [f_h, s_h, f_l, s_l] = sums[i];
                                let (scaled_l, mins_l) = if SPLIT {
                                    (scaled(f_l, s_l), _mm256_madd_epi16(mins, half_sums(l[i])))
                                } else {
                                    (_mm256_setzero_si256(), _mm256_setzero_si256())
                                };
                                acc[i] = add_sums::<SPLIT>(
                                    acc[i],
                                    d,
                                    scaled(f_h, s_h),
                                    scaled_l,
                                    h[i],
                                    l[i],
                                );
                                let mins_h = _mm256_madd_epi16(mins, half_sums(h[i]));
                                acc[i] =
                                    add_sums::<SPLIT>(acc[i], neg_dmin, mins_h, mins_l, h[i], l[i]);
                            }
                        }
                    }
                    let mut out = [[0f32; GROUP]; N];
                    for (out, acc) in out.iter_mut().zip(acc) {
                        *out = store(acc);
                    }
                    out
                }
            }
        };
    }

    nibble_tiles!(
        avx2,
        "avx2,fma,f16c",
        dot_avx2,
        dot_avx2_i16,
        widen_avx2,
        i16_fit,
        avx2_parts
    );
    nibble_tiles!(
        vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        dot_vnni,
        dot_vnni,
        widen_vnni,
        vnni_fit,
        vnni_parts
    );

    /// Q8_0 on AVX2 with the sign trick: `vpmaddubsw` multiplies unsigned by signed bytes, so
    /// the weights go in as `|w|` and the activations as `sign(a, w)` (`|-128|` is 128 read
    /// unsigned, activations never reach -128): pair sums of at most 2 × 128 × 127 fit its
    /// 16-bit lanes.
    pub(super) mod q8_0_sign {
        use super::*;

        /// A chunk of 32 stored quants at `p` back as signed bytes.
        ///
        /// # Safety
        /// 32 bytes at `p` must be readable.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn signed(p: *const u8) -> __m256i {
            // SAFETY: the caller's contract: 32 readable bytes, the unaligned load's width.
            let stored = unsafe { _mm256_loadu_si256(p.cast()) };
            _mm256_xor_si256(stored, _mm256_set1_epi8(i8::MIN))
        }

        /// Eight Q8_0 rows × `N` two-pass activation rows ([`super::super::TileFn`]): each
        /// chunk's magnitudes are taken once for all of them.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) unsafe fn tile<const N: usize, const SPLIT: bool>(
            w: &[u8],
            hi: [&[ActBlock]; N],
            lo: [&[ActBlock]; N],
        ) -> [[f32; GROUP]; N] {
            let blocks = hi[0].len();
            debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..blocks {
                // SAFETY: column `b < blocks` (272 bytes: eight f16 `d`, eight chunks of 32
                // quants) lies in `w`.
                let p = unsafe { w.as_ptr().add(272 * b) };
                prefetch_ahead(p, 272);
                // SAFETY: `b < blocks`, every row's length (the `TileFn` contract).
                let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                let mut sh = [_mm256_setzero_si256(); N];
                let mut sl = [_mm256_setzero_si256(); N];
                for j in 0..8 {
                    // SAFETY: `j < 8`: chunk `16 + 32 j ..` ends by byte 271 of the column.
                    let w0 = unsafe { signed(p.add(16 + 32 * j)) };
                    let u0 = _mm256_abs_epi8(w0);
                    for i in 0..N {
                        sh[i] = dot_avx2(sh[i], u0, _mm256_sign_epi8(broadcast(h[i], j), w0));
                        if SPLIT {
                            sl[i] = dot_avx2(sl[i], u0, _mm256_sign_epi8(broadcast(l[i], j), w0));
                        }
                    }
                }
                // SAFETY: the column's first 16 bytes are the eight f16 `d`.
                let d = unsafe { halves(p) };
                for i in 0..N {
                    acc[i] = add_sums::<SPLIT>(acc[i], d, sh[i], sl[i], h[i], l[i]);
                }
            }
            let mut out = [[0f32; GROUP]; N];
            for (out, acc) in out.iter_mut().zip(acc) {
                *out = store(acc);
            }
            out
        }
    }

    /// Q6_K on AVX2 with one activation pass, a row at a time. A 16-bit sum holds two of
    /// Q6_K's products (`i16_fit`), so the shared tile keeps four sums per row live across a
    /// sub-block's chunks, and with four rows LLVM spilled them and the broadcasts to the
    /// stack (about 90 stack accesses per sub-block). Here a sub-block's values are unpacked
    /// once into eight registers for all the rows, and each row's two chunk pairs are summed
    /// and widened at once, so only its two 32-bit half sums live beside them; the sums start
    /// from the activation block's `q6_k_starts` (one broadcast from memory each) instead of
    /// taking `32 × Σ a` off through general registers. The integer sums are the shared
    /// tile's exactly and the float steps its own, so the bits are too. Two passes, and
    /// Q3_K, run the shared tile.
    pub(super) mod q6_k_one_pass {
        use super::*;
        use crate::interleaved::{Q6_K_BYTES, Q6_K_QUANTS, Q6_K_SUB};

        /// The values of a Q6_K sub-block of eight rows at `q` (its 128 bytes of low nibbles,
        /// then 64 of high bits), per chunk `j`: the first half's (values `4j..4j + 4` of each
        /// row, as `q + 32`), then the second's (`16 + 4j..`).
        ///
        /// # Safety
        /// 192 bytes at `q` must be readable.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn unpack(q: *const u8) -> [[__m256i; 2]; 4] {
            std::array::from_fn(|j| {
                // SAFETY: `j < 4`: the chunk `32 j ..` lies in the first 128 bytes, and the
                // high bits `128 + 32 (j / 2) ..` end by byte 191, of the 192 the caller
                // vouches for.
                let (raw, bits) = unsafe {
                    (
                        _mm256_loadu_si256(q.add(32 * j).cast()),
                        _mm256_loadu_si256(q.add(128 + 32 * (j / 2)).cast()),
                    )
                };
                q6_k_values(raw, bits, j)
            })
        }

        /// A row's integer sums with a sub-block's `values` ([`unpack`]), each half's from
        /// its `q6_k_starts`: Σ q × a per half, `q` the signed values. Two products fit a
        /// 16-bit lane (at most `2 × 63 × 127` each), so each chunk pair is added in 16 bits
        /// and widened once.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn row_sums(values: &[[__m256i; 2]; 4], a: &ActBlock) -> [__m256i; 2] {
            let ones = _mm256_set1_epi16(1);
            const STARTS: usize = offset_of!(ActBlock, q6_k_starts);
            let mut sums = [
                int_field_lanes::<_, STARTS>(a),
                int_field_lanes::<_, { STARTS + 4 }>(a),
            ];
            for pair in [0, 2] {
                for (half, sum) in sums.iter_mut().enumerate() {
                    let product = |j: usize| {
                        _mm256_maddubs_epi16(values[j][half], broadcast(a, 4 * half + j))
                    };
                    let narrow = _mm256_add_epi16(product(pair), product(pair + 1));
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(narrow, ones));
                }
            }
            sums
        }

        /// Sub-block `s` of the Q6_K column of eight rows at `p` (whose eight `d` are `d`): its
        /// values ([`unpack`]) and the `d × scale` of its two halves per row lane, what
        /// [`add_row`] takes (the narrow tile forms them per tile, AVX2's wide Q6_K tiles once
        /// per pass of activation rows).
        ///
        /// # Safety
        /// `s < 8`, and the `Q6_K_BYTES` at `p` must be readable.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) unsafe fn sub_block(
            p: *const u8,
            d: __m256,
            s: usize,
        ) -> ([[__m256i; 2]; 4], [__m256; 2]) {
            // SAFETY: `s < 8`: sub-block `s` (192 bytes at `Q6_K_QUANTS + 192 s`) ends by the
            // column's end; the scales of halves `2 s` and `2 s + 1` (eight bytes each at
            // `16 + 8 (2 s + half)`) lie in bytes 16-143.
            unsafe {
                (
                    unpack(p.add(Q6_K_QUANTS + Q6_K_SUB * s)),
                    [
                        _mm256_mul_ps(d, i8_lanes(p.add(16 + 8 * (2 * s)))),
                        _mm256_mul_ps(d, i8_lanes(p.add(16 + 8 * (2 * s + 1)))),
                    ],
                )
            }
        }

        /// `acc` plus one activation row's products with a sub-block's `values` and half
        /// `scales` ([`sub_block`]): its integer sums, then the float steps.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) fn add_row(
            acc: &mut __m256,
            values: &[[__m256i; 2]; 4],
            scales: [__m256; 2],
            a: &ActBlock,
        ) {
            let [first, second] = row_sums(values, a);
            *acc = one_pass_halves(*acc, scales, first, second, a);
        }

        /// Eight Q6_K rows × `N` activation rows ([`super::super::TileFn`]); with two passes
        /// (`SPLIT`), the shared tile.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::interleaved) unsafe fn tile<const N: usize, const SPLIT: bool>(
            w: &[u8],
            hi: [&[ActBlock]; N],
            lo: [&[ActBlock]; N],
        ) -> [[f32; GROUP]; N] {
            if SPLIT {
                // SAFETY: this function's `TileFn` contract is the shared tile's.
                return unsafe { avx2::q6_k_tile::<N, SPLIT>(w, hi, lo) };
            }
            let blocks = hi[0].len();
            debug_assert!(hi.iter().all(|a| a.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); N];
            for c in 0..blocks / 8 {
                // SAFETY: column `c < blocks / 8` of `Q6_K_BYTES` lies in `w`; its first 16
                // bytes are the eight f16 `d`.
                let (p, d) = unsafe {
                    let p = w.as_ptr().add(Q6_K_BYTES * c);
                    (p, halves(p))
                };
                for s in 0..8 {
                    let eighth = Q6_K_BYTES / 8;
                    prefetch_ahead(p.wrapping_add(eighth * s), eighth);
                    // SAFETY: `8 c + s < blocks`, every row's length (the `TileFn` contract).
                    let h = unsafe { blocks_at(hi, 8 * c + s) };
                    // SAFETY: `p` is a whole column, `d` its scales, `s < 8`.
                    let (values, scales) = unsafe { sub_block(p, d, s) };
                    for i in 0..N {
                        add_row(&mut acc[i], &values, scales, h[i]);
                    }
                }
            }
            let mut out = [[0f32; GROUP]; N];
            for (out, acc) in out.iter_mut().zip(acc) {
                *out = store(acc);
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
        fn unoffset(sum: __m256i, a: &ActBlock) -> __m256i {
            _mm256_sub_epi32(sum, _mm256_set1_epi32(a.sum << 7))
        }

        /// Eight Q8_0 rows × `N` two-pass activation rows ([`super::super::TileFn`]): each
        /// chunk is loaded once for all of them.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(in crate::interleaved) unsafe fn tile<const N: usize, const SPLIT: bool>(
            w: &[u8],
            hi: [&[ActBlock]; N],
            lo: [&[ActBlock]; N],
        ) -> [[f32; GROUP]; N] {
            // 32-bit sums: any number of products fits.
            let parts = vnni_parts(N, usize::MAX);
            let blocks = hi[0].len();
            debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..blocks {
                // SAFETY: column `b < blocks` (272 bytes: eight f16 `d`, eight chunks of 32
                // quants) lies in `w`.
                let p = unsafe { w.as_ptr().add(272 * b) };
                prefetch_ahead(p, 272);
                // SAFETY: `b < blocks`, every row's length (the `TileFn` contract).
                let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                let mut sh = [[_mm256_setzero_si256(); 4]; N];
                let mut sl = [[_mm256_setzero_si256(); 4]; N];
                for j in 0..8 {
                    // SAFETY: `j < 8`: chunk `16 + 32 j ..` ends by byte 271 of the column.
                    let w0 = unsafe { _mm256_loadu_si256(p.add(16 + 32 * j).cast()) };
                    let k = j % parts;
                    for i in 0..N {
                        sh[i][k] = dot_vnni(sh[i][k], w0, broadcast(h[i], j));
                        if SPLIT {
                            sl[i][k] = dot_vnni(sl[i][k], w0, broadcast(l[i], j));
                        }
                    }
                }
                // SAFETY: the column's first 16 bytes are the eight f16 `d`.
                let d = unsafe { halves(p) };
                for i in 0..N {
                    let (sum_h, sum_l) =
                        (unoffset(total(sh[i]), h[i]), unoffset(total(sl[i]), l[i]));
                    acc[i] = add_sums::<SPLIT>(acc[i], d, sum_h, sum_l, h[i], l[i]);
                }
            }
            let mut out = [[0f32; GROUP]; N];
            for (out, acc) in out.iter_mut().zip(acc) {
                *out = store(acc);
            }
            out
        }
    }
}
