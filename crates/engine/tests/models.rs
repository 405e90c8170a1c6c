//! The engine on real weights: packed prefill equals each prompt alone, a batch of mixed
//! lengths gives each prompt its own greedy (and seeded) continuation with every cache kind on
//! cpu and wgpu, snapshots resume exactly, and the sliding window attends over the last W
//! tokens only.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::OnceLock;

use kiln_core::kv_cache::{CacheKind, DynamicKvCache, SlidingKvCache};
use kiln_core::sampling::{Sampler, SamplingParams, TokenHistory};
use kiln_core::{
    Batch, CausalLm, Dtype, InferenceBackend, KvDtype, LogitsFor, Position, SeqId, TokenId,
};
use kiln_engine::bench::{Cell, Sampling, run_cell, synthetic_prompts};
use kiln_engine::{
    BeamSearch, CacheSpec, DraftSource, EarlyStopping, Engine, EngineConfig, EngineError,
    FinishReason, Grammar, GrammarCompiler, OutputConstraint, Request, Session, Snapshot,
    SpecCounts, Speculation, generate,
};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, LoadedModel, WeightStorage};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(name)
}

fn smollm2() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| match std::env::var_os("KILN_SMOLLM2_GGUF") {
        Some(path) => PathBuf::from(path),
        None => SMOLLM2_135M_INSTRUCT
            .ensure(&kiln_home().unwrap(), &mut |_| {})
            .unwrap(),
    })
    .clone()
}

fn load<B: InferenceBackend>(path: &std::path::Path, dtype: Dtype) -> LoadedModel<B> {
    load_with::<B>(path, dtype, WeightStorage::Dequantized)
}

fn load_with<B: InferenceBackend>(
    path: &std::path::Path,
    dtype: Dtype,
    weights: WeightStorage,
) -> LoadedModel<B> {
    let options = LoadOptions {
        dtype,
        weights,
        ..Default::default()
    };
    let loaded = kiln_models::load::<B>(path, &options, &B::inference_device()).unwrap();
    let quantized = loaded
        .model
        .weight_summary()
        .iter()
        .any(|(kind, _, _)| kind.contains("quantized"));
    assert_eq!(quantized, weights == WeightStorage::Quantized);
    loaded
}

/// A JSON reference file of the fixtures.
fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A JSON array of token ids.
fn token_ids(v: &serde_json::Value) -> Vec<TokenId> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| TokenId(x.as_u64().unwrap() as u32))
        .collect()
}

/// A cache of `kind` for `sequences` sequences of `max_len` tokens, whose sliding window
/// (512) no scenario outgrows, taking steps of up to 512 tokens.
fn any_kind(kind: CacheKind, sequences: usize, max_len: usize) -> CacheSpec {
    CacheSpec {
        kind,
        window: 512,
        max_step: 512,
        ..CacheSpec::paged(sequences, max_len)
    }
}

fn rows<B: InferenceBackend>(t: burn::tensor::Tensor<B, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Synthetic prompts of the given lengths (ids spread over the vocabulary).
fn prompts(lengths: &[usize], vocab: usize) -> Vec<Vec<TokenId>> {
    lengths
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n)
                .map(|i| TokenId(((i * 7919 + p * 104_729 + 13) % vocab) as u32))
                .collect()
        })
        .collect()
}

/// The reference every path is held to, without the engine: the prompt in one forward on a
/// fresh dynamic cache, then one forward per new token, each picked by the request's own
/// sampler. (`crates/models/tests/golden.rs` holds this loop to a full recompute and to
/// transformers; recomputing here instead would cost minutes on lavapipe.)
fn alone<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    prompt: &[TokenId],
    n: usize,
    sampling: &SamplingParams,
) -> Vec<TokenId> {
    let sampler = Sampler::new(sampling, model.shape().vocab).unwrap();
    alone_with(model, prompt, n, sampler, |_| false)
}

/// [`alone`] with any sampler, stopping before a token for which `ends` holds.
fn alone_with<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    prompt: &[TokenId],
    n: usize,
    sampler: Sampler,
    ends: impl Fn(TokenId) -> bool,
) -> Vec<TokenId> {
    alone_in(model, model.dtype(), prompt, n, sampler, ends)
}

/// [`alone_with`] over a cache that holds its K/V in `kv_dtype`.
fn alone_in<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    kv_dtype: impl Into<KvDtype>,
    prompt: &[TokenId],
    n: usize,
    mut sampler: Sampler,
    ends: impl Fn(TokenId) -> bool,
) -> Vec<TokenId> {
    let shape = model.shape();
    let mut history = TokenHistory::with_prompt(prompt);
    let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), kv_dtype, &model.device());
    let mut batch = Batch::single(SeqId(0), prompt, Position(0)).unwrap();
    for fed in prompt.len()..prompt.len() + n {
        let logits = model
            .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
            .unwrap();
        let token = sampler.try_sample(&rows(logits), &history).unwrap();
        if ends(token) {
            break;
        }
        history.push(token);
        batch = Batch::single(SeqId(0), &[token], Position(fed as u32)).unwrap();
    }
    history.generated().to_vec()
}

/// Every prompt through one engine with `config` on a cache of `spec` (and `draft`'s cache of
/// the same spec, when it drafts): each prompt's tokens, in submission order, and the engine's
/// speculation counts; no cache is left held.
fn engine_outputs<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    draft: Option<&dyn CausalLm<B>>,
    spec: CacheSpec,
    config: EngineConfig,
    prompts: &[Vec<TokenId>],
    n: usize,
    sampling: &[SamplingParams],
) -> (Vec<Vec<TokenId>>, SpecCounts) {
    let cache_of = |m: &dyn CausalLm<B>| {
        spec.build::<B>(m.shape().kv_layout(), m.dtype(), &m.device())
            .unwrap()
    };
    let mut engine = Engine::new(model, cache_of(model), config).unwrap();
    if let Some(draft) = draft {
        engine = engine.with_draft_model(draft, cache_of(draft)).unwrap();
    }
    for (prompt, sampling) in prompts.iter().zip(sampling) {
        engine
            .submit(Request {
                prompt: prompt.clone(),
                max_tokens: n,
                sampling: sampling.clone(),
                ..Default::default()
            })
            .unwrap();
    }
    let done = engine.run(|_| {}).unwrap();
    assert_eq!(engine.cache().usage().sequences, 0);
    if let Some(cache) = engine.draft_cache() {
        assert_eq!(cache.usage().sequences, 0, "the draft model's cache");
    }
    let tokens = done.into_iter().map(|c| c.tokens).collect();
    (tokens, engine.speculation_stats())
}

/// All prompts in one batch, prompts up to 512 tokens in one step.
fn one_batch(prompts: usize) -> EngineConfig {
    EngineConfig {
        max_batch: prompts,
        max_step_tokens: 512,
        ..EngineConfig::default()
    }
}

