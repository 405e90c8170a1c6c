//! [`InferenceBackend`] for each burn backend kiln supports, each behind its cargo feature.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::DeviceMemory;
#[allow(unused_imports)]
use super::{BackendKind, InferenceBackend};

/// burn-flex, kiln's `cpu` backend.
#[cfg(feature = "cpu")]
pub type CpuBackend = burn::backend::Flex;

#[cfg(feature = "cpu")]
impl InferenceBackend for burn::backend::Flex {
    const KIND: BackendKind = BackendKind::Cpu;

    fn inference_device() -> Self::Device {
        burn::backend::flex::FlexDevice
    }

    fn write_in_place(
        target: &mut burn::tensor::Tensor<Self, 4>,
        ranges: [std::ops::Range<usize>; 4],
        values: burn::tensor::Tensor<Self, 4>,
    ) {
        flex_write::write_in_place(target, ranges, values);
    }

    fn linear_dense(
        x: burn::tensor::Tensor<Self, 2>,
        w: &burn::tensor::Tensor<Self, 2>,
    ) -> burn::tensor::Tensor<Self, 2> {
        flex_linear::dense(x, w)
    }

    type QuantWeight = std::sync::Arc<kiln_kernels::QuantMatrix>;

    const KEEPS_16_BIT_WEIGHTS: bool = true;

    fn linear_quantized(
        x: burn::tensor::Tensor<Self, 2>,
        w: &Self::QuantWeight,
    ) -> burn::tensor::Tensor<Self, 2> {
        flex_linear::quantized(x, w)
    }

    fn packed_attention(
        q: burn::tensor::Tensor<Self, 3>,
        k: burn::tensor::Tensor<Self, 3>,
        v: burn::tensor::Tensor<Self, 3>,
        mask: burn::tensor::Tensor<Self, 3, burn::tensor::Bool>,
        scoring: crate::attention::Scoring,
    ) -> burn::tensor::Tensor<Self, 2> {
        flex_attention::packed(q, k, v, mask, scoring)
    }

    fn grouped_attention(
        q: burn::tensor::Tensor<Self, 4>,
        k: burn::tensor::Tensor<Self, 4>,
        v: burn::tensor::Tensor<Self, 4>,
        mask: burn::tensor::Tensor<Self, 3, burn::tensor::Bool>,
        scoring: crate::attention::Scoring,
    ) -> burn::tensor::Tensor<Self, 4> {
        flex_attention::grouped(q, k, v, mask, scoring)
    }

    fn cached_attention(
        q: burn::tensor::Tensor<Self, 4>,
        kv: crate::kv_cache::CachedKv<'_, Self>,
        mask: burn::tensor::Tensor<Self, 3, burn::tensor::Bool>,
        scoring: crate::attention::Scoring,
    ) -> burn::tensor::Tensor<Self, 4> {
        flex_attention::cached(q, kv, mask, scoring)
    }

    fn rms_norm(
        x: burn::tensor::Tensor<Self, 2>,
        gamma: &burn::tensor::Tensor<Self, 1>,
        eps: f64,
    ) -> burn::tensor::Tensor<Self, 2> {
        flex_rowwise::rms_norm(x, gamma, eps)
    }

    fn rotate_half(
        x: burn::tensor::Tensor<Self, 3>,
        cos: &burn::tensor::Tensor<Self, 3>,
        sin: &burn::tensor::Tensor<Self, 3>,
    ) -> burn::tensor::Tensor<Self, 3> {
        flex_rowwise::rotate_half(x, cos, sin)
    }

    fn swiglu(gate_up: burn::tensor::Tensor<Self, 2>) -> burn::tensor::Tensor<Self, 2> {
        flex_rowwise::swiglu(gate_up)
    }

    fn split_columns<const N: usize>(
        x: burn::tensor::Tensor<Self, 2>,
        widths: [usize; N],
    ) -> [burn::tensor::Tensor<Self, 2>; N] {
        flex_rowwise::split_columns(x, widths)
    }
}

/// burn-flex's host buffers, as kiln's kernels read and write them.
#[cfg(feature = "cpu")]
mod flex_buffers {
    use burn::backend::Flex;
    use burn::backend::flex::{FlexTensor, Layout};
    use burn::tensor::{Bytes, DType, Tensor, TensorPrimitive};

    /// The float primitive of `t`, as it is laid out.
    pub(super) fn float<const D: usize>(t: Tensor<Flex, D>) -> FlexTensor {
        match t.into_primitive() {
            TensorPrimitive::Float(t) => t,
            TensorPrimitive::QFloat(_) => unreachable!("kiln never makes burn-quantized tensors"),
        }
    }

