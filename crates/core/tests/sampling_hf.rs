//! The whole sampling chain against Hugging Face transformers' processors, on fixed logit
//! vectors. Expected values: `scripts/reference/sampling_reference.py` (see the JSON's header
//! for the versions that produced them).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::TokenId;
use kiln_core::sampling::{Sampler, SamplingParams, TokenHistory};
use serde_json::Value;

#[test]
fn chain_matches_transformers_processors() {
    let text = include_str!("fixtures/sampling_hf.json");
    let fixture: Value = serde_json::from_str(text).expect("valid fixture");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 60);
    for case in cases {
        let logits: Vec<f32> = case["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let p = &case["params"];
        let get = |key: &str, default: f64| p.get(key).and_then(Value::as_f64).unwrap_or(default);
        let params = SamplingParams {
            temperature: get("temperature", 1.0) as f32,
            top_k: get("top_k", 0.0) as usize,
            top_p: get("top_p", 1.0) as f32,
            min_p: get("min_p", 0.0) as f32,
            repetition_penalty: get("repetition_penalty", 1.0) as f32,
            seed: Some(0),
            ..SamplingParams::default()
        };
        let prompt: Vec<TokenId> = case["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| TokenId(v.as_u64().unwrap() as u32))
            .collect();
        let history = TokenHistory::with_prompt(&prompt);
        let sampler = Sampler::new(&params, logits.len()).unwrap();
        let candidates = sampler.candidates(&logits, &history).unwrap();

        let mut ours: Vec<(u32, f32)> = candidates
            .ids()
            .iter()
            .map(|t| t.0)
            .zip(candidates.probabilities())
            .collect();
        ours.sort_by_key(|(id, _)| *id);
        let kept: Vec<u32> = case["kept"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let probs: Vec<f64> = case["probs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let label = format!("{} {}", case["logits_name"], p);
        assert_eq!(
            ours.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            kept,
            "kept tokens differ for {label}"
        );
        for ((_, ours), theirs) in ours.iter().zip(&probs) {
            assert!(
                (f64::from(*ours) - theirs).abs() < 2e-6,
                "{label}: probability {ours} vs {theirs}"
            );
        }

        let greedy = SamplingParams {
            temperature: 0.0,
            ..params.clone()
        };
        let mut greedy = Sampler::new(&greedy, logits.len()).unwrap();
        assert_eq!(
            u64::from(greedy.sample(&logits, &history).0),
            case["greedy_after_penalty"].as_u64().unwrap(),
            "greedy token differs for {label}"
        );
    }
}