/// Several fresh prompts in one packed forward: each last-position row equals the prompt's
/// own forward within `tolerance` (f32).
fn packed_prefill_matches_alone<B: InferenceBackend>(
    models: &[(PathBuf, WeightStorage)],
    tolerance: f32,
) {
    for (path, weights) in models {
        let loaded = load_with::<B>(path, Dtype::F32, *weights);
        let model = &loaded.model;
        let shape = model.shape();
        let prompts = prompts(&[1, 9, 30, 4], shape.vocab);
        let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), Dtype::F32, &model.device());
        let mut batch = Batch::new();
        for (i, p) in prompts.iter().enumerate() {
            batch.push(SeqId(i as u64), p, Position(0)).unwrap();
        }
        let packed = rows(
            model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .unwrap(),
        );
        for (i, p) in prompts.iter().enumerate() {
            let mut cache =
                DynamicKvCache::<B>::new(shape.kv_layout(), Dtype::F32, &model.device());
            let batch = Batch::single(SeqId(0), p, Position(0)).unwrap();
            let own = rows(
                model
                    .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                    .unwrap(),
            );
            let diff = max_abs_diff(&packed[i * shape.vocab..(i + 1) * shape.vocab], &own);
            assert!(diff <= tolerance, "{} prompt {i}: {diff}", path.display());
        }
    }
}

fn tiny_fixtures() -> Vec<(PathBuf, WeightStorage)> {
    ["llama-tiny", "gpt2-tiny"]
        .map(|name| (fixture(name), WeightStorage::Dequantized))
        .to_vec()
}

/// Prompts of 1 to 300 tokens (SmolLM2; the tiny fixtures hold 128 positions, so 1 to 100
/// there) in one engine: each cache kind in `kinds` gives each prompt its continuation alone,
/// greedy for four prompts and sampled with a fixed seed for two more in the same batch. The
/// sliding window (512) is wider than any sequence, so it must equal the static cache too.
fn mixed_batch_matches_alone<B: InferenceBackend>(
    path: &std::path::Path,
    weights: WeightStorage,
    kinds: &[CacheKind],
) {
    let loaded = load_with::<B>(path, Dtype::F32, weights);
    let model = &loaded.model;
    let n = 8;
    let lengths = if model.shape().max_positions >= 320 {
        [1, 300, 5, 37, 12, 150]
    } else {
        [1, 100, 5, 37, 12, 60]
    };
    let prompts = prompts(&lengths, model.shape().vocab);
    let sampling: Vec<SamplingParams> = (0..prompts.len())
        .map(|i| match i {
            0..4 => SamplingParams::greedy(),
            // The CLI's defaults. Without top-k the synthetic prompts give near-flat
            // distributions over 49152 tokens, where one token's slice of the CDF (~2e-5) is as
            // thin as the rounding difference between a batched and a single forward.
            _ => SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                seed: Some(40 + i as u64),
                ..SamplingParams::default()
            },
        })
        .collect();
    let expected: Vec<Vec<TokenId>> = prompts
        .iter()
        .zip(&sampling)
        .map(|(p, s)| alone(model, p, n, s))
        .collect();
    for &kind in kinds {
        let spec = any_kind(kind, prompts.len(), 320);
        let (ours, _) = engine_outputs(
            model,
            None,
            spec,
            one_batch(prompts.len()),
            &prompts,
            n,
            &sampling,
        );
        assert_eq!(ours, expected, "{kind}");
    }
}

/// `logit_bias` through the engine: greedy rows with a bias (+100 forcing a token, -100 banning
/// the unbiased first pick) and a sampled one, beside a plain greedy row and then all biased,
/// each give exactly their continuation alone. On a GPU backend a step whose rows are all
/// plain greedy lets the device pick the argmaxes; a biased row must never go that way (its
/// pick is the argmax of the biased logits), which the all-biased batch holds.
fn logit_bias_matches_alone<B: InferenceBackend>() {
    let loaded = load_with::<B>(
        &fixture("llama-tiny"),
        Dtype::F32,
        WeightStorage::Dequantized,
    );
    let model = &loaded.model;
    let n = 6;
    let prompts = prompts(&[3, 17, 9, 5], model.shape().vocab);
    let plain: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| alone(model, p, n, &SamplingParams::greedy()))
        .collect();
    let forced = TokenId(7);
    assert!(!plain[2].contains(&forced), "a token greedy would not pick");
    let biased = |bias: Vec<(TokenId, f32)>, base: SamplingParams| SamplingParams {
        logit_bias: bias,
        ..base
    };
    let sampling = [
        SamplingParams::greedy(),
        biased(vec![(plain[1][0], -100.0)], SamplingParams::greedy()),
        biased(vec![(forced, 100.0)], SamplingParams::greedy()),
        biased(
            vec![(plain[3][0], -100.0), (TokenId(11), 3.0)],
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                seed: Some(5),
                ..SamplingParams::default()
            },
        ),
    ];
    let expected: Vec<Vec<TokenId>> = prompts
        .iter()
        .zip(&sampling)
        .map(|(p, s)| alone(model, p, n, s))
        .collect();
    assert_eq!(expected[0], plain[0]);
    assert_ne!(expected[1][0], plain[1][0], "-100 bans the greedy pick");
    assert_eq!(expected[2], vec![forced; n], "+100 forces the token");
    let spec = any_kind(CacheKind::Paged, prompts.len(), 128);
    let (ours, _) = engine_outputs(model, None, spec, one_batch(4), &prompts, n, &sampling);
    assert_eq!(ours, expected, "beside a plain greedy row");
    let (ours, _) = engine_outputs(
        model,
        None,
        spec,
        one_batch(2),
        &prompts[1..3],
        n,
        &sampling[1..3],
    );
    assert_eq!(ours, expected[1..3], "every row greedy with a bias");
}