    /// Whether every dtype is f32 (kiln's kernels take f32; other dtypes take burn's ops).
    pub(super) fn all_f32(dtypes: &[DType]) -> bool {
        dtypes.iter().all(|d| *d == DType::F32)
    }

    /// `t` contiguous (a copy only when it was a strided view).
    pub(super) fn host<const D: usize>(t: Tensor<Flex, D>) -> FlexTensor {
        float(t).to_contiguous()
    }

    /// The values of a contiguous f32 tensor.
    pub(super) fn f32_slice(t: &FlexTensor) -> &[f32] {
        values(t)
    }

    /// The values of a contiguous tensor of element type `E`.
    pub(super) fn values<E: burn::tensor::Element + bytemuck::Pod>(t: &FlexTensor) -> &[E] {
        let start = t.layout().start_offset();
        &t.storage::<E>()[start..start + t.layout().num_elements()]
    }

    /// `out` as a contiguous f32 tensor of `shape`.
    pub(super) fn wrap<const D: usize>(out: Vec<f32>, shape: [usize; D]) -> Tensor<Flex, D> {
        let t = FlexTensor::new(
            Bytes::from_elems(out),
            Layout::contiguous(shape.into()),
            DType::F32,
        );
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }
}

/// Attention on burn-flex through kiln's kernel (burn-flex runs the (batch, head) loop of its
/// own on one thread, and its sums run over masked keys too).
#[cfg(feature = "cpu")]
mod flex_attention {
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;
    use burn::tensor::{Bool, Tensor};
    use burn::tensor::{DType, FloatDType};
    use burn::tensor::{bf16, f16};
    use kiln_kernels::ThreadPool;
    use kiln_kernels::attention::{
        AttentionShape, KvBlocks, KvElement, Q8_0Block, Scoring, attention, attention_blocks,
        q8_0_blocks,
    };

    use crate::dtype::KvDtype;
    use crate::kv_cache::CachedKv;

    use super::flex_buffers::{all_f32, f32_slice, host, values, wrap};

    pub(super) fn grouped(
        q: Tensor<Flex, 4>,
        k: Tensor<Flex, 4>,
        v: Tensor<Flex, 4>,
        mask: Tensor<Flex, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Flex, 4> {
        if !all_f32(&[q.dtype(), k.dtype(), v.dtype()]) {
            return crate::attention::sdpa_grouped(q, k, v, mask, scoring);
        }
        let shape = attention_shape(&q, &mask, k.dims()[2]);
        let (k, v) = (host(k), host(v));
        let kv = KvBlocks {
            k: f32_slice(&k),
            v: f32_slice(&v),
            // Each (row, KV head) is one block of all its keys.
            table: &(0..shape.batch * shape.n_kv_heads).collect::<Vec<_>>(),
            block_keys: shape.keys,
        };
        run(shape, scoring, q, kv, mask)
    }

    /// The packed prefill: the token-major rows regrouped head-major by row copies, the
    /// kernel, and its output regrouped back the same way.
    pub(super) fn packed(
        q: Tensor<Flex, 3>,
        k: Tensor<Flex, 3>,
        v: Tensor<Flex, 3>,
        mask: Tensor<Flex, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Flex, 2> {
        if !all_f32(&[q.dtype(), k.dtype(), v.dtype()]) {
            return crate::attention::sdpa_packed(q, k, v, mask, scoring);
        }
        let [len, n_heads, head_dim] = q.dims();
        let n_kv_heads = k.dims()[1];
        let shape = AttentionShape {
            batch: 1,
            n_kv_heads,
            n_rep: n_heads / n_kv_heads,
            q_len: len,
            keys: len,
            head_dim,
        };
        // Query head `kv * n_rep + rep` at position `i` is row `rep * len + i` of KV head
        // `kv`: head-major `[n_heads, len, head_dim]` is the kernel's layout.
        let (q, k, v) = (host(q), host(k), host(v));
        let q = transpose_rows(f32_slice(&q), 1, len, n_heads, head_dim);
        let k = transpose_rows(f32_slice(&k), 1, len, n_kv_heads, head_dim);
        let v = transpose_rows(f32_slice(&v), 1, len, n_kv_heads, head_dim);
        let mut out = vec![0f32; q.len()];
        with_mask(mask, |mask| {
            attention(
                shape,
                scoring,
                &q,
                &k,
                &v,
                mask,
                &mut out,
                ThreadPool::global(),
            )
        })
        .expect("the shapes were taken from the tensors");
        let out = transpose_rows(&out, 1, n_heads, len, head_dim);
        wrap(out, [len, n_heads * head_dim])
    }

    /// `[batch, a, b, width]` → `[batch, b, a, width]`, a row of `width` values at a time.
    fn transpose_rows(x: &[f32], batch: usize, a: usize, b: usize, width: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), batch * a * b * width);
        let mut out = vec![0f32; x.len()];
        for (x, out) in x
            .chunks_exact(a * b * width)
            .zip(out.chunks_exact_mut(a * b * width))
        {
            for (i, rows) in x.chunks_exact(b * width).enumerate() {
                for (j, row) in rows.chunks_exact(width).enumerate() {
                    out[(j * a + i) * width..][..width].copy_from_slice(row);
                }
            }
        }
        out
    }

