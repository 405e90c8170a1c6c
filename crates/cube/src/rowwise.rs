//! Row operations of a transformer block as one launch each, where burn's compositions take
//! five to eight: RMSNorm, rotary embeddings in Hugging Face's rotate-half layout, and
//! SwiGLU's gating. Each computes in f32 and rounds once to the output's dtype; the
//! compositions they replace are `kiln_core::layer_ops`.

use burn_backend::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::util::{Result, cube_index, empty_like, grid, input_error, unit_last_stride};

/// Threads per cube of the row kernels: one RMSNorm row, or 256 elements.
const BLOCK: usize = 256;

/// The sum of every unit's `partial` over a cube of `block` units (a power of two), by a tree
/// through shared memory; every unit gets it.
#[cube]
fn cube_sum(partial: f32, #[comptime] block: usize) -> f32 {
    let tid = UNIT_POS_X as usize;
    let mut sums = SharedMemory::<f32>::new(block);
    sums[tid] = partial;
    sync_cube();
    let mut stride = block.runtime() / 2;
    while stride > 0 {
        if tid < stride {
            sums[tid] += sums[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
    sums[0]
}

#[cube(launch_unchecked)]
fn rms_norm_kernel<F: Float, G: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<G>,
    out: &mut Tensor<F>,
    rows: usize,
    eps: f32,
    #[comptime] block: usize,
    #[define(F, G)] _dtypes: [StorageType; 2],
) {
    let row = cube_index();
    let tid = UNIT_POS_X as usize;
    let d = x.shape(1);
    let mut partial = 0.0f32;
    if row < rows {
        let base = row * x.stride(0);
        let mut i = tid;
        while i < d {
            let v = f32::cast_from(x[base + i]);
            partial += v * v;
            i += block;
        }
    }
    let total = cube_sum(partial, block);
    if row < rows {
        let rms = f32::sqrt(total / f32::cast_from(d) + eps);
        let base = row * x.stride(0);
        let out_base = row * d;
        let mut i = tid;
        while i < d {
            // transformers' LlamaRMSNorm: normalised in f32, cast back, then scaled.
            let normed = F::cast_from(f32::cast_from(x[base + i]) / rms);
            out[out_base + i] = F::cast_from(f32::cast_from(normed) * f32::cast_from(gamma[i]));
            i += block;
        }
    }
}

/// RMSNorm of each row: `x / sqrt(mean(x²) + eps)` in f32, rounded to `x`'s dtype, times
/// `gamma`.
///
/// # Shapes
/// - `x`: `[n, d]` (rows may be strided), `gamma`: `[d]` → `[n, d]` in `x`'s dtype
///
/// # Errors
/// [`crate::CubeError::Input`] when the shapes disagree.
pub fn rms_norm<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    eps: f64,
) -> Result<CubeTensor<R>> {
    let dims = x.meta.shape().to_vec();
    let [rows, d] = dims[..] else {
        return input_error("rms_norm", format!("x must be [n, d], got {dims:?}"));
    };
    if gamma.meta.shape().to_vec() != [d] {
        return input_error(
            "rms_norm",
            format!("gamma must be [{d}], got {:?}", gamma.meta.shape()),
        );
    }
    let x = unit_last_stride(x);
    let gamma = crate::util::contiguous(gamma);
    let out = empty_like(&x, Shape::new([rows, d]), x.dtype);
    let dtypes = [x.dtype.into(), gamma.dtype.into()];
    // SAFETY: the kernel reads `x` rows below `rows` and columns below `d` through its strides,
    // `gamma` below `d`, and writes `out`'s `rows * d` values; `rows` and `d` are the tensors'.
    unsafe {
        rms_norm_kernel::launch_unchecked::<R>(
            &x.client,
            grid(rows),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            gamma.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            eps as f32,
            BLOCK,
            dtypes,
        );
    }
    Ok(out)
}

#[cube(launch_unchecked)]
fn add_rms_norm_kernel<F: Float, G: Float>(
    x: &Tensor<F>,
    delta: &Tensor<F>,
    gamma: &Tensor<G>,
    sum: &mut Tensor<F>,
    out: &mut Tensor<F>,
    rows: usize,
    eps: f32,
    #[comptime] block: usize,
    #[define(F, G)] _dtypes: [StorageType; 2],
) {
    let row = cube_index();
    let tid = UNIT_POS_X as usize;
    let d = x.shape(1);
    let mut partial = 0.0f32;
    if row < rows {
        let (x_base, delta_base, base) = (row * x.stride(0), row * delta.stride(0), row * d);
        let mut i = tid;
        while i < d {
            // The residual stream rounded to the dtype, as a separate addition would leave it.
            let s =
                F::cast_from(f32::cast_from(x[x_base + i]) + f32::cast_from(delta[delta_base + i]));
            sum[base + i] = s;
            let v = f32::cast_from(s);
            partial += v * v;
            i += block;
        }
    }
    let total = cube_sum(partial, block);
    if row < rows {
        let rms = f32::sqrt(total / f32::cast_from(d) + eps);
        let base = row * d;
        let mut i = tid;
        while i < d {
            // Each unit reads back the sums it wrote itself.
            let normed = F::cast_from(f32::cast_from(sum[base + i]) / rms);
            out[base + i] = F::cast_from(f32::cast_from(normed) * f32::cast_from(gamma[i]));
            i += block;
        }
    }
}

/// The residual stream's next value and its RMSNorm in one launch: `sum = x + delta` rounded
/// to the dtype, then [`rms_norm`] of `sum` (the same values as the two apart).
///
/// # Shapes
/// - `x`, `delta`: `[n, d]` (rows may be strided), `gamma`: `[d]` → (`sum`, `normed`), each
///   `[n, d]` in `x`'s dtype
///
/// # Errors
/// [`crate::CubeError::Input`] when the shapes or dtypes disagree.
pub fn add_rms_norm<R: CubeRuntime>(
    x: CubeTensor<R>,
    delta: CubeTensor<R>,
    gamma: CubeTensor<R>,
    eps: f64,
) -> Result<(CubeTensor<R>, CubeTensor<R>)> {
    let dims = x.meta.shape().to_vec();
    let [rows, d] = dims[..] else {
        return input_error("add_rms_norm", format!("x must be [n, d], got {dims:?}"));
    };
    if delta.meta.shape().to_vec() != dims
        || delta.dtype != x.dtype
        || gamma.meta.shape().to_vec() != [d]
    {
        return input_error(
            "add_rms_norm",
            format!(
                "x {dims:?} ({:?}) needs delta of the same shape and dtype, got {:?} ({:?}), \
                 and gamma of [{d}], got {:?}",
                x.dtype,
                delta.meta.shape(),
                delta.dtype,
                gamma.meta.shape()
            ),
        );
    }
    let (x, delta) = (unit_last_stride(x), unit_last_stride(delta));
    let gamma = crate::util::contiguous(gamma);
    let sum = empty_like(&x, Shape::new([rows, d]), x.dtype);
    let out = empty_like(&x, Shape::new([rows, d]), x.dtype);
    let dtypes = [x.dtype.into(), gamma.dtype.into()];
    // SAFETY: the kernel reads `x` and `delta` rows below `rows` and columns below `d` through
    // their strides, `gamma` below `d`, and writes `sum`'s and `out`'s `rows * d` values.
    unsafe {
        add_rms_norm_kernel::launch_unchecked::<R>(
            &x.client,
            grid(rows),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            delta.into_tensor_arg(),
            gamma.into_tensor_arg(),
            sum.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            eps as f32,
            BLOCK,
            dtypes,
        );
    }
    Ok((sum, out))
}

#[cube(launch_unchecked)]
fn rotate_half_kernel<F: Float, C: Float>(
    x: &Tensor<F>,
    cos: &Tensor<C>,
    sin: &Tensor<C>,
    out: &mut Tensor<F>,
    total: usize,
    #[define(F, C)] _dtypes: [StorageType; 2],
) {
    // One unit per (token, head, i < half): both outputs of the pair (i, i + half).
    let index = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index < total {
        let heads = x.shape(1);
        let half = x.shape(2) / 2;
        let i = index % half;
        let head = (index / half) % heads;
        let token = index / (half * heads);
        let at = token * x.stride(0) + head * x.stride(1);
        let x1 = f32::cast_from(x[at + i]);
        let x2 = f32::cast_from(x[at + i + half]);
        let c = f32::cast_from(cos[token * cos.stride(0) + i]);
        let s = f32::cast_from(sin[token * sin.stride(0) + i]);
        let out_at = (token * heads + head) * 2 * half;
        out[out_at + i] = F::cast_from(x1 * c - x2 * s);
        out[out_at + i + half] = F::cast_from(x2 * c + x1 * s);
    }
}

/// Rotary embeddings in the rotate-half layout: `(x1, x2) → (x1 cos − x2 sin, x2 cos + x1
/// sin)` for each head's two halves.
///
/// # Shapes
/// - `x`: `[n_tokens, n_heads, head_dim]` (may be strided) → same, contiguous
/// - `cos`, `sin`: `[n_tokens, 1, head_dim / 2]`
///
/// # Errors
/// [`crate::CubeError::Input`] when the shapes disagree.
pub fn rotate_half<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
) -> Result<CubeTensor<R>> {
    let dims = x.meta.shape().to_vec();
    let [n, heads, dim] = dims[..] else {
        return input_error("rotate_half", format!("x must be 3-D, got {dims:?}"));
    };
    let table = [n, 1, dim / 2];
    if !dim.is_multiple_of(2)
        || cos.meta.shape().to_vec() != table
        || sin.meta.shape().to_vec() != table
    {
        return input_error(
            "rotate_half",
            format!(
                "x {dims:?} needs cos and sin of {table:?}, got {:?} and {:?}",
                cos.meta.shape(),
                sin.meta.shape()
            ),
        );
    }
    let x = unit_last_stride(x);
    let (cos, sin) = (unit_last_stride(cos), unit_last_stride(sin));
    let out = empty_like(&x, Shape::new([n, heads, dim]), x.dtype);
    let total = n * heads * (dim / 2);
    let dtypes = [x.dtype.into(), cos.dtype.into()];
    // SAFETY: indices below `total` address the pairs of `x` (through its strides), the rows
    // of `cos`/`sin` below `n`, and `out`'s `n * heads * dim` values.
    unsafe {
        rotate_half_kernel::launch_unchecked::<R>(
            &x.client,
            grid(total.div_ceil(BLOCK)),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            total,
            dtypes,
        );
    }
    Ok(out)
}

