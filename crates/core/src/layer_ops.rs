//! The per-layer operations a backend may run as one kernel ([`InferenceBackend::rms_norm`],
//! [`InferenceBackend::rotate_half`], [`InferenceBackend::swiglu`],
//! [`InferenceBackend::split_columns`]), written here as burn compositions: the reference
//! every backend gets by default, and what a fused override must equal up to the order of a
//! sum.
//!
//! [`InferenceBackend::rms_norm`]: crate::InferenceBackend::rms_norm
//! [`InferenceBackend::rotate_half`]: crate::InferenceBackend::rotate_half
//! [`InferenceBackend::swiglu`]: crate::InferenceBackend::swiglu
//! [`InferenceBackend::split_columns`]: crate::InferenceBackend::split_columns

use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

/// RMSNorm computed in f32 whatever `x`'s dtype, cast back before the scale, as transformers'
/// `LlamaRMSNorm` does (`weight * hidden.to(input_dtype)`).
///
/// # Shapes
/// - `x`: `[n, d]`, `gamma`: `[d]` → `[n, d]` in `x`'s dtype
pub fn rms_norm<B: Backend>(x: Tensor<B, 2>, gamma: &Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let dtype = FloatDType::from(x.dtype());
    let x32 = x.cast(FloatDType::F32);
    let rms = x32
        .clone()
        .powi_scalar(2)
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt();
    (x32 / rms).cast(dtype) * gamma.clone().unsqueeze_dim(0)
}

/// Rotates each head's halves, `(x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)`: rotary
/// embeddings in Hugging Face's rotate-half layout.
///
/// # Shapes
/// - `x`: `[n_tokens, n_heads, head_dim]` → same
/// - `cos`, `sin`: `[n_tokens, 1, head_dim / 2]`, in `x`'s dtype
pub fn rotate_half<B: Backend>(
    x: Tensor<B, 3>,
    cos: &Tensor<B, 3>,
    sin: &Tensor<B, 3>,
) -> Tensor<B, 3> {
    let [n, heads, dim] = x.dims();
    let half = dim / 2;
    let x1 = x.clone().slice([0..n, 0..heads, 0..half]);
    let x2 = x.slice([0..n, 0..heads, half..dim]);
    let first = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let second = x2 * cos.clone() + x1 * sin.clone();
    Tensor::cat(vec![first, second], 2)
}

/// SwiGLU's gating, `silu(g) * u`, for rows holding the gate's outputs then up's (a fused
/// gate-and-up product).
///
/// # Shapes
/// - `gate_up`: `[n, 2 d_ff]` → `[n, d_ff]`
pub fn swiglu<B: Backend>(gate_up: Tensor<B, 2>) -> Tensor<B, 2> {
    let [n, width] = gate_up.dims();
    let d_ff = width / 2;
    let gate = gate_up.clone().slice([0..n, 0..d_ff]);
    let up = gate_up.slice([0..n, d_ff..width]);
    silu(gate) * up
}

/// `x`'s columns cut into consecutive parts of `widths` columns, as slices (views).
///
/// # Shapes
/// - `x`: `[n, Σ widths]` → `[n, widths[i]]` each
pub fn split_columns<B: Backend, const N: usize>(
    x: Tensor<B, 2>,
    widths: [usize; N],
) -> [Tensor<B, 2>; N] {
    let n = x.dims()[0];
    let mut start = 0;
    widths.map(|w| {
        start += w;
        x.clone().slice([0..n, start - w..start])
    })
}
