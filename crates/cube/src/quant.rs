//! Weights kept in their GGUF blocks on the device ([`QuantWeights`]: the file's bytes, as
//! 32-bit words), multiplied without a dequantized copy: [`matmul`] decodes each 32-value group
//! of a row where it multiplies it, for up to [`few_rows_max`] activation rows (decode); for more
//! rows (prefill) [`dequantize`] writes the matrix in the activations' dtype once and a tiled
//! product runs on it.
//!
//! Blocks keep GGUF's byte layout (no repacking), so a Q4_K matrix takes 4.5 bits a weight on
//! the device as in the file. Values are decoded in f32 exactly as ggml's `dequantize_row_*`
//! computes them, and the products sum in f32 with unquantized activations: the result equals
//! the dequantized weights' product up to the order of the sums.

// Kernel bodies are cubecl's language, expanded at compile time, not plain Rust: it has no
// `div_ceil` or `is_multiple_of` on its integers, and a comptime condition stays its own `if`
// so the expansion drops the branch.
#![allow(clippy::manual_is_multiple_of, clippy::collapsible_if)]

use burn_backend::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::Plane;
use cubecl::prelude::*;

use crate::matmul::few_rows_max;
use crate::util::{Result, cube_index, empty_like, grid, input_error, unit_last_stride};

/// The GGUF block types kept quantized on the device, as the kernels' comptime codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockType {
    /// 32 values: f16 scale, 32 × i8.
    Q8_0,
    /// 32 values: f16 scale, 32 × 4-bit, offset 8.
    Q4_0,
    /// 32 values: f16 scale and minimum, 32 × 4-bit.
    Q4_1,
    /// 32 values: f16 scale, 32 × 5-bit, offset 16.
    Q5_0,
    /// 32 values: f16 scale and minimum, 32 × 5-bit.
    Q5_1,
    /// 256 values: f16 scale and minimum, 8 × (6-bit scale, 6-bit minimum), 4-bit values.
    Q4K,
    /// 256 values: as Q4_K, with a fifth bit per value.
    Q5K,
    /// 256 values: f16 scale, 16 × i8 scales, 6-bit values offset 32.
    Q6K,
}

impl BlockType {
    /// Every type.
    pub const ALL: [BlockType; 8] = [
        BlockType::Q8_0,
        BlockType::Q4_0,
        BlockType::Q4_1,
        BlockType::Q5_0,
        BlockType::Q5_1,
        BlockType::Q4K,
        BlockType::Q5K,
        BlockType::Q6K,
    ];

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            BlockType::Q4K | BlockType::Q5K | BlockType::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q8_0 => 34,
            BlockType::Q4_0 => 18,
            BlockType::Q4_1 => 20,
            BlockType::Q5_0 => 22,
            BlockType::Q5_1 => 24,
            BlockType::Q4K => 144,
            BlockType::Q5K => 176,
            BlockType::Q6K => 210,
        }
    }

    fn code(self) -> u32 {
        self as u32
    }
}

/// A `[rows, cols]` weight in GGUF blocks on the device, row after row.
#[derive(Debug, Clone)]
pub struct QuantWeights<R: CubeRuntime> {
    /// The blocks' bytes, little-endian 32-bit words (the last one zero-padded). `[words]` u32
    pub words: CubeTensor<R>,
    /// The block type.
    pub ty: BlockType,
    /// Output rows.
    pub rows: usize,
    /// Values per row (a multiple of the type's block).
    pub cols: usize,
}