#[cube(launch_unchecked)]
fn swiglu_kernel<F: Float>(
    gate_up: &Tensor<F>,
    out: &mut Tensor<F>,
    total: usize,
    #[define(F)] _dtype: StorageType,
) {
    let index = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if index < total {
        let d_ff = out.shape(1);
        let row = index / d_ff;
        let col = index % d_ff;
        let at = row * gate_up.stride(0) + col;
        let g = f32::cast_from(gate_up[at]);
        let u = f32::cast_from(gate_up[at + d_ff]);
        // silu(g) = g · sigmoid(g), rounded to the dtype as burn's composition rounds it.
        let silu = F::cast_from(g / (1.0f32 + f32::exp(-g)));
        out[index] = F::cast_from(f32::cast_from(silu) * u);
    }
}

/// SwiGLU's gating, `silu(g) * u`, for rows holding the gate's outputs then up's.
///
/// # Shapes
/// - `gate_up`: `[n, 2 d_ff]` (rows may be strided) → `[n, d_ff]`
///
/// # Errors
/// [`crate::CubeError::Input`] when the width is odd or the tensor is not 2-D.
pub fn swiglu<R: CubeRuntime>(gate_up: CubeTensor<R>) -> Result<CubeTensor<R>> {
    let dims = gate_up.meta.shape().to_vec();
    let [n, width] = dims[..] else {
        return input_error(
            "swiglu",
            format!("gate_up must be [n, 2 d_ff], got {dims:?}"),
        );
    };
    if !width.is_multiple_of(2) {
        return input_error("swiglu", format!("gate_up's width {width} is odd"));
    }
    let gate_up = unit_last_stride(gate_up);
    let out = empty_like(&gate_up, Shape::new([n, width / 2]), gate_up.dtype);
    let total = n * width / 2;
    let dtype = gate_up.dtype.into();
    // SAFETY: indices below `total` read row `index / d_ff` of `gate_up` at two columns below
    // its width and write `out`'s `n * d_ff` values.
    unsafe {
        swiglu_kernel::launch_unchecked::<R>(
            &gate_up.client,
            grid(total.div_ceil(BLOCK)),
            CubeDim::new_1d(BLOCK as u32),
            gate_up.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            total,
            dtype,
        );
    }
    Ok(out)
}

