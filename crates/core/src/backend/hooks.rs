//! The operations a backend runs for kiln ([`InferenceBackend`]): burn's `Backend` plus the
//! hooks kiln's models and attention call (linear layers, attention, row kernels, argmax), each
//! with a default in burn's operations that any backend can run, and the defaults' helpers.
//!
//! It depends only on the pieces of attention and the KV cache its signatures and defaults
//! name (the step index, the reference attention in [`crate::attention::ops`], a layer's cached
//! K/V); [`crate::attention::attend`] calls these hooks. Which backends exist and how one is
//! picked at run time is [`super::select`]'s.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor};

use kiln_kernels::QuantMatrix;
use kiln_kernels::attention::Scoring;

use crate::attention::ops as reference;
use crate::attention::step::StepIndex;
use crate::dtype::Dtype;
use crate::error::{CoreError, Result};
use crate::kv_cache::CachedKv;

use super::{BackendKind, QuantWeight};

/// A burn backend kiln can run on: burn's `Backend` plus what kiln needs to pick it at run time.
pub trait InferenceBackend: Backend {
    /// Which kind this is.
    const KIND: BackendKind;

    /// The device kiln runs on for this backend (the first GPU, the host CPU).
    fn inference_device() -> Self::Device;

    /// Whether tensors of `dtype` can be stored and computed on `device`. Call only after a
    /// successful probe: it may initialise the backend's runtime.
    fn supports(device: &Self::Device, dtype: Dtype) -> bool {
        <Self as Backend>::supports_dtype(device, dtype.burn())
    }

    /// `Ok` if `dtype` is usable on `device`, else a typed error naming backend and dtype.
    ///
    /// # Errors
    /// [`CoreError::UnsupportedDtype`].
    fn require_dtype(device: &Self::Device, dtype: Dtype) -> Result<()> {
        if Self::supports(device, dtype) {
            Ok(())
        } else {
            Err(CoreError::UnsupportedDtype {
                kind: Self::KIND,
                dtype,
            })
        }
    }

    /// Writes `values` into `target[ranges]` without copying the rest of `target` (the KV
    /// caches' append). The default hands `slice_assign` the only handle through
    /// `Tensor::inplace`, which cubecl and ndarray honour; backends whose `slice_assign` copies
    /// anyway override it.
    ///
    /// # Shapes
    /// - `values`: the shape of the ranges
    fn write_in_place(
        target: &mut Tensor<Self, 4>,
        ranges: [Range<usize>; 4],
        values: Tensor<Self, 4>,
    ) {
        target.inplace(|t| t.slice_assign(ranges, values));
    }

    /// Whether dense weights live on this backend as `[d_out, d_in]` tensors (PyTorch's layout)
    /// that linear layers hold as their transposed `[d_in, d_out]` views: each output is then
    /// a contiguous dot product, which the GPU backends' matrix-vector kernels read in
    /// coalesced rows. The loaders and the fusing of projections follow it; the CPU backends
    /// keep `[d_in, d_out]` row-major.
    const DENSE_WEIGHTS_OUT_IN: bool = false;

    /// `x · w` for a dense weight stored `[d_in, d_out]` (a linear layer without its bias).
    /// The default is burn's matmul; the cpu backend runs few-row f32 products (decoding) on
    /// kiln's multithreaded kernel instead.
    ///
    /// # Shapes
    /// - `x`: `[n, d_in]`, `w`: `[d_in, d_out]` → `[n, d_out]`
    fn linear_dense(x: Tensor<Self, 2>, w: &Tensor<Self, 2>) -> Tensor<Self, 2> {
        x.matmul(w.clone())
    }

    /// `x`'s columns cut into consecutive parts of `widths` columns (a fused projection's
    /// outputs: Q, K and V). The default slices ([`crate::layer_ops::split_columns`]), views
    /// that later reshapes may copy value by value; the cpu backend copies each row's parts
    /// into contiguous tensors in one pass.
    ///
    /// # Shapes
    /// - `x`: `[n, Σ widths]` → `[n, widths[i]]` each
    fn split_columns<const N: usize>(
        x: Tensor<Self, 2>,
        widths: [usize; N],
    ) -> [Tensor<Self, 2>; N] {
        crate::layer_ops::split_columns(x, widths)
    }

