//! Every fixture's logits and greedy continuations against Hugging Face transformers
//! (`scripts/reference/make_model_fixtures.py`), on cpu and on wgpu.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use crate::common::*;
use kiln_core::{Dtype, InferenceBackend, TokenId};

/// f32 logits within 1e-4 of transformers, for every position of every prompt.
fn logits_match<B: InferenceBackend>() {
    for name in FIXTURES {
        let loaded = load::<B>(name, Dtype::F32);
        let (_, cases) = reference(name);
        for (i, case) in cases.iter().enumerate() {
            let ours = all_logits(&loaded.model, &case.prompt);
            let diff = max_abs_diff(&ours, &case.logits);
            assert!(diff <= 1e-4, "{name} prompt {i}: max |diff| {diff}");
        }
    }
}

/// Greedy 20-token continuations equal transformers' (with cache), token for token; the first
/// prompt's also equal a plain full forward's. With `batched`, the first prompt runs alone and
/// the others together (one packed prefill, one forward per step), which keeps the wgpu test's
/// launches affordable on a CPU-emulated GPU; on cpu every prompt runs alone.
fn greedy_matches<B: InferenceBackend>(batched: bool) {
    for name in FIXTURES {
        let loaded = load::<B>(name, Dtype::F32);
        let (_, cases) = reference(name);
        let n = cases[0].greedy.len();
        let cached = greedy_cached(&loaded.model, &cases[0].prompt, n);
        assert_eq!(cached, cases[0].greedy, "{name} prompt 0: cached greedy");
        let recomputed = greedy_by_full_forward(&loaded.model, &cases[0].prompt, &cached);
        assert_eq!(recomputed, cached, "{name} prompt 0: full forward vs cache");
        let rest = &cases[1..];
        let ours: Vec<Vec<TokenId>> = if batched {
            let prompts: Vec<Vec<TokenId>> = rest.iter().map(|c| c.prompt.clone()).collect();
            assert!(rest.iter().all(|c| c.greedy.len() == n), "{name}: lengths");
            greedy_batched(&loaded.model, &prompts, n)
        } else {
            rest.iter()
                .map(|c| greedy_cached(&loaded.model, &c.prompt, c.greedy.len()))
                .collect()
        };
        for (i, (ours, case)) in ours.iter().zip(rest).enumerate() {
            assert_eq!(ours, &case.greedy, "{name} prompt {}: cached greedy", i + 1);
        }
    }
}

/// `GPT2Config(vocab_size=512)` keeps GPT-2's BOS/EOS 50256 outside the vocabulary, as many
/// test checkpoints do; transformers loads and runs it (its tokens are checked with every other
/// fixture above), and so does kiln: the impossible ids are dropped, with one warning each, from
/// the generation settings, from `read_config` and from `inspect`.
#[test]
fn special_tokens_outside_the_vocabulary_are_dropped_with_a_warning() {
    let loaded = load::<burn::backend::Flex>("gpt2-tiny-lenient", Dtype::F32);
    assert_eq!(loaded.generation.bos, None);
    assert!(loaded.generation.eos.is_empty());
    assert!(!loaded.generation.add_bos);
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
    assert!(loaded.warnings[0].starts_with("bos_token_id 50256 is outside the vocabulary (512"));
    assert!(loaded.warnings[1].starts_with("eos_token_id 50256 is outside the vocabulary (512"));

    let path = fixture("gpt2-tiny-lenient");
    let info = kiln_models::inspect(&path, &Default::default()).unwrap();
    assert_eq!(info.warnings, loaded.warnings);
    assert_eq!((info.config.bos, info.config.eos.len()), (None, 0));
    let config = kiln_models::loaders::read_config(&path, &Default::default()).unwrap();
    assert_eq!((config.bos, config.eos.len()), (None, 0));

    // The fixtures whose special tokens exist keep them, without a warning.
    let plain = load::<burn::backend::Flex>("gpt2-tiny", Dtype::F32);
    assert!(plain.warnings.is_empty(), "{:?}", plain.warnings);
    assert_eq!(plain.generation.eos.len(), 1);
}