    /// Attention over the cache's K/V where they lie (no gather per layer), f32, f16, bf16 or
    /// Q8_0 blocks read in place by the kernel, the token-major queries of each row regrouped
    /// head-major and back by row copies.
    pub(super) fn cached(
        q: Tensor<Flex, 4>,
        kv: CachedKv<'_, Flex>,
        mask: Tensor<Flex, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Flex, 4> {
        let kv_dtype = kv.k.dtype();
        let readable = matches!(kv_dtype, DType::F32 | DType::F16 | DType::BF16);
        if q.dtype() != DType::F32 && kv.dtype == KvDtype::Q8_0 {
            // The kernel takes f32 queries; the reference path would dequantize the cache.
            let computed = FloatDType::from(q.dtype());
            return cached(q.cast(FloatDType::F32), kv, mask, scoring).cast(computed);
        }
        if q.dtype() != DType::F32 || kv.v.dtype() != kv_dtype || !readable {
            return crate::attention::sdpa_cached(q, kv, mask, scoring);
        }
        let dims @ [rows, q_len, n_heads, head_dim] = q.dims();
        let [_, n_kv_heads, slots, _] = kv.k.dims();
        let shape = AttentionShape {
            batch: rows,
            n_kv_heads,
            n_rep: n_heads / n_kv_heads,
            q_len,
            keys: mask.dims()[2],
            head_dim,
        };
        let table = kv.table().to_vec();
        let (k, v) = (host(kv.k), host(kv.v));
        let q = host(q);
        let q = transpose_rows(f32_slice(&q), rows, q_len, n_heads, head_dim);
        let mut out = vec![0f32; q.len()];
        with_mask(mask, |mask| {
            let pool = ThreadPool::global();
            match (kv.dtype, kv_dtype) {
                (KvDtype::Q8_0, _) => {
                    let blocks = q8_0_blocks_of(&k, &v, &table, slots);
                    attention_blocks(shape, scoring, &q, blocks, mask, &mut out, pool)
                }
                (_, DType::F16) => {
                    let blocks = blocks_of::<f16>(&k, &v, &table, slots);
                    attention_blocks(shape, scoring, &q, blocks, mask, &mut out, pool)
                }
                (_, DType::BF16) => {
                    let blocks = blocks_of::<bf16>(&k, &v, &table, slots);
                    attention_blocks(shape, scoring, &q, blocks, mask, &mut out, pool)
                }
                _ => {
                    let blocks = blocks_of::<f32>(&k, &v, &table, slots);
                    attention_blocks(shape, scoring, &q, blocks, mask, &mut out, pool)
                }
            }
        })
        .expect("the shapes were taken from the tensors");
        wrap(transpose_rows(&out, rows, n_heads, q_len, head_dim), dims)
    }

    /// The kernel's view of contiguous K/V storage of element type `T`.
    fn blocks_of<'a, T: KvElement + burn::tensor::Element + bytemuck::Pod>(
        k: &'a FlexTensor,
        v: &'a FlexTensor,
        table: &'a [usize],
        block_keys: usize,
    ) -> KvBlocks<'a, T> {
        KvBlocks {
            k: values(k),
            v: values(v),
            table,
            block_keys,
        }
    }

    /// The kernel's view of a Q8_0 cache's storage: its f16 words as blocks.
    fn q8_0_blocks_of<'a>(
        k: &'a FlexTensor,
        v: &'a FlexTensor,
        table: &'a [usize],
        block_keys: usize,
    ) -> KvBlocks<'a, Q8_0Block> {
        let blocks = |t: &'a FlexTensor| {
            q8_0_blocks(values::<f16>(t)).expect("a Q8_0 cache stores whole blocks")
        };
        KvBlocks {
            k: blocks(k),
            v: blocks(v),
            table,
            block_keys,
        }
    }

    /// The kernel's view of `q` (`[batch, n_kv_heads, n_rep * q_len, head_dim]`) and `mask`
    /// (`[batch, q_len, keys]`).
    fn attention_shape(
        q: &Tensor<Flex, 4>,
        mask: &Tensor<Flex, 3, Bool>,
        keys: usize,
    ) -> AttentionShape {
        let [batch, n_kv_heads, q_rows, head_dim] = q.dims();
        let q_len = mask.dims()[1];
        AttentionShape {
            batch,
            n_kv_heads,
            n_rep: q_rows / q_len.max(1),
            q_len,
            keys,
            head_dim,
        }
    }

    fn run(
        shape: AttentionShape,
        scoring: Scoring,
        q: Tensor<Flex, 4>,
        kv: KvBlocks<'_>,
        mask: Tensor<Flex, 3, Bool>,
    ) -> Tensor<Flex, 4> {
        let dims = q.dims();
        let q = host(q);
        let mut out = vec![0f32; dims.iter().product()];
        with_mask(mask, |mask| {
            attention_blocks(
                shape,
                scoring,
                f32_slice(&q),
                kv,
                mask,
                &mut out,
                ThreadPool::global(),
            )
        })
        .expect("the shapes were taken from the tensors");
        wrap(out, dims)
    }

    /// `f` over `mask`'s values as `bool`s, read where burn-flex keeps them.
    fn with_mask<R>(mask: Tensor<Flex, 3, Bool>, f: impl FnOnce(&[bool]) -> R) -> R {
        let mask = mask.into_primitive().to_contiguous();
        let start = mask.layout().start_offset();
        let bytes = &mask.storage::<u8>()[start..start + mask.layout().num_elements()];
        assert!(
            bytes.iter().all(|&b| b <= 1),
            "burn-flex stores booleans as 0 or 1"
        );
        // SAFETY: every byte is 0 or 1 (just checked), the representation of `bool`.
        f(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) })
    }
}

