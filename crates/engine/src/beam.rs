//! Beam search with Hugging Face transformers' semantics (`generate(num_beams=N,
//! do_sample=False)`, transformers 5): the arithmetic of one search step, kept apart from the
//! engine, which runs each beam as a sequence of its own in the batch and forks and frees their
//! caches as its `BeamGroup::advance` says.
//!
//! One step: each running beam's next-token log-probabilities (the log-softmax of its logits,
//! in f32) are added to its running score; of all `beams x vocab` candidates the best
//! `max(2, 1 + eos ids) x beams` are kept, best first. A candidate *finishes* when its token is
//! an EOS or it reaches the token budget; finished candidates ranked among the first `beams`
//! become hypotheses, scored `score / length^length_penalty` (length counts the EOS), and the
//! best `beams` hypotheses are kept. The first `beams` unfinished candidates run on. The search
//! ends when the budget is reached, when every hypothesis slot is filled and `early_stopping`
//! is true, or (slots filled, otherwise) when the best running beam can no longer beat the worst
//! hypothesis by transformers' estimate ([`EarlyStopping`]).

use std::fmt;
use std::str::FromStr;

use kiln_core::TokenId;
use serde::Serialize;

use crate::finish::FinishReason;

/// When a beam search stops before its budget (transformers' `early_stopping`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EarlyStopping {
    /// `false`: once `num_beams` hypotheses are finished, stop when the best running beam,
    /// scored at its current length, cannot beat the worst of them.
    #[default]
    Heuristic,
    /// `true`: stop as soon as `num_beams` hypotheses are finished.
    Immediate,
    /// `"never"`: as `false`, but a positive length penalty scores the best running beam at the
    /// full budget (the canonical search, with `length_penalty` 0).
    Never,
}

impl EarlyStopping {
    /// The spelling transformers and the command line use.
    pub fn name(self) -> &'static str {
        match self {
            EarlyStopping::Heuristic => "false",
            EarlyStopping::Immediate => "true",
            EarlyStopping::Never => "never",
        }
    }
}

impl fmt::Display for EarlyStopping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EarlyStopping {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "false" => Ok(EarlyStopping::Heuristic),
            "true" => Ok(EarlyStopping::Immediate),
            "never" => Ok(EarlyStopping::Never),
            _ => Err(format!(
                "early stopping `{s}` is not one of: false, true, never"
            )),
        }
    }
}

/// The most beams one request may ask for.
pub const MAX_BEAMS: usize = 64;

/// Beam search settings of a request ([`crate::Request::beam`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BeamSearch {
    /// Beams kept at each step (at least 1, at most [`MAX_BEAMS`]).
    pub num_beams: usize,
    /// Exponent of the length a finished hypothesis's score is divided by: above 0 favours
    /// longer outputs, below 0 shorter ones (transformers' default 1).
    pub length_penalty: f32,
    /// When to stop before the budget.
    pub early_stopping: EarlyStopping,
    /// Hypotheses returned, best first (at most `num_beams`).
    pub num_return_sequences: usize,
}

impl BeamSearch {
    /// `num_beams` beams with transformers' defaults: length penalty 1, heuristic early
    /// stopping, the best hypothesis returned.
    pub fn new(num_beams: usize) -> Self {
        Self {
            num_beams,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::Heuristic,
            num_return_sequences: 1,
        }
    }

    /// What is wrong with these settings, if anything.
    pub fn problem(&self) -> Option<String> {
        if self.num_beams == 0 || self.num_beams > MAX_BEAMS {
            return Some(format!(
                "num_beams is {}; it must be between 1 and {MAX_BEAMS}",
                self.num_beams
            ));
        }
        if self.num_return_sequences == 0 || self.num_return_sequences > self.num_beams {
            return Some(format!(
                "num_return_sequences is {}; it must be between 1 and num_beams ({})",
                self.num_return_sequences, self.num_beams
            ));
        }
        if !self.length_penalty.is_finite() {
            return Some(format!(
                "length_penalty is {}; it must be a finite number",
                self.length_penalty
            ));
        }
        None
    }
}

