//! Rotary position embeddings with per-token positions, in Hugging Face's rotate-half layout
//! (each head's first half pairs with its second half). Weights stored in Meta's or GGUF's
//! interleaved layout are permuted on load (`HostTensor::interleaved_to_half_split`), so one
//! rotation serves every format.

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use kiln_core::{InferenceBackend, Position};

use crate::config::{Llama3Scaling, RopeConfig};

/// The inverse frequencies of a head of width `head_dim`, with Llama 3.1's scaling if
/// configured (transformers' `_compute_llama3_parameters`), in f32 as transformers computes
/// them.
pub fn inverse_frequencies(config: &RopeConfig, head_dim: usize) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / config.theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let scaled: Vec<f32> = match config.llama3_scaling {
        None => base,
        Some(s) => base.into_iter().map(|f| llama3_scale(f, &s)).collect(),
    };
    match &config.frequency_divisors {
        None => scaled,
        Some(divisors) => scaled.iter().zip(divisors).map(|(f, d)| f / d).collect(),
    }
}

fn llama3_scale(inv_freq: f32, s: &Llama3Scaling) -> f32 {
    let original = s.original_max_positions as f32;
    let low_freq_wavelen = original / s.low_freq_factor;
    let high_freq_wavelen = original / s.high_freq_factor;
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    if wavelen < high_freq_wavelen {
        inv_freq
    } else if wavelen > low_freq_wavelen {
        inv_freq / s.factor
    } else {
        let smooth =
            (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

/// The cos and sin of each token's angles, built once per forward.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    /// `[n_tokens, 1, head_dim / 2]`
    cos: Tensor<B, 3>,
    /// `[n_tokens, 1, head_dim / 2]`
    sin: Tensor<B, 3>,
}

impl<B: Backend> RopeTables<B> {
    /// Angles `position * inv_freq` in f32 (as transformers), cos and sin in the model dtype.
    pub fn new(
        inv_freq: &[f32],
        positions: &[Position],
        dtype: FloatDType,
        device: &B::Device,
    ) -> Self {
        let half = inv_freq.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            for f in inv_freq {
                let angle = p.0 as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let make = |v: Vec<f32>| {
            kiln_core::tensor::upload::<B, 3, burn::tensor::Float>(
                TensorData::new(v, [positions.len(), 1, half]),
                device,
            )
            .cast(dtype)
        };
        Self {
            cos: make(cos),
            sin: make(sin),
        }
    }

    /// The tables, `(cos, sin)`, each `[n_tokens, 1, head_dim / 2]`.
    pub fn tables(&self) -> (&Tensor<B, 3>, &Tensor<B, 3>) {
        (&self.cos, &self.sin)
    }

    /// Rotates each head's halves: `(x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)`
    /// ([`InferenceBackend::rotate_half`], one pass on the cpu backend).
    ///
    /// # Shapes
    /// - `x`: `[n_tokens, n_heads, head_dim]` → same
    pub fn apply(&self, x: Tensor<B, 3>) -> Tensor<B, 3>
    where
        B: InferenceBackend,
    {
        B::rotate_half(x, &self.cos, &self.sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `_compute_llama3_parameters` for theta 10000, head_dim 16, factor 8,
    /// low 1, high 4, original 32 (printed by torch for this test).
    #[test]
    fn llama3_scaling_keeps_high_scales_low_and_smooths_the_middle() {
        let config = RopeConfig {
            theta: 10000.0,
            llama3_scaling: Some(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 32,
            }),
            frequency_divisors: None,
        };
        let f = inverse_frequencies(&config, 16);
        let plain = inverse_frequencies(
            &RopeConfig {
                theta: 10000.0,
                llama3_scaling: None,
                frequency_divisors: None,
            },
            16,
        );
        // wavelength 2π < 8: untouched.
        assert_eq!(f[0], plain[0]);
        // the lowest frequency's wavelength (~19869) > 32: divided by the factor.
        assert!((f[7] - plain[7] / 8.0).abs() < 1e-12);
        // every frequency lies between the scaled and the unscaled one.
        for (s, p) in f.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 8.0 - 1e-12);
        }
    }
}
