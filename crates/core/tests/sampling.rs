//! Each processor against distributions computed by hand; the whole chain against
//! transformers lives in `tests/sampling_hf.rs`.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::TokenId;
use kiln_core::sampling::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// The tokens `verify` yields (the draft when accepted, the replacement otherwise) over many
/// draws, as frequencies, and the share of drafts accepted. Each draft is drawn from `q`
/// (with its own RNG), or is `certain` when `q` is `None`.
fn verified_frequencies(
    sampler: &mut Sampler,
    logits: &[f32],
    certain: TokenId,
    q: Option<&[f32]>,
    draws: usize,
) -> (Vec<f64>, f64) {
    let history = TokenHistory::default();
    let mut drafter = ChaCha8Rng::seed_from_u64(99);
    let mut counts = vec![0usize; logits.len()];
    let mut accepted = 0;
    for _ in 0..draws {
        let draft = match q {
            None => certain,
            Some(q) => TokenId(draw(q, drafter.random()) as u32),
        };
        let token = match sampler.verify(logits, &history, draft, q).unwrap() {
            Verdict::Accepted => {
                accepted += 1;
                draft
            }
            Verdict::Rejected(t) => t,
        };
        counts[token.0 as usize] += 1;
    }
    let freq = counts.iter().map(|&c| c as f64 / draws as f64).collect();
    (freq, accepted as f64 / draws as f64)
}

fn total_variation(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f64>() / 2.0
}

/// Whatever the draft distribution q, the verified token is distributed as the target's p
/// (after every processor), and drafts are accepted as often as sum min(p, q) says. The
/// total-variation bound: with 200,000 draws over 6 tokens the expected distance is about
/// 0.002 (sum of sqrt(p(1-p)/(2 pi N))); 0.01 is five times that, and a wrong rule (accepting
/// every draft) is off by more than 0.3 for the bad drafts here.
#[test]
fn verify_keeps_the_target_distribution() {
    let logits = [1.0f32, 2.5, 0.3, 2.0, -1.0, 1.7];
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 5,
        seed: Some(7),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(&params, logits.len()).unwrap();
    let history = TokenHistory::default();
    let candidates = sampler.candidates(&logits, &history).unwrap();
    let mut p = vec![0f64; logits.len()];
    for (t, pt) in candidates.ids().iter().zip(candidates.probabilities()) {
        p[t.0 as usize] = f64::from(pt);
    }
    let draws = 200_000;
    let q_close: Vec<f32> = p.iter().map(|&x| (0.8 * x + 0.2 / 6.0) as f32).collect();
    let q_bad = [0.05f32, 0.05, 0.05, 0.05, 0.75, 0.05];
    let cases: [(TokenId, Option<&[f32]>); 5] = [
        (TokenId(1), None), // a certain draft of the likeliest token
        (TokenId(2), None), // a certain draft of an unlikely one
        (TokenId(4), None), // a certain draft outside top-k: p = 0, always rejected
        (TokenId(0), Some(&q_close)),
        (TokenId(0), Some(&q_bad)),
    ];
    for (certain, q) in cases {
        let (freq, accepted) = verified_frequencies(&mut sampler, &logits, certain, q, draws);
        let tv = total_variation(&freq, &p);
        assert!(tv < 0.01, "{certain} {q:?}: {freq:?} vs {p:?} ({tv})");
        let expected: f64 = match q {
            None => p[certain.0 as usize],
            Some(q) => p.iter().zip(q).map(|(&a, &b)| a.min(f64::from(b))).sum(),
        };
        assert!(
            (accepted - expected).abs() < 0.01,
            "{accepted} vs {expected}"
        );
    }
}

#[test]
fn greedy_verify_accepts_only_the_argmax() {
    let mut sampler = Sampler::new(&SamplingParams::greedy(), 4).unwrap();
    let history = TokenHistory::default();
    let logits = [0.1f32, 3.0, 2.0, 3.0];
    let mut verify = |t| sampler.verify(&logits, &history, TokenId(t), None).unwrap();
    // Ties go to the lower id, as `sample` does.
    assert_eq!(verify(1), Verdict::Accepted);
    assert_eq!(verify(3), Verdict::Rejected(TokenId(1)));
    assert_eq!(verify(0), Verdict::Rejected(TokenId(1)));
    let short = sampler.verify(&logits[..3], &history, TokenId(1), None);
    assert!(short.is_err());
}