/// One finished hypothesis of a beam search.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BeamHypothesis {
    /// Its tokens after the prompt (no EOS).
    pub tokens: Vec<TokenId>,
    /// The decoded tokens (`None` without a detokenizer).
    pub text: Option<String>,
    /// The sum of its tokens' log-probabilities (an ending EOS's included) divided by its
    /// length (the EOS counted) to the power `length_penalty`: transformers'
    /// `sequences_scores`.
    pub score: f32,
    /// [`FinishReason::Eos`] or [`FinishReason::Length`].
    pub finish_reason: FinishReason,
}

/// A running beam: its tokens after the prompt and their summed log-probability.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Beam {
    pub tokens: Vec<TokenId>,
    pub score: f32,
}

/// What one step decided for the running beams.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Advance {
    /// The next running beams, best first, each as the index of the beam it extends (into
    /// the beams the step's logits came from) and its new token.
    pub next: Vec<(usize, TokenId)>,
    /// The search is over: [`BeamGroup::results`] holds the answer.
    pub done: bool,
}

/// A candidate continuation: `(summed log-probability, parent beam, token)`.
type Candidate = (f32, usize, TokenId);

/// The state of one request's beam search.
#[derive(Debug, Clone)]
pub(crate) struct BeamGroup {
    pub params: BeamSearch,
    /// Running beams, best first; empty before the first step (the prompt alone).
    pub running: Vec<Beam>,
    /// The best finished hypotheses so far (at most `num_beams`), best first:
    /// `(score, tokens without EOS, ended by EOS)`.
    finished: Vec<(f32, Vec<TokenId>, bool)>,
}

impl BeamGroup {
    pub fn new(params: BeamSearch) -> Self {
        Self {
            params,
            running: Vec::new(),
            finished: Vec::new(),
        }
    }

    /// Back to the state before the first step (a preempted search starts over: it is
    /// deterministic, so it reaches the same answer).
    pub fn restart(&mut self) {
        self.running.clear();
        self.finished.clear();
    }

    /// One search step. `rows` holds the logits of each running beam, in order (before the
    /// first step: the prompt's one row); `budget` is the most tokens a hypothesis may have.
    ///
    /// # Shapes
    /// `rows`: `[beams, vocab]`, row-major.
    pub fn advance(
        &mut self,
        rows: &[f32],
        vocab: usize,
        eos: &[TokenId],
        budget: usize,
    ) -> Advance {
        let n = self.params.num_beams;
        let parents: Vec<Beam> = if self.running.is_empty() {
            vec![Beam {
                tokens: Vec::new(),
                score: 0.0,
            }]
        } else {
            std::mem::take(&mut self.running)
        };
        debug_assert_eq!(rows.len(), parents.len() * vocab);
        let length = parents[0].tokens.len() + 1;
        let mut eos_ids: Vec<TokenId> = eos.to_vec();
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let keep = 2.max(1 + eos_ids.len()) * n;
        let candidates = best_candidates(&parents, rows, vocab, keep);
        let at_budget = length >= budget;
        let finishes = |token: TokenId| at_budget || eos_ids.binary_search(&token).is_ok();

        // Finished candidates among the first `n` become hypotheses (unless every slot is
        // filled and the search stops at that).
        let slots_full = self.finished.len() == n;
        if !(slots_full && self.params.early_stopping == EarlyStopping::Immediate) {
            let norm = (length as f64).powf(f64::from(self.params.length_penalty));
            for &(score, parent, token) in candidates.iter().take(n) {
                if !finishes(token) {
                    continue;
                }
                let is_eos = eos_ids.binary_search(&token).is_ok();
                let mut tokens = parents[parent].tokens.clone();
                if !is_eos {
                    tokens.push(token);
                }
                let normalized = (f64::from(score) / norm) as f32;
                self.add_hypothesis(normalized, tokens, is_eos);
            }
        }

        let next: Vec<(usize, TokenId)> = candidates
            .iter()
            .filter(|&&(_, _, token)| !finishes(token))
            .take(n)
            .map(|&(_, parent, token)| (parent, token))
            .collect();
        self.running = candidates
            .iter()
            .filter(|&&(_, _, token)| !finishes(token))
            .take(n)
            .map(|&(score, parent, token)| {
                let mut tokens = parents[parent].tokens.clone();
                tokens.push(token);
                Beam { tokens, score }
            })
            .collect();
        let done = at_budget || self.running.is_empty() || self.cannot_improve(length, budget);
        Advance { next, done }
    }