impl<R: CubeRuntime> QuantWeights<R> {
    /// Uploads `bytes`, the blocks of `rows` rows of `cols` values of `ty` in GGUF's layout.
    ///
    /// # Errors
    /// [`crate::CubeError::Input`] when the sizes disagree.
    pub fn upload(
        client: &ComputeClient<R>,
        device: &R::Device,
        ty: BlockType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self> {
        if !cols.is_multiple_of(ty.block_values())
            || bytes.len() != rows * cols / ty.block_values() * ty.block_bytes()
        {
            return input_error(
                "quant upload",
                format!(
                    "{} bytes are not {rows} rows of {cols} {ty:?} values",
                    bytes.len()
                ),
            );
        }
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
        let handle = client.create_from_slice(&padded);
        let words = CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            Shape::new([padded.len() / 4]),
            handle,
            DType::U32,
        );
        Ok(Self {
            words,
            ty,
            rows,
            cols,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.words.meta.shape()[0] * 4
    }
}

/// Byte `at` of the blocks.
#[cube]
fn byte(words: &Tensor<u32>, at: usize) -> u32 {
    (words[at / 4] >> (u32::cast_from(at % 4) * 8)) & 0xFFu32
}

/// The little-endian u16 at byte `at`.
#[cube]
fn half_bits(words: &Tensor<u32>, at: usize) -> u32 {
    byte(words, at) | (byte(words, at + 1) << 8u32)
}

/// An f16's bits as an f32 (subnormals included), without an f16 type on the device.
#[cube]
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u32) << 16u32;
    let exponent = (h >> 10u32) & 0x1Fu32;
    let mantissa = h & 0x3FFu32;
    let mut value = f32::reinterpret(sign | ((exponent + 112u32) << 23u32) | (mantissa << 13u32));
    if exponent == 0u32 {
        // Subnormal (or zero): mantissa × 2^-24.
        value = f32::cast_from(mantissa) * 5.960_464_5e-8f32;
        if sign != 0u32 {
            value = -value;
        }
    }
    if exponent == 31u32 {
        // Inf/NaN: no weight file should hold them; kept as such.
        value = f32::reinterpret(sign | 0x7F80_0000u32 | (mantissa << 13u32));
    }
    value
}

/// The f16 at byte `at` as f32.
#[cube]
fn f16_at(words: &Tensor<u32>, at: usize) -> f32 {
    f16_to_f32(half_bits(words, at))
}

/// The 6-bit scale (`min = false`) or minimum (`min = true`) of sub-block `j` of a K-quant block
/// whose 12 scale bytes start at `s` (ggml's `get_scale_min_k4`).
// cubecl wants variables initialised before the branches that assign them.
#[allow(unused_assignments)]
#[cube]
fn scale_min_k4(words: &Tensor<u32>, s: usize, j: usize, #[comptime] min: bool) -> f32 {
    let mut value = 0u32;
    if j < 4 {
        if min {
            value = byte(words, s + j + 4) & 63u32;
        } else {
            value = byte(words, s + j) & 63u32;
        }
    } else if min {
        value = (byte(words, s + j + 4) >> 4u32) | ((byte(words, s + j) >> 6u32) << 4u32);
    } else {
        value = (byte(words, s + j + 4) & 0xFu32) | ((byte(words, s + j - 4) >> 6u32) << 4u32);
    }
    f32::cast_from(value)
}

/// A signed byte's value.
#[cube]
fn signed(b: u32) -> f32 {
    f32::cast_from(i32::cast_from(b) - i32::cast_from(b >> 7u32) * 256)
}

/// The 4-bit value `i` of a 16-byte run starting at `at`: nibble `i % 16`, low for `i < 16`.
#[cube]
fn nibble(words: &Tensor<u32>, at: usize, i: usize) -> u32 {
    let b = byte(words, at + i % 16);
    select(i < 16, b & 0xFu32, b >> 4u32)
}

