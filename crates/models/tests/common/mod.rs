//! Shared by the golden tests: fixture paths, the reference files, a greedy loop.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use burn::tensor::Tensor;
use kiln_core::kv_cache::DynamicKvCache;
use kiln_core::{Batch, CausalLm, Dtype, InferenceBackend, LogitsFor, Position, SeqId, TokenId};
use serde_json::Value;

pub const FIXTURES: [&str; 15] = [
    "gpt2-tiny",
    "gpt2-tiny-legacy",
    "gpt2-tiny-lenient",
    "llama-tiny",
    "llama-tiny-meta",
    "llama-tiny-tied",
    "mistral-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "gemma2-tiny",
    "gemma3-tiny",
    "gpt-bigcode-tiny",
    "llama2-tiny",
    "phi3-tiny",
    "gemma3-mm-tiny",
];

/// A reference file's chat messages (`[{"role", "content"}]`) as kiln's.
pub fn chat_messages(messages: &Value) -> Vec<kiln_models::chat::ChatMessage> {
    use kiln_models::chat::{ChatMessage, Role};
    messages
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
        .collect()
}

/// The fixture `name`: under `$KILN_FIXTURES` when set (a test binary carried to another
/// machine, `cargo xtask gpu-check`), else in this crate's `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    match std::env::var_os("KILN_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    }
}

/// Whether the CUDA tests run here: where a CUDA device is usable, or always (failing without
/// one) when `KILN_REQUIRE_CUDA=1` (`cargo xtask test --backend cuda`, the GPU check). Without
/// a device they are skipped, with the reason printed.
#[cfg(feature = "cuda")]
pub fn cuda_here(test: &str) -> bool {
    let required = std::env::var("KILN_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    match kiln_core::BackendKind::Cuda.require() {
        Ok(_) => true,
        Err(err) if required => panic!("{test}: KILN_REQUIRE_CUDA=1 but {err}"),
        Err(err) => {
            eprintln!("skipped {test}: {err}");
            false
        }
    }
}

pub struct Case {
    pub prompt: Vec<TokenId>,
    pub greedy: Vec<TokenId>,
    /// `[prompt_len, vocab]`, row-major.
    pub logits: Vec<f32>,
}

pub fn ids(value: &Value) -> Vec<TokenId> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| TokenId(v.as_u64().unwrap() as u32))
        .collect()
}

/// The fixture folder `name`'s `reference.json` and `logits.safetensors`.
pub fn reference(name: &str) -> (Value, Vec<Case>) {
    let dir = fixture(name);
    reference_at(&dir.join("reference.json"), &dir.join("logits.safetensors"))
}

/// A reference file and its logits (`prompt_0`, `prompt_1`, ... in case order).
pub fn reference_at(json: &std::path::Path, logits: &std::path::Path) -> (Value, Vec<Case>) {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let bytes = std::fs::read(logits).unwrap();
    let logits = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let cases = json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let view = logits.tensor(&format!("prompt_{i}")).unwrap();
            Case {
                prompt: ids(&c["prompt_ids"]),
                greedy: ids(&c["greedy"]),
                logits: view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            }
        })
        .collect();
    (json, cases)
}

pub fn host(t: Tensor<impl burn::tensor::backend::Backend, 2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    TokenId(best as u32)
}

/// Next-token agreement of `q` with `p` (both `[positions, vocab]` logits, `p` the exact
/// path): the summed KL divergence `KL(p || q)`, the positions whose top tokens agree, and the
/// positions.
pub fn divergence(p: &[f32], q: &[f32], vocab: usize) -> (f64, usize, usize) {
    let (mut kl, mut agree, mut positions) = (0.0f64, 0usize, 0usize);
    for (p, q) in p.chunks(vocab).zip(q.chunks(vocab)) {
        let log_softmax = |x: &[f32]| -> Vec<f64> {
            let max = x.iter().copied().fold(f32::MIN, f32::max) as f64;
            let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
            x.iter().map(|&v| v as f64 - max - sum.ln()).collect()
        };
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        kl += lp
            .iter()
            .zip(&lq)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        let top = |x: &[f32]| kiln_core::sampling::first_max_index(x);
        agree += usize::from(top(p) == top(q));
        positions += 1;
    }
    (kl, agree, positions)
}