/// RMSNorm, rotary embeddings, SwiGLU's gating and column splits on burn-flex as single
/// passes over flex's host buffers (f32; other dtypes take burn's composition).
#[cfg(feature = "cpu")]
mod flex_rowwise {
    use burn::backend::Flex;
    use burn::tensor::{DType, Tensor};
    use kiln_kernels::ThreadPool;
    use kiln_kernels::rowwise::{self, par_rows};

    use super::flex_buffers::{all_f32, f32_slice, host, wrap};

    pub(super) fn rms_norm(
        x: Tensor<Flex, 2>,
        gamma: &Tensor<Flex, 1>,
        eps: f64,
    ) -> Tensor<Flex, 2> {
        if x.dtype() != DType::F32 || gamma.dtype() != DType::F32 {
            return crate::layer_ops::rms_norm(x, gamma, eps);
        }
        let dims = x.dims();
        let (x, gamma) = (host(x), host(gamma.clone()));
        let (x, gamma) = (f32_slice(&x), f32_slice(&gamma));
        let d = dims[1];
        let mut out = vec![0f32; x.len()];
        par_rows(ThreadPool::global(), dims[0], &mut out, &|rows, out| {
            rowwise::rms_norm(&x[rows.start * d..rows.end * d], gamma, eps as f32, out);
        });
        wrap(out, dims)
    }

    pub(super) fn split_columns<const N: usize>(
        x: Tensor<Flex, 2>,
        widths: [usize; N],
    ) -> [Tensor<Flex, 2>; N] {
        let [n, width] = x.dims();
        if x.dtype() != DType::F32 || widths.iter().sum::<usize>() != width {
            return crate::layer_ops::split_columns(x, widths);
        }
        let x = host(x);
        let x = f32_slice(&x);
        let mut parts = widths.map(|w| Vec::with_capacity(n * w));
        for row in x.chunks_exact(width) {
            let mut rest = row;
            for (part, &w) in parts.iter_mut().zip(&widths) {
                let (head, tail) = rest.split_at(w);
                part.extend_from_slice(head);
                rest = tail;
            }
        }
        let mut parts = parts.into_iter();
        widths.map(|w| wrap(parts.next().expect("one part per width"), [n, w]))
    }

