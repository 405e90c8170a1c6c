//! Attention in burn's operations on any backend, with none of kiln's backend hooks: burn's
//! fused op ([`sdpa`]), its grouped-query form ([`sdpa_grouped`]), the plain reference
//! ([`sdpa_reference`], [`step_attention_reference`]) and the regrouping around a
//! grouped-attention call ([`sdpa_packed_with`], [`sdpa_cached_with`]).
//!
//! These are the defaults of [`InferenceBackend`](crate::InferenceBackend)'s attention hooks;
//! the hooks module imports them, and this module imports nothing of the hooks (nor of
//! [`super::attend`], which calls them), so the two do not import each other.

use burn::tensor::backend::Backend;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, FloatDType, Tensor, TensorData};

use kiln_kernels::attention::Scoring;

use super::step::{StepIndex, TOKEN_FIELDS};
use crate::tensor::int_tensor;

/// Scaled dot-product attention through burn's fused op, with an explicit mask, the scores as
/// `scoring` says (burn's own scale and soft cap options).
///
/// # Shapes
/// - `q`: `[b, h, sq, d]`; `k`, `v`: `[b, h, sk, d]`; `mask`: `[b, h, sq, sk]` (`true` = masked)
/// - returns `[b, h, sq, d]`
pub fn sdpa<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let options = AttentionModuleOptions {
        scale: scoring.scale.map(f64::from),
        softcap: scoring.softcap.map(f64::from),
        is_causal: false,
    };
    burn::tensor::module::attention(q, k, v, Some(mask), None, options)
}

/// [`sdpa`] for grouped queries and a mask shared by the heads: the mask is expanded over
/// them (the default
/// [`InferenceBackend::grouped_attention`](crate::InferenceBackend::grouped_attention)). The
/// keys are first padded to a multiple of [`KEY_PADDING`] with masked zeros ([`pad_keys`]).
///
/// # Shapes
/// As [`InferenceBackend::grouped_attention`](crate::InferenceBackend::grouped_attention).
pub fn sdpa_grouped<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let (k, v, mask) = pad_keys(k, v, mask);
    let [batch, n_kv, q_rows, _] = q.dims();
    let [_, q_len, keys] = mask.dims();
    let mask = mask
        .unsqueeze_dims::<5>(&[1, 2])
        .expand([batch, n_kv, q_rows / q_len.max(1), q_len, keys])
        .reshape([batch, n_kv, q_rows, keys]);
    sdpa(q, k, v, mask, scoring)
}

/// The key count [`sdpa_grouped`] rounds up to: the largest plane (warp, wavefront) a GPU has.
pub const KEY_PADDING: usize = 64;

/// Pads the keys to a multiple of [`KEY_PADDING`] with zero K/V that the mask hides, which
/// leaves the attention's output unchanged.
///
/// Why: burn 0.21's device attention falls back to matmuls whose autotune (cubecl 0.10) keys
/// `q kᵀ` by the key count rounded up to a power of two, but not by whether it is a multiple
/// of the GPU's plane size. Once a vector-matrix kernel that needs that multiple wins the
/// tuning at, say, 32 keys, a later step with 17 keys reuses it and panics ("Rhs dimension
/// n=17 must be a multiple of plane size 8", seen on lavapipe). Padded key counts are always
/// such a multiple.
///
/// # Shapes
/// - `k`, `v`: `[batch, n_kv_heads, keys, head_dim]`, `mask`: `[batch, q_len, keys]`
/// - returns them with `keys` rounded up to a multiple of [`KEY_PADDING`]
pub fn pad_keys<B: Backend>(
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 3, Bool>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3, Bool>) {
    let [batch, n_kv, keys, head_dim] = k.dims();
    let padding = keys.next_multiple_of(KEY_PADDING) - keys;
    if padding == 0 {
        return (k, v, mask);
    }
    let device = k.device();
    let zeros = Tensor::<B, 4>::zeros([batch, n_kv, padding, head_dim], (&device, k.dtype()));
    let q_len = mask.dims()[1];
    let hidden = Tensor::<B, 3, Bool>::ones([batch, q_len, padding], &device);
    (
        Tensor::cat(vec![k, zeros.clone()], 2),
        Tensor::cat(vec![v, zeros], 2),
        Tensor::cat(vec![mask, hidden], 2),
    )
}

