//! f32 matrix products at the sizes of a 512-token prefill of SmolLM2 (576 hidden, 1536 feed
//! forward) and of Llama-3.2-1B (2048, 8192): kiln's `gemm` kernel (what burn-flex's `Linear`
//! runs above 16 rows) against burn-flex's own matmul (the `gemm` crate), on the same data,
//! every thread; and kiln's product with the same weights kept in F16 (`[n, k]` rows widened as
//! they are packed).
//! Run: `cargo bench -p kiln-benches --bench gemm`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use burn::tensor::{Distribution, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

type B = burn::backend::Flex;

/// (rows, d_in, d_out): SmolLM2's up/gate projection, down projection, q/o; Llama-3.2-1B's.
const SHAPES: [(usize, usize, usize); 6] = [
    (512, 576, 1536),
    (512, 1536, 576),
    (512, 576, 576),
    (512, 2048, 8192),
    (512, 8192, 2048),
    (512, 2048, 2048),
];

fn gemm(c: &mut Criterion) {
    let device = Default::default();
    let mut group = c.benchmark_group("f32 product, [m, k] x [k, n]");
    for (m, k, n) in SHAPES {
        let x = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 0.05), &device);
        let xs: Vec<f32> = x.to_data().to_vec().expect("f32");
        let ws: Vec<f32> = w.to_data().to_vec().expect("f32");
        let mut out = vec![0f32; m * n];
        let shape = format!("{m}x{k}x{n}");
        group.throughput(Throughput::Elements((2 * m * k * n) as u64));
        group.bench_function(BenchmarkId::new("kiln gemm", &shape), |b| {
            b.iter(|| kiln_kernels::gemm::gemm_in_out(&ws, k, n, &xs, m, &mut out))
        });
        let f16_rows: Vec<u8> = (0..n)
            .flat_map(|j| (0..k).map(move |i| (i, j)))
            .flat_map(|(i, j)| half::f16::from_f32(ws[i * n + j]).to_le_bytes())
            .collect();
        let f16 = kiln_kernels::QuantMatrix::new(kiln_kernels::GgmlType::F16, n, k, f16_rows)
            .expect("an F16 matrix");
        group.bench_function(BenchmarkId::new("kiln F16 weights", &shape), |b| {
            b.iter(|| f16.matmul(&xs, m, &mut out))
        });
        if k * n <= 1536 * 576 {
            group.bench_function(BenchmarkId::new("burn-flex matmul", &shape), |b| {
                b.iter(|| x.clone().matmul(w.clone()))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, gemm);
criterion_main!(benches);