    pub(super) fn swiglu(gate_up: Tensor<Flex, 2>) -> Tensor<Flex, 2> {
        if gate_up.dtype() != DType::F32 {
            return crate::layer_ops::swiglu(gate_up);
        }
        let [n, width] = gate_up.dims();
        let gate_up = host(gate_up);
        let gate_up = f32_slice(&gate_up);
        let mut out = vec![0f32; n * width / 2];
        par_rows(ThreadPool::global(), n, &mut out, &|rows, out| {
            let rows = &gate_up[rows.start * width..rows.end * width];
            rowwise::swiglu(rows, width / 2, out);
        });
        wrap(out, [n, width / 2])
    }

    pub(super) fn rotate_half(
        x: Tensor<Flex, 3>,
        cos: &Tensor<Flex, 3>,
        sin: &Tensor<Flex, 3>,
    ) -> Tensor<Flex, 3> {
        if !all_f32(&[x.dtype(), cos.dtype(), sin.dtype()]) {
            return crate::layer_ops::rotate_half(x, cos, sin);
        }
        let dims = x.dims();
        let (x, cos, sin) = (host(x), host(cos.clone()), host(sin.clone()));
        let (x, cos, sin) = (f32_slice(&x), f32_slice(&cos), f32_slice(&sin));
        let (per_token, half) = (dims[1] * dims[2], dims[2] / 2);
        let mut out = vec![0f32; x.len()];
        par_rows(ThreadPool::global(), dims[0], &mut out, &|tokens, out| {
            let (x, angles) = (
                &x[tokens.start * per_token..tokens.end * per_token],
                tokens.start * half..tokens.end * half,
            );
            rowwise::rotate_half(x, &cos[angles.clone()], &sin[angles], dims[2], out);
        });
        wrap(out, dims)
    }
}

/// Linear layers on burn-flex through kiln's kernels, reading and writing flex's host buffers
/// directly.
#[cfg(feature = "cpu")]
mod flex_linear {
    use burn::backend::Flex;
    use burn::tensor::{DType, Tensor};
    use kiln_kernels::QuantMatrix;

    use super::flex_buffers::{f32_slice, float, host, wrap};

    /// Rows up to which kiln's decode kernel (`dense`, one pass over the weights) is used;
    /// above it the register-blocked `gemm` kernel.
    const DENSE_KERNEL_MAX_ROWS: usize = 16;

    pub(super) fn dense(x: Tensor<Flex, 2>, w: &Tensor<Flex, 2>) -> Tensor<Flex, 2> {
        let [n, d_in] = x.dims();
        let [_, d_out] = w.dims();
        if x.dtype() != DType::F32 || w.dtype() != DType::F32 {
            return x.matmul(w.clone());
        }
        let w_flex = float(w.clone());
        // `[d_in, d_out]` as stored, or the transposed view of a `[d_out, d_in]` table (a tied
        // output head); anything else goes to burn, since copying the weight would cost more
        // than the product.
        let layout = w_flex.layout();
        let stored_as_is = layout.is_contiguous();
        if !stored_as_is && layout.strides() != [1, d_in as isize] {
            return x.matmul(w.clone());
        }
        let offset = layout.start_offset();
        let stored = &w_flex.storage::<f32>()[offset..offset + d_in * d_out];
        let many_rows = n > DENSE_KERNEL_MAX_ROWS;
        // The scalar tier's gemm is the kernels' reference, far slower than burn's.
        if many_rows
            && (!stored_as_is || kiln_kernels::Tier::active() == kiln_kernels::Tier::Scalar)
        {
            return x.matmul(w.clone());
        }
        let x = host(x);
        let mut out = vec![0f32; n * d_out];
        if many_rows {
            kiln_kernels::gemm::gemm_in_out(stored, d_in, d_out, f32_slice(&x), n, &mut out);
        } else if stored_as_is {
            kiln_kernels::dense::matmul_in_out(stored, d_in, d_out, f32_slice(&x), n, &mut out);
        } else {
            kiln_kernels::dense::matmul_out_in(stored, d_in, d_out, f32_slice(&x), n, &mut out);
        }
        wrap(out, [n, d_out])
    }

    pub(super) fn quantized(x: Tensor<Flex, 2>, w: &QuantMatrix) -> Tensor<Flex, 2> {
        let [n, _] = x.dims();
        let x = host(x.cast(burn::tensor::FloatDType::F32));
        let mut out = vec![0f32; n * w.rows()];
        w.matmul(f32_slice(&x), n, &mut out);
        wrap(out, [n, w.rows()])
    }
}

