//! The cpu backend's one-pass RMSNorm, rotary embedding and SwiGLU gating against the burn
//! compositions they replace (`kiln_core::layer_ops`, every other backend's default): the
//! rotation rounds the same way, so the same bits; RMSNorm's sum of squares runs in another
//! order and SiLU may round its sigmoid otherwise, so within a few ulps.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use kiln_core::InferenceBackend;
use kiln_core::layer_ops;

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 * 4.0 - 2.0
        })
        .collect()
}

fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D]) -> Tensor<Flex, D> {
    Tensor::from_data(TensorData::new(v, shape), &Flex::inference_device())
}

fn host<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
    t.into_data().into_vec::<f32>().unwrap()
}

#[test]
fn rms_norm_matches_the_composition() {
    for (rows, d) in [(1, 576), (7, 64), (3, 33)] {
        let x = tensor(values(rows * d, 1), [rows, d]);
        let gamma = tensor(values(d, 2), [d]);
        let fused = host(Flex::rms_norm(x.clone(), &gamma, 1e-5));
        let composed = host(layer_ops::rms_norm(x, &gamma, 1e-5));
        for (a, b) in fused.iter().zip(&composed) {
            assert!(
                (a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1e-3),
                "[{rows}, {d}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn rotate_half_matches_the_composition_bit_for_bit() {
    for (tokens, heads, dim) in [(1, 9, 64), (5, 3, 64), (4, 2, 6)] {
        let x = tensor(values(tokens * heads * dim, 3), [tokens, heads, dim]);
        let cos = tensor(values(tokens * dim / 2, 4), [tokens, 1, dim / 2]);
        let sin = tensor(values(tokens * dim / 2, 5), [tokens, 1, dim / 2]);
        let fused = host(Flex::rotate_half(x.clone(), &cos, &sin));
        let composed = host(layer_ops::rotate_half(x, &cos, &sin));
        assert_eq!(
            fused.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            composed.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "[{tokens}, {heads}, {dim}]"
        );
    }
}

#[test]
fn swiglu_matches_the_composition() {
    for (rows, d_ff) in [(1, 1536), (4, 20)] {
        let gate_up = tensor(values(rows * 2 * d_ff, 6), [rows, 2 * d_ff]);
        let fused = host(Flex::swiglu(gate_up.clone()));
        let composed = host(layer_ops::swiglu(gate_up));
        assert_eq!(fused.len(), rows * d_ff);
        for (a, b) in fused.iter().zip(&composed) {
            assert!(
                (a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1e-3),
                "[{rows}, {d_ff}]: {a} vs {b}"
            );
        }
    }
}