    /// A quantized weight as this backend multiplies it ([`QuantWeight`]): the host blocks
    /// on the cpu backends, the same blocks copied to the device on the GPU backends.
    type QuantWeight: QuantWeight;

    /// Whether [`linear_quantized`](Self::linear_quantized) takes activations in any dtype
    /// (the GPU kernels, which return the activations' dtype) or f32 only (kiln's CPU
    /// kernels).
    const QUANTIZED_ANY_DTYPE: bool = false;

    /// Whether weights a file stores as 16-bit floats (F16, BF16) stay in them, multiplied by
    /// [`linear_quantized`](Self::linear_quantized) (the cpu backend: its kernels widen each
    /// weight as they read it, half the bytes of f32), rather than held dense in the model's
    /// dtype (the GPU backends, where a 16-bit dtype costs no more and runs their dense
    /// kernels).
    const KEEPS_16_BIT_WEIGHTS: bool = false;

    /// `x · wᵀ` for a weight kept in its quantized blocks. The default reads `x` back to the
    /// host, runs kiln's CPU kernel and uploads the result
    /// ([`linear_quantized_on_host`]): correct on every backend, fast where tensors live in
    /// host memory; the cpu backend overrides it to skip both copies, the GPU backends to
    /// multiply the blocks on the device.
    ///
    /// # Shapes
    /// - `x`: `[n, d_in]`, `w`: `[d_out, d_in]` → `[n, d_out]` (f32 on the cpu backends,
    ///   `x`'s dtype on the GPU backends)
    fn linear_quantized(x: Tensor<Self, 2>, w: &Self::QuantWeight) -> Tensor<Self, 2> {
        linear_quantized_on_host(x, w.host())
    }