/// burn-flex 0.21's `slice_assign` always copies the whole destination: `slice_write_impl`
/// shadows its argument with `tensor.to_contiguous()`, a second handle to the same buffer, so
/// the copy-on-write in `storage_mut` fires even when the caller held the only one. The KV
/// cache writes straight into the buffer instead when it is uniquely owned and contiguous.
#[cfg(feature = "cpu")]
mod flex_write {
    use std::ops::Range;

    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;
    use burn::tensor::{DType, Tensor, TensorPrimitive, bf16, f16};

    pub(super) fn write_in_place(
        target: &mut Tensor<Flex, 4>,
        ranges: [Range<usize>; 4],
        values: Tensor<Flex, 4>,
    ) {
        let device = target.device();
        let owned = std::mem::replace(target, Tensor::empty([0; 4], &device));
        let (TensorPrimitive::Float(mut dst), TensorPrimitive::Float(src)) =
            (owned.into_primitive(), values.into_primitive())
        else {
            unreachable!("float tensors have float primitives");
        };
        let unwritten = match dst.dtype() {
            DType::F32 => copy_block::<f32>(&mut dst, &ranges, src),
            DType::F16 => copy_block::<f16>(&mut dst, &ranges, src),
            DType::BF16 => copy_block::<bf16>(&mut dst, &ranges, src),
            _ => Some(src),
        };
        *target = Tensor::from_primitive(TensorPrimitive::Float(dst));
        if let Some(values) = unwritten {
            let values = Tensor::from_primitive(TensorPrimitive::Float(values));
            target.inplace(|t| t.slice_assign(ranges, values));
        }
    }

    /// Copies `src` into the block `ranges` of `dst` when that block lies in one index of the
    /// first dimension and spans the whole last one, and `dst` is contiguous and uniquely
    /// owned once `src` is let go: one contiguous run per index of the second dimension (a KV
    /// write: one run per head). Returns the values it did not write (`None`: it did).
    fn copy_block<E: burn::tensor::Element + bytemuck::Pod>(
        dst: &mut FlexTensor,
        ranges: &[Range<usize>; 4],
        src: FlexTensor,
    ) -> Option<FlexTensor> {
        let Ok(dims) = <[usize; 4]>::try_from(dst.layout().shape().as_ref()) else {
            return Some(src);
        };
        let contiguous = dst.is_contiguous() && dst.layout().start_offset() == 0;
        let in_bounds = ranges.iter().zip(&dims).all(|(r, &d)| r.end <= d);
        let blocky = ranges[0].len() == 1 && ranges[3] == (0..dims[3]);
        if !contiguous || !in_bounds || !blocky || src.dtype() != dst.dtype() {
            return Some(src);
        }
        let expected = [1, ranges[1].len(), ranges[2].len(), dims[3]];
        if !src.layout().shape().iter().copied().eq(expected) {
            return Some(src);
        }
        // The new K/V arrive as a view `[1, heads, tokens, head_dim]` of token-major rows:
        // copied a head row at a time from where they lie (burn-flex would copy such a view
        // one value at a time to make it contiguous first).
        let strides = src.layout().strides();
        let (head_stride, token_stride) = (strides[1], strides[2]);
        if strides[3] != 1 || head_stride < 0 || token_stride < 0 {
            return Some(src);
        }
        let (head_stride, token_stride) = (head_stride as usize, token_stride as usize);
        let (heads, tokens, width) = (ranges[1].len(), ranges[2].len(), dims[3]);
        let write = |storage: &mut [E], values: &[E], start: usize, head: usize, token: usize| {
            for (i, outer) in ranges[1].clone().enumerate() {
                let at = ((ranges[0].start * dims[1] + outer) * dims[2] + ranges[2].start) * width;
                for t in 0..tokens {
                    let from = start + i * head + t * token;
                    storage[at + t * width..][..width].copy_from_slice(&values[from..from + width]);
                }
            }
        };
        if let Some(storage) = dst.try_storage_mut::<E>() {
            write(
                storage,
                src.storage::<E>(),
                src.layout().start_offset(),
                head_stride,
                token_stride,
            );
            return None;
        }
        // `dst` is shared, most often with `src` itself: a copy between two places of one
        // cache (a beam taking a copy of its parent's last block) reads a view of the buffer
        // it writes. Its rows are copied out first and its handle let go, so the write stays
        // in place instead of copying the whole pool.
        let mut rows: Vec<E> = Vec::with_capacity(heads * tokens * width);
        let values: &[E] = src.storage::<E>();
        let start = src.layout().start_offset();
        for i in 0..heads {
            for t in 0..tokens {
                let from = start + i * head_stride + t * token_stride;
                rows.extend_from_slice(&values[from..from + width]);
            }
        }
        drop(src);
        if let Some(storage) = dst.try_storage_mut::<E>() {
            write(storage, &rows, 0, tokens * width, width);
            return None;
        }
        let data = burn::tensor::TensorData::new(rows, [1, heads, tokens, width]);
        let options = (&burn::backend::flex::FlexDevice, dst.dtype());
        let values = Tensor::<Flex, 4>::from_data(data, options);
        match values.into_primitive() {
            TensorPrimitive::Float(values) => Some(values),
            TensorPrimitive::QFloat(_) => unreachable!("float data makes a float tensor"),
        }
    }