/// A copy of fixture `name` (weights, tokenizer, its `config.json` as `edit` leaves it).
fn with_config(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let source = fixture(name);
    let temp = tempfile::tempdir().unwrap();
    for file in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(source.join(file), temp.path().join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
            .unwrap();
    edit(&mut config);
    std::fs::write(temp.path().join("config.json"), config.to_string()).unwrap();
    temp
}

/// YaRN RoPE scaling (Qwen3's documented long-context setting, scaled to the fixture: factor
/// 4 over an original context of 32): `qwen3-tiny`'s weights with that `rope_parameters` give
/// transformers' last-position logits (within 1e-4) and greedy tokens.
#[test]
fn yarn_scaling_matches_transformers() {
    let source = fixture("qwen3-tiny");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("yarn_reference.json")).unwrap())
            .unwrap();
    let temp = with_config("qwen3-tiny", |config| {
        config["rope_parameters"] = reference["rope_parameters"].clone();
    });
    let dir = temp.path();
    let loaded =
        kiln_models::load::<burn::backend::Flex>(dir, &Default::default(), &Default::default())
            .unwrap();
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let logits = all_logits(&loaded.model, &prompt);
        let last = &logits[logits.len() - loaded.model.config().vocab..];
        let expected: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let diff = max_abs_diff(last, &expected);
        assert!(diff <= 1e-4, "case {i}: max |diff| {diff}");
        let greedy = ids(&case["greedy"]);
        assert_eq!(
            greedy_cached(&loaded.model, &prompt, greedy.len()),
            greedy,
            "case {i}"
        );
    }
}

/// LongRoPE on both sides of the original context: `phi3-tiny`'s weights with an original
/// context of 32 (of 128). With `--context 32` kiln takes the short factors, as transformers
/// does while a sequence fits in 32 positions; with the model's whole context it takes the
/// long ones, as transformers does for a prompt of 45 tokens. Each gives transformers'
/// last-position logits (within 1e-4) and greedy tokens; the long factors on the short
/// prompt do not. A context above the model's is refused.
#[test]
fn longrope_matches_transformers_on_both_sides_of_the_original_context() {
    let source = fixture("phi3-tiny");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(source.join("longrope_reference.json")).unwrap(),
    )
    .unwrap();
    let original = reference["original_max_position_embeddings"].clone();
    let temp = with_config("phi3-tiny", |config| {
        config["rope_parameters"]["original_max_position_embeddings"] = original.clone();
        config["original_max_position_embeddings"] = original.clone();
    });
    let dir = temp.path();
    let load = |context: Option<usize>| {
        let options = kiln_models::LoadOptions {
            context,
            ..Default::default()
        };
        kiln_models::load::<burn::backend::Flex>(dir, &options, &Default::default()).unwrap()
    };
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let context = case["context"].as_u64().map(|c| c as usize);
        let prompt = ids(&case["prompt_ids"]);
        let expected: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let last = |model: &kiln_models::Transformer<burn::backend::Flex>| {
            let logits = all_logits(model, &prompt);
            logits[logits.len() - model.config().vocab..].to_vec()
        };
        let loaded = load(context);
        let diff = max_abs_diff(&last(&loaded.model), &expected);
        assert!(diff <= 1e-4, "case {i}: max |diff| {diff}");
        let greedy = ids(&case["greedy"]);
        assert_eq!(
            greedy_cached(&loaded.model, &prompt, greedy.len()),
            greedy,
            "case {i}"
        );
        if context.is_some() {
            // The long factors give other logits: the test tells the two apart.
            let apart = max_abs_diff(&last(&load(None).model), &expected);
            assert!(
                apart > 1e-2,
                "case {i}: the long factors differ by {apart} only"
            );
        }
    }
    let err = kiln_models::load::<burn::backend::Flex>(
        dir,
        &kiln_models::LoadOptions {
            context: Some(129),
            ..Default::default()
        },
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("129") && err.contains("1 to 128"), "{err}");
}

mod cpu {
    type B = burn::backend::Flex;

    #[test]
    fn logits_match_transformers() {
        super::logits_match::<B>();
    }

    #[test]
    fn greedy_matches_transformers() {
        super::greedy_matches::<B>(false);
    }
}

mod wgpu {
    type B = burn::backend::Wgpu;

    #[test]
    fn logits_match_transformers() {
        super::logits_match::<B>();
    }

    #[test]
    fn greedy_matches_transformers() {
        super::greedy_matches::<B>(true);
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    type B = burn::backend::Cuda;

    #[test]
    fn logits_match_transformers() {
        if super::cuda_here("cuda::logits_match_transformers") {
            super::logits_match::<B>();
        }
    }

    #[test]
    fn greedy_matches_transformers() {
        if super::cuda_here("cuda::greedy_matches_transformers") {
            super::greedy_matches::<B>(true);
        }
    }
}