#[cube(launch_unchecked)]
fn split3_kernel<F: Float>(
    x: &Tensor<F>,
    a: &mut Tensor<F>,
    b: &mut Tensor<F>,
    c: &mut Tensor<F>,
    total: usize,
    #[define(F)] _dtype: StorageType,
) {
    // One unit per input value: written to the part its column falls in.
    let unit = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if unit < total {
        let (wa, wb, wc) = (a.shape(1), b.shape(1), c.shape(1));
        let width = wa + wb + wc;
        let row = unit / width;
        let col = unit % width;
        let value = x[row * x.stride(0) + col];
        if col < wa {
            a[row * wa + col] = value;
        } else if col < wa + wb {
            b[row * wb + col - wa] = value;
        } else {
            c[row * wc + col - wa - wb] = value;
        }
    }
}

/// `x`'s columns cut into three contiguous tensors of `widths` columns (a fused Q/K/V
/// projection's outputs), in one launch where slicing and reshaping each part would copy it
/// once per part.
///
/// # Shapes
/// - `x`: `[n, Σ widths]` (rows may be strided) → `[n, widths[i]]` each, contiguous
///
/// # Errors
/// [`crate::CubeError::Input`] when the widths do not add up to `x`'s.
pub fn split3<R: CubeRuntime>(x: CubeTensor<R>, widths: [usize; 3]) -> Result<[CubeTensor<R>; 3]> {
    let dims = x.meta.shape().to_vec();
    let [n, width] = dims[..] else {
        return input_error("split3", format!("x must be 2-D, got {dims:?}"));
    };
    if widths.iter().sum::<usize>() != width || widths.contains(&0) {
        return input_error("split3", format!("widths {widths:?} do not cut x {dims:?}"));
    }
    let x = unit_last_stride(x);
    let parts = widths.map(|w| empty_like(&x, Shape::new([n, w]), x.dtype));
    let total = n * width;
    let dtype = x.dtype.into();
    // SAFETY: units below `n * width` read row `unit / width` of `x` at a column below its
    // width and write one value inside the part that column belongs to.
    unsafe {
        split3_kernel::launch_unchecked::<R>(
            &x.client,
            grid(total.div_ceil(BLOCK)),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            parts[0].clone().into_tensor_arg(),
            parts[1].clone().into_tensor_arg(),
            parts[2].clone().into_tensor_arg(),
            total,
            dtype,
        );
    }
    Ok(parts)
}