    #[cfg(test)]
    mod tests {
        use burn::backend::Flex;
        use burn::tensor::{Tensor, TensorData, TensorPrimitive};

        fn buffer_address(t: &Tensor<Flex, 4>) -> usize {
            match t.clone().into_primitive() {
                TensorPrimitive::Float(p) => p.storage::<f32>().as_ptr() as usize,
                TensorPrimitive::QFloat(_) => unreachable!(),
            }
        }

        /// A copy between two places of one cache (a beam's fork) reads a view of the buffer
        /// it writes: it must still write in place, not copy the whole pool first.
        #[test]
        fn a_copy_within_one_buffer_stays_in_place() {
            let values: Vec<f32> = (0..2 * 2 * 4 * 3).map(|v| v as f32).collect();
            let data = TensorData::new(values.clone(), [2, 2, 4, 3]);
            let mut pool = Tensor::<Flex, 4>::from_data(data, &Default::default());
            let before = buffer_address(&pool);
            let source = pool.clone().slice([0..1, 0..2, 1..3, 0..3]);
            super::write_in_place(&mut pool, [1..2, 0..2, 1..3, 0..3], source);
            assert_eq!(buffer_address(&pool), before, "the pool was copied");
            let after: Vec<f32> = pool.into_data().to_vec().unwrap();
            let at = |t: usize, h: usize, s: usize, d: usize| ((t * 2 + h) * 4 + s) * 3 + d;
            for h in 0..2 {
                for s in 0..4 {
                    for d in 0..3 {
                        let expected = if (1..3).contains(&s) {
                            values[at(0, h, s, d)]
                        } else {
                            values[at(1, h, s, d)]
                        };
                        assert_eq!(after[at(1, h, s, d)], expected, "head {h} slot {s}");
                        assert_eq!(after[at(0, h, s, d)], values[at(0, h, s, d)]);
                    }
                }
            }
        }
    }
}

/// burn-ndarray, kiln's `ndarray` backend.
#[cfg(feature = "ndarray")]
pub type NdarrayBackend = burn::backend::NdArray;

#[cfg(feature = "ndarray")]
impl InferenceBackend for burn::backend::NdArray {
    const KIND: BackendKind = BackendKind::Ndarray;
    type QuantWeight = std::sync::Arc<kiln_kernels::QuantMatrix>;

    fn inference_device() -> Self::Device {
        burn::backend::ndarray::NdArrayDevice::Cpu
    }
}

