//! Embeddings on real weights equal transformers' (`AutoModel(...).last_hidden_state`, pooled by
//! the last token or the mean, L2-normalised; `scripts/reference/make_embedding_fixtures.py`)
//! within 1e-4 in f32: each input alone, and all of them packed into one forward.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::path::PathBuf;

use kiln_core::{CausalLm, Dtype, InferenceBackend, TokenId};
use kiln_engine::embed::{Pooling, embed};
use kiln_models::LoadOptions;

type B = burn::backend::Flex;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(name)
}

/// Each case's input and its reference vectors (last-token and mean pooling).
struct Case {
    input: Vec<TokenId>,
    last: Vec<f32>,
    mean: Vec<f32>,
}

fn cases(name: &str) -> (usize, Vec<Case>) {
    let path = fixture(name).join("embedding_reference.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let cases = json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            input: c["input"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| TokenId(t.as_u64().unwrap() as u32))
                .collect(),
            last: floats(&c["last"]),
            mean: floats(&c["mean"]),
        })
        .collect();
    (json["d_model"].as_u64().unwrap() as usize, cases)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_family(name: &str) {
    let options = LoadOptions {
        dtype: Dtype::F32,
        ..Default::default()
    };
    let loaded = kiln_models::load::<B>(&fixture(name), &options, &B::inference_device()).unwrap();
    let model: &dyn CausalLm<B> = &loaded.model;
    let (d_model, cases) = cases(name);
    assert_eq!(model.hidden_size(), Some(d_model));
    let inputs: Vec<Vec<TokenId>> = cases.iter().map(|c| c.input.clone()).collect();
    for pooling in [Pooling::Last, Pooling::Mean] {
        let want = |c: &Case| match pooling {
            Pooling::Last => c.last.clone(),
            Pooling::Mean => c.mean.clone(),
        };
        // Every input in one packed forward (the job fits one step).
        let packed = embed(model, inputs.clone(), pooling).unwrap();
        assert_eq!(packed.len(), cases.len());
        for (i, (got, case)) in packed.iter().zip(&cases).enumerate() {
            let diff = max_abs_diff(got, &want(case));
            assert!(
                diff < 1e-4,
                "{name} {pooling:?} input {i} packed: max |diff| {diff}"
            );
        }
        // Each alone gives the same.
        for (i, case) in cases.iter().enumerate() {
            let alone = embed(model, vec![case.input.clone()], pooling).unwrap();
            let diff = max_abs_diff(&alone[0], &want(case));
            assert!(
                diff < 1e-4,
                "{name} {pooling:?} input {i} alone: max |diff| {diff}"
            );
        }
    }
}

#[test]
fn qwen3_embeddings_equal_transformers() {
    check_family("qwen3-tiny");
}

#[test]
fn llama_embeddings_equal_transformers() {
    check_family("llama-tiny");
}

#[test]
fn an_input_past_the_context_or_vocabulary_is_refused() {
    let loaded = kiln_models::load::<B>(
        &fixture("qwen3-tiny"),
        &LoadOptions::default(),
        &B::inference_device(),
    )
    .unwrap();
    let model: &dyn CausalLm<B> = &loaded.model;
    let context = model.shape().max_positions;
    let long = vec![TokenId(1); context + 1];
    assert!(embed(model, vec![long], Pooling::Last).is_err());
    let vocab = model.shape().vocab as u32;
    assert!(embed(model, vec![vec![TokenId(vocab)]], Pooling::Mean).is_err());
}
