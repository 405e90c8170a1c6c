//! One decode step of attention over each KV-cache kind, at batch 1 and 32, on the cpu
//! backend: the cache's plan, the attention plan (masks and indices), the K/V append and the
//! attention itself for one layer of SmolLM2's shape (9 query heads, 3 KV heads of 64), every
//! sequence holding 512 tokens. Each iteration rolls the sequences back (`truncate`) so the
//! context stays 512. Run: `cargo bench -p kiln-benches --bench attention`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use burn::tensor::{Distribution, Tensor};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kiln_core::attention::{AttentionPlan, attend};
use kiln_core::kv_cache::{
    CacheKind, DynamicKvCache, KvCache, KvLayout, PagedKvCache, SlidingKvCache, StaticKvCache,
};
use kiln_core::{Batch, Dtype, InferenceBackend, Position, SeqId, TokenId};

type B = burn::backend::Flex;
use burn::backend::flex::FlexDevice;

const LAYOUT: KvLayout = KvLayout {
    n_layers: 1,
    n_kv_heads: 3,
    head_dim: 64,
};
const N_HEADS: usize = 9;
const CONTEXT: usize = 512;

fn cache(kind: CacheKind, batch: usize, device: &FlexDevice) -> Box<dyn KvCache<B>> {
    let len = CONTEXT + 1;
    match kind {
        CacheKind::Static => {
            Box::new(StaticKvCache::new(LAYOUT, batch, len, Dtype::F32, device).expect("valid"))
        }
        CacheKind::Dynamic => Box::new(DynamicKvCache::new(LAYOUT, Dtype::F32, device)),
        CacheKind::Sliding => Box::new(
            SlidingKvCache::new(LAYOUT, batch, 4096, 512, Dtype::F32, device).expect("valid"),
        ),
        CacheKind::Paged => Box::new(
            PagedKvCache::new(LAYOUT, batch * len.div_ceil(16), 16, Dtype::F32, device)
                .expect("valid"),
        ),
    }
}

fn random(n: usize, device: &FlexDevice, heads: usize) -> Tensor<B, 3> {
    Tensor::random(
        [n, heads, LAYOUT.head_dim],
        Distribution::Normal(0.0, 1.0),
        device,
    )
}

/// Fills every sequence with `CONTEXT` tokens.
fn prefill(cache: &mut dyn KvCache<B>, batch: usize, device: &FlexDevice) {
    let tokens = vec![TokenId(0); CONTEXT];
    for seq in 0..batch {
        let b = Batch::single(SeqId(seq as u64), &tokens, Position(0)).expect("valid batch");
        let plan = cache.plan(&b).expect("room");
        let plan = AttentionPlan::new(&b, plan, N_HEADS, LAYOUT.n_kv_heads, device);
        attend(
            cache,
            0,
            &plan,
            random(CONTEXT, device, N_HEADS),
            random(CONTEXT, device, 3),
            random(CONTEXT, device, 3),
        );
    }
}

fn decode_step(c: &mut Criterion) {
    let device = <B as InferenceBackend>::inference_device();
    let mut group = c.benchmark_group("attention_decode_step/cpu");
    for kind in CacheKind::ALL {
        for batch in [1usize, 32] {
            let mut cache = cache(kind, batch, &device);
            prefill(cache.as_mut(), batch, &device);
            let mut step = Batch::new();
            for seq in 0..batch {
                step.push(SeqId(seq as u64), &[TokenId(0)], Position(CONTEXT as u32))
                    .expect("valid batch");
            }
            let (q, k, v) = (
                random(batch, &device, N_HEADS),
                random(batch, &device, 3),
                random(batch, &device, 3),
            );
            group.bench_with_input(BenchmarkId::new(kind.name(), batch), &batch, |b, &batch| {
                b.iter(|| {
                    let plan = cache.plan(&step).expect("room");
                    let plan = AttentionPlan::new(&step, plan, N_HEADS, LAYOUT.n_kv_heads, &device);
                    let out = attend(cache.as_mut(), 0, &plan, q.clone(), k.clone(), v.clone());
                    let _ = out.into_data();
                    for seq in 0..batch {
                        cache
                            .truncate(SeqId(seq as u64), CONTEXT)
                            .expect("roll back one token");
                    }
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
