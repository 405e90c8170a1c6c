//! OpenAI's `logit_bias` in the sampling chain: the bias alone and the whole chain against
//! transformers' `SequenceBiasLogitsProcessor` (one-token sequences) followed by its other
//! processors, on fixed logit vectors, and the settings' validation. Expected values:
//! `scripts/reference/sampling_reference.py` (`logit_bias_cases` in the fixture; its header
//! names the versions that produced them).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::TokenId;
use kiln_core::sampling::{
    Candidates, LogitBias, LogitsProcessor, MAX_LOGIT_BIAS_TOKENS, Sampler, SamplingError,
    SamplingParams, TokenHistory,
};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn bias_and_chain_match_transformers_sequence_bias() {
    let fixture: Value =
        serde_json::from_str(include_str!("fixtures/sampling_hf.json")).expect("valid fixture");
    let cases = fixture["logit_bias_cases"]
        .as_array()
        .expect("logit_bias_cases");
    assert!(cases.len() >= 40);
    let mut greedy_moved = 0;
    for case in cases {
        let logits: Vec<f32> = floats(&case["logits"]).iter().map(|&x| x as f32).collect();
        let bias: Vec<(TokenId, f32)> = case["logit_bias"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| {
                (
                    TokenId(pair[0].as_u64().unwrap() as u32),
                    pair[1].as_f64().unwrap() as f32,
                )
            })
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
            logit_bias: bias.clone(),
            ..SamplingParams::default()
        };
        let prompt: Vec<TokenId> = ids(&case["prompt"]).into_iter().map(TokenId).collect();
        let history = TokenHistory::with_prompt(&prompt);
        let label = format!("{} {} {}", case["logits_name"], case["logit_bias"], p);

        // The processor alone: every logit, biased or not, as transformers leaves it.
        let mut alone = Candidates::from_logits(&logits);
        LogitBias(bias.clone()).process(&mut alone, &history);
        for (i, (ours, theirs)) in alone
            .logits()
            .iter()
            .zip(floats(&case["biased"]))
            .enumerate()
        {
            assert!(
                (f64::from(*ours) - theirs).abs() < 1e-5,
                "{label}: biased logit {i} is {ours}, transformers {theirs}"
            );
        }

        // The whole chain: the same survivors, logits and probabilities.
        let sampler = Sampler::new(&params, logits.len()).unwrap();
        assert_eq!(
            sampler.chain()[0],
            "logit_bias",
            "{label}: the bias comes first"
        );
        let candidates = sampler.candidates(&logits, &history).unwrap();
        let mut ours: Vec<(u32, f32, f32)> = candidates
            .ids()
            .iter()
            .zip(candidates.logits())
            .zip(candidates.probabilities())
            .map(|((t, &l), p)| (t.0, l, p))
            .collect();
        ours.sort_by_key(|&(id, _, _)| id);
        assert_eq!(
            ours.iter().map(|&(id, _, _)| id).collect::<Vec<_>>(),
            ids(&case["kept"]),
            "{label}: kept tokens differ"
        );
        let theirs = floats(&case["kept_logits"])
            .into_iter()
            .zip(floats(&case["probs"]));
        for (&(id, logit, prob), (their_logit, their_prob)) in ours.iter().zip(theirs) {
            assert!(
                (f64::from(logit) - their_logit).abs() < 1e-4,
                "{label}: token {id}'s logit {logit} vs {their_logit}"
            );
            assert!(
                (f64::from(prob) - their_prob).abs() < 2e-6,
                "{label}: token {id}'s probability {prob} vs {their_prob}"
            );
        }

        // Greedy: the argmax of the biased (and penalised) logits, never the device's plain
        // argmax of the raw ones.
        let greedy = SamplingParams {
            temperature: 0.0,
            ..params.clone()
        };
        let mut greedy = Sampler::new(&greedy, logits.len()).unwrap();
        assert!(
            !greedy.is_plain_greedy(),
            "{label}: a bias is not plain greedy"
        );
        let pick = greedy.sample(&logits, &history).0;
        assert_eq!(
            u64::from(pick),
            case["greedy"].as_u64().unwrap(),
            "{label}: greedy token differs"
        );
        greedy_moved += usize::from(pick as usize != kiln_core::sampling::first_max_index(&logits));
    }
    // The cases are built so that many move the greedy pick away from the raw argmax.
    assert!(
        greedy_moved >= 20,
        "only {greedy_moved} cases moved the argmax"
    );
}