/// Prefix caching changes no token: prompts that share leading tokens with each other (in one
/// wave: they wait for each other's blocks) and with the previous wave's finished requests
/// (their blocks are cached) give exactly what each gives alone, greedy, and what the same
/// engine gives with prefix caching off; the second wave really reads cached blocks. The KV
/// cache holds `kv_dtype` (f16: a prefix read from the cache must equal one computed in the
/// step, which attention rounds to the cache's precision).
fn prefix_cache_matches_alone<B: InferenceBackend>(
    path: &std::path::Path,
    weights: WeightStorage,
    kv_dtype: KvDtype,
) {
    let loaded = load_with::<B>(path, Dtype::F32, weights);
    let model = &loaded.model;
    let vocab = model.shape().vocab;
    let n = 6;
    let base = &prompts(&[70], vocab)[0];
    let tail = prompts(&[3, 9, 5, 11], vocab);
    let extend = |len: usize, t: &[TokenId]| -> Vec<TokenId> {
        base[..len].iter().chain(t).copied().collect()
    };
    let waves = [
        vec![
            extend(70, &tail[0]),
            extend(70, &tail[1]),
            extend(41, &tail[2]),
        ],
        vec![
            extend(70, &tail[0]),
            extend(70, &[]),
            extend(45, &tail[3]),
            tail[1].clone(),
        ],
    ];
    let greedy = SamplingParams::greedy();
    let run = |prefix_cache: bool| {
        let spec = CacheSpec {
            page_size: 4,
            ..CacheSpec::paged(4, 128)
        };
        let cache = spec
            .build::<B>(model.shape().kv_layout(), kv_dtype, &model.device())
            .unwrap();
        let config = EngineConfig {
            max_batch: 4,
            max_step_tokens: 64,
            prefix_cache,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(model, cache, config).unwrap();
        let mut outputs = Vec::new();
        for wave in &waves {
            for prompt in wave {
                let request = Request {
                    prompt: prompt.clone(),
                    max_tokens: n,
                    sampling: greedy.clone(),
                    ..Default::default()
                };
                engine.submit(request).unwrap();
            }
            outputs.push(engine.run(|_| {}).unwrap());
        }
        assert_eq!(engine.cache().usage().used, 0);
        outputs
    };
    let on = run(true);
    let off = run(false);
    for (wave, (ours, plain)) in waves.iter().zip(on.iter().zip(&off)) {
        for ((prompt, ours), plain) in wave.iter().zip(ours).zip(plain) {
            let sampler = Sampler::new(&greedy, vocab).unwrap();
            let expected = alone_in(model, kv_dtype, prompt, n, sampler, |_| false);
            assert_eq!(ours.tokens, expected, "prefix caching on");
            assert_eq!(plain.tokens, expected, "prefix caching off");
            assert_eq!(plain.cached_tokens, 0);
        }
    }
    let cached: Vec<usize> = on.iter().flatten().map(|c| c.cached_tokens).collect();
    // Wave 1: the second prompt waits for the first's 68 whole-block tokens, the third shares
    // 40 of its 41 common ones; wave 2 finds wave 1's blocks (the exact repeat and the
    // shortened one as far as whole blocks go; the unrelated prompt nothing).
    assert_eq!(cached, vec![0, 68, 40, 72, 68, 44, 0]);
}

/// One fixture of each family the rotary decoder or GPT-BigCode's loader runs beside Llama
/// (`make_model_fixtures.py`), each with transformers' greedy continuations.
const FAMILY_FIXTURES: [&str; 7] = [
    "mistral-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "gemma2-tiny",
    "gemma3-tiny",
    "phi3-tiny",
    "gpt-bigcode-tiny",
];

/// Every family's fixture gives transformers' greedy continuations through the engine, its
/// prompts batched and packed, on every cache kind (the default paged one included, with
/// prefix caching on). The windows belong to the model: Mistral's (`sliding_window` 5 on every
/// layer), Qwen2's (5 on its second layer only) and Gemma's (5 on layers 0 and 2) are shorter
/// than the prompts, as is Phi-3's (7 on every layer); Gemma 2's soft-capped scores, Gemma 3's
/// two RoPEs, Phi-3's fused projections and LongRoPE and GPT-BigCode's one key/value head ride
/// along.
fn families_hold_on_every_cache_kind<B: InferenceBackend>() {
    for name in FAMILY_FIXTURES {
        let dir = fixture(name);
        let loaded = load::<B>(&dir, Dtype::F32);
        let reference = read_json(&dir.join("reference.json"));
        let cases = reference["cases"].as_array().unwrap();
        let prompts: Vec<Vec<TokenId>> =
            cases.iter().map(|c| token_ids(&c["prompt_ids"])).collect();
        let expected: Vec<Vec<TokenId>> = cases.iter().map(|c| token_ids(&c["greedy"])).collect();
        let greedy = vec![SamplingParams::greedy(); prompts.len()];
        for kind in CacheKind::ALL {
            let spec = CacheSpec {
                kind,
                window: 64,
                max_step: 64,
                page_size: 4,
                ..CacheSpec::paged(prompts.len(), 64)
            };
            let config = one_batch(prompts.len());
            let (ours, _) =
                engine_outputs(&loaded.model, None, spec, config, &prompts, 20, &greedy);
            assert_eq!(ours, expected, "{name} on {kind}");
        }
    }
}

/// Prompt-lookup drafting of 4 tokens from 1-3-grams at a fixed length (not adaptive), so
/// drafts are proposed, rejected and rolled back on every step a match allows.
fn steady_prompt_lookup() -> Speculation {
    Speculation {
        source: DraftSource::PromptLookup {
            min_ngram: 1,
            max_ngram: 3,
        },
        draft_tokens: 4,
        adaptive: false,
        max_batch: 0,
    }
}

/// A model whose every layer has a window (Mistral's 5, Phi-3's 7) generates far past what
/// its paged pool could hold without forgetting: 8 blocks of 4 tokens for two sequences of
/// up to 110. The blocks that left the window go back to the pool as the sequences grow
/// (prompts, and a preempted sequence's recompute, run in chunks of 8 tokens so that they
/// forget between chunks too);
/// the tokens equal each prompt's alone on an unbounded cache, plain and with prompt-lookup
/// drafts (whose rejected drafts roll the cache back inside the kept slack).
fn windowed_models_outgrow_their_pool<B: InferenceBackend>() {
    for name in ["mistral-tiny", "phi3-tiny"] {
        let loaded = load::<B>(&fixture(name), Dtype::F32);
        let model = &loaded.model;
        assert!(model.attention_window().is_some(), "{name}");
        let prompts = prompts(&[9, 20], model.shape().vocab);
        let n = 90;
        let greedy = SamplingParams::greedy();
        let expected: Vec<Vec<TokenId>> = prompts
            .iter()
            .map(|p| alone(model, p, n, &greedy))
            .collect();
        let spec = CacheSpec {
            page_size: 4,
            blocks: Some(8),
            ..CacheSpec::paged(2, 128)
        };
        for speculation in [None, Some(steady_prompt_lookup())] {
            let config = EngineConfig {
                speculation,
                max_batch: prompts.len(),
                max_step_tokens: 8,
                ..EngineConfig::default()
            };
            let sampling = vec![greedy.clone(); prompts.len()];
            let (ours, _) = engine_outputs(model, None, spec, config, &prompts, n, &sampling);
            assert_eq!(ours, expected, "{name}, speculation {speculation:?}");
        }
    }
}

/// A chat session keeps its cache between turns: turn 2 extends what turn 1 left, turn 3
/// diverges inside the cached tokens and rolls the cache back. Every turn gives exactly the
/// tokens of a full recompute of its context, on each cache kind in `kinds`.
fn session_reuses_its_cache_exactly<B: InferenceBackend>(
    weights: WeightStorage,
    kinds: &[CacheKind],
) {
    let loaded = load_with::<B>(&smollm2(), Dtype::F32, weights);
    let model = &loaded.model;
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let encode = |text: &str| tokenizer.encode(text, false).unwrap();
    let n = 10;
    let request = |prompt: Vec<TokenId>| Request {
        prompt,
        max_tokens: n,
        sampling: SamplingParams::greedy(),
        ..Request::default()
    };
    for &kind in kinds {
        let spec = any_kind(kind, 1, 512);
        let cache = spec
            .build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
            .unwrap();
        let mut session = Session::new(model, cache, EngineConfig::default()).unwrap();
        let mut turn = |context: Vec<TokenId>| {
            let reply = session
                .reply(request(context.clone()), |_| ControlFlow::Continue(()))
                .unwrap();
            let expected = alone(model, &context, n, &SamplingParams::greedy());
            assert_eq!(reply.tokens, expected, "{kind}");
            let computed = reply.prompt_tokens - reply.cached_tokens;
            (reply.tokens, reply.cached_tokens, computed)
        };
        let first = encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        );
        let (tokens, reused, computed) = turn(first.clone());
        assert_eq!((reused, computed), (0, first.len()), "{kind}");

        let mut second = first.clone();
        second.extend(&tokens);
        second.extend(encode(
            "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
        ));
        let (_, reused, computed) = turn(second.clone());
        // The last token of turn 1 was sampled but never fed.
        let held = first.len() + n - 1;
        assert_eq!((reused, computed), (held, second.len() - held));

        let keep = second.len() - 6;
        let mut third = second[..keep].to_vec();
        third.extend(encode(" Germany?<|im_end|>\n<|im_start|>assistant\n"));
        let (_, reused, _) = turn(third.clone());
        assert_eq!(reused, keep, "{kind}: rolled back to the shared prefix");
        assert_eq!(session.cached().len(), third.len() + n - 1);
        assert_eq!(session.cache().seq_len(SeqId(0)), session.cached().len());

        // Stopped by the caller after its first token (Ctrl-C in `kiln chat`): the reply
        // ends with `Stop` and its cache is kept for the next turn.
        let reply = session
            .reply(request(third.clone()), |_| ControlFlow::Break(()))
            .unwrap();
        assert_eq!(reply.finish_reason, FinishReason::Stop, "{kind}");
        assert_eq!(reply.tokens.len(), 1);
        assert_eq!(session.cached(), &third[..], "{kind}");
        assert_eq!(session.cache().usage().sequences, 1);
        session.reset();
        assert_eq!(session.cache().usage().sequences, 0);
    }
}

