//! ggml tensor types and their dequantization to f32, following the block layouts of
//! llama.cpp's `ggml-quants.c` (`dequantize_row_*`). Every block starts (or, for Q6_K, ends)
//! with f16 scales; 4- and 5-bit values are packed low nibbles first.
//!
//! Dequantization is the reference the quantized dot products ([`crate::quant`]) are tested
//! against, and what the loaders use for types without a kernel.

use half::f16;

/// The ggml types kiln reads, with their ids in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: f16 scale, 32 × 4-bit, offset 8.
    Q4_0,
    /// 32 values: f16 scale and minimum, 32 × 4-bit.
    Q4_1,
    /// 32 values: f16 scale, 32 × 5-bit (high bits in a u32), offset 16.
    Q5_0,
    /// 32 values: f16 scale and minimum, 32 × 5-bit.
    Q5_1,
    /// 32 values: f16 scale, 32 × i8.
    Q8_0,
    /// 256 values in 8 sub-blocks with 6-bit scales and minimums, 4-bit values.
    Q4K,
    /// 256 values in 8 sub-blocks with 6-bit scales and minimums, 5-bit values.
    Q5K,
    /// 256 values in 16 sub-blocks with i8 scales, 6-bit values, offset 32.
    Q6K,
    /// 256 values in 16 sub-blocks with 4-bit scales and minimums, 2-bit values.
    Q2K,
    /// 256 values in 16 sub-blocks with 6-bit scales, 3-bit values, offset 4.
    Q3K,
    /// 32 values: f16 scale, 32 × 4-bit indices into a fixed non-uniform table.
    Iq4Nl,
    /// 256 values in 8 sub-blocks with 6-bit scales, IQ4_NL's table.
    Iq4Xs,
}

/// The 16 values an IQ4_NL or IQ4_XS index stands for (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl GgmlType {
    /// Every supported type.
    pub const ALL: [GgmlType; 15] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q2K,
        Self::Q3K,
        Self::Iq4Nl,
        Self::Iq4Xs,
    ];

    /// The type with ggml id `id`, or `None` for one kiln cannot dequantize.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The id in `ggml_type`.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Iq4Nl => 20,
            Self::Iq4Xs => 23,
            Self::Bf16 => 30,
        }
    }

    /// llama.cpp's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Iq4Nl => "IQ4_NL",
            Self::Iq4Xs => "IQ4_XS",
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Iq4Nl => 32,
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q2K | Self::Q3K | Self::Iq4Xs => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Iq4Nl => 18,
            Self::Iq4Xs => 136,
        }
    }

    /// Bytes taken by `n` values, or `None` when `n` is not a whole number of blocks or the
    /// bytes would overflow a `usize` (a file's shape can claim any count).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
}

/// The name of any ggml type id, for errors about types kiln does not read.
pub fn ggml_type_name(id: u32) -> String {
    const OTHERS: [(u32, &str); 12] = [
        (9, "Q8_1"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
        (39, "MXFP4"),
    ];
    GgmlType::from_id(id)
        .map(|t| t.name().to_string())
        .or_else(|| {
            OTHERS
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, n)| n.to_string())
        })
        .unwrap_or_else(|| format!("ggml type {id}"))
}

/// The f16 at byte `at`, as f32.
pub(crate) fn half(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantizes `bytes` (whole blocks of `ty`) into `out`.
///
/// # Panics
/// If `bytes.len()` is not `ty.bytes_for(out.len())`; callers check sizes against the file.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(bytes.len()),
        ty.bytes_for(out.len()),
        "dequantize: {} bytes for {} {} values",
        bytes.len(),
        out.len(),
        ty.name()
    );
    let blocks = bytes
        .chunks_exact(ty.type_size())
        .zip(out.chunks_exact_mut(ty.block_size()));
    match ty {
        GgmlType::F32 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = half(b, 0)),
        GgmlType::Bf16 => {
            blocks.for_each(|(b, y)| {
                y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)
            });
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        GgmlType::Q2K => blocks.for_each(|(b, y)| q2_k(b, y)),
        GgmlType::Q3K => blocks.for_each(|(b, y)| q3_k(b, y)),
        GgmlType::Iq4Nl => blocks.for_each(|(b, y)| iq4_nl(b, y)),
        GgmlType::Iq4Xs => blocks.for_each(|(b, y)| iq4_xs(b, y)),
    }
}