/// Logits of every prompt position, from a fresh cache.
pub fn all_logits<B: InferenceBackend>(model: &impl CausalLm<B>, prompt: &[TokenId]) -> Vec<f32> {
    let shape = model.shape();
    let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), model.dtype(), &model.device());
    let batch = Batch::single(SeqId(0), prompt, Position(0)).unwrap();
    host(model.forward(&batch, &mut cache, LogitsFor::All).unwrap())
}

/// Greedy continuation with the KV cache: prefill once, then one token per step.
pub fn greedy_cached<B: InferenceBackend>(
    model: &impl CausalLm<B>,
    prompt: &[TokenId],
    n: usize,
) -> Vec<TokenId> {
    let shape = model.shape();
    let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), model.dtype(), &model.device());
    let mut out = Vec::new();
    let mut batch = Batch::single(SeqId(0), prompt, Position(0)).unwrap();
    for pos in (prompt.len() as u32..).take(n) {
        let logits = host(
            model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .unwrap(),
        );
        let next = argmax(&logits);
        out.push(next);
        batch = Batch::single(SeqId(0), &[next], Position(pos)).unwrap();
    }
    out
}

/// The greedy tokens a plain full forward gives, without a cache carried between steps: one
/// forward over `prompt` and `continuation` (minus its last token); position `prompt.len() - 1 +
/// k` gives token `k`. A causal model's logits at a position depend only on the tokens up to
/// it, so this equals recomputing the sequence at every step wherever the continuation is its
/// own greedy one, and differs from it first where the continuation does.
pub fn greedy_by_full_forward<B: InferenceBackend>(
    model: &impl CausalLm<B>,
    prompt: &[TokenId],
    continuation: &[TokenId],
) -> Vec<TokenId> {
    let Some((_, fed)) = continuation.split_last() else {
        return Vec::new();
    };
    let sequence: Vec<TokenId> = prompt.iter().chain(fed).copied().collect();
    let vocab = model.shape().vocab;
    all_logits(model, &sequence)
        .chunks_exact(vocab)
        .skip(prompt.len() - 1)
        .map(argmax)
        .collect()
}

pub fn load<B: InferenceBackend>(name: &str, dtype: Dtype) -> kiln_models::LoadedModel<B> {
    let options = kiln_models::LoadOptions {
        dtype,
        ..Default::default()
    };
    kiln_models::load::<B>(&fixture(name), &options, &B::inference_device()).unwrap()
}

/// Greedy continuations of several prompts at once: one packed prefill of every prompt, then
/// one batched forward per step, as the engine runs them (the dynamic cache grows per sequence).
pub fn greedy_batched<B: InferenceBackend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<TokenId>],
    n: usize,
) -> Vec<Vec<TokenId>> {
    let shape = model.shape();
    let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), model.dtype(), &model.device());
    let mut out: Vec<Vec<TokenId>> = vec![Vec::new(); prompts.len()];
    let mut batch = Batch::new();
    for (i, prompt) in prompts.iter().enumerate() {
        batch.push(SeqId(i as u64), prompt, Position(0)).unwrap();
    }
    for step in 0..n {
        let logits = host(
            model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .unwrap(),
        );
        batch = Batch::new();
        for (i, row) in logits.chunks_exact(shape.vocab).enumerate() {
            let next = argmax(row);
            out[i].push(next);
            let position = Position((prompts[i].len() + step) as u32);
            batch.push(SeqId(i as u64), &[next], position).unwrap();
        }
    }
    out
}