/// `generate` is one engine request on the caller's cache: the reference tokens, `Stop` when
/// the callback breaks, the cache left without sequences, and (paged) the prompt's full blocks
/// left cached for the next call.
fn generate_runs_one_request_on_a_lent_cache<B: InferenceBackend>() {
    let loaded = load::<B>(&fixture("llama-tiny"), Dtype::F32);
    let model = &loaded.model;
    let prompt = prompts(&[37], model.shape().vocab).remove(0);
    let n = 7;
    let request = Request {
        prompt: prompt.clone(),
        max_tokens: n,
        sampling: SamplingParams::greedy(),
        ..Request::default()
    };
    let mut cache = CacheSpec {
        page_size: 16,
        ..CacheSpec::paged(1, 64)
    }
    .build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
    .unwrap();
    let mut streamed = Vec::new();
    let done = generate(model, cache.as_mut(), request.clone(), |t| {
        streamed.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(
        done.tokens,
        alone(model, &prompt, n, &SamplingParams::greedy())
    );
    assert_eq!(streamed, done.tokens);
    assert_eq!(
        (done.finish_reason, done.cached_tokens),
        (FinishReason::Length, 0)
    );
    assert_eq!(cache.usage().sequences, 0);

    let stopped = generate(model, cache.as_mut(), request, |_| ControlFlow::Break(())).unwrap();
    assert_eq!(stopped.tokens, done.tokens[..1]);
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    assert_eq!(
        stopped.cached_tokens, 32,
        "two whole blocks of the first call"
    );
    assert_eq!(cache.usage().sequences, 0);

    let empty = Request::default();
    let err = generate(model, cache.as_mut(), empty, |_| ControlFlow::Continue(())).unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
}

/// Prefill once, save, load, resume: the same tokens as generating alone; another model or
/// dtype refuses the snapshot.
fn snapshots_resume_exactly<B: InferenceBackend>() {
    let loaded = load::<B>(&fixture("llama-tiny"), Dtype::F32);
    let model = &loaded.model;
    let prompt = prompts(&[21], model.shape().vocab).remove(0);
    let n = 12;
    let expected = alone(model, &prompt, n, &SamplingParams::greedy());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prompt.kv");
    Snapshot::prefill(model, &prompt)
        .unwrap()
        .save(&path)
        .unwrap();
    let snapshot = Snapshot::load(&path).unwrap();
    for _ in 0..2 {
        let cache = CacheSpec::paged(2, 64)
            .build::<B>(model.shape().kv_layout(), Dtype::F32, &model.device())
            .unwrap();
        let mut engine = Engine::new(model, cache, EngineConfig::default()).unwrap();
        let request = Request {
            max_tokens: n,
            sampling: SamplingParams::greedy(),
            ..Default::default()
        };
        engine.submit_snapshot(&snapshot, request).unwrap();
        let done = engine.run(|_| {}).unwrap();
        assert_eq!(done[0].tokens, expected);
    }

    let refuse = |other: &dyn CausalLm<B>| {
        let cache = CacheSpec::paged(2, 64)
            .build::<B>(other.shape().kv_layout(), other.dtype(), &other.device())
            .unwrap();
        let mut engine = Engine::new(other, cache, EngineConfig::default()).unwrap();
        let err = engine
            .submit_snapshot(&snapshot, Request::default())
            .unwrap_err();
        assert!(matches!(err, EngineError::Snapshot { .. }), "{err}");
        err.to_string()
    };
    let tied = load::<B>(&fixture("llama-tiny-tied"), Dtype::F32);
    assert!(refuse(&tied.model).contains("another model"));
    // A snapshot built in memory whose layer holds less than its prompt needs is refused
    // rather than sliced past its end.
    let mut short = snapshot.clone();
    short.layers[1].1.truncate(3);
    let cache = CacheSpec::paged(2, 64)
        .build::<B>(model.shape().kv_layout(), Dtype::F32, &model.device())
        .unwrap();
    let mut engine = Engine::new(model, cache, EngineConfig::default()).unwrap();
    let err = engine
        .submit_snapshot(&short, Request::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 1 holds"), "{err}");
    let mut old = std::fs::read(&path).unwrap();
    old[..8].copy_from_slice(b"KILNKV01");
    std::fs::write(&path, old).unwrap();
    let err = Snapshot::load(&path).unwrap_err().to_string();
    assert!(err.contains("older kiln snapshot format"), "{err}");
    let half = load::<B>(&fixture("llama-tiny"), Dtype::F16);
    assert!(refuse(&half.model).contains("dtype"));
}

/// A one-layer Llama (llama-tiny's first layer) run past a window of W tokens: at every step,
/// the sliding cache's logits equal a fresh forward over only the last W tokens at their own
/// positions, which in one layer is exactly windowed attention, computed without any cache.
fn sliding_window_attends_over_the_last_w_tokens<B: InferenceBackend>() {
    let dir = tempfile::tempdir().unwrap();
    let source = fixture("llama-tiny");
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["num_hidden_layers"] = 1.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let loaded = load::<B>(dir.path(), Dtype::F32);
    let model = &loaded.model;
    let shape = model.shape();
    let (window, chunk) = (8, 5);
    let tokens = prompts(&[60], shape.vocab).remove(0);
    let mut cache = SlidingKvCache::<B>::new(
        shape.kv_layout(),
        1,
        window,
        chunk,
        Dtype::F32,
        &model.device(),
    )
    .unwrap();
    let mut fed = 0;
    while fed < tokens.len() {
        let n = chunk.min(tokens.len() - fed);
        let batch = Batch::single(SeqId(0), &tokens[fed..fed + n], Position(fed as u32)).unwrap();
        let ours = rows(
            model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .unwrap(),
        );
        fed += n;
        let start = fed.saturating_sub(window);
        let mut fresh = DynamicKvCache::<B>::new(shape.kv_layout(), Dtype::F32, &model.device());
        let batch = Batch::single(SeqId(0), &tokens[start..fed], Position(start as u32)).unwrap();
        let reference = rows(
            model
                .forward(&batch, &mut fresh, LogitsFor::LastOfEachSequence)
                .unwrap(),
        );
        let diff = max_abs_diff(&ours, &reference);
        assert!(diff <= 1e-4, "after {fed} tokens: {diff}");
    }
    assert!(fed > 2 * window);
}

/// A benchmark cell decodes, for each of its prompts, exactly what `generate` decodes for that
/// prompt alone, and reads device memory exactly where the backend reports it: at least the
/// cache, all the cell's tokens in it at their largest.
fn bench_cell_generates_what_generate_does<B: InferenceBackend>() {
    let loaded = load::<B>(&fixture("llama-tiny"), Dtype::F32);
    let model = &loaded.model;
    let shape = model.shape();
    let cell = Cell {
        prompt_len: 20,
        batch: 3,
        new_tokens: 6,
        max_step_tokens: 512,
        sampling: Sampling::Greedy,
        speculation: None,
    };
    let cache = cell
        .cache_spec()
        .build::<B>(shape.kv_layout(), Dtype::F32, &model.device())
        .unwrap();
    let mut engine = Engine::new(model, cache, cell.engine_config()).unwrap();
    let timings = run_cell(&mut engine, &cell).unwrap();
    let expected: Vec<Vec<TokenId>> = synthetic_prompts(cell.batch, cell.prompt_len, shape.vocab)
        .iter()
        .map(|p| alone(model, p, cell.new_tokens, &SamplingParams::greedy()))
        .collect();
    assert_eq!(timings.tokens, expected);
    assert_eq!(timings.decode_steps.len(), cell.new_tokens - 1);
    assert_eq!(
        engine.cache().usage().sequences,
        0,
        "the cell empties its cache"
    );

    let reports = B::device_memory(&model.device()).is_some();
    assert_eq!(timings.peak_device_memory.is_some(), reports);
    if let Some(peak) = timings.peak_device_memory {
        let cached = cell.batch * (cell.prompt_len + cell.new_tokens);
        let cache_bytes = cached * shape.kv_layout().bytes_per_token(Dtype::F32);
        assert!(
            peak.in_use as usize >= cache_bytes,
            "{peak:?} < {cache_bytes}"
        );
        assert!(peak.reserved >= peak.in_use, "{peak:?}");
    }
}

/// Speculative decoding with prompt lookup and with `draft` as a draft model, each on the cache
/// kinds in `kinds`, gives exactly the plain greedy tokens of each prompt alone, one request at
/// a time and all in one batch. Returns the counts over every run of each source (so a caller
/// can check that drafts were proposed and accepted).
fn speculative_greedy_matches_alone<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    draft: &dyn CausalLm<B>,
    kinds: &[CacheKind],
    prompts: &[Vec<TokenId>],
    n: usize,
) -> [SpecCounts; 2] {
    let greedy = SamplingParams::greedy();
    let expected: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| alone(model, p, n, &greedy))
        .collect();
    let lookup = Speculation {
        source: DraftSource::PromptLookup {
            min_ngram: 2,
            max_ngram: 3,
        },
        draft_tokens: 4,
        adaptive: true,
        max_batch: 0,
    };
    let drafted = Speculation {
        source: DraftSource::Model,
        ..lookup
    };
    let mut counts = [SpecCounts::default(); 2];
    let sources = [(lookup, None), (drafted, Some(draft))];
    for (source, (speculation, draft)) in sources.into_iter().enumerate() {
        for &kind in kinds {
            let spec = any_kind(kind, prompts.len(), 256);
            for batch in [1, prompts.len()] {
                let config = EngineConfig {
                    max_batch: batch,
                    speculation: Some(speculation),
                    ..EngineConfig::default()
                };
                let sampling = vec![greedy.clone(); prompts.len()];
                let (ours, stats) =
                    engine_outputs(model, draft, spec, config, prompts, n, &sampling);
                for (i, (ours, theirs)) in ours.iter().zip(&expected).enumerate() {
                    assert_eq!(
                        ours, theirs,
                        "{speculation:?}, {kind}, batch {batch}, prompt {i}"
                    );
                }
                counts[source].add(&stats);
            }
        }
    }
    counts
}

/// SmolLM2: the reference prompts (whose greedy continuations transformers wrote) and a
/// prompt that asks for a copy, drafted by prompt lookup and by the quantized copy of the
/// model, on the engine's default cache (the tiny Llama runs every cache kind). Exact weights
/// must also give transformers' tokens.
fn speculative_greedy_on_smollm2<B: InferenceBackend>(weights: WeightStorage) {
    let loaded = load_with::<B>(&smollm2(), Dtype::F32, weights);
    let model = &loaded.model;
    let quantized;
    let draft = if weights == WeightStorage::Quantized {
        model
    } else {
        quantized = load_with::<B>(&smollm2(), Dtype::F32, WeightStorage::Quantized);
        &quantized.model
    };
    let reference = read_json(&fixture("smollm2/reference.json"));
    let n = 16;
    let cases = reference["greedy_cases"].as_array().unwrap();
    let mut prompts: Vec<Vec<TokenId>> =
        cases.iter().map(|c| token_ids(&c["prompt_ids"])).collect();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    prompts.push(
        tokenizer
            .encode(
                "<|im_start|>user\nRepeat this sentence exactly: The quick brown fox jumps over \
                 the lazy dog near the river bank.<|im_end|>\n<|im_start|>assistant\n",
                false,
            )
            .unwrap(),
    );
    let [lookup, drafted] =
        speculative_greedy_matches_alone(model, draft, &[CacheKind::Paged], &prompts, n);
    assert!(lookup.accepted > 0, "{lookup:?}");
    // The quantized copy agrees with the exact model on most tokens.
    assert!(drafted.acceptance_rate() > 0.5, "{drafted:?}");
    if weights == WeightStorage::Dequantized {
        let greedy = SamplingParams::greedy();
        for (case, prompt) in cases.iter().zip(&prompts) {
            let reference = token_ids(&case["greedy"]);
            assert_eq!(alone(model, prompt, n, &greedy), reference[..n]);
        }
    }
}

/// The tiny Llama on prompts that repeat themselves, on the cache kinds in `kinds`.
fn speculative_greedy_on_llama_tiny<B: InferenceBackend>(kinds: &[CacheKind]) {
    let loaded = load::<B>(&fixture("llama-tiny"), Dtype::F32);
    let model = &loaded.model;
    let prompts: Vec<Vec<TokenId>> = prompts(&[9, 14, 5], model.shape().vocab)
        .into_iter()
        .map(|p| p.iter().chain(&p).chain(&p[..3]).copied().collect())
        .collect();
    // The model drafts for itself: (nearly) every draft stands, the longest accepted runs.
    let [lookup, drafted] = speculative_greedy_matches_alone(model, model, kinds, &prompts, 12);
    assert!(lookup.drafted > 0, "{lookup:?}");
    assert!(drafted.acceptance_rate() > 0.9, "{drafted:?}");
    assert!(drafted.tokens_per_forward() > 2.0, "{drafted:?}");
}

/// One case of a `beam_reference.json` (written by `scripts/reference/make_beam_fixtures.py`):
/// the request, and transformers' returned hypotheses as `(tokens, ended by EOS, score)`.
struct BeamCase {
    name: String,
    request: Request,
    expected: Vec<(Vec<TokenId>, bool, f32)>,
}

fn beam_cases(fixture_dir: &str) -> Vec<BeamCase> {
    let reference = read_json(&fixture(fixture_dir).join("beam_reference.json"));
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let early_stopping = match &case["early_stopping"] {
                serde_json::Value::Bool(true) => EarlyStopping::Immediate,
                serde_json::Value::Bool(false) => EarlyStopping::Heuristic,
                other => other.as_str().unwrap().parse().unwrap(),
            };
            let beam = BeamSearch {
                num_beams: case["num_beams"].as_u64().unwrap() as usize,
                length_penalty: case["length_penalty"].as_f64().unwrap() as f32,
                early_stopping,
                num_return_sequences: case["num_return_sequences"].as_u64().unwrap() as usize,
            };
            let expected = case["outputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| {
                    let score = o["score"].as_f64().unwrap() as f32;
                    (token_ids(&o["tokens"]), o["eos"].as_bool().unwrap(), score)
                })
                .collect();
            BeamCase {
                name: case["name"].as_str().unwrap().to_string(),
                request: Request {
                    prompt: token_ids(&case["prompt_ids"]),
                    max_tokens: case["max_new_tokens"].as_u64().unwrap() as usize,
                    eos: token_ids(&case["eos_token_ids"]),
                    beam: Some(beam),
                    ..Request::default()
                },
                expected,
            }
        })
        .collect()
}