/// `d: f16, qs: [u8; 16]`; value `j` is nibble `j % 16` (low for `j < 16`), minus 8, times d.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = (i32::from(q & 0xF) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// `d, m: f16, qs: [u8; 16]`; value = nibble × d + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = f32::from(q & 0xF) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The fifth bits of values `j` and `j + 16` from Q5's `qh`.
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    (
        (((qh >> j) << 4) & 0x10) as u8,
        ((qh >> (j + 12)) & 0x10) as u8,
    )
}

/// `d: f16, qh: u32, qs: [u8; 16]`; value = 5-bit − 16, times d.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = (i32::from((q & 0xF) | h0) - 16) as f32 * d;
        y[j + 16] = (i32::from((q >> 4) | h1) - 16) as f32 * d;
    }
}

/// `d, m: f16, qh: u32, qs: [u8; 16]`; value = 5-bit × d + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let (h0, h1) = fifth_bits(qh, j);
        y[j] = f32::from((q & 0xF) | h0) * d + m;
        y[j + 16] = f32::from((q >> 4) | h1) * d + m;
    }
}

/// `d: f16, qs: [i8; 32]`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = f32::from(q as i8) * d;
    }
}

/// Scale and minimum of sub-block `j` from the 12 packed 6-bit K-quant scale bytes
/// (llama.cpp's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = scale_min_k4_bits(j, s);
    (f32::from(sc), f32::from(m))
}

/// [`scale_min_k4`] as the 6-bit integers.
pub(crate) fn scale_min_k4_bits(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 12 packed bytes of eight 6-bit scales and minimums: the inverse of
/// [`scale_min_k4_bits`] (every bit of the 12 bytes is used, so the packing is one to one).
pub(crate) fn pack_scale_min_k4(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    s
}

/// The (scale, minimum) of the two 32-value sub-blocks of K-quant group `group` (64 values).
fn group_scales(group: usize, d: f32, dmin: f32, scales: &[u8]) -> [(f32, f32); 2] {
    [2 * group, 2 * group + 1].map(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        (d * sc, dmin * m)
    })
}

/// `d, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: four 64-value groups, each the low then
/// the high nibbles of 32 bytes, with its own pair of sub-block scales.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    for (group, (qs, y)) in b[16..144]
        .chunks_exact(32)
        .zip(y.chunks_exact_mut(64))
        .enumerate()
    {
        let [(d1, m1), (d2, m2)] = group_scales(group, d, dmin, scales);
        for (l, &q) in qs.iter().enumerate() {
            y[l] = d1 * f32::from(q & 0xF) - m1;
            y[l + 32] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// `d, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: as Q4_K, with group `g`'s
/// fifth bits in bits `2g` (low nibbles) and `2g + 1` (high nibbles) of `qh`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (group, (ql, y)) in b[48..176]
        .chunks_exact(32)
        .zip(y.chunks_exact_mut(64))
        .enumerate()
    {
        let [(d1, m1), (d2, m2)] = group_scales(group, d, dmin, scales);
        let (u1, u2) = (1u8 << (2 * group), 2u8 << (2 * group));
        for (l, &q) in ql.iter().enumerate() {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * f32::from((q & 0xF) + h1) - m1;
            y[l + 32] = d2 * f32::from((q >> 4) + h2) - m2;
        }
    }
}

/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: two 128-value halves; in each,
/// value `l + 32k` takes 4 bits from `ql` and 2 bits from `qh[l]` (bits `2k..2k+2`), minus 32,
/// times `d × scale[l / 16 + 2k]`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 208);
    for (half_index, y) in y.chunks_exact_mut(128).enumerate() {
        let ql = &b[64 * half_index..64 * half_index + 64];
        let qh = &b[128 + 32 * half_index..128 + 32 * half_index + 32];
        let sc = &b[192 + 8 * half_index..192 + 8 * half_index + 8];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, q) in q.into_iter().enumerate() {
                let scale = f32::from(sc[is + 2 * k] as i8);
                y[l + 32 * k] = d * scale * (i32::from(q) - 32) as f32;
            }
        }
    }
}

