//! The reference dot products: plain integer arithmetic per block, then one float multiply-add
//! per block (per sub-block for the K-quants). Every SIMD tier is tested against these.
//!
//! Each function takes one weight row (whole ggml blocks) and the row's activations quantized
//! to [`ActBlock`]s, one per 32 weights, and returns `Σ w_i x_i`.

use crate::act::ActBlock;
use crate::ggml::{
    IQ4_VALUES, half, iq4_xs_scale, q2_k_sub, q3_k_scales, q3_k_value, scale_min_k4,
};

/// `Σ u_i a_i` over 32 unsigned 4-bit values stored low nibbles (values 0-15) then high
/// nibbles (16-31) in 16 bytes.
fn nibble_dot(qs: &[u8], a: &[i8; 32]) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &q)| {
            i32::from(q & 0xF) * i32::from(a[j]) + i32::from(q >> 4) * i32::from(a[j + 16])
        })
        .sum()
}

/// Q8_0 (34-byte blocks: f16 d, 32 × i8).
pub fn q8_0(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(34)
        .zip(a)
        .map(|(b, ab)| {
            let dot: i32 = b[2..34]
                .iter()
                .zip(&ab.qs)
                .map(|(&q, &x)| i32::from(q as i8) * i32::from(x))
                .sum();
            half(b, 0) * ab.d * dot as f32
        })
        .sum()
}

/// Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles, offset 8).
pub fn q4_0(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(18)
        .zip(a)
        .map(|(b, ab)| half(b, 0) * (ab.d * nibble_dot(&b[2..18], &ab.qs) as f32 - 8.0 * ab.d_sum))
        .sum()
}

/// Q4_1 (20-byte blocks: f16 d and minimum m, 16 bytes of nibbles).
pub fn q4_1(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(20)
        .zip(a)
        .map(|(b, ab)| {
            half(b, 0) * ab.d * nibble_dot(&b[4..20], &ab.qs) as f32 + half(b, 2) * ab.d_sum
        })
        .sum()
}

/// `Σ q_i a_i` over 32 five-bit values: nibbles as [`nibble_dot`], fifth bit of value `i` in
/// bit `i` of `qh`.
fn five_bit_dot(qh: u32, qs: &[u8], a: &[i8; 32]) -> i32 {
    (0..32)
        .map(|i| {
            let nibble = if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 };
            let q = nibble | ((((qh >> i) & 1) as u8) << 4);
            i32::from(q) * i32::from(a[i])
        })
        .sum()
}

/// Q5_0 (22-byte blocks: f16 d, u32 of fifth bits, 16 bytes of nibbles, offset 16).
pub fn q5_0(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(22)
        .zip(a)
        .map(|(b, ab)| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let dot = five_bit_dot(qh, &b[6..22], &ab.qs);
            half(b, 0) * (ab.d * dot as f32 - 16.0 * ab.d_sum)
        })
        .sum()
}

/// Q5_1 (24-byte blocks: f16 d and minimum m, u32 of fifth bits, 16 bytes of nibbles).
pub fn q5_1(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(24)
        .zip(a)
        .map(|(b, ab)| {
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let dot = five_bit_dot(qh, &b[8..24], &ab.qs);
            half(b, 0) * ab.d * dot as f32 + half(b, 2) * ab.d_sum
        })
        .sum()
}

/// Q2_K (84-byte blocks of 256: 16 bytes of 4-bit scales and minimums, 64 bytes of 2-bit
/// values, f16 d and dmin; one scale per 16 values). Per activation block, the scaled sums
/// and the minimums' sums are integers; two float steps close it.
pub fn q2_k(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(84)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let (d, dmin) = (half(b, 80), half(b, 82));
            let mut sum = 0f32;
            for (j, act) in ab.iter().enumerate() {
                let (mut scaled, mut mins) = (0i32, 0i32);
                for h in 0..2 {
                    let (sc, m, at, shift) = q2_k_sub(b, 2 * j + h);
                    let dot: i32 = (0..16)
                        .map(|l| {
                            i32::from((b[at + l] >> shift) & 3) * i32::from(act.qs[16 * h + l])
                        })
                        .sum();
                    scaled += i32::from(sc) * dot;
                    mins += i32::from(m) * act.half_sum(h);
                }
                sum += act.d * (d * scaled as f32 - dmin * mins as f32);
            }
            sum
        })
        .sum()
}

/// Q3_K (110-byte blocks of 256: 32 bytes of high bits, 64 of low 2-bit pairs, 12 of packed
/// 6-bit scales, f16 d; values −4..=3, one scale per 16 values).
pub fn q3_k(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(110)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let d = half(b, 108);
            let scales = q3_k_scales(&b[96..108]);
            let mut sum = 0f32;
            for (j, act) in ab.iter().enumerate() {
                let mut scaled = 0i32;
                for h in 0..2 {
                    let s = 2 * j + h;
                    let dot: i32 = (0..16)
                        .map(|l| {
                            i32::from(q3_k_value(b, 16 * s + l)) * i32::from(act.qs[16 * h + l])
                        })
                        .sum();
                    scaled += i32::from(scales[s]) * dot;
                }
                sum += d * act.d * scaled as f32;
            }
            sum
        })
        .sum()
}

