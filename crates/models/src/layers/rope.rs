//! Rotary position embeddings with per-token positions, in Hugging Face's rotate-half layout
//! (each head's first half pairs with its second half). Weights stored in Meta's or GGUF's
//! interleaved layout are permuted on load (`HostTensor::interleaved_to_half_split`), so one
//! rotation serves every format.

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use kiln_core::{InferenceBackend, Position};

use crate::config::{Llama3Scaling, RopeConfig, RopeScaling, YarnScaling};

/// The inverse frequencies of a head of width `head_dim`, scaled as configured (transformers'
/// `_compute_llama3_parameters`, `_compute_linear_scaling_rope_parameters`,
/// `_compute_yarn_parameters`, `_compute_longrope_parameters`), in f32 as transformers
/// computes them, for a run whose context is `context` positions (LongRoPE's choice of
/// factors).
pub fn inverse_frequencies(config: &RopeConfig, head_dim: usize, context: usize) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / config.theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let scaled: Vec<f32> = match &config.scaling {
        None => base,
        Some(RopeScaling::Llama3(s)) => base.into_iter().map(|f| llama3_scale(f, s)).collect(),
        Some(RopeScaling::Linear { factor }) => base.into_iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Yarn(s)) => yarn_scale(&base, config.theta, head_dim, s),
        Some(RopeScaling::LongRope(s)) => base
            .iter()
            .zip(s.factors_for(context))
            .map(|(f, divisor)| f / divisor)
            .collect(),
        Some(RopeScaling::Dynamic { .. }) => base,
    };
    match &config.frequency_divisors {
        None => scaled,
        Some(divisors) => scaled.iter().zip(divisors).map(|(f, d)| f / d).collect(),
    }
}

/// What cos and sin are multiplied by: YaRN's attention factor, 1 otherwise.
pub fn attention_factor(config: &RopeConfig) -> f32 {
    match &config.scaling {
        Some(RopeScaling::Yarn(s)) => s.attention_factor,
        Some(RopeScaling::LongRope(s)) => s.attention_factor,
        _ => 1.0,
    }
}