/// The plain reference: `softmax(scores(q kᵀ) + mask) v` (scores `q·k / √d` unless `scoring`
/// says otherwise), computed in f32 with matmuls. Tests and `kiln selftest` hold [`sdpa`] to it.
///
/// # Shapes
/// Same as [`sdpa`].
pub fn sdpa_reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let dtype = FloatDType::from(q.dtype());
    let [.., head_dim] = q.dims();
    let f32_ = FloatDType::F32;
    let scores = q
        .cast(f32_)
        .matmul(k.cast(f32_).swap_dims(2, 3))
        .mul_scalar(scoring.scale_for(head_dim));
    let scores = match scoring.softcap {
        Some(cap) => scores.div_scalar(cap).tanh().mul_scalar(cap),
        None => scores,
    }
    .mask_fill(mask, f32::NEG_INFINITY);
    burn::tensor::activation::softmax(scores, 3)
        .matmul(v.cast(f32_))
        .cast(dtype)
}

/// The default [`InferenceBackend::step_attention`](crate::InferenceBackend::step_attention),
/// in burn's operations on any backend: for each run of query tokens that read the same keys
/// (a fresh sequence, or a history row), the keys gathered from the step's new K/V or from the
/// storage through the row's blocks, the mask built from positions, and [`sdpa_reference`].
/// Slow (operations per sequence) and exact: the reference the fused kernels are held to.
///
/// # Shapes
/// - `q`: `[n_tokens, n_heads, head_dim]`; `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`
/// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`, after this step's write
/// - returns `[n_tokens, n_heads * head_dim]` in batch order
pub fn step_attention_reference<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    k_store: Tensor<B, 4>,
    v_store: Tensor<B, 4>,
    index: &StepIndex<B>,
    scoring: Scoring,
) -> Tensor<B, 2> {
    let host = &index.host;
    let [n, n_heads, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let n_rep = n_heads / n_kv;
    let [targets, _, slots, _] = k_store.dims();
    let device = q.device();
    let dtype = FloatDType::from(q.dtype());
    let fields = |t: usize| &host.tokens[t * TOKEN_FIELDS..][..TOKEN_FIELDS];
    let mut outputs = Vec::new();
    let mut first = 0;
    while first < n {
        let mut end = first + 1;
        while end < n && fields(end)[..3] == fields(first)[..3] {
            end += 1;
        }
        let [row, start, count, _] = *fields(first) else {
            unreachable!("TOKEN_FIELDS is 4")
        };
        let (start, count) = (start as usize, count as usize);
        // [count, n_kv, head_dim] each, and the keys' positions.
        let (keys, values, key_positions) = if row < 0 {
            (
                k.clone().narrow(0, start, count),
                v.clone().narrow(0, start, count),
                host.positions[start..start + count].to_vec(),
            )
        } else {
            let row = row as usize;
            let blocks = host.blocks_per_row;
            let head_blocks: Vec<usize> = host.table[row * n_kv * blocks..][..n_kv * blocks]
                .iter()
                .map(|&b| b as usize)
                .collect();
            let gather = |store: Tensor<B, 4>| {
                store
                    .reshape([targets * n_kv, slots, head_dim])
                    .select(0, int_tensor::<B>(head_blocks.clone(), &device))
                    .reshape([n_kv, blocks * slots, head_dim])
                    .slice([0..n_kv, 0..count])
                    .swap_dims(0, 1)
                    .cast(dtype)
            };
            (
                gather(k_store.clone()),
                gather(v_store.clone()),
                host.key_positions[row * host.keys..][..count].to_vec(),
            )
        };
        // Query head `h` reads KV head `h / n_rep`: [1, n_heads, count, head_dim].
        let by_head = |x: Tensor<B, 3>| {
            x.unsqueeze_dim::<4>(2)
                .expand([count, n_kv, n_rep, head_dim])
                .reshape([count, n_heads, head_dim])
                .swap_dims(0, 1)
                .unsqueeze_dim::<4>(0)
        };
        let queries = end - first;
        let window = index.window;
        let mask: Vec<bool> = (first..end)
            .flat_map(|t| {
                let q_pos = host.positions[t];
                key_positions.iter().map(move |&k_pos| {
                    !(k_pos >= 0
                        && k_pos <= q_pos
                        && window.is_none_or(|w| ((q_pos - k_pos) as usize) < w))
                })
            })
            .collect();
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [1, 1, queries, count]), &device)
                .expand([1, n_heads, queries, count]);
        let q_rows = q
            .clone()
            .narrow(0, first, end - first)
            .swap_dims(0, 1)
            .unsqueeze_dim::<4>(0);
        let out = sdpa_reference(q_rows, by_head(keys), by_head(values), mask, scoring);
        outputs.push(
            out.reshape([n_heads, queries, head_dim])
                .swap_dims(0, 1)
                .reshape([queries, n_heads * head_dim]),
        );
        first = end;
    }
    Tensor::cat(outputs, 0)
}

