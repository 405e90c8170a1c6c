//! Sampling over a 128k vocabulary (Llama 3's 128256 tokens): each logits processor alone, and
//! the whole chain with a seeded draw, as one decode step of one sequence pays it. Run:
//! `cargo bench -p kiln-benches --bench sampling`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kiln_core::sampling::{
    Candidates, LogitsProcessor, MinP, PresenceFrequencyPenalty, RepetitionPenalty, Temperature,
    TokenHistory, TopK, TopP,
};
use kiln_core::{Sampler, SamplingParams, TokenId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 128_256;

/// Logits like a model's: mostly small, a few large.
fn logits() -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    (0..VOCAB)
        .map(|_| {
            let x: f32 = rng.random_range(-4.0..4.0);
            if rng.random_range(0..1000) == 0 {
                x + 12.0
            } else {
                x
            }
        })
        .collect()
}

/// A 512-token prompt and 128 generated tokens.
fn history() -> TokenHistory {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let prompt: Vec<TokenId> = (0..512)
        .map(|_| TokenId(rng.random_range(0..VOCAB as u32)))
        .collect();
    let mut history = TokenHistory::with_prompt(&prompt);
    for _ in 0..128 {
        history.push(TokenId(rng.random_range(0..VOCAB as u32)));
    }
    history
}

fn processors(c: &mut Criterion) {
    let logits = logits();
    let history = history();
    let mut group = c.benchmark_group("sampling_128k");
    group.bench_function("candidates_from_logits", |b| {
        b.iter(|| Candidates::from_logits(&logits))
    });
    let each: Vec<(&str, Box<dyn LogitsProcessor>)> = vec![
        ("repetition_penalty", Box::new(RepetitionPenalty(1.1))),
        (
            "presence_frequency_penalty",
            Box::new(PresenceFrequencyPenalty {
                presence: 0.5,
                frequency: 0.5,
            }),
        ),
        ("temperature", Box::new(Temperature(0.8))),
        ("top_k_40", Box::new(TopK(40))),
        ("top_p_0.95", Box::new(TopP(0.95))),
        ("min_p_0.05", Box::new(MinP(0.05))),
    ];
    for (name, processor) in &each {
        // The copy of the logits is setup, not measured.
        group.bench_function(*name, |b| {
            b.iter_batched_ref(
                || Candidates::from_logits(&logits),
                |candidates| processor.process(candidates, &history),
                BatchSize::LargeInput,
            )
        });
    }
    let greedy = SamplingParams::greedy();
    let mut sampler = Sampler::new(&greedy, VOCAB).expect("valid parameters");
    group.bench_function("greedy", |b| b.iter(|| sampler.sample(&logits, &history)));
    let full = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repetition_penalty: 1.1,
        presence_penalty: 0.5,
        frequency_penalty: 0.5,
        seed: Some(7),
        logit_bias: Vec::new(),
    };
    let mut sampler = Sampler::new(&full, VOCAB).expect("valid parameters");
    group.bench_function("full_chain", |b| {
        b.iter(|| sampler.sample(&logits, &history))
    });
    let no_top_k = SamplingParams { top_k: 0, ..full };
    let mut sampler = Sampler::new(&no_top_k, VOCAB).expect("valid parameters");
    group.bench_function("full_chain_without_top_k", |b| {
        b.iter(|| sampler.sample(&logits, &history))
    });
    group.finish();
}

criterion_group!(benches, processors);
criterion_main!(benches);