#[cube(launch_unchecked)]
fn split3_rope_kernel<F: Float, C: Float>(
    x: &Tensor<F>,
    a: &mut Tensor<F>,
    b: &mut Tensor<F>,
    c: &mut Tensor<F>,
    cos: &Tensor<C>,
    sin: &Tensor<C>,
    total: usize,
    head_dim: usize,
    #[define(F, C)] _dtypes: [StorageType; 2],
) {
    // One unit per input value, written to its part; in the first two parts (Q and K) each
    // head's value rotated with its pair across the head's halves.
    let unit = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if unit < total {
        let (wa, wb, wc) = (a.shape(1), b.shape(1), c.shape(1));
        let width = wa + wb + wc;
        let row = unit / width;
        let col = unit % width;
        let at = row * x.stride(0) + col;
        let mut value = x[at];
        if col < wa + wb {
            let half = head_dim / 2;
            let i = col % head_dim;
            let own = f32::cast_from(value);
            if i < half {
                let pair = f32::cast_from(x[at + half]);
                let cs = f32::cast_from(cos[row * cos.stride(0) + i]);
                let sn = f32::cast_from(sin[row * sin.stride(0) + i]);
                value = F::cast_from(own * cs - pair * sn);
            } else {
                let pair = f32::cast_from(x[at - half]);
                let cs = f32::cast_from(cos[row * cos.stride(0) + i - half]);
                let sn = f32::cast_from(sin[row * sin.stride(0) + i - half]);
                value = F::cast_from(own * cs + pair * sn);
            }
        }
        if col < wa {
            a[row * wa + col] = value;
        } else if col < wa + wb {
            b[row * wb + col - wa] = value;
        } else {
            c[row * wc + col - wa - wb] = value;
        }
    }
}