/// Sub-block `s` (0..16) of a Q2_K block: its 4-bit scale and minimum (`scales[s]`), and
/// where its 16 values sit: bytes `16 * (s % 2)..` of the 32-byte quant chunk `s / 8`, at bit
/// `2 * (s / 2 % 4)`.
pub(crate) fn q2_k_sub(b: &[u8], s: usize) -> (u8, u8, usize, u32) {
    let sc = b[s];
    (
        sc & 0xF,
        sc >> 4,
        16 + 32 * (s / 8) + 16 * (s % 2),
        2 * ((s / 2) % 4) as u32,
    )
}

/// `scales: [u8; 16], qs: [u8; 64], d, dmin: f16`: 16 sub-blocks of 16 values, value = `d ×
/// scale × q − dmin × min` with `q` two bits (see [`q2_k_sub`]).
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(b, 80), half(b, 82));
    for (s, y) in y.chunks_exact_mut(16).enumerate() {
        let (sc, m, at, shift) = q2_k_sub(b, s);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        for (l, y) in y.iter_mut().enumerate() {
            *y = dl * f32::from((b[at + l] >> shift) & 3) - ml;
        }
    }
}

/// The sixteen 6-bit scales of a Q3_K block, unpacked from its 12 bytes and offset by 32
/// (ggml's `kmask` shuffle in `dequantize_row_q3_K`).
pub(crate) fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    std::array::from_fn(|s| {
        let low = if s < 8 {
            packed[s] & 0xF
        } else {
            packed[s - 8] >> 4
        };
        let high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// Value `v` (0..256) of a Q3_K block, from −4 to 3: two low bits as Q2_K places them, minus 4
/// where the value's bit in `hmask` (byte `v % 32`, bit `v / 32`) is clear.
pub(crate) fn q3_k_value(b: &[u8], v: usize) -> i8 {
    let s = v / 16;
    let at = 32 + 32 * (s / 8) + 16 * (s % 2) + v % 16;
    let low = ((b[at] >> (2 * ((s / 2) % 4))) & 3) as i8;
    let high = (b[v % 32] >> (v / 32)) & 1;
    if high == 0 { low - 4 } else { low }
}

/// `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`: 16 sub-blocks of 16 values,
/// value = `d × (scale − 32) × q` with `q` in −4..=3 ([`q3_k_value`]).
fn q3_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 108);
    let scales = q3_k_scales(&b[96..108]);
    for (v, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(scales[v / 16]) * f32::from(q3_k_value(b, v));
    }
}

/// `d: f16, qs: [u8; 16]`: value `j` is the table entry of nibble `j % 16` (low for `j < 16`)
/// times d.
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * f32::from(IQ4_VALUES[usize::from(q & 0xF)]);
        y[j + 16] = d * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
    }
}

/// The 6-bit scale (offset by 32) of sub-block `s` (0..8) of an IQ4_XS block: four low bits
/// from `scales_l`, two high bits from `scales_h`.
pub(crate) fn iq4_xs_scale(b: &[u8], s: usize) -> i32 {
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    let high = ((scales_h >> (2 * s)) & 3) as u8;
    i32::from(low | (high << 4)) - 32
}

/// `d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128]`: eight IQ4_NL-like sub-blocks of
/// 32 (16 bytes each), value = `d × scale × table[nibble]`.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (s, y) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * iq4_xs_scale(b, s) as f32;
        for (j, &q) in b[8 + 16 * s..8 + 16 * s + 16].iter().enumerate() {
            y[j] = dl * f32::from(IQ4_VALUES[usize::from(q & 0xF)]);
            y[j + 16] = dl * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_match_ggml() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        assert_eq!(GgmlType::Q4K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(ggml_type_name(11), "Q3_K");
    }

    #[test]
    fn q8_0_is_scale_times_value() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block[2] = 4;
        block[3] = (-6i8) as u8;
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &block, &mut out);
        assert_eq!(&out[..3], &[2.0, -3.0, 0.0]);
    }
}