/// Value `i` (0..32) of 32-value group `g` of the row whose blocks start at byte `row`, before
/// its group's scale and offset ([`group_scale`], [`group_offset`]).
// cubecl wants variables initialised before the branches that assign them.
#[allow(unused_assignments)]
#[cube]
fn group_quant(words: &Tensor<u32>, row: usize, g: usize, i: usize, #[comptime] ty: u32) -> f32 {
    let mut q = 0.0f32;
    if ty == 0 {
        // Q8_0: d, 32 × i8.
        q = signed(byte(words, row + g * 34 + 2 + i));
    } else if ty == 1 {
        // Q4_0: d, 16 bytes of nibbles.
        q = f32::cast_from(nibble(words, row + g * 18 + 2, i));
    } else if ty == 2 {
        // Q4_1: d, m, 16 bytes of nibbles.
        q = f32::cast_from(nibble(words, row + g * 20 + 4, i));
    } else if ty == 3 || ty == 4 {
        // Q5_0 (d, qh, nibbles), Q5_1 (d, m, qh, nibbles): value i's fifth bit is bit i of qh.
        let mut qh_at = row + g * 22 + 2;
        if ty == 4 {
            qh_at = row + g * 24 + 4;
        }
        let qh = byte(words, qh_at)
            | (byte(words, qh_at + 1) << 8u32)
            | (byte(words, qh_at + 2) << 16u32)
            | (byte(words, qh_at + 3) << 24u32);
        let high = (qh >> u32::cast_from(i)) & 1u32;
        q = f32::cast_from(nibble(words, qh_at + 4, i) | (high << 4u32));
    } else if ty == 5 || ty == 6 {
        // Q4_K, Q5_K: sub-block j of the 256-value block; its 64-value group j / 2 holds the
        // low (even j) or high (odd j) nibbles of 32 bytes; Q5_K's fifth bit is bit j of qh[i].
        let j = g % 8;
        let mut block = row + (g / 8) * 144;
        let mut qs = block + 16;
        if ty == 6 {
            block = row + (g / 8) * 176;
            qs = block + 48;
        }
        let b = byte(words, qs + (j / 2) * 32 + i);
        let mut value = select(j % 2 == 0, b & 0xFu32, b >> 4u32);
        if ty == 6 {
            value |= ((byte(words, block + 16 + i) >> u32::cast_from(j)) & 1u32) << 4u32;
        }
        q = f32::cast_from(value);
    } else {
        // Q6_K: quarter k of half h; 4 bits from ql, 2 from qh, minus 32.
        let block = row + (g / 8) * 210;
        let h = (g % 8) / 4;
        let k = g % 4;
        let ql = byte(words, block + 64 * h + i + (k % 2) * 32);
        let low = select(k < 2, ql & 0xFu32, ql >> 4u32);
        let high = (byte(words, block + 128 + 32 * h + i) >> u32::cast_from(2 * k)) & 3u32;
        q = f32::cast_from(i32::cast_from(low | (high << 4u32)) - 32);
    }
    q
}

/// The scale of 32-value group `g` (Q6_K: of value `i`'s 16-value half; the others ignore
/// `i`): a value is `scale × q + offset`.
// cubecl wants variables initialised before the branches that assign them.
#[allow(unused_assignments)]
#[cube]
fn group_scale(words: &Tensor<u32>, row: usize, g: usize, i: usize, #[comptime] ty: u32) -> f32 {
    let mut scale = 0.0f32;
    if ty == 0 {
        scale = f16_at(words, row + g * 34);
    } else if ty == 1 {
        scale = f16_at(words, row + g * 18);
    } else if ty == 2 {
        scale = f16_at(words, row + g * 20);
    } else if ty == 3 {
        scale = f16_at(words, row + g * 22);
    } else if ty == 4 {
        scale = f16_at(words, row + g * 24);
    } else if ty == 5 || ty == 6 {
        let mut block = row + (g / 8) * 144;
        if ty == 6 {
            block = row + (g / 8) * 176;
        }
        scale = f16_at(words, block) * scale_min_k4(words, block + 4, g % 8, false);
    } else {
        let block = row + (g / 8) * 210;
        let h = (g % 8) / 4;
        let k = g % 4;
        let sc = byte(words, block + 192 + 8 * h + i / 16 + 2 * k);
        scale = f16_at(words, block + 208) * signed(sc);
    }
    scale
}

/// The offset of 32-value group `g`: a value is `scale × q + offset`.
// cubecl wants variables initialised before the branches that assign them.
#[allow(unused_assignments)]
#[cube]
fn group_offset(words: &Tensor<u32>, row: usize, g: usize, #[comptime] ty: u32) -> f32 {
    let mut offset = 0.0f32;
    if ty == 1 {
        offset = f16_at(words, row + g * 18) * -8.0f32;
    } else if ty == 2 {
        offset = f16_at(words, row + g * 20 + 2);
    } else if ty == 3 {
        offset = f16_at(words, row + g * 22) * -16.0f32;
    } else if ty == 4 {
        offset = f16_at(words, row + g * 24 + 2);
    } else if ty == 5 || ty == 6 {
        let mut block = row + (g / 8) * 144;
        if ty == 6 {
            block = row + (g / 8) * 176;
        }
        offset = -(f16_at(words, block + 2) * scale_min_k4(words, block + 4, g % 8, true));
    }
    offset
}