    /// Attention of one packed row of fresh prompts over their own keys (the packed prefill):
    /// the tokens as the projections give them, token-major, scored as `scoring` says (as in
    /// every attention hook below). The default regroups them
    /// head-major for [`grouped_attention`](Self::grouped_attention) and back; the cpu backend
    /// regroups with row copies (burn-flex copies such permuted views one value at a time,
    /// about a tenth of a 512-token prefill).
    ///
    /// # Shapes
    /// - `q`: `[len, n_heads, head_dim]`; `k`, `v`: `[len, n_kv_heads, head_dim]`
    /// - `mask`: `[1, len, len]`
    /// - returns `[len, n_heads * head_dim]`
    fn packed_attention(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        mask: Tensor<Self, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Self, 2> {
        reference::sdpa_packed_with(q, k, v, mask, scoring, Self::grouped_attention)
    }

    /// Grouped-query attention with an explicit mask (`true` = masked): each KV head serves
    /// its `n_rep` query heads without copying its keys. The default expands the mask over the
    /// heads and runs burn's attention; the cpu backend runs kiln's multithreaded kernel, which
    /// sums over each query's visible keys only, so a sequence's outputs are the same bits
    /// alone, packed or padded ([`kiln_kernels::attention`]).
    ///
    /// # Shapes
    /// - `q`: `[batch, n_kv_heads, n_rep * q_len, head_dim]`: query head `kv * n_rep + rep` at
    ///   position `i` is row `rep * q_len + i` of KV head `kv`
    /// - `k`, `v`: `[batch, n_kv_heads, keys, head_dim]`
    /// - `mask`: `[batch, q_len, keys]`
    /// - returns the shape of `q`
    fn grouped_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        mask: Tensor<Self, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Self, 4> {
        reference::sdpa_grouped(q, k, v, mask, scoring)
    }

    /// [`grouped_attention`](Self::grouped_attention) of history rows over their cached K/V,
    /// the queries token-major as the projections give them. The default regroups them
    /// head-major, gathers the K/V each row reads into one tensor (cast to `q`'s dtype) and
    /// regroups the output back; the cpu backend regroups with row copies (burn-flex copies a
    /// permuted view a value at a time) and reads the K/V where the cache keeps them, through
    /// the block table.
    ///
    /// # Shapes
    /// - `q`: `[rows, q_len, n_heads, head_dim]` (query head `kv * n_rep + rep` serves KV head
    ///   `kv`)
    /// - `mask`: `[rows, q_len, keys]`
    /// - returns the shape of `q`
    fn cached_attention(
        q: Tensor<Self, 4>,
        kv: CachedKv<'_, Self>,
        mask: Tensor<Self, 3, Bool>,
        scoring: Scoring,
    ) -> Tensor<Self, 4> {
        let (k, v) = kv.gather();
        reference::sdpa_cached_with(q, k, v, mask, scoring, Self::grouped_attention)
    }

    /// Whether a forward hands this backend each layer's KV writes and attention for the whole
    /// step at once, from one [`StepIndex`] uploaded per forward ([`write_kv_places`],
    /// [`step_attention`]), instead of the packed and cached hooks above (which then never
    /// run). The GPU backends do: one launch per layer whatever the batch, where the hooks
    /// above cost a launch per sequence and a gather of the cache.
    ///
    /// [`write_kv_places`]: Self::write_kv_places
    /// [`step_attention`]: Self::step_attention
    const STEP_ATTENTION: bool = false;

    /// Writes token `t`'s K and V at its place in `index` (slot `places[t, 1]` of target
    /// `places[t, 0]`) of a layer's storage, skipping tokens with a negative target. The
    /// default writes each token with [`write_in_place`]; backends with [`STEP_ATTENTION`]
    /// scatter them in one launch.
    ///
    /// [`write_in_place`]: Self::write_in_place
    /// [`STEP_ATTENTION`]: Self::STEP_ATTENTION
    ///
    /// # Shapes
    /// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`
    /// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`
    fn write_kv_places(
        k_store: &mut Tensor<Self, 4>,
        v_store: &mut Tensor<Self, 4>,
        index: &StepIndex<Self>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
    ) {
        write_kv_one_by_one(k_store, v_store, &index.host.places, k, v);
    }

    /// Attention of every query token of a step over what it sees (see
    /// [`StepIndex`]): fresh tokens over their sequence's new K/V, tokens with history over
    /// the cache storage through their row's blocks. The default runs burn's operations per
    /// sequence ([`crate::attention::step_attention_reference`]); the GPU backends run one
    /// kernel (kiln-cube).
    ///
    /// # Shapes
    /// - `q`: `[n_tokens, n_heads, head_dim]`; `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`
    /// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`, after this step's
    ///   write
    /// - returns `[n_tokens, n_heads * head_dim]`, in batch order
    fn step_attention(
        q: Tensor<Self, 3>,
        k: Tensor<Self, 3>,
        v: Tensor<Self, 3>,
        k_store: Tensor<Self, 4>,
        v_store: Tensor<Self, 4>,
        index: &StepIndex<Self>,
        scoring: Scoring,
    ) -> Tensor<Self, 2> {
        reference::step_attention_reference(q, k, v, k_store, v_store, index, scoring)
    }

    /// RMSNorm of each row in f32, cast back to `x`'s dtype before the scale (transformers'
    /// `LlamaRMSNorm`). The default is burn's composition ([`crate::layer_ops::rms_norm`]);
    /// the cpu backend runs it as one pass per row ([`kiln_kernels::rowwise::rms_norm`]).
    ///
    /// # Shapes
    /// - `x`: `[n, d]`, `gamma`: `[d]` → `[n, d]`
    fn rms_norm(x: Tensor<Self, 2>, gamma: &Tensor<Self, 1>, eps: f64) -> Tensor<Self, 2> {
        crate::layer_ops::rms_norm(x, gamma, eps)
    }

    /// The residual stream's next value and its RMSNorm: `sum = x + delta` (rounded to the
    /// dtype, as an addition leaves it), then [`rms_norm`](Self::rms_norm) of `sum`. The
    /// default is the two apart; the GPU backends run both in one launch.
    ///
    /// # Shapes
    /// - `x`, `delta`: `[n, d]`, `gamma`: `[d]` → (`sum`, `normed`), each `[n, d]`
    fn add_rms_norm(
        x: Tensor<Self, 2>,
        delta: Tensor<Self, 2>,
        gamma: &Tensor<Self, 1>,
        eps: f64,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let sum = x + delta;
        (sum.clone(), Self::rms_norm(sum, gamma, eps))
    }

    /// A fused Q/K/V projection's output as Q, K and V heads, Q and K rotated with the rotary
    /// tables `rope` (`(cos, sin)`) where given. The default is
    /// [`split_columns`](Self::split_columns), reshapes and [`rotate_half`](Self::rotate_half)
    /// on Q and K; the GPU backends cut and rotate in one launch.
    ///
    /// # Shapes
    /// - `qkv`: `[n, (n_heads + 2 n_kv_heads) head_dim]`, `heads`: `[n_heads, n_kv_heads]`
    /// - `cos`, `sin`: `[n, 1, head_dim / 2]`
    /// - returns `[n, n_heads, head_dim]`, `[n, n_kv_heads, head_dim]` twice
    fn split_heads_rope(
        qkv: Tensor<Self, 2>,
        heads: [usize; 2],
        head_dim: usize,
        rope: Option<(&Tensor<Self, 3>, &Tensor<Self, 3>)>,
    ) -> [Tensor<Self, 3>; 3] {
        let [n, _] = qkv.dims();
        let [q_heads, kv_heads] = heads;
        let widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim];
        let [q, k, v] = Self::split_columns(qkv, widths);
        let q = q.reshape([n, q_heads, head_dim]);
        let k = k.reshape([n, kv_heads, head_dim]);
        let v = v.reshape([n, kv_heads, head_dim]);
        match rope {
            Some((cos, sin)) => [
                Self::rotate_half(q, cos, sin),
                Self::rotate_half(k, cos, sin),
                v,
            ],
            None => [q, k, v],
        }
    }