/// Beam search gives transformers' hypotheses (tokens, how each ended, and scores within
/// 1e-4) on every cache kind in `kinds`: each case alone on its engine, and every case in one
/// batch beside a plain greedy request, which must still get its own greedy tokens. No cache
/// is left held.
fn beam_search_matches_transformers<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    fixture_dir: &str,
    kinds: &[CacheKind],
) {
    let cases = beam_cases(fixture_dir);
    let greedy_prompt = prompts(&[7], model.shape().vocab).remove(0);
    let greedy = alone(model, &greedy_prompt, 6, &SamplingParams::greedy());
    let rows: usize = cases
        .iter()
        .map(|c| c.request.beam.unwrap().num_beams)
        .sum();
    for &kind in kinds {
        let spec = any_kind(kind, rows + 1, 128);
        for together in [false, true] {
            let groups: Vec<Vec<&BeamCase>> = if together {
                vec![cases.iter().collect()]
            } else {
                cases.iter().map(|c| vec![c]).collect()
            };
            for group in groups {
                let cache = spec
                    .build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
                    .unwrap();
                // A row per beam, and one for the greedy request.
                let config = EngineConfig {
                    max_batch: group.iter().map(|c| c.request.rows()).sum::<usize>() + 1,
                    ..EngineConfig::default()
                };
                let mut engine = Engine::new(model, cache, config).unwrap();
                for case in &group {
                    engine.submit(case.request.clone()).unwrap();
                }
                if together {
                    engine
                        .submit(Request {
                            prompt: greedy_prompt.clone(),
                            max_tokens: 6,
                            sampling: SamplingParams::greedy(),
                            ..Request::default()
                        })
                        .unwrap();
                }
                let done = engine.run(|_| {}).unwrap();
                assert_eq!(engine.cache().usage().sequences, 0, "{kind}");
                for (case, completion) in group.iter().zip(&done) {
                    let at = format!("{}, {kind}, together {together}", case.name);
                    let ours: Vec<(Vec<TokenId>, bool)> = completion
                        .beams
                        .iter()
                        .map(|h| (h.tokens.clone(), h.finish_reason == FinishReason::Eos))
                        .collect();
                    let theirs: Vec<(Vec<TokenId>, bool)> = case
                        .expected
                        .iter()
                        .map(|(t, eos, _)| (t.clone(), *eos))
                        .collect();
                    assert_eq!(ours, theirs, "{at}");
                    for (h, (_, _, score)) in completion.beams.iter().zip(&case.expected) {
                        assert!(
                            (h.score - score).abs() < 1e-4,
                            "{at}: {} vs {score}",
                            h.score
                        );
                    }
                    assert_eq!(completion.tokens, completion.beams[0].tokens, "{at}");
                }
                if together {
                    assert_eq!(done.last().unwrap().tokens, greedy, "{kind}");
                }
            }
        }
    }
}