    /// Whether every hypothesis slot is filled and the running beams cannot beat them:
    /// transformers' `_check_early_stop_heuristic` and the `early_stopping=True` rule.
    fn cannot_improve(&self, length: usize, budget: usize) -> bool {
        if self.finished.len() < self.params.num_beams {
            return false;
        }
        let lp = self.params.length_penalty;
        match self.params.early_stopping {
            EarlyStopping::Immediate => true,
            stopping => {
                let best_length = if stopping == EarlyStopping::Never && lp > 0.0 {
                    budget
                } else {
                    length
                };
                let best_running = self.running[0].score;
                let best_possible =
                    (f64::from(best_running) / (best_length as f64).powf(f64::from(lp))) as f32;
                let worst = self.finished.last().map_or(f32::NEG_INFINITY, |h| h.0);
                best_possible <= worst
            }
        }
    }

    fn add_hypothesis(&mut self, score: f32, tokens: Vec<TokenId>, eos: bool) {
        // Best first; a later hypothesis with an equal score goes after the earlier ones.
        let at = self.finished.partition_point(|h| h.0 >= score);
        if at >= self.params.num_beams {
            return;
        }
        self.finished.insert(at, (score, tokens, eos));
        self.finished.truncate(self.params.num_beams);
    }

    /// The returned hypotheses, best first (text not filled in).
    pub fn results(&self) -> Vec<BeamHypothesis> {
        self.finished
            .iter()
            .take(self.params.num_return_sequences)
            .map(|(score, tokens, eos)| BeamHypothesis {
                tokens: tokens.clone(),
                text: None,
                score: *score,
                finish_reason: if *eos {
                    FinishReason::Eos
                } else {
                    FinishReason::Length
                },
            })
            .collect()
    }
}