#[test]
fn plus_100_forces_and_minus_100_bans() {
    // A logit spread wider than a language model's usual one.
    let logits = [12.0f32, -8.0, 3.0, 15.0, 0.0];
    let greedy = |bias: Vec<(TokenId, f32)>| {
        let params = SamplingParams {
            logit_bias: bias,
            ..SamplingParams::greedy()
        };
        Sampler::new(&params, logits.len())
            .unwrap()
            .sample(&logits, &TokenHistory::default())
            .0
    };
    assert_eq!(greedy(Vec::new()), 3);
    assert_eq!(greedy(vec![(TokenId(1), 100.0)]), 1);
    assert_eq!(greedy(vec![(TokenId(3), -100.0)]), 0);
    // Sampling at temperature 1: the two best tokens banned, neither is ever drawn (each keeps
    // e^-85 of the mass); a forced token always is.
    for seed in 0..200 {
        let mut sampler = Sampler::new(
            &SamplingParams {
                seed: Some(seed),
                logit_bias: vec![(TokenId(3), -100.0), (TokenId(0), -100.0)],
                ..SamplingParams::default()
            },
            logits.len(),
        )
        .unwrap();
        let drawn = sampler.sample(&logits, &TokenHistory::default()).0;
        assert!(
            ![0, 3].contains(&drawn),
            "seed {seed} drew banned token {drawn}"
        );
        let mut forced = Sampler::new(
            &SamplingParams {
                seed: Some(seed),
                logit_bias: vec![(TokenId(4), 100.0)],
                ..SamplingParams::default()
            },
            logits.len(),
        )
        .unwrap();
        assert_eq!(forced.sample(&logits, &TokenHistory::default()).0, 4);
    }
}

#[test]
fn bad_biases_name_the_field() {
    let with = |bias: Vec<(TokenId, f32)>| SamplingParams {
        logit_bias: bias,
        ..SamplingParams::default()
    };
    for bad in [101.0, -100.5, f32::NAN, f32::INFINITY] {
        match with(vec![(TokenId(1), 0.0), (TokenId(7), bad)]).validate() {
            Err(SamplingError::Invalid { field, value, .. }) => {
                assert_eq!(field, "logit_bias");
                assert!(value.contains('7'), "{value} names the token");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
    assert!(
        with(vec![(TokenId(1), 100.0), (TokenId(2), -100.0)])
            .validate()
            .is_ok()
    );
    let twice = with(vec![(TokenId(5), 1.0), (TokenId(5), 2.0)]).validate();
    assert!(
        matches!(&twice, Err(SamplingError::Invalid { field: "logit_bias", value, .. }) if value.contains("twice")),
        "{twice:?}"
    );
    let many: Vec<(TokenId, f32)> = (0..=MAX_LOGIT_BIAS_TOKENS as u32)
        .map(|t| (TokenId(t), 1.0))
        .collect();
    assert!(matches!(
        with(many).validate(),
        Err(SamplingError::Invalid {
            field: "logit_bias",
            ..
        })
    ));
    // Past the vocabulary: the sampler (which knows it) refuses, naming the token.
    let past = with(vec![(TokenId(4), 1.0)]);
    let err = Sampler::new(&past, 4).unwrap_err();
    assert_eq!(
        err,
        SamplingError::TokenOutsideVocab {
            field: "logit_bias",
            token: TokenId(4),
            vocab: 4
        }
    );
    assert!(err.to_string().contains("token id 4"), "{err}");
    assert!(Sampler::new(&past, 5).is_ok());
}
