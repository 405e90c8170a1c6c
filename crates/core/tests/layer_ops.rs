//! The cpu backend's one-pass RMSNorm, rotary embedding, SwiGLU gating and column split
//! against the burn compositions they replace (`kiln_core::layer_ops`, every other backend's
//! default): the rotation and the split round the same way (the split copies), so the same
//! bits; RMSNorm's sum of squares runs in another order and SiLU may round its sigmoid
//! otherwise, so within a few ulps. The packed prefill's
//! attention with its row-copy regrouping against the default's burn permutes (the same
//! kernel: the same bits), and the device backends' grouped attention, keys padded, against
//! the plain reference.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use burn::backend::Flex;
use burn::tensor::{Bool, Tensor, TensorData};
use kiln_core::InferenceBackend;
use kiln_core::attention::{
    KEY_PADDING, Scoring, pad_keys, sdpa_grouped, sdpa_packed, sdpa_reference,
};
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

#[test]
fn split_columns_matches_the_slices_bit_for_bit() {
    for (rows, widths) in [(1, [576, 192, 192]), (5, [7, 1, 12])] {
        let width: usize = widths.iter().sum();
        let x = tensor(values(rows * width, 9), [rows, width]);
        let parts = Flex::split_columns(x.clone(), widths);
        let slices = layer_ops::split_columns(x, widths);
        for ((part, slice), w) in parts.into_iter().zip(slices).zip(widths) {
            assert_eq!(part.dims(), [rows, w]);
            assert_eq!(
                host(part).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                host(slice).iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "[{rows}, {widths:?}]"
            );
        }
    }
}

/// The default grouped attention pads the keys (a workaround for a device autotune bug) with
/// masked zeros: the output must be the reference's over the unpadded keys.
#[test]
fn padded_grouped_attention_matches_the_reference() {
    let (batch, n_kv, n_rep, q_len, head_dim) = (2, 2, 3, 4, 8);
    for keys in [q_len, 17, KEY_PADDING, KEY_PADDING + 5] {
        let q_rows = n_rep * q_len;
        let q = tensor(
            values(batch * n_kv * q_rows * head_dim, 7),
            [batch, n_kv, q_rows, head_dim],
        );
        let k = tensor(
            values(batch * n_kv * keys * head_dim, 8),
            [batch, n_kv, keys, head_dim],
        );
        let v = tensor(
            values(batch * n_kv * keys * head_dim, 9),
            [batch, n_kv, keys, head_dim],
        );
        // Row i of each sequence sees keys 0..=i + keys - q_len (causal over its history).
        let hidden = |b: usize, i: usize, key: usize| key + q_len > i + keys + b;
        let mask: Vec<bool> = (0..batch * q_len * keys)
            .map(|n| hidden(n / (q_len * keys), (n / keys) % q_len, n % keys))
            .collect();
        let device = Flex::inference_device();
        let mask = Tensor::<Flex, 3, Bool>::from_data(
            TensorData::new(mask, [batch, q_len, keys]),
            &device,
        );
        let (padded_k, _, padded_mask) = pad_keys(k.clone(), v.clone(), mask.clone());
        assert_eq!(padded_k.dims()[2] % KEY_PADDING, 0);
        assert_eq!(padded_mask.dims()[2], padded_k.dims()[2]);

        let expanded = mask
            .clone()
            .unsqueeze_dims::<5>(&[1, 2])
            .expand([batch, n_kv, n_rep, q_len, keys])
            .reshape([batch, n_kv, q_rows, keys]);
        let reference = host(sdpa_reference(
            q.clone(),
            k.clone(),
            v.clone(),
            expanded,
            Scoring::default(),
        ));
        let padded = host(sdpa_grouped(q, k, v, mask, Scoring::default()));
        for (a, b) in padded.iter().zip(&reference) {
            assert!(
                (a - b).abs() <= 2e-5 * b.abs().max(1.0),
                "{keys} keys: {a} vs {b}"
            );
        }
    }
}

#[test]
fn packed_attention_regroups_like_the_default_bit_for_bit() {
    let device = Flex::inference_device();
    for (len, n_heads, n_kv, head_dim) in [(1, 9, 3, 64), (37, 9, 3, 64), (20, 4, 4, 16)] {
        let q = tensor(
            values(len * n_heads * head_dim, 10),
            [len, n_heads, head_dim],
        );
        let k = tensor(values(len * n_kv * head_dim, 11), [len, n_kv, head_dim]);
        let v = tensor(values(len * n_kv * head_dim, 12), [len, n_kv, head_dim]);
        // Two prompts packed: each token sees the earlier tokens of its own prompt.
        let split = len / 2;
        let mask: Vec<bool> = (0..len * len)
            .map(|n| {
                let (i, j) = (n / len, n % len);
                j > i || (i >= split && j < split)
            })
            .collect();
        let mask =
            Tensor::<Flex, 3, Bool>::from_data(TensorData::new(mask, [1, len, len]), &device);
        let fast = host(Flex::packed_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            mask.clone(),
            Scoring::default(),
        ));
        let default = host(sdpa_packed(q, k, v, mask, Scoring::default()));
        assert_eq!(fast.len(), len * n_heads * head_dim);
        assert_eq!(
            fast.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            default.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "[{len}, {n_heads}, {head_dim}]"
        );
    }
}