/// The `keep` best continuations of `parents` (summed log-probability, best first; equal
/// scores in beam-then-token order, as a flattened `topk` meets them).
///
/// # Shapes
/// `rows`: `[parents, vocab]` logits.
fn best_candidates(parents: &[Beam], rows: &[f32], vocab: usize, keep: usize) -> Vec<Candidate> {
    let mut best: Vec<Candidate> = Vec::with_capacity(keep + 1);
    for (b, (beam, row)) in parents.iter().zip(rows.chunks_exact(vocab)).enumerate() {
        // log_softmax in f32 as torch computes it: x - max - ln(sum(exp(x - max))).
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        let log_norm = max + sum.ln() as f32;
        for (t, &x) in row.iter().enumerate() {
            let score = beam.score + (x - log_norm);
            if best.len() == keep && score <= best[keep - 1].0 {
                continue;
            }
            let at = best.partition_point(|c| c.0 >= score);
            best.insert(at, (score, b, TokenId(t as u32)));
            best.truncate(keep);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    /// Logits whose log-softmax is `ln(p)` for the given probabilities.
    fn row(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn the_first_step_expands_the_prompt_into_the_best_tokens() {
        let mut group = BeamGroup::new(BeamSearch::new(2));
        let step = group.advance(&row(&[0.1, 0.5, 0.3, 0.1]), 4, &[], 10);
        assert_eq!(step.next, vec![(0, TokenId(1)), (0, TokenId(2))]);
        assert!(!step.done);
        assert_eq!(group.running[0].tokens, ids(&[1]));
        assert!((group.running[1].score - 0.3f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn a_beam_that_falls_behind_is_dropped_and_the_better_one_forks() {
        let mut group = BeamGroup::new(BeamSearch::new(2));
        group.advance(&row(&[0.0, 0.6, 0.4, 0.0]), 4, &[], 10);
        // Beam 0 (p 0.6) is sure of token 3; beam 1 (p 0.4) is torn: both children of beam 0
        // (0.6 * 0.9, 0.6 * 0.1 = 0.06) vs beam 1's best 0.4 * 0.5 = 0.2.
        let rows = [row(&[0.0, 0.0, 0.1, 0.9]), row(&[0.5, 0.5, 0.0, 0.0])].concat();
        let step = group.advance(&rows, 4, &[], 10);
        assert_eq!(step.next, vec![(0, TokenId(3)), (1, TokenId(0))]);
        let rows = [row(&[0.0, 0.0, 0.1, 0.9]), row(&[0.25; 4])].concat();
        let step = group.advance(&rows, 4, &[], 10);
        // 0.54 * 0.9 = 0.486, 0.54 * 0.1 = 0.054 against 0.2 * 0.25 = 0.05 at best: beam 0
        // forks, beam 1 drops.
        assert_eq!(step.next, vec![(0, TokenId(3)), (0, TokenId(2))]);
        assert_eq!(group.running[1].tokens, ids(&[1, 3, 2]));
    }

    #[test]
    fn hypotheses_are_scored_by_length_and_returned_best_first() {
        let mut params = BeamSearch::new(2);
        params.num_return_sequences = 2;
        params.early_stopping = EarlyStopping::Immediate;
        let mut group = BeamGroup::new(params);
        let eos = [TokenId(0)];
        // EOS is the best first token: a one-token hypothesis (EOS counted in its length).
        let step = group.advance(&row(&[0.5, 0.3, 0.2, 0.0]), 4, &eos, 10);
        assert_eq!(step.next, vec![(0, TokenId(1)), (0, TokenId(2))]);
        assert!(!step.done);
        // Beam 0 (token 1, p 0.3) ends with EOS: 0.3 * 0.9 over its length 2 (the EOS
        // counted) beats the one-token hypothesis: ln(0.27) / 2 > ln(0.5).
        let rows = [row(&[0.9, 0.1, 0.0, 0.0]), row(&[0.0, 0.0, 0.0, 1.0])].concat();
        let step = group.advance(&rows, 4, &eos, 10);
        assert!(step.done, "two hypotheses and early stopping");
        let results = group.results();
        assert_eq!(results.len(), 2);
        assert!((results[0].score - (0.27f32.ln() / 2.0)).abs() < 1e-5);
        assert_eq!(results[0].tokens, ids(&[1]));
        assert_eq!(results[0].finish_reason, FinishReason::Eos);
        assert!((results[1].score - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(results[1].tokens, ids(&[]));
    }

    #[test]
    fn the_budget_finishes_the_best_beams_by_length() {
        let mut group = BeamGroup::new(BeamSearch::new(2));
        group.advance(&row(&[0.1, 0.5, 0.4, 0.0]), 4, &[], 2);
        let rows = [row(&[0.0, 0.0, 0.4, 0.6]), row(&[0.0, 1.0, 0.0, 0.0])].concat();
        let step = group.advance(&rows, 4, &[], 2);
        assert!(step.done);
        assert!(step.next.is_empty());
        let best = &group.results()[0];
        assert_eq!(best.tokens, ids(&[2, 1]));
        assert_eq!(best.finish_reason, FinishReason::Length);
        assert!((best.score - 0.4f32.ln() / 2.0).abs() < 1e-6);
    }

    #[test]
    fn settings_out_of_range_are_named() {
        assert!(BeamSearch::new(0).problem().unwrap().contains("num_beams"));
        let mut p = BeamSearch::new(2);
        p.num_return_sequences = 3;
        assert!(p.problem().unwrap().contains("num_return_sequences"));
        p.num_return_sequences = 1;
        p.length_penalty = f32::NAN;
        assert!(p.problem().unwrap().contains("length_penalty"));
        assert_eq!("never".parse(), Ok(EarlyStopping::Never));
        assert!("sometimes".parse::<EarlyStopping>().is_err());
    }
}
