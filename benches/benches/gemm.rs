//! f32 matrix products at the sizes of a 512-token prefill of SmolLM2 (576 hidden, 1536 feed
//! forward): kiln's `gemm` kernel (what burn-flex's `Linear` runs above 16 rows) against
//! burn-flex's own matmul (the `gemm` crate), on the same data, every thread.
//! Run: `cargo bench -p kiln-benches --bench gemm`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use burn::tensor::{Distribution, Tensor};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

type B = burn::backend::Flex;

/// (rows, d_in, d_out): the up/gate projection, the down projection, q/o.
const SHAPES: [(usize, usize, usize); 3] = [(512, 576, 1536), (512, 1536, 576), (512, 576, 576)];

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
        group.bench_function(BenchmarkId::new("burn-flex matmul", &shape), |b| {
            b.iter(|| x.clone().matmul(w.clone()))
        });
    }
    group.finish();
}

criterion_group!(benches, gemm);
criterion_main!(benches);