/// `Σ table[q_i] a_i` over 32 IQ4 indices stored as [`nibble_dot`]'s nibbles.
fn iq4_dot(qs: &[u8], a: &[i8; 32]) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &q)| {
            i32::from(IQ4_VALUES[usize::from(q & 0xF)]) * i32::from(a[j])
                + i32::from(IQ4_VALUES[usize::from(q >> 4)]) * i32::from(a[j + 16])
        })
        .sum()
}

/// IQ4_NL (18-byte blocks: f16 d, 16 bytes of table indices).
pub fn iq4_nl(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(18)
        .zip(a)
        .map(|(b, ab)| half(b, 0) * ab.d * iq4_dot(&b[2..18], &ab.qs) as f32)
        .sum()
}

/// IQ4_XS (136-byte blocks of 256: f16 d, 6-bit scales in a u16 and 4 bytes, 8 × 16 bytes of
/// table indices).
pub fn iq4_xs(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(136)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let d = half(b, 0);
            let mut scaled = 0f32;
            for (s, act) in ab.iter().enumerate() {
                let dot = iq4_dot(&b[8 + 16 * s..8 + 16 * s + 16], &act.qs);
                scaled += act.d * (iq4_xs_scale(b, s) * dot) as f32;
            }
            d * scaled
        })
        .sum()
}

/// Q4_K (144-byte blocks of 256: f16 d and dmin, 12 bytes of 6-bit scales and minimums, 128
/// bytes of nibbles; four 64-value groups, each the low then the high nibbles of 32 bytes).
pub fn q4_k(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(144)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let scales = &b[4..16];
            let mut sum = 0f32;
            for (j, act) in ab.iter().enumerate() {
                let qs = &b[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
                let shift = if j % 2 == 0 { 0 } else { 4 };
                let dot: i32 = qs
                    .iter()
                    .zip(&act.qs)
                    .map(|(&q, &x)| i32::from((q >> shift) & 0xF) * i32::from(x))
                    .sum();
                let (sc, m) = scale_min_k4(j, scales);
                sum += d * sc * act.d * dot as f32 - dmin * m * act.d_sum;
            }
            sum
        })
        .sum()
}

/// Q5_K (176-byte blocks of 256: as Q4_K, with 32 bytes of fifth bits before the nibbles;
/// sub-block `j`'s fifth bits are bit `j` of each byte).
pub fn q5_k(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(176)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let (scales, qh) = (&b[4..16], &b[16..48]);
            let mut sum = 0f32;
            for (j, act) in ab.iter().enumerate() {
                let qs = &b[48 + 32 * (j / 2)..48 + 32 * (j / 2) + 32];
                let shift = if j % 2 == 0 { 0 } else { 4 };
                let dot: i32 = qs
                    .iter()
                    .zip(qh)
                    .zip(&act.qs)
                    .map(|((&q, &h), &x)| {
                        let q = ((q >> shift) & 0xF) | (((h >> j) & 1) << 4);
                        i32::from(q) * i32::from(x)
                    })
                    .sum();
                let (sc, m) = scale_min_k4(j, scales);
                sum += d * sc * act.d * dot as f32 - dmin * m * act.d_sum;
            }
            sum
        })
        .sum()
}

/// Q6_K (210-byte blocks of 256: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16
/// i8 scales, f16 d; values offset by 32, one scale per 16).
pub fn q6_k(w: &[u8], a: &[ActBlock]) -> f32 {
    w.chunks_exact(210)
        .zip(a.chunks_exact(8))
        .map(|(b, ab)| {
            let d = half(b, 208);
            let mut sum = 0f32;
            for (h, acts) in ab.chunks_exact(4).enumerate() {
                let ql = &b[64 * h..64 * h + 64];
                let qh = &b[128 + 32 * h..128 + 32 * h + 32];
                let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                for (k, act) in acts.iter().enumerate() {
                    let mut halves = [0i32; 2];
                    for l in 0..32 {
                        // values l + 32k: k = 0, 1 take the low nibbles of ql[l], ql[l + 32];
                        // k = 2, 3 their high nibbles.
                        let byte = ql[l + 32 * (k % 2)];
                        let low = if k < 2 { byte & 0xF } else { byte >> 4 };
                        let q = i32::from(low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
                        halves[l / 16] += q * i32::from(act.qs[l]);
                    }
                    let s0 = f32::from(sc[2 * k] as i8);
                    let s1 = f32::from(sc[2 * k + 1] as i8);
                    sum += d * act.d * (s0 * halves[0] as f32 + s1 * halves[1] as f32);
                }
            }
            sum
        })
        .sum()
}
