//! The feed-forward block: GELU (tanh) for GPT-2, gated for the rotary families (SwiGLU for
//! Llama and Qwen, GeGLU for Gemma).

use burn::tensor::Tensor;
use burn::tensor::activation::{gelu_approximate, silu};
use kiln_core::InferenceBackend;

use super::linear::Linear;

/// The activation on a gated block's gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// SiLU (SwiGLU: Llama, Mistral, Qwen).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

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
    /// `down(act(gate(x)) * up(x))`
    Gated {
        /// `act`.
        activation: GateActivation,
        /// `[d_model, d_ff]`
        gate: Linear<B>,
        /// `[d_model, d_ff]`
        up: Linear<B>,
        /// `[d_ff, d_model]`
        down: Linear<B>,
    },
    /// `down(act(g) * u)` where `[g | u] = gate_up(x)`: the gated block with its two input
    /// projections as one product ([`Linear::fuse_outputs`]).
    GatedFused {
        /// `act`.
        activation: GateActivation,
        /// `[d_model, 2 d_ff]`: gate's outputs, then up's
        gate_up: Linear<B>,
        /// `[d_ff, d_model]`
        down: Linear<B>,
    },
}

impl<B: InferenceBackend> Mlp<B> {
    /// A gated block, its gate and up projections fused when [`Linear::fuse_outputs`] can.
    pub fn gated(
        activation: GateActivation,
        gate: Linear<B>,
        up: Linear<B>,
        down: Linear<B>,
    ) -> Self {
        match Linear::fuse_outputs(&[&gate, &up]) {
            Some(gate_up) => Mlp::GatedFused {
                activation,
                gate_up,
                down,
            },
            None => Mlp::Gated {
                activation,
                gate,
                up,
                down,
            },
        }
    }

    /// Its linear layers, inputs first.
    pub fn linears(&self) -> Vec<&Linear<B>> {
        match self {
            Mlp::GeluTanh { up, down } => vec![up, down],
            Mlp::Gated { gate, up, down, .. } => vec![gate, up, down],
            Mlp::GatedFused { gate_up, down, .. } => vec![gate_up, down],
        }
    }

    /// # Shapes
    /// - `x`: `[n, d_model]` → `[n, d_model]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Mlp::GeluTanh { up, down } => down.forward(gelu_approximate(up.forward(x))),
            Mlp::Gated {
                activation,
                gate,
                up,
                down,
            } => {
                let g = gate.forward(x.clone());
                let g = match activation {
                    GateActivation::Silu => silu(g),
                    GateActivation::GeluTanh => gelu_approximate(g),
                };
                down.forward(g * up.forward(x))
            }
            Mlp::GatedFused {
                activation: GateActivation::Silu,
                gate_up,
                down,
            } => down.forward(B::swiglu(gate_up.forward(x))),
            Mlp::GatedFused {
                activation: GateActivation::GeluTanh,
                gate_up,
                down,
            } => {
                let gate_up = gate_up.forward(x);
                let d_ff = gate_up.dims()[1] / 2;
                let [g, u] = B::split_columns(gate_up, [d_ff, d_ff]);
                down.forward(gelu_approximate(g) * u)
            }
        }
    }
}
