//! Quantized products at the Llama-3.2-1B shape (2048 hidden, 8192 feed forward): the `gate`
//! projection (`[8192, 2048]`) and `down` (`[2048, 8192]`) in Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS
//! and Q2_K, for a 512-token prefill (512 rows: the wide tiles on AVX-512 VNNI) and a decoding
//! step (1 row), every thread, best tier, with the activations in two 8-bit passes (`q8x2`),
//! in one (`q8`), and for Q8_0 in one 16-bit pass (`q16`). Throughput is in multiply-adds of
//! the real product (done once per pass).
//! Run: `cargo bench -p kiln-benches --bench quant`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use burn::tensor::f16;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln_kernels::{ActPasses, GgmlType, QuantMatrix};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// (d_out, d_in): `gate` (and `up`), then `down`.
const SHAPES: [(usize, usize); 2] = [(8192, 2048), (2048, 8192)];

/// Byte offsets of each f16 scale in a block of `ty` (`d`, and `dmin` where there is one).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Iq4Xs => &[0],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::Q2K => &[80, 82],
        other => panic!("no random blocks of {}", other.name()),
    }
}

/// A `[rows, cols]` matrix of random blocks with small positive scales.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> QuantMatrix {
    let block_bytes = ty.type_size();
    let mut data = vec![0u8; rows * cols / ty.block_size() * block_bytes];
    rng.fill_bytes(&mut data);
    for block in data.chunks_exact_mut(block_bytes) {
        for &at in scale_offsets(ty) {
            let scale = 0.002 + 0.05 * rng.random::<f32>();
            block[at..at + 2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
        }
    }
    QuantMatrix::new(ty, rows, cols, data).expect("a valid matrix")
}

fn quant(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut group = c.benchmark_group("quantized product, [m, d_in] x [d_out, d_in]^T");
    group.sample_size(10);
    for ty in [
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8_0,
        GgmlType::Iq4Xs,
        GgmlType::Q2K,
    ] {
        for (rows, cols) in SHAPES {
            let two = random_matrix(ty, rows, cols, &mut rng);
            let one = two.clone().with_activation_passes(ActPasses::One);
            // Only Q8_0 keeps 16-bit activations (the others take two passes for them).
            let sixteen = two.clone().with_activation_passes(ActPasses::Q16);
            let precisions = if sixteen.activation_passes() == ActPasses::Q16 {
                vec![&two, &one, &sixteen]
            } else {
                vec![&two, &one]
            };
            for m in [1, 512] {
                let x: Vec<f32> = (0..m * cols)
                    .map(|_| rng.random::<f32>() * 2.0 - 1.0)
                    .collect();
                let mut out = vec![0f32; m * rows];
                group.throughput(Throughput::Elements((m * rows * cols) as u64));
                for &w in &precisions {
                    let passes = w.activation_passes().name();
                    let id = format!("{} {passes} m={m} {rows}x{cols}", ty.name());
                    group.bench_function(BenchmarkId::from_parameter(id), |b| {
                        b.iter(|| w.matmul(&x, m, &mut out))
                    });
                }
            }
        }
    }
    group.finish();
}

criterion_group!(benches, quant);
criterion_main!(benches);