/// The tiny GPT-2 and Llama fixtures, on every cache kind.
fn beam_search_on_tiny_fixtures<B: InferenceBackend>(kinds: &[CacheKind]) {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let loaded = load::<B>(&fixture(name), Dtype::F32);
        beam_search_matches_transformers(&loaded.model, name, kinds);
    }
}

/// SmolLM2 on the exact path (what transformers computes), on the engine's default cache (the
/// tiny fixtures run every cache kind).
fn beam_search_on_smollm2<B: InferenceBackend>() {
    let loaded = load::<B>(&smollm2(), Dtype::F32);
    beam_search_matches_transformers(&loaded.model, "smollm2", &[CacheKind::Paged]);
}

/// [`alone`] with a grammar: the matcher first in the sampler's chain, and the sequence ends
/// on an end token (which is not output), as the engine's does.
fn alone_constrained<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    prompt: &[TokenId],
    n: usize,
    sampling: &SamplingParams,
    grammar: &Grammar,
    eos: &[TokenId],
) -> Vec<TokenId> {
    let matcher = grammar.start(eos);
    let mut sampler = Sampler::new(sampling, model.shape().vocab).unwrap();
    sampler.prepend_processor(Box::new(matcher.clone()));
    alone_with(model, prompt, n, sampler, |t| matcher.is_end(t))
}