/// Rows a unit accumulates at once in [`quant_rows_kernel`].
const CHUNK: usize = 8;

/// Units per output row in [`quant_rows_kernel`] (a plane on most GPUs).
const LANES: usize = 32;

/// Output rows per cube in [`quant_rows_kernel`].
const ROWS_PER_CUBE: usize = 4;

/// `out[r, j] = Σ_k x[r, k] · w[j, k]` with `w` decoded from its blocks: [`LANES`] units per
/// output row `j` stride over its 32-value groups, each decoding a group once for up to
/// [`CHUNK`] activation rows, then the lanes add their sums (plane operations where the device
/// has them, shared memory where it has not).
#[allow(unused_assignments)]
#[cube(launch_unchecked)]
fn quant_rows_kernel<F: Float>(
    x: &Tensor<F>,
    words: &Tensor<u32>,
    out: &mut Tensor<F>,
    rows: usize,
    n: usize,
    k: usize,
    row_bytes: usize,
    #[comptime] ty: u32,
    #[comptime] planes: bool,
    #[define(F)] _dtype: StorageType,
) {
    let t = UNIT_POS_X as usize;
    let lane = t % LANES;
    let slot = t / LANES;
    let col = cube_index() * ROWS_PER_CUBE + slot;
    let live = col < n;
    let groups = k / 32;
    let row = col * row_bytes;
    let mut partial = SharedMemory::<f32>::new(LANES * ROWS_PER_CUBE * CHUNK);
    let mut first = 0;
    while first < rows {
        let mut acc = Array::<f32>::new(CHUNK);
        #[unroll]
        for r in 0..CHUNK {
            acc[r] = 0.0f32;
        }
        if live {
            let mut g = lane;
            while g < groups {
                let mut scale = group_scale(words, row, g, 0, ty);
                let offset = group_offset(words, row, g, ty);
                let mut sums = Array::<f32>::new(CHUNK);
                let mut plain = Array::<f32>::new(CHUNK);
                #[unroll]
                for r in 0..CHUNK {
                    sums[r] = 0.0f32;
                    plain[r] = 0.0f32;
                }
                for i in 0..32 {
                    if ty == 7 {
                        if i == 16 {
                            // Q6_K's scale changes every 16 values: flush the first half.
                            #[unroll]
                            for r in 0..CHUNK {
                                acc[r] += scale * sums[r];
                                sums[r] = 0.0f32;
                            }
                            scale = group_scale(words, row, g, 16, ty);
                        }
                    }
                    let q = group_quant(words, row, g, i, ty);
                    #[unroll]
                    for r in 0..CHUNK {
                        if first + r < rows {
                            let v = f32::cast_from(x[(first + r) * x.stride(0) + g * 32 + i]);
                            sums[r] += q * v;
                            plain[r] += v;
                        }
                    }
                }
                #[unroll]
                for r in 0..CHUNK {
                    acc[r] += scale * sums[r] + offset * plain[r];
                }
                g += LANES;
            }
        }
        let base = slot * LANES * CHUNK;
        if planes {
            #[unroll]
            for r in 0..CHUNK {
                let total = plane_sum(acc[r]);
                if lane == 0 {
                    partial[base + r] = total;
                }
            }
            sync_cube();
            if live && lane < CHUNK && first + lane < rows {
                out[(first + lane) * n + col] = F::cast_from(partial[base + lane]);
            }
        } else {
            #[unroll]
            for r in 0..CHUNK {
                partial[base + r * LANES + lane] = acc[r];
            }
            sync_cube();
            if live && lane < CHUNK && first + lane < rows {
                let mut total = 0.0f32;
                for l in 0..LANES {
                    total += partial[base + lane * LANES + l];
                }
                out[(first + lane) * n + col] = F::cast_from(total);
            }
        }
        sync_cube();
        first += CHUNK;
    }
}

