//! Each processor against distributions computed by hand; the whole chain against
//! transformers lives in `tests/sampling_hf.rs`.

use super::*;

fn ids(c: &Candidates) -> Vec<u32> {
    c.ids().iter().map(|t| t.0).collect()
}

fn run(processor: &dyn LogitsProcessor, logits: &[f32], history: &TokenHistory) -> Candidates {
    let mut c = Candidates::from_logits(logits);
    processor.process(&mut c, history);
    c
}

fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
    }
}

#[test]
fn temperature_divides_logits() {
    let c = run(
        &Temperature(0.5),
        &[1.0, -2.0, 0.0],
        &TokenHistory::default(),
    );
    assert_close(c.logits(), &[2.0, -4.0, 0.0]);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let history = TokenHistory::with_prompt(&[TokenId(0), TokenId(1), TokenId(1)]);
    let c = run(&RepetitionPenalty(2.0), &[3.0, -1.0, 5.0], &history);
    // Token 1 appears twice in the prompt but is penalised once.
    assert_close(c.logits(), &[1.5, -2.0, 5.0]);
}

#[test]
fn presence_and_frequency_count_generated_tokens_only() {
    let mut history = TokenHistory::with_prompt(&[TokenId(2)]);
    history.push(TokenId(0));
    history.push(TokenId(0));
    history.push(TokenId(1));
    let p = PresenceFrequencyPenalty {
        presence: 0.5,
        frequency: 0.25,
    };
    let c = run(&p, &[1.0, 1.0, 1.0], &history);
    // token 0: 1 - 0.5 - 2*0.25; token 1: 1 - 0.5 - 0.25; token 2 only in the prompt.
    assert_close(c.logits(), &[0.0, 0.25, 1.0]);
}

#[test]
fn top_k_keeps_the_k_best_and_ties_with_the_kth() {
    let c = run(&TopK(2), &[0.1, 0.9, 0.5, 0.7], &TokenHistory::default());
    assert_eq!(ids(&c), vec![1, 3]);
    let tied = run(&TopK(2), &[1.0, 2.0, 1.0, 0.0], &TokenHistory::default());
    assert_eq!(ids(&tied), vec![1, 0, 2]);
}

#[test]
fn top_p_keeps_the_token_that_crosses_p() {
    // Probabilities 0.5, 0.25, 0.125, 0.125 (logits are their logs).
    let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
    let c = run(&TopP(0.6), &logits, &TokenHistory::default());
    assert_eq!(ids(&c), vec![0, 1]);
    assert_close(&c.probabilities(), &[2.0 / 3.0, 1.0 / 3.0]);
    let c = run(&TopP(0.5), &logits, &TokenHistory::default());
    assert_eq!(ids(&c), vec![0]);
    let c = run(&TopP(0.3), &logits, &TokenHistory::default());
    assert_eq!(ids(&c), vec![0]);
}

#[test]
fn min_p_drops_tokens_below_a_fraction_of_the_best() {
    // Probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.3 keeps p >= 0.15.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
    let c = run(&MinP(0.3), &logits, &TokenHistory::default());
    assert_eq!(ids(&c), vec![0, 1, 2]);
    assert_close(&c.probabilities(), &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]);
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties_and_applies_penalties() {
    let mut s = Sampler::new(&SamplingParams::greedy(), 4).unwrap();
    assert_eq!(
        s.sample(&[1.0, 3.0, 3.0, 0.0], &TokenHistory::default()),
        TokenId(1)
    );
    let params = SamplingParams {
        repetition_penalty: 4.0,
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(&params, 4).unwrap();
    let history = TokenHistory::with_prompt(&[TokenId(1), TokenId(2)]);
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 0.0], &history), TokenId(0));
}

#[test]
fn chain_order_is_penalties_temperature_top_k_top_p_min_p() {
    let params = SamplingParams {
        temperature: 0.5,
        top_k: 3,
        top_p: 0.9,
        min_p: 0.1,
        repetition_penalty: 1.2,
        presence_penalty: 0.1,
        ..SamplingParams::default()
    };
    let s = Sampler::new(&params, 10).unwrap();
    assert_eq!(
        s.chain(),
        vec![
            "repetition_penalty",
            "presence_frequency_penalty",
            "temperature",
            "top_k",
            "top_p",
            "min_p"
        ]
    );
}

#[test]
fn same_seed_same_tokens_and_draws_follow_the_distribution() {
    let logits: Vec<f32> = vec![0.0, 1.0, 2.0, 0.5];
    let params = SamplingParams {
        seed: Some(42),
        ..SamplingParams::default()
    };
    let draw = |params: &SamplingParams| {
        let mut s = Sampler::new(params, 4).unwrap();
        (0..4000)
            .map(|_| s.sample(&logits, &TokenHistory::default()).0)
            .collect::<Vec<_>>()
    };
    let a = draw(&params);
    assert_eq!(a, draw(&params));
    let other = draw(&SamplingParams {
        seed: Some(43),
        ..params.clone()
    });
    assert_ne!(a, other);
    // Empirical frequencies within 3% of the softmax.
    let expected = Candidates::from_logits(&logits).probabilities();
    for (token, p) in expected.iter().enumerate() {
        let freq = a.iter().filter(|&&t| t as usize == token).count() as f32 / a.len() as f32;
        assert!((freq - p).abs() < 0.03, "token {token}: {freq} vs {p}");
    }
}

#[test]
fn top_k_larger_than_vocab_is_clamped() {
    let params = SamplingParams {
        top_k: 1000,
        seed: Some(1),
        ..SamplingParams::default()
    };
    let s = Sampler::new(&params, 4).unwrap();
    assert!(s.chain().is_empty());
}

#[test]
fn logits_of_the_wrong_width_are_an_error() {
    let mut s = Sampler::new(&SamplingParams::greedy(), 4).unwrap();
    let err = s
        .try_sample(&[0.0; 3], &TokenHistory::default())
        .unwrap_err();
    assert_eq!(err, SamplingError::VocabMismatch { got: 3, vocab: 4 });
}