/// YaRN: each frequency blended between itself (fast rotations, kept) and itself / factor
/// (slow ones, interpolated) along a linear ramp over the dimensions whose rotations within
/// the original context fall between `beta_slow` and `beta_fast`.
fn yarn_scale(base: &[f32], theta: f32, head_dim: usize, s: &YarnScaling) -> Vec<f32> {
    let (dim, theta, original) = (head_dim as f64, f64::from(theta), s.original_max_positions);
    // The dimension at which a frequency makes `rotations` turns over the original context.
    let correction = |rotations: f32| {
        dim * (original as f64 / (f64::from(rotations) * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction(s.beta_fast), correction(s.beta_slow));
    if s.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
    if low == high {
        high += 0.001;
    }
    base.iter()
        .enumerate()
        .map(|(i, &f)| {
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            f / s.factor * (1.0 - keep) + f * keep
        })
        .collect()
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
    /// Angles `position * inv_freq` in f32 (as transformers), cos and sin times
    /// `attention_factor` ([`attention_factor`]) in the model dtype.
    pub fn new(
        inv_freq: &[f32],
        attention_factor: f32,
        positions: &[Position],
        dtype: FloatDType,
        device: &B::Device,
    ) -> Self {
        let half = inv_freq.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            for f in inv_freq {
                let angle = p.0 as f32 * f;
                cos.push(angle.cos() * attention_factor);
                sin.push(angle.sin() * attention_factor);
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
    use crate::config::LongRopeScaling;

    /// transformers' `_compute_llama3_parameters` for theta 10000, head_dim 16, factor 8,
    /// low 1, high 4, original 32 (printed by torch for this test).
    #[test]
    fn llama3_scaling_keeps_high_scales_low_and_smooths_the_middle() {
        let config = RopeConfig {
            theta: 10000.0,
            scaling: Some(RopeScaling::Llama3(Llama3Scaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 32,
            })),
            frequency_divisors: None,
        };
        let f = inverse_frequencies(&config, 16, 1 << 20);
        let plain = inverse_frequencies(
            &RopeConfig {
                theta: 10000.0,
                scaling: None,
                frequency_divisors: None,
            },
            16,
            1 << 20,
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

    /// transformers' `ROPE_INIT_FUNCTIONS["yarn"]` and `["linear"]` for a Qwen3Config with
    /// head_dim 32, `rope_theta` 1e6, factor 4, original context 32 (printed by torch 2.15 /
    /// transformers 5.24 for this test).
    #[test]
    fn yarn_and_linear_match_transformers() {
        let expected: [f64; 16] = [
            1.0,
            0.263_560_32,
            0.044_456_985,
            0.018_747_354,
            0.007_905_694_7,
            0.003_333_803_7,
            0.001_405_853_3,
            0.000_592_843_45,
            0.000_250_000_01,
            0.000_105_424_12,
            4.445_698_5e-5,
            1.874_735_6e-5,
            7.905_693_6e-6,
            3.333_803_5e-6,
            1.405_853_4e-6,
            5.928_434_3e-7,
        ];
        let yarn = RopeConfig {
            theta: 1_000_000.0,
            scaling: Some(RopeScaling::Yarn(YarnScaling {
                factor: 4.0,
                original_max_positions: 32,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 1.138_629_4,
                truncate: true,
            })),
            frequency_divisors: None,
        };
        let ours = inverse_frequencies(&yarn, 32, 128);
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert!(
                (f64::from(*a) - b).abs() <= 1e-6 * b,
                "frequency {i}: {a} vs {b}"
            );
        }
        assert_eq!(attention_factor(&yarn), 1.138_629_4);
        let linear = RopeConfig {
            scaling: Some(RopeScaling::Linear { factor: 4.0 }),
            ..yarn
        };
        let ours = inverse_frequencies(&linear, 32, 128);
        assert_eq!(&ours[..3], &[0.25, 0.105_424_13, 0.044_456_985]);
        assert_eq!(attention_factor(&linear), 1.0);
    }

    /// transformers' `ROPE_INIT_FUNCTIONS["longrope"]` for a Phi3Config with head_dim 16,
    /// 128 positions over an original 32 and these factors, short (no `seq_len`) and long
    /// (`seq_len` 33) (printed by transformers 5.24 for this test); `dynamic` within the
    /// context is the default RoPE.
    #[test]
    fn longrope_picks_its_factors_by_the_context_as_transformers_computes_them() {
        let short: [f64; 8] = [
            1.0,
            0.287_479_76,
            0.076_923_08,
            0.019_764_235,
            0.005,
            0.001_264_911_1,
            0.000_322_580_66,
            8.321_784e-5,
        ];
        let long: [f64; 8] = [
            1.0,
            0.210_818_5,
            0.04,
            0.007_905_694_7,
            0.001_666_666_7,
            0.000_351_364_2,
            7.692_307_6e-5,
            1.756_820_9e-5,
        ];
        let scaling = LongRopeScaling {
            factor: 4.0,
            original_max_positions: 32,
            short_factors: vec![1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            long_factors: vec![1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
            attention_factor: LongRopeScaling::default_attention_factor(4.0, 32) as f32,
        };
        let config = RopeConfig {
            theta: 10000.0,
            scaling: Some(RopeScaling::LongRope(scaling)),
            frequency_divisors: None,
        };
        for (context, expected) in [(32, short), (33, long), (128, long)] {
            let ours = inverse_frequencies(&config, 16, context);
            for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
                assert!(
                    (f64::from(*a) - b).abs() <= 1e-6 * b,
                    "context {context}, frequency {i}: {a} vs {b}"
                );
            }
        }
        assert!((attention_factor(&config) - 1.183_216).abs() < 1e-6);
        let plain = RopeConfig {
            scaling: None,
            ..config.clone()
        };
        let dynamic = RopeConfig {
            scaling: Some(RopeScaling::Dynamic { factor: 2.0 }),
            ..config
        };
        assert_eq!(
            inverse_frequencies(&dynamic, 16, 128),
            inverse_frequencies(&plain, 16, 128)
        );
        assert_eq!(attention_factor(&dynamic), 1.0);
    }
}