#[cube(launch_unchecked)]
fn dequantize_kernel<F: Float>(
    words: &Tensor<u32>,
    out: &mut Tensor<F>,
    groups: usize,
    k: usize,
    row_bytes: usize,
    #[comptime] ty: u32,
    #[define(F)] _dtype: StorageType,
) {
    // One unit per 32-value group of the matrix.
    let unit = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if unit < groups {
        let per_row = k / 32;
        let col = unit / per_row;
        let g = unit % per_row;
        let row = col * row_bytes;
        let mut scale = group_scale(words, row, g, 0, ty);
        let offset = group_offset(words, row, g, ty);
        for i in 0..32 {
            if ty == 7 {
                if i == 16 {
                    scale = group_scale(words, row, g, 16, ty);
                }
            }
            let q = group_quant(words, row, g, i, ty);
            out[col * k + g * 32 + i] = F::cast_from(scale * q + offset);
        }
    }
}

/// The weight decoded into a row-major `[rows, cols]` tensor of `dtype`.
///
/// # Errors
/// Never for weights made by [`QuantWeights::upload`]; the type is for symmetry with the
/// products.
pub fn dequantize<R: CubeRuntime>(w: &QuantWeights<R>, dtype: DType) -> Result<CubeTensor<R>> {
    let out = empty_like(&w.words, Shape::new([w.rows, w.cols]), dtype);
    let groups = w.rows * w.cols / 32;
    let row_bytes = w.cols / w.ty.block_values() * w.ty.block_bytes();
    // SAFETY: units below `groups` read one group's bytes inside its row's blocks (the upload
    // checked rows × row bytes) and write its 32 values inside `out`.
    unsafe {
        dequantize_kernel::launch_unchecked::<R>(
            &w.words.client,
            grid(groups.div_ceil(256)),
            CubeDim::new_1d(256),
            w.words.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            groups,
            w.cols,
            row_bytes,
            w.ty.code(),
            dtype.into(),
        );
    }
    Ok(out)
}

/// `x · wᵀ` for a weight in its blocks, in `x`'s dtype (see the module).
///
/// # Shapes
/// - `x`: `[m, cols]` (rows may be strided) → `[m, rows]`
///
/// # Errors
/// [`crate::CubeError::Input`] when the widths disagree; the tiled product's errors for more
/// than [`few_rows_max`] rows.
pub fn matmul<R: CubeRuntime>(x: CubeTensor<R>, w: &QuantWeights<R>) -> Result<CubeTensor<R>> {
    let dims = x.meta.shape().to_vec();
    let [m, k] = dims[..] else {
        return input_error("quant matmul", format!("x must be 2-D, got {dims:?}"));
    };
    if k != w.cols {
        return input_error(
            "quant matmul",
            format!("x {dims:?} against a weight of {} columns", w.cols),
        );
    }
    if m > few_rows_max(x.dtype) {
        let dense = dequantize(w, x.dtype)?;
        // `[rows, cols]` seen as `[cols, rows]`.
        let view = CubeTensor {
            meta: Box::new(burn_std::Metadata::new(
                Shape::new([w.cols, w.rows]),
                burn_std::strides![1, w.cols],
            )),
            ..dense
        };
        return crate::matmul::matmul(x, view);
    }
    let x = unit_last_stride(x);
    let out = empty_like(&x, Shape::new([m, w.rows]), x.dtype);
    let client = x.client.clone();
    let hardware = &client.properties().hardware;
    let planes = client.features().plane.contains(Plane::Ops)
        && hardware.plane_size_min == LANES as u32
        && hardware.plane_size_max == LANES as u32;
    let row_bytes = w.cols / w.ty.block_values() * w.ty.block_bytes();
    let dtype = x.dtype.into();
    // SAFETY: cube `c` handles output rows `c * ROWS_PER_CUBE ..` below `rows`, reading their
    // blocks inside the uploaded words and `x`'s rows below `m`; it writes `out[r, j]` for
    // `r < m`, `j < rows`.
    unsafe {
        quant_rows_kernel::launch_unchecked::<R>(
            &client,
            grid(w.rows.div_ceil(ROWS_PER_CUBE)),
            CubeDim::new_1d((LANES * ROWS_PER_CUBE) as u32),
            x.into_tensor_arg(),
            w.words.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            m,
            w.rows,
            k,
            row_bytes,
            w.ty.code(),
            planes,
            dtype,
        );
    }
    Ok(out)
}