#[test]
fn proposals_come_with_the_distribution_they_were_drawn_from() {
    let logits = [1.0f32, 2.5, 0.3, 2.0, -1.0, 1.7];
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 4,
        seed: Some(3),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(&params, logits.len()).unwrap();
    let history = TokenHistory::default();
    let draws = 100_000;
    let mut freq = vec![0f64; logits.len()];
    let mut q_seen = None;
    for _ in 0..draws {
        let (token, q) = sampler.propose(&logits, &history).unwrap();
        freq[token.0 as usize] += 1.0 / f64::from(draws);
        q_seen = q;
    }
    let q: Vec<f64> = q_seen.unwrap().iter().map(|&x| f64::from(x)).collect();
    assert_eq!(q.len(), logits.len());
    assert_eq!(q[4], 0.0, "outside top-k");
    assert!((q.iter().sum::<f64>() - 1.0).abs() < 1e-5);
    let tv = total_variation(&freq, &q);
    assert!(tv < 0.01, "{freq:?} vs {q:?} ({tv})");
    // Greedy proposes the argmax and needs no distribution.
    let mut greedy = Sampler::new(&SamplingParams::greedy(), logits.len()).unwrap();
    assert_eq!(
        greedy.propose(&logits, &history).unwrap(),
        (TokenId(1), None)
    );
}

#[test]
fn keep_only_may_remove_the_best_token_but_never_every_token() {
    let logits = [1.0f32, 3.0, 2.0, 0.5];
    let mut c = Candidates::from_logits(&logits);
    c.keep_only(|t| t.0 % 2 == 0);
    assert_eq!(c.ids(), &[TokenId(0), TokenId(2)]);
    assert_eq!(c.logits(), &[1.0, 2.0]);
    // A later processor that looks the token up by id still finds it.
    c.update(TokenId(2), |l| l + 1.0);
    assert_eq!(c.logits(), &[1.0, 3.0]);
    let mut none = Candidates::from_logits(&logits);
    none.keep_only(|_| false);
    assert_eq!(none.ids(), &[TokenId(1)]);
}

#[test]
fn greedy_without_processors_picks_what_the_candidates_would() {
    // The in-place argmax (no processors) against the candidates' argmax, on logits with
    // many ties (a few distinct values) and on distinct ones.
    let mut state = 7u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    for case in 0..200 {
        let vocab = 1 + (next() % 64) as usize;
        let levels = if case % 2 == 0 { 3 } else { 1 << 20 };
        let logits: Vec<f32> = (0..vocab).map(|_| (next() % levels) as f32 - 1.0).collect();
        let history = TokenHistory::default();
        let mut sampler = Sampler::new(&SamplingParams::greedy(), vocab).unwrap();
        let candidates = sampler.candidates(&logits, &history).unwrap();
        let expected = candidates.ids()[candidates.argmax_index()];
        assert_eq!(sampler.sample(&logits, &history), expected, "{logits:?}");
        let (proposed, q) = sampler.propose(&logits, &history).unwrap();
        assert_eq!((proposed, q), (expected, None));
        let verdict = sampler.verify(&logits, &history, TokenId(0), None).unwrap();
        let want = if expected == TokenId(0) {
            Verdict::Accepted
        } else {
            Verdict::Rejected(expected)
        };
        assert_eq!(verdict, want);
    }
}

/// The drafter's draw from `q`: the first id at which the running sum of `q` exceeds `u`.
fn draw(q: &[f32], u: f64) -> usize {
    let mut cumulative = 0.0f64;
    for (id, &p) in q.iter().enumerate() {
        cumulative += f64::from(p);
        if u < cumulative {
            return id;
        }
    }
    q.len() - 1
}
