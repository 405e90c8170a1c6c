//! KV-cache appends: one decode token written into a static and a paged cache whose capacity
//! grows 16x. In-place writes take the same time at every capacity; a backend that copied the
//! cache on each write would slow down 16x. Run: `cargo bench -p kiln-benches --bench kv_cache`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use burn::tensor::Tensor;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kiln_core::kv_cache::{KvCache, KvLayout, PagedKvCache, StaticKvCache};
use kiln_core::{Batch, Dtype, InferenceBackend, Position, SeqId, TokenId};

/// SmolLM2-135M's per-layer K/V shape.
const LAYOUT: KvLayout = KvLayout {
    n_layers: 1,
    n_kv_heads: 3,
    head_dim: 64,
};

fn append_one<B: InferenceBackend>(cache: &mut dyn KvCache<B>, device: &B::Device, step: u32) {
    let batch = Batch::single(SeqId(0), &[TokenId(1)], Position(step)).expect("valid batch");
    let plan = cache.plan(&batch).expect("room in the cache");
    let kv = Tensor::<B, 3>::ones([1, LAYOUT.n_kv_heads, LAYOUT.head_dim], device);
    cache.write(0, &plan, kv.clone(), kv);
    B::sync(device).expect("device sync");
}

/// Appends one token per iteration, clearing the cache whenever it is full.
fn bench_appends<B: InferenceBackend>(
    b: &mut criterion::Bencher,
    mut cache: Box<dyn KvCache<B>>,
    slots: usize,
    device: &B::Device,
) {
    let mut step = 0;
    b.iter(|| {
        if step as usize == slots {
            cache.clear();
            step = 0;
        }
        append_one(cache.as_mut(), device, step);
        step += 1;
    });
}

fn bench_backend<B: InferenceBackend>(c: &mut Criterion, name: &str) {
    let device = B::inference_device();
    let mut group = c.benchmark_group(format!("kv_append/{name}"));
    for slots in [1024usize, 16384] {
        group.bench_with_input(BenchmarkId::new("static", slots), &slots, |b, &slots| {
            let cache = StaticKvCache::<B>::new(LAYOUT, 4, slots, Dtype::F32, &device);
            bench_appends(b, Box::new(cache.expect("cache")), slots, &device);
        });
        group.bench_with_input(BenchmarkId::new("paged", slots), &slots, |b, &slots| {
            let cache = PagedKvCache::<B>::new(LAYOUT, 4 * slots / 16, 16, Dtype::F32, &device);
            bench_appends(b, Box::new(cache.expect("cache")), slots, &device);
        });
    }
    group.finish();
}

fn kv_append(c: &mut Criterion) {
    bench_backend::<burn::backend::Flex>(c, "cpu");
    #[cfg(feature = "wgpu")]
    if kiln_core::BackendKind::Wgpu.require().is_ok() {
        bench_backend::<burn::backend::Wgpu>(c, "wgpu");
    }
}

criterion_group!(benches, kv_append);
criterion_main!(benches);