    /// Rotary embeddings in the rotate-half layout. The default is burn's composition
    /// ([`crate::layer_ops::rotate_half`]); the cpu backend runs it as one pass
    /// ([`kiln_kernels::rowwise::rotate_half`]).
    ///
    /// # Shapes
    /// - `x`: `[n_tokens, n_heads, head_dim]` → same
    /// - `cos`, `sin`: `[n_tokens, 1, head_dim / 2]`
    fn rotate_half(
        x: Tensor<Self, 3>,
        cos: &Tensor<Self, 3>,
        sin: &Tensor<Self, 3>,
    ) -> Tensor<Self, 3> {
        crate::layer_ops::rotate_half(x, cos, sin)
    }

    /// SwiGLU's gating, `silu(g) * u`, for rows holding the gate's outputs then up's. The
    /// default is burn's composition ([`crate::layer_ops::swiglu`]); the cpu backend runs it
    /// as one pass ([`kiln_kernels::rowwise::swiglu`]).
    ///
    /// # Shapes
    /// - `gate_up`: `[n, 2 d_ff]` → `[n, d_ff]`
    fn swiglu(gate_up: Tensor<Self, 2>) -> Tensor<Self, 2> {
        crate::layer_ops::swiglu(gate_up)
    }

    /// The index of each row's largest logit (the lowest among equal ones: the host sampler's
    /// greedy rule), read back as token ids. The default reads the rows to the host and
    /// scans them; the GPU backends pick on the device and read back one id a row instead of
    /// a vocabulary of logits.
    ///
    /// # Shapes
    /// - `logits`: `[rows, vocab]` → `rows` ids
    fn argmax_rows(logits: Tensor<Self, 2>) -> Vec<u32> {
        argmax_on_host(logits)
    }

    /// What the backend's device allocator holds, where it reports it (the GPU backends);
    /// `None` on the CPU backends, whose memory is the process's resident set. Call after the
    /// work to be measured has been read back: queued work is not counted.
    fn device_memory(_device: &Self::Device) -> Option<DeviceMemory> {
        None
    }

