//! The feed-forward block: GELU (tanh) for GPT-2, SwiGLU for Llama.

use burn::tensor::Tensor;
use burn::tensor::activation::{gelu_approximate, silu};
use kiln_core::InferenceBackend;

use super::linear::Linear;

/// A feed-forward block.
#[derive(Debug, Clone)]
pub enum Mlp<B: InferenceBackend> {
    /// `down(gelu_tanh(up(x)))`
    GeluTanh {
        /// `[d_model, d_ff]`
        up: Linear<B>,
        /// `[d_ff, d_model]`
        down: Linear<B>,
    },
    /// `down(silu(gate(x)) * up(x))`
    SwiGlu {
        /// `[d_model, d_ff]`
        gate: Linear<B>,
        /// `[d_model, d_ff]`
        up: Linear<B>,
        /// `[d_ff, d_model]`
        down: Linear<B>,
    },
    /// `down(silu(g) * u)` where `[g | u] = gate_up(x)`: SwiGLU with its two input
    /// projections as one product ([`Linear::fuse_outputs`]).
    SwiGluFused {
        /// `[d_model, 2 d_ff]`: gate's outputs, then up's
        gate_up: Linear<B>,
        /// `[d_ff, d_model]`
        down: Linear<B>,
    },
}

impl<B: InferenceBackend> Mlp<B> {
    /// SwiGLU, its gate and up projections fused when [`Linear::fuse_outputs`] can.
    pub fn swiglu(gate: Linear<B>, up: Linear<B>, down: Linear<B>) -> Self {
        match Linear::fuse_outputs(&[&gate, &up]) {
            Some(gate_up) => Mlp::SwiGluFused { gate_up, down },
            None => Mlp::SwiGlu { gate, up, down },
        }
    }

    /// # Shapes
    /// - `x`: `[n, d_model]` → `[n, d_model]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Mlp::GeluTanh { up, down } => down.forward(gelu_approximate(up.forward(x))),
            Mlp::SwiGlu { gate, up, down } => {
                down.forward(silu(gate.forward(x.clone())) * up.forward(x))
            }
            Mlp::SwiGluFused { gate_up, down } => down.forward(B::swiglu(gate_up.forward(x))),
        }
    }
}