/// Structured output: each constrained request (greedy, and sampled with a seed) gives the
/// tokens of the hand-written loop with the same grammar, served in one batch with an
/// unconstrained request on every cache kind in `kinds`, with and without prompt-lookup
/// speculation. Returns the outputs' texts per constraint (greedy, then sampled).
fn structured_output_matches_alone<B: InferenceBackend>(
    loaded: &LoadedModel<B>,
    prompt: &str,
    constraints: &[OutputConstraint],
    kinds: &[CacheKind],
    n: usize,
) -> Vec<[String; 2]> {
    let model = &loaded.model;
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let eos = loaded.generation.eos.clone();
    let vocab = model.shape().vocab;
    let compiler = GrammarCompiler::new(&tokenizer.token_texts(vocab), eos[0]).unwrap();
    let prompt = tokenizer.encode(prompt, true).unwrap();
    let settings = [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..SamplingParams::default()
        },
    ];
    let mut texts = Vec::new();
    for constraint in constraints {
        let grammar = compiler.compile(constraint).unwrap();
        let expected: Vec<Vec<TokenId>> = settings
            .iter()
            .map(|s| alone_constrained(model, &prompt, n, s, &grammar, &eos))
            .collect();
        for &kind in kinds {
            for speculation in [None, Some(steady_prompt_lookup())] {
                let spec = any_kind(kind, 3, prompt.len() + n + 8);
                let mut engine = Engine::new(
                    model,
                    spec.build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
                        .unwrap(),
                    EngineConfig {
                        speculation,
                        ..one_batch(3)
                    },
                )
                .unwrap();
                for sampling in &settings {
                    engine
                        .submit(Request {
                            prompt: prompt.clone(),
                            max_tokens: n,
                            sampling: sampling.clone(),
                            eos: eos.clone(),
                            constraint: Some(grammar.clone()),
                            ..Default::default()
                        })
                        .unwrap();
                }
                engine
                    .submit(Request {
                        prompt: prompt.clone(),
                        max_tokens: 8,
                        sampling: SamplingParams::greedy(),
                        ..Default::default()
                    })
                    .unwrap();
                let done = engine.run(|_| {}).unwrap();
                assert_eq!(engine.cache().usage().sequences, 0);
                for (i, (c, expected)) in done.iter().zip(&expected).enumerate() {
                    // Verification draws its random numbers differently from plain sampling:
                    // a sampled request keeps its distribution, not its tokens.
                    let matcher = grammar.start(&eos);
                    for (k, &t) in c.tokens.iter().enumerate() {
                        assert!(matcher.allows(&c.tokens[..k], t), "{:?}", c.tokens);
                    }
                    if i > 0 && speculation.is_some() {
                        continue;
                    }
                    assert_eq!(
                        &c.tokens,
                        expected,
                        "{} on the {kind} cache, {:?}, speculation {speculation:?}",
                        constraint.kind(),
                        settings[i]
                    );
                    let reason = if c.tokens.len() < n {
                        FinishReason::Eos
                    } else {
                        c.finish_reason
                    };
                    assert_eq!(c.finish_reason, reason);
                }
                assert_eq!(done[2].tokens, alone(model, &prompt, 8, &settings[0]));
            }
        }
        let text = |t: &[TokenId]| tokenizer.decode(t, true).unwrap();
        texts.push([text(&expected[0]), text(&expected[1])]);
    }
    texts
}

/// SmolLM2 asked for a person as JSON: a schema, any JSON object, a regex and a Lark
/// grammar, each on the engine's default cache (paged); the outputs parse as asked. The schema
/// runs on every other cache kind too: each kind's engine gives the hand-written loop's tokens.
fn structured_output_on_smollm2<B: InferenceBackend>(weights: WeightStorage) {
    let loaded = load_with::<B>(&smollm2(), Dtype::F32, weights);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    });
    let constraints = [
        OutputConstraint::JsonSchema(schema),
        OutputConstraint::JsonObject,
        OutputConstraint::Regex("[A-Z][a-z]+, [0-9]{1,3} years".into()),
        OutputConstraint::Lark(
            "start: \"name=\" NAME \"; age=\" AGE\nNAME: /[A-Za-z]{1,12}/\nAGE: /[0-9]{1,3}/"
                .into(),
        ),
    ];
    let prompt = "<|im_start|>user\nDescribe a person (name, age, city) as JSON.<|im_end|>\n\
                  <|im_start|>assistant\n";
    let texts =
        structured_output_matches_alone(&loaded, prompt, &constraints, &[CacheKind::Paged], 48);
    let others: Vec<CacheKind> = CacheKind::ALL
        .into_iter()
        .filter(|&k| k != CacheKind::Paged)
        .collect();
    structured_output_matches_alone(&loaded, prompt, &constraints[..1], &others, 48);
    for text in texts[0].iter().chain(&texts[1]) {
        let value: serde_json::Value = serde_json::from_str(text).unwrap();
        assert!(value.is_object(), "{text}");
    }
    let person: serde_json::Value = serde_json::from_str(&texts[0][0]).unwrap();
    assert!(["Paris", "Berlin", "Tokyo"].contains(&person["city"].as_str().unwrap()));
    assert!(person["age"].as_u64().unwrap() <= 120);
    for text in &texts[2] {
        let (name, age) = text.split_once(", ").unwrap();
        assert!(name.chars().next().unwrap().is_ascii_uppercase(), "{text}");
        assert!(age.ends_with(" years"), "{text}");
    }
    for text in &texts[3] {
        assert!(
            text.starts_with("name=") && text.contains("; age="),
            "{text}"
        );
    }
}

/// The decoding features hold for every family without code of its own: on each family
/// fixture (Mistral's windows, Qwen2's biases, Qwen3's and Gemma 3's head norms, Gemma 2's soft
/// caps, Phi-3's fused projections and LongRoPE, GPT-BigCode's one key/value head, Llama 2's
/// SentencePiece vocabulary), on the engine's default cache kind, beam search gives
/// transformers' hypotheses (`make_beam_fixtures.py`), speculative decoding (prompt lookup, and
/// the model drafting for itself) gives the plain greedy tokens, and structured output (a regex
/// and any JSON object, greedy and sampled, with and without speculation) gives the
/// hand-written constrained loop's tokens (on the fixtures with a tokenizer: all but
/// mistral-tiny).
fn every_family_decodes_alike<B: InferenceBackend>() {
    for name in FAMILY_FIXTURES.into_iter().chain(["llama2-tiny"]) {
        let loaded = load::<B>(&fixture(name), Dtype::F32);
        let model = &loaded.model;
        beam_search_matches_transformers(model, name, &[CacheKind::Paged]);

        // Each prompt is `q`, the model's own continuation of `q`, and `q` again: the model
        // tends to go on as it did, and prompt lookup finds that continuation to draft.
        let greedy = SamplingParams::greedy();
        let prompts: Vec<Vec<TokenId>> = prompts(&[9, 5, 14], model.shape().vocab)
            .into_iter()
            .map(|q| {
                let went_on = alone(model, &q, 6, &greedy);
                q.iter().chain(&went_on).chain(&q).copied().collect()
            })
            .collect();
        let [lookup, drafted] =
            speculative_greedy_matches_alone(model, model, &[CacheKind::Paged], &prompts, 12);
        // (Prompt lookup drafts only where the model repeats itself: llama2-tiny does not on
        // these prompts; llama-tiny's test covers its architecture.)
        assert!(
            lookup.drafted > 0 || name == "llama2-tiny",
            "{name}: {lookup:?}"
        );
        assert!(drafted.acceptance_rate() > 0.9, "{name}: {drafted:?}");

        if loaded.tokenizer.is_none() {
            continue; // mistral-tiny has no vocabulary to compile a grammar over
        }
        let constraints = [
            OutputConstraint::Regex("[a-z]{1,8}( [a-z]{1,8}){0,4}".into()),
            OutputConstraint::JsonObject,
        ];
        structured_output_matches_alone(
            &loaded,
            "The quick brown fox",
            &constraints,
            &[CacheKind::Paged],
            12,
        );
    }
}

mod cpu {
    type B = burn::backend::Flex;

    #[test]
    fn logit_bias_matches_alone() {
        super::logit_bias_matches_alone::<B>();
    }

    #[test]
    fn every_family_decodes_alike() {
        super::every_family_decodes_alike::<B>();
    }

    #[test]
    fn beam_search_on_tiny_fixtures() {
        super::beam_search_on_tiny_fixtures::<B>(&super::CacheKind::ALL);
    }

    #[test]
    fn beam_search_on_smollm2() {
        super::beam_search_on_smollm2::<B>();
    }