    /// Asks the device allocator to return the memory it holds but no tensor uses (a no-op on
    /// the CPU backends), so that a later [`device_memory`](Self::device_memory) counts less of
    /// what earlier work left behind. The allocator decides what it frees; nothing is promised.
    fn release_unused_device_memory(_device: &Self::Device) {}
}

/// Kernel launches counted in this process once the count has settled, where counting is on
/// (a GPU backend configured with `count_launches`, [`super::device_runtime`]); `None` elsewhere.
pub fn launches_settled() -> Option<u64> {
    #[cfg(feature = "gpu-runtime")]
    if super::device_runtime::LaunchCounter::is_active() {
        return Some(super::device_runtime::LaunchCounter::settled());
    }
    None
}

/// How many GPU hook calls in this process ran burn's composition because kiln's own kernel
/// refused the inputs (a shape or dtype it does not take, or a kernel choice the device cannot
/// launch), and the first refusal's reason. The results are the same either way; the count
/// says whether the fixed kernels (and their launch and speed figures) were what ran. `(0,
/// None)` without a GPU backend.
pub fn kernel_fallbacks() -> (u64, Option<String>) {
    #[cfg(feature = "gpu-runtime")]
    return super::cube::fallbacks();
    #[cfg(not(feature = "gpu-runtime"))]
    (0, None)
}

/// [`InferenceBackend::argmax_rows`]'s default: the rows read back and scanned on the host.
///
/// # Shapes
/// - `logits`: `[rows, vocab]` → `rows` ids
pub fn argmax_on_host<B: Backend>(logits: Tensor<B, 2>) -> Vec<u32> {
    let [_, vocab] = logits.dims();
    let values = crate::tensor::host_f32(logits);
    values
        .chunks(vocab.max(1))
        .map(|row| crate::sampling::first_max_index(row) as u32)
        .collect()
}

/// [`InferenceBackend::write_kv_places`]'s default: each token's K and V written with
/// [`InferenceBackend::write_in_place`].
///
/// # Shapes
/// As [`InferenceBackend::write_kv_places`].
pub fn write_kv_one_by_one<B: InferenceBackend>(
    k_store: &mut Tensor<B, 4>,
    v_store: &mut Tensor<B, 4>,
    host_places: &[i32],
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) {
    let [_, heads, dim] = k.dims();
    let dtype = burn::tensor::FloatDType::from(k_store.dtype());
    for (t, place) in host_places.chunks_exact(2).enumerate() {
        if place[0] < 0 {
            continue;
        }
        let (target, slot) = (place[0] as usize, place[1] as usize);
        let ranges = [target..target + 1, 0..heads, slot..slot + 1, 0..dim];
        for (store, new) in [(&mut *k_store, &k), (&mut *v_store, &v)] {
            let row = new
                .clone()
                .narrow(0, t, 1)
                .reshape([1, heads, 1, dim])
                .cast(dtype);
            B::write_in_place(store, ranges.clone(), row);
        }
    }
}

/// A device allocator's report, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Held by live tensors.
    pub in_use: u64,
    /// Taken from the device by the allocator: live tensors, padding and free pages it keeps
    /// (PyTorch's "reserved").
    pub reserved: u64,
}

/// `x · wᵀ` through kiln's CPU kernel on any backend: `x` read back to the host in f32, the
/// product uploaded.
///
/// # Shapes
/// - `x`: `[n, d_in]`, `w`: `[d_out, d_in]` → `[n, d_out]` (f32)
pub fn linear_quantized_on_host<B: Backend>(x: Tensor<B, 2>, w: &QuantMatrix) -> Tensor<B, 2> {
    let [n, d_in] = x.dims();
    let device = x.device();
    let host = crate::tensor::read_back(x.cast(burn::tensor::FloatDType::F32))
        .into_vec::<f32>()
        .expect("an f32 tensor reads back as f32");
    debug_assert_eq!(host.len(), n * d_in);
    let mut out = vec![0f32; n * w.rows()];
    w.matmul(&host, n, &mut out);
    crate::tensor::upload(burn::tensor::TensorData::new(out, [n, w.rows()]), &device)
}
