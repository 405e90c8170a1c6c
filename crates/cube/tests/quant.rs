//! Products and dequantization of GGUF blocks on the device against kiln's CPU decoder
//! (`kiln_kernels::ggml::dequantize`, itself checked against ggml) and a host product, on
//! wgpu: every block type, few rows (decoded in the product) and many (dequantized first).

#![allow(clippy::unwrap_used)]

use crate::common::*;
use burn_backend::DType;
use cubecl::Runtime;
use kiln_cube::quant::{BlockType, QuantWeights, dequantize, matmul};
use kiln_kernels::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn ggml(ty: BlockType) -> GgmlType {
    match ty {
        BlockType::Q8_0 => GgmlType::Q8_0,
        BlockType::Q4_0 => GgmlType::Q4_0,
        BlockType::Q4_1 => GgmlType::Q4_1,
        BlockType::Q5_0 => GgmlType::Q5_0,
        BlockType::Q5_1 => GgmlType::Q5_1,
        BlockType::Q4K => GgmlType::Q4K,
        BlockType::Q5K => GgmlType::Q5K,
        BlockType::Q6K => GgmlType::Q6K,
    }
}

/// Byte offsets of each block's f16 fields (scales, minimums), set to small finite values:
/// random bytes there could be NaN or huge.
fn f16_fields(ty: BlockType) -> &'static [usize] {
    match ty {
        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 => &[0],
        BlockType::Q4_1 | BlockType::Q5_1 | BlockType::Q4K | BlockType::Q5K => &[0, 2],
        BlockType::Q6K => &[208],
    }
}

/// `rows` rows of `cols` values of random blocks of `ty`.
fn random_blocks(ty: BlockType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let blocks = rows * cols / ty.block_values();
    let mut bytes: Vec<u8> = (0..blocks * ty.block_bytes())
        .map(|_| rng.random())
        .collect();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in f16_fields(ty) {
            let value = half::f16::from_f32(rng.random::<f32>() * 0.02 - 0.01);
            block[at..at + 2].copy_from_slice(&value.to_le_bytes());
        }
    }
    bytes
}

#[test]
fn every_block_type_decodes_and_multiplies_as_the_cpu_decoder() {
    let client = R::client(&device());
    for ty in BlockType::ALL {
        let (rows, cols) = (37, 512);
        let bytes = random_blocks(ty, rows, cols, ty as u64);
        let mut dense = vec![0f32; rows * cols];
        kiln_kernels::ggml::dequantize(ggml(ty), &bytes, &mut dense);
        let weights = QuantWeights::upload(&client, &device(), ty, rows, cols, &bytes).unwrap();

        let decoded = host(dequantize(&weights, DType::F32).unwrap());
        assert_eq!(decoded, dense, "{ty:?}: dequantized");

        // Few rows (decoded in the product) and more than the few-rows kernel takes.
        for m in [1, 3, 9, 70] {
            let x = random(m * cols, m as u64);
            let mut expected = vec![0f32; m * rows];
            for r in 0..m {
                for j in 0..rows {
                    expected[r * rows + j] = (0..cols)
                        .map(|i| f64::from(x[r * cols + i]) * f64::from(dense[j * cols + i]))
                        .sum::<f64>() as f32;
                }
            }
            let ours = host(matmul(f32s(&x, &[m, cols]), &weights).unwrap());
            let diff = max_abs_diff(&ours, &expected);
            let scale = expected.iter().fold(0f32, |a, b| a.max(b.abs())).max(1e-3);
            assert!(
                diff / scale < 1e-5,
                "{ty:?}, {m} rows: max |diff| {diff} (largest {scale})"
            );
        }
    }
}

#[test]
fn sizes_that_do_not_fit_the_type_are_errors() {
    let client = R::client(&device());
    let err =
        QuantWeights::upload(&client, &device(), BlockType::Q4K, 2, 100, &[0; 10]).unwrap_err();
    assert!(err.to_string().contains("are not 2 rows of 100"), "{err}");
}