    #[test]
    fn packed_prefill_matches_alone() {
        super::packed_prefill_matches_alone::<B>(&super::tiny_fixtures(), 1e-4);
    }

    #[test]
    fn mixed_batch_matches_alone() {
        // The default cache only: the quantized copy runs every kind.
        let paged = [super::CacheKind::Paged];
        let path = super::smollm2();
        super::mixed_batch_matches_alone::<B>(&path, super::WeightStorage::Dequantized, &paged);
    }

    #[test]
    fn speculative_greedy_on_smollm2() {
        super::speculative_greedy_on_smollm2::<B>(super::WeightStorage::Dequantized);
    }

    #[test]
    fn speculative_greedy_on_llama_tiny() {
        super::speculative_greedy_on_llama_tiny::<B>(&super::CacheKind::ALL);
    }

    #[test]
    fn generate_runs_one_request_on_a_lent_cache() {
        super::generate_runs_one_request_on_a_lent_cache::<B>();
    }

    #[test]
    fn session_reuses_its_cache_exactly() {
        // The default cache only: the quantized copy runs every kind (the cache does not
        // depend on how the weights are stored).
        let paged = [super::CacheKind::Paged];
        super::session_reuses_its_cache_exactly::<B>(super::WeightStorage::Dequantized, &paged);
    }

    #[test]
    fn prefix_cache_matches_alone() {
        super::prefix_cache_matches_alone::<B>(
            &super::smollm2(),
            super::WeightStorage::Dequantized,
            super::KvDtype::F32,
        );
    }

    #[test]
    fn families_hold_on_every_cache_kind() {
        super::families_hold_on_every_cache_kind::<B>();
    }

    #[test]
    fn windowed_models_outgrow_their_pool() {
        super::windowed_models_outgrow_their_pool::<B>();
    }

    #[test]
    fn snapshots_resume_exactly() {
        super::snapshots_resume_exactly::<B>();
    }

    #[test]
    fn sliding_window_attends_over_the_last_w_tokens() {
        super::sliding_window_attends_over_the_last_w_tokens::<B>();
    }

    #[test]
    fn bench_cell_generates_what_generate_does() {
        super::bench_cell_generates_what_generate_does::<B>();
    }
}

/// SmolLM2's weights kept quantized (kiln's CPU kernels). Activations are quantized per row,
/// so a last-bit difference between a batched and a single forward would become a whole
/// quantization step and could flip a token; kiln's CPU attention sums over each query's
/// visible keys only, which makes a sequence's logits the same bits in any batch, and these
/// tests hold it to that.
mod cpu_quantized {
    use super::WeightStorage;
    type B = burn::backend::Flex;

    #[test]
    fn packed_prefill_matches_alone() {
        let models = [(super::smollm2(), WeightStorage::Quantized)];
        super::packed_prefill_matches_alone::<B>(&models, 0.0);
    }

    #[test]
    fn mixed_batch_matches_alone() {
        let all = super::CacheKind::ALL;
        let path = super::smollm2();
        super::mixed_batch_matches_alone::<B>(&path, WeightStorage::Quantized, &all);
    }

    #[test]
    fn session_reuses_its_cache_exactly() {
        super::session_reuses_its_cache_exactly::<B>(
            WeightStorage::Quantized,
            &super::CacheKind::ALL,
        );
    }

    #[test]
    fn prefix_cache_matches_alone() {
        // The KV precision `kiln` picks for quantized weights on the cpu backend.
        super::prefix_cache_matches_alone::<B>(
            &super::smollm2(),
            WeightStorage::Quantized,
            super::KvDtype::F16,
        );
    }

    /// The same with a q8_0 cache: a prefix read from the cache's blocks equals one computed in
    /// the step (attention rounds fresh K/V through the same blocks).
    #[test]
    fn prefix_cache_matches_alone_with_a_q8_0_cache() {
        super::prefix_cache_matches_alone::<B>(
            &super::smollm2(),
            WeightStorage::Quantized,
            super::KvDtype::Q8_0,
        );
    }

    #[test]
    fn speculative_greedy_on_smollm2() {
        super::speculative_greedy_on_smollm2::<B>(WeightStorage::Quantized);
    }

    #[test]
    fn structured_output_on_smollm2() {
        super::structured_output_on_smollm2::<B>(WeightStorage::Quantized);
    }
}

mod wgpu {
    type B = burn::backend::Wgpu;

    /// Greedy rows with a bias are never the device's plain argmax.
    #[test]
    fn logit_bias_matches_alone() {
        super::logit_bias_matches_alone::<B>();
    }

    /// Forks on the paged cache (shared blocks, copy on write) and the static rows; the cpu
    /// tests run every kind and SmolLM2.
    #[test]
    fn beam_search_on_tiny_fixtures() {
        use super::CacheKind::{Paged, Static};
        super::beam_search_on_tiny_fixtures::<B>(&[Paged, Static]);
    }

    #[test]
    fn packed_prefill_matches_alone() {
        super::packed_prefill_matches_alone::<B>(&super::tiny_fixtures(), 1e-4);
    }

    /// The tiny Llama on every cache kind: SmolLM2 through the engine on lavapipe took five
    /// minutes for two kinds (the cpu tests run it on every kind; `smollm2::greedy…` holds
    /// SmolLM2 on wgpu to transformers).
    #[test]
    fn mixed_batch_matches_alone() {
        let path = super::fixture("llama-tiny");
        let all = super::CacheKind::ALL;
        super::mixed_batch_matches_alone::<B>(&path, super::WeightStorage::Dequantized, &all);
    }

    #[test]
    fn sliding_window_attends_over_the_last_w_tokens() {
        super::sliding_window_attends_over_the_last_w_tokens::<B>();
    }

    #[test]
    fn bench_cell_generates_what_generate_does() {
        super::bench_cell_generates_what_generate_does::<B>();
    }

    /// The tiny Llama fixture: lavapipe runs SmolLM2 too slowly for a second scenario.
    #[test]
    fn prefix_cache_matches_alone() {
        let path = super::fixture("llama-tiny");
        super::prefix_cache_matches_alone::<B>(
            &path,
            super::WeightStorage::Dequantized,
            super::KvDtype::F32,
        );
    }

    #[test]
    fn families_hold_on_every_cache_kind() {
        super::families_hold_on_every_cache_kind::<B>();
    }

    #[test]
    fn speculative_greedy_on_llama_tiny() {
        // Drafting is not backend-specific: the cpu tests run every cache kind.
        super::speculative_greedy_on_llama_tiny::<B>(&[super::CacheKind::Paged]);
    }

    /// A regex on the tiny Llama, paged cache (the cpu tests run SmolLM2 on every kind).
    #[test]
    fn structured_output_on_llama_tiny() {
        let loaded = super::load::<B>(&super::fixture("llama-tiny"), super::Dtype::F32);
        let rx = super::OutputConstraint::Regex("[a-z]{2,6}( [a-z]{2,6}){1,3}".into());
        let kinds = [super::CacheKind::Paged];
        let texts = super::structured_output_matches_alone(&loaded, "hello", &[rx], &kinds, 24);
        for text in &texts[0] {
            assert!(
                text.split(' ').all(|w| (2..=6).contains(&w.len())),
                "{text:?}"
            );
        }
    }
}