/// The hooks both GPU backends run on kiln-cube's kernels ([`super::cube`]).
#[cfg(feature = "gpu-runtime")]
macro_rules! cube_kernels {
    ($runtime:ty) => {
        const STEP_ATTENTION: bool = true;
        const DENSE_WEIGHTS_OUT_IN: bool = true;
        const QUANTIZED_ANY_DTYPE: bool = true;
        type QuantWeight = super::cube::DeviceQuant<$runtime>;

        fn linear_quantized(
            x: burn::tensor::Tensor<Self, 2>,
            w: &Self::QuantWeight,
        ) -> burn::tensor::Tensor<Self, 2> {
            super::cube::linear_quantized(x, w)
        }

        fn rms_norm(
            x: burn::tensor::Tensor<Self, 2>,
            gamma: &burn::tensor::Tensor<Self, 1>,
            eps: f64,
        ) -> burn::tensor::Tensor<Self, 2> {
            super::cube::rms_norm(x, gamma, eps)
        }

        fn rotate_half(
            x: burn::tensor::Tensor<Self, 3>,
            cos: &burn::tensor::Tensor<Self, 3>,
            sin: &burn::tensor::Tensor<Self, 3>,
        ) -> burn::tensor::Tensor<Self, 3> {
            super::cube::rotate_half(x, cos, sin)
        }

        fn swiglu(gate_up: burn::tensor::Tensor<Self, 2>) -> burn::tensor::Tensor<Self, 2> {
            super::cube::swiglu(gate_up)
        }

        fn add_rms_norm(
            x: burn::tensor::Tensor<Self, 2>,
            delta: burn::tensor::Tensor<Self, 2>,
            gamma: &burn::tensor::Tensor<Self, 1>,
            eps: f64,
        ) -> (burn::tensor::Tensor<Self, 2>, burn::tensor::Tensor<Self, 2>) {
            super::cube::add_rms_norm(x, delta, gamma, eps)
        }

        fn split_heads_rope(
            qkv: burn::tensor::Tensor<Self, 2>,
            heads: [usize; 2],
            head_dim: usize,
            rope: Option<(
                &burn::tensor::Tensor<Self, 3>,
                &burn::tensor::Tensor<Self, 3>,
            )>,
        ) -> [burn::tensor::Tensor<Self, 3>; 3] {
            super::cube::split_heads_rope(qkv, heads, head_dim, rope)
        }

        fn argmax_rows(logits: burn::tensor::Tensor<Self, 2>) -> Vec<u32> {
            super::cube::argmax_rows(logits)
        }

        fn split_columns<const N: usize>(
            x: burn::tensor::Tensor<Self, 2>,
            widths: [usize; N],
        ) -> [burn::tensor::Tensor<Self, 2>; N] {
            super::cube::split_columns(x, widths)
        }

        fn linear_dense(
            x: burn::tensor::Tensor<Self, 2>,
            w: &burn::tensor::Tensor<Self, 2>,
        ) -> burn::tensor::Tensor<Self, 2> {
            super::cube::linear_dense(x, w)
        }

        fn write_kv_places(
            k_store: &mut burn::tensor::Tensor<Self, 4>,
            v_store: &mut burn::tensor::Tensor<Self, 4>,
            index: &crate::attention::StepIndex<Self>,
            k: burn::tensor::Tensor<Self, 3>,
            v: burn::tensor::Tensor<Self, 3>,
        ) {
            super::cube::write_kv_places(k_store, v_store, index, k, v);
        }

        fn step_attention(
            q: burn::tensor::Tensor<Self, 3>,
            k: burn::tensor::Tensor<Self, 3>,
            v: burn::tensor::Tensor<Self, 3>,
            k_store: burn::tensor::Tensor<Self, 4>,
            v_store: burn::tensor::Tensor<Self, 4>,
            index: &crate::attention::StepIndex<Self>,
            scoring: crate::attention::Scoring,
        ) -> burn::tensor::Tensor<Self, 2> {
            super::cube::step_attention(q, k, v, k_store, v_store, index, scoring)
        }
    };
}

/// burn-wgpu, kiln's `wgpu` backend.
#[cfg(feature = "wgpu")]
pub type WgpuBackend = burn::backend::Wgpu;

#[cfg(feature = "wgpu")]
impl InferenceBackend for burn::backend::Wgpu {
    const KIND: BackendKind = BackendKind::Wgpu;

    fn inference_device() -> Self::Device {
        burn::backend::wgpu::WgpuDevice::DefaultDevice
    }

    fn device_memory(device: &Self::Device) -> Option<DeviceMemory> {
        cubecl_memory::<burn::backend::wgpu::WgpuRuntime>(device)
    }

    fn release_unused_device_memory(device: &Self::Device) {
        cubecl_release::<burn::backend::wgpu::WgpuRuntime>(device);
    }

    cube_kernels!(burn::backend::wgpu::WgpuRuntime);
}

/// burn-cuda, kiln's `cuda` backend.
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda;

#[cfg(feature = "cuda")]
impl InferenceBackend for burn::backend::Cuda {
    const KIND: BackendKind = BackendKind::Cuda;

    fn inference_device() -> Self::Device {
        burn::backend::cuda::CudaDevice::new(0)
    }

    fn device_memory(device: &Self::Device) -> Option<DeviceMemory> {
        cubecl_memory::<cubecl::cuda::CudaRuntime>(device)
    }

    fn release_unused_device_memory(device: &Self::Device) {
        cubecl_release::<cubecl::cuda::CudaRuntime>(device);
    }

    cube_kernels!(cubecl::cuda::CudaRuntime);
}

/// The report of cubecl's memory manager for `device` (burn's fusion backends share the
/// runtime's client, so this is the memory burn's tensors live in).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn cubecl_memory<R: cubecl::Runtime>(device: &R::Device) -> Option<DeviceMemory> {
    let usage = R::client(device).memory_usage().ok()?;
    Some(DeviceMemory {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved,
    })
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn cubecl_release<R: cubecl::Runtime>(device: &R::Device) {
    R::client(device).memory_cleanup();
}