/// A packed row of fresh prompts regrouped head-major for `grouped` (a grouped-query
/// attention: [`InferenceBackend::grouped_attention`](crate::InferenceBackend::grouped_attention)
/// or [`sdpa_grouped`]), and its output regrouped back: the default
/// [`InferenceBackend::packed_attention`](crate::InferenceBackend::packed_attention).
///
/// # Shapes
/// - `q`: `[len, n_heads, head_dim]`; `k`, `v`: `[len, n_kv_heads, head_dim]`
/// - `mask`: `[1, len, len]`
/// - returns `[len, n_heads * head_dim]`
pub fn sdpa_packed_with<B: Backend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
    grouped: impl FnOnce(
        Tensor<B, 4>,
        Tensor<B, 4>,
        Tensor<B, 4>,
        Tensor<B, 3, Bool>,
        Scoring,
    ) -> Tensor<B, 4>,
) -> Tensor<B, 2> {
    let [len, n_heads, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let n_rep = n_heads / n_kv;
    // [len, n_heads, d] → [1, n_kv, n_rep * len, d].
    let q = q
        .reshape([len, n_kv, n_rep, head_dim])
        .permute([1, 2, 0, 3])
        .reshape([1, n_kv, n_rep * len, head_dim]);
    let k = k.swap_dims(0, 1).unsqueeze_dim::<4>(0);
    let v = v.swap_dims(0, 1).unsqueeze_dim::<4>(0);
    grouped(q, k, v, mask, scoring)
        .reshape([n_kv, n_rep, len, head_dim])
        .permute([2, 0, 1, 3])
        .reshape([len, n_heads * head_dim])
}

/// History rows' token-major queries regrouped head-major
/// (`[rows, n_kv_heads, n_rep * q_len, head_dim]`) for `grouped` over the K/V they read (cast
/// to `q`'s dtype), and the output regrouped back: the default
/// [`InferenceBackend::cached_attention`](crate::InferenceBackend::cached_attention) once the
/// K/V are gathered.
///
/// # Shapes
/// - `q`: `[rows, q_len, n_heads, head_dim]`
/// - `k`, `v`: `[rows, n_kv_heads, keys, head_dim]`; `mask`: `[rows, q_len, keys]`
/// - returns the shape of `q`
pub fn sdpa_cached_with<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
    grouped: impl FnOnce(
        Tensor<B, 4>,
        Tensor<B, 4>,
        Tensor<B, 4>,
        Tensor<B, 3, Bool>,
        Scoring,
    ) -> Tensor<B, 4>,
) -> Tensor<B, 4> {
    let [rows, q_len, n_heads, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let dtype = FloatDType::from(q.dtype());
    let q = q
        .swap_dims(1, 2)
        .reshape([rows, n_kv, n_heads / n_kv * q_len, head_dim]);
    grouped(q, k.cast(dtype), v.cast(dtype), mask, scoring)
        .reshape([rows, n_heads, q_len, head_dim])
        .swap_dims(1, 2)
}