/// A fused Q/K/V projection's output cut into its three parts, as [`split3`], with each
/// `head_dim`-wide head of the first two rotated as [`rotate_half`] does, in one launch.
///
/// # Shapes
/// - `x`: `[n, Σ widths]` (rows may be strided) → `[n, widths[i]]` each, contiguous
/// - `cos`, `sin`: `[n, 1, head_dim / 2]`
///
/// # Errors
/// [`crate::CubeError::Input`] when the widths do not add up to `x`'s, a part is not whole
/// heads, or the tables disagree.
pub fn split3_rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    widths: [usize; 3],
    head_dim: usize,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
) -> Result<[CubeTensor<R>; 3]> {
    let dims = x.meta.shape().to_vec();
    let [n, width] = dims[..] else {
        return input_error("split3_rope", format!("x must be 2-D, got {dims:?}"));
    };
    let table = [n, 1, head_dim / 2];
    if widths.iter().sum::<usize>() != width
        || widths.contains(&0)
        || head_dim == 0
        || !head_dim.is_multiple_of(2)
        || widths.iter().any(|w| !w.is_multiple_of(head_dim))
        || cos.meta.shape().to_vec() != table
        || sin.meta.shape().to_vec() != table
    {
        return input_error(
            "split3_rope",
            format!(
                "widths {widths:?} of heads of {head_dim} do not cut x {dims:?}, or the tables \
                 {:?} / {:?} are not {table:?}",
                cos.meta.shape(),
                sin.meta.shape()
            ),
        );
    }
    let x = unit_last_stride(x);
    let (cos, sin) = (unit_last_stride(cos), unit_last_stride(sin));
    let parts = widths.map(|w| empty_like(&x, Shape::new([n, w]), x.dtype));
    let total = n * width;
    let dtypes = [x.dtype.into(), cos.dtype.into()];
    // SAFETY: units below `n * width` read row `unit / width` of `x` at their column and, in
    // Q and K, at the pair in the same head (heads are whole inside each part), the tables' rows
    // below `n` at columns below `head_dim / 2`, and write one value inside their part.
    unsafe {
        split3_rope_kernel::launch_unchecked::<R>(
            &x.client,
            grid(total.div_ceil(BLOCK)),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            parts[0].clone().into_tensor_arg(),
            parts[1].clone().into_tensor_arg(),
            parts[2].clone().into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            total,
            head_dim,
            dtypes,
        );
    }
    Ok(parts)
}

#[cube(launch_unchecked)]
fn argmax_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<i32>,
    rows: usize,
    #[comptime] block: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = cube_index();
    let t = UNIT_POS_X as usize;
    let width = x.shape(1);
    let mut best = SharedMemory::<f32>::new(block);
    let mut at = SharedMemory::<u32>::new(block);
    let mut value = f32::new(-3.0e38);
    let mut index = 0u32;
    if row < rows {
        let mut i = t;
        while i < width {
            let v = f32::cast_from(x[row * x.stride(0) + i]);
            // Strictly greater: within a unit the first maximum stays.
            if v > value {
                value = v;
                index = u32::cast_from(i);
            }
            i += block;
        }
    }
    best[t] = value;
    at[t] = index;
    sync_cube();
    if row < rows && t == 0 {
        let mut top = best[0];
        let mut top_at = at[0];
        for u in 1..block {
            let v = best[u];
            // The lowest index among equal maxima, as the host sampler's greedy rule.
            if v > top || (v == top && at[u] < top_at) {
                top = v;
                top_at = at[u];
            }
        }
        out[row] = i32::cast_from(top_at);
    }
}

/// The index of each row's largest value (the lowest index among equal ones: the host
/// sampler's greedy rule), for greedy decoding that reads back token ids instead of logits.
///
/// # Shapes
/// - `x`: `[rows, width]` → `[rows]` i32
///
/// # Errors
/// [`crate::CubeError::Input`] when `x` is not 2-D or has no column.
pub fn argmax<R: CubeRuntime>(x: CubeTensor<R>) -> Result<CubeTensor<R>> {
    let dims = x.meta.shape().to_vec();
    let [rows, width] = dims[..] else {
        return input_error("argmax", format!("x must be 2-D, got {dims:?}"));
    };
    if width == 0 || width > u32::MAX as usize {
        return input_error("argmax", format!("rows of {width} values"));
    }
    let x = unit_last_stride(x);
    let out = empty_like(&x, Shape::new([rows]), burn_backend::DType::I32);
    let dtype = x.dtype.into();
    // SAFETY: cube `row < rows` reads its row's `width` values through the row stride and
    // writes `out[row]`.
    unsafe {
        argmax_kernel::launch_unchecked::<R>(
            &x.client,
            grid(rows),
            CubeDim::new_1d(BLOCK as u32),
            x.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            BLOCK,
            dtype,
        );
    }
    Ok(out)
}
