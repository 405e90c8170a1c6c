//! Sampling: from a row of logits to the next token.
//!
//! A [`Sampler`] is a chain of [`LogitsProcessor`]s in a fixed order, then a selection:
//!
//! 1. [`LogitBias`] (OpenAI's `logit_bias`: a bias added to chosen tokens' raw logits);
//! 2. penalties: [`RepetitionPenalty`] (Hugging Face semantics, over prompt and generated
//!    tokens), then [`PresenceFrequencyPenalty`] (OpenAI semantics, over generated tokens);
//! 3. [`Temperature`];
//! 4. [`TopK`], 5. [`TopP`], 6. [`MinP`] (each as Hugging Face's warper of the same name);
//! 7. select: argmax when the temperature is 0, else a draw from the softmax of what remains,
//!    with the sampler's own seeded RNG (ChaCha8: same seed and logits, same tokens, on every
//!    platform).
//!
//! This is transformers' order (`_get_logits_processor`, whose `SequenceBiasLogitsProcessor`
//! comes before the penalties, as vLLM's logit bias does), and the top-k/top-p/min-p filters
//! see temperature-scaled logits, as there. Temperature 0 skips temperature, top-k, top-p and
//! min-p (they cannot change the argmax) but not the bias or the penalties, as transformers'
//! greedy search.

mod candidates;
mod history;
mod params;
mod processors;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use candidates::{Candidates, first_max_index};
pub use history::TokenHistory;
pub use params::{MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, SamplingError, SamplingParams};
pub use processors::{
    LogitBias, LogitsProcessor, MinP, PresenceFrequencyPenalty, RepetitionPenalty, Temperature,
    TopK, TopP,
};

use crate::ids::TokenId;

/// How the final token is picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selection {
    /// The highest logit (lowest id among ties).
    Greedy,
    /// A draw from the softmax of the remaining candidates.
    Multinomial,
}

/// Turns logits into tokens for one sequence. Owns its RNG, so sequences sampled in the same
/// batch stay independent and reproducible.
#[derive(Debug)]
pub struct Sampler {
    processors: Vec<Box<dyn LogitsProcessor>>,
    selection: Selection,
    vocab: usize,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// The standard chain for `params` over a vocabulary of `vocab` tokens.
    ///
    /// # Errors
    /// [`SamplingError::Invalid`] naming the first field out of range;
    /// [`SamplingError::TokenOutsideVocab`] for a logit bias on a token past `vocab`.
    pub fn new(params: &SamplingParams, vocab: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        params.check_vocab(vocab)?;
        let mut processors: Vec<Box<dyn LogitsProcessor>> = Vec::new();
        if !params.logit_bias.is_empty() {
            processors.push(Box::new(LogitBias(params.logit_bias.clone())));
        }
        if params.repetition_penalty != 1.0 {
            processors.push(Box::new(RepetitionPenalty(params.repetition_penalty)));
        }
        if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            processors.push(Box::new(PresenceFrequencyPenalty {
                presence: params.presence_penalty,
                frequency: params.frequency_penalty,
            }));
        }
        let selection = if params.is_greedy() {
            Selection::Greedy
        } else {
            if params.temperature != 1.0 {
                processors.push(Box::new(Temperature(params.temperature)));
            }
            if params.top_k > 0 && params.top_k < vocab {
                processors.push(Box::new(TopK(params.top_k)));
            }
            if params.top_p < 1.0 {
                processors.push(Box::new(TopP(params.top_p)));
            }
            if params.min_p > 0.0 {
                processors.push(Box::new(MinP(params.min_p)));
            }
            Selection::Multinomial
        };
        Ok(Self::with_processors(
            processors,
            selection,
            vocab,
            params.seed,
        ))
    }

    /// A custom chain: `processors` run in the given order, then `selection`.
    pub fn with_processors(
        processors: Vec<Box<dyn LogitsProcessor>>,
        selection: Selection,
        vocab: usize,
        seed: Option<u64>,
    ) -> Self {
        let seed = seed.unwrap_or_else(random_seed);
        Self {
            processors,
            selection,
            vocab,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Adds a processor at the end of the chain (before selection).
    pub fn push_processor(&mut self, processor: Box<dyn LogitsProcessor>) {
        self.processors.push(processor);
    }

    /// Adds a processor at the start of the chain, before the penalties: where a hard
    /// constraint (a grammar) belongs, so nothing after it can choose a token it forbids.
    pub fn prepend_processor(&mut self, processor: Box<dyn LogitsProcessor>) {
        self.processors.insert(0, processor);
    }

    /// The processors' names, in order.
    pub fn chain(&self) -> Vec<&'static str> {
        self.processors.iter().map(|p| p.name()).collect()
    }

    /// How the token is picked.
    pub fn selection(&self) -> Selection {
        self.selection
    }

    /// Whether this sampler takes the plain argmax of the logits (greedy, no processor: no
    /// logit bias, penalty or grammar, which change the argmax), a choice the device can make
    /// itself ([`crate::InferenceBackend::argmax_rows`]) so that
    /// only token ids come back.
    pub fn is_plain_greedy(&self) -> bool {
        self.selection == Selection::Greedy && self.processors.is_empty()
    }

    /// The candidates after every processor: what selection chooses from.
    ///
    /// # Errors
    /// [`SamplingError::VocabMismatch`] if `logits` is not one entry per vocabulary token.
    pub fn candidates(
        &self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<Candidates, SamplingError> {
        self.check_vocab(logits)?;
        let mut candidates = Candidates::from_logits(logits);
        for processor in &self.processors {
            processor.process(&mut candidates, history);
        }
        Ok(candidates)
    }

    /// [`SamplingError::VocabMismatch`] unless `values` holds one entry per vocabulary token.
    fn check_vocab(&self, values: &[f32]) -> Result<(), SamplingError> {
        if values.len() == self.vocab {
            Ok(())
        } else {
            Err(SamplingError::VocabMismatch {
                got: values.len(),
                vocab: self.vocab,
            })
        }
    }

    /// The greedy choice (the highest processed logit, the lowest id among ties), or `None`
    /// when this sampler draws. With no processor (no bias, penalty or grammar: the common case,
    /// and every row a speculative verification checks) the argmax is taken from `logits` in
    /// place, without building the candidates (two vocabulary-sized copies a token).
    ///
    /// # Errors
    /// [`SamplingError::VocabMismatch`] if `logits` is not one entry per vocabulary token.
    fn greedy_token(
        &self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<Option<TokenId>, SamplingError> {
        if self.selection != Selection::Greedy {
            return Ok(None);
        }
        if self.processors.is_empty() {
            self.check_vocab(logits)?;
            return Ok(Some(TokenId(candidates::first_max_index(logits) as u32)));
        }
        let candidates = self.candidates(logits, history)?;
        Ok(Some(candidates.ids()[candidates.argmax_index()]))
    }

    /// Picks the next token.
    ///
    /// # Panics
    /// If `logits` does not have one entry per vocabulary token; use [`Sampler::try_sample`]
    /// for untrusted input.
    pub fn sample(&mut self, logits: &[f32], history: &TokenHistory) -> TokenId {
        self.try_sample(logits, history)
            .expect("logits must have one entry per vocabulary token")
    }

    /// Picks the next token.
    ///
    /// # Errors
    /// [`SamplingError::VocabMismatch`].
    pub fn try_sample(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<TokenId, SamplingError> {
        if let Some(best) = self.greedy_token(logits, history)? {
            return Ok(best);
        }
        let candidates = self.candidates(logits, history)?;
        let probs = candidates.probabilities();
        let ids = candidates.ids();
        // Walk the distribution in token-id order, as torch.multinomial does: then a
        // perturbation of the logits (a batched matmul rounds differently from a single one)
        // moves each boundary of the CDF by about as much, whereas an order by probability
        // would swap near-equal tokens and pick the neighbour.
        let u: f64 = self.rng.random();
        Ok(ids[draw_in_id_order(ids, &probs, u)])
    }
}

/// The outcome of checking one drafted token against the target model ([`Sampler::verify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft stands: it is the next token.
    Accepted,
    /// The draft is refused and this token takes its place (later drafts are discarded).
    Rejected(TokenId),
}

impl Sampler {
    /// Speculative decoding's acceptance rule (Leviathan et al. 2023; Chen et al. 2023) for a
    /// token `draft` that a draft source proposed from its distribution `q` over the
    /// vocabulary (`None`: a certain draft, q = 1 on `draft`, as prompt lookup's). With p the
    /// distribution [`Sampler::try_sample`] draws from (every processor applied), the draft is
    /// accepted with probability min(1, p(draft) / q(draft)); otherwise a token is drawn from
    /// max(0, p - q), renormalised. Either way the token that results is distributed exactly
    /// as p. Greedy: the draft stands when it is the argmax; otherwise the argmax replaces it.
    ///
    /// # Errors
    /// [`SamplingError::VocabMismatch`] if `logits` (or `q`) is not one entry per vocabulary
    /// token.
    pub fn verify(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        draft: TokenId,
        q: Option<&[f32]>,
    ) -> Result<Verdict, SamplingError> {
        if let Some(q) = q {
            self.check_vocab(q)?;
        }
        if let Some(best) = self.greedy_token(logits, history)? {
            return Ok(if best == draft {
                Verdict::Accepted
            } else {
                Verdict::Rejected(best)
            });
        }
        let candidates = self.candidates(logits, history)?;
        let ids = candidates.ids();
        let p = candidates.probabilities();
        let q_of = |t: TokenId| match q {
            Some(q) => f64::from(q[t.0 as usize]),
            None => f64::from(u8::from(t == draft)),
        };
        let p_draft = ids
            .iter()
            .position(|&t| t == draft)
            .map_or(0.0, |i| f64::from(p[i]));
        let q_draft = q_of(draft);
        let u: f64 = self.rng.random();
        if q_draft > 0.0 && u < p_draft / q_draft {
            return Ok(Verdict::Accepted);
        }
        let mut residual: Vec<f32> = ids
            .iter()
            .zip(&p)
            .map(|(&t, &pt)| (f64::from(pt) - q_of(t)).max(0.0) as f32)
            .collect();
        let total: f64 = residual.iter().map(|&r| f64::from(r)).sum();
        if total > 0.0 {
            residual
                .iter_mut()
                .for_each(|r| *r = (f64::from(*r) / total) as f32);
        } else {
            // p <= q everywhere means p == q: a rejection had probability 0 and only rounding
            // got here; p itself is then the residual.
            residual = p;
        }
        let u: f64 = self.rng.random();
        Ok(Verdict::Rejected(ids[draw_in_id_order(ids, &residual, u)]))
    }

    /// A draft model's proposal: the token [`Sampler::try_sample`] would pick from `logits`,
    /// and, when it draws (rather than takes the argmax), the distribution `q` it drew from
    /// over the whole vocabulary, which [`Sampler::verify`] needs to keep the target's
    /// distribution. Greedy proposals need no `q` (greedy verification ignores it).
    ///
    /// # Errors
    /// [`SamplingError::VocabMismatch`].
    pub fn propose(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<(TokenId, Option<Vec<f32>>), SamplingError> {
        if let Some(best) = self.greedy_token(logits, history)? {
            return Ok((best, None));
        }
        let candidates = self.candidates(logits, history)?;
        let ids = candidates.ids();
        let probs = candidates.probabilities();
        let u: f64 = self.rng.random();
        let token = ids[draw_in_id_order(ids, &probs, u)];
        let mut q = vec![0.0; self.vocab];
        for (&t, &p) in ids.iter().zip(&probs) {
            q[t.0 as usize] = p;
        }
        Ok((token, Some(q)))
    }
}

/// The index of `ids` (and `probs`) that `u` picks when the distribution is walked in token-id
/// order.
fn draw_in_id_order(ids: &[TokenId], probs: &[f32], u: f64) -> usize {
    if ids.is_sorted() {
        inverse_cdf(0..ids.len(), probs, u)
    } else {
        let mut by_id: Vec<usize> = (0..ids.len()).collect();
        by_id.sort_unstable_by_key(|&i| ids[i]);
        inverse_cdf(by_id, probs, u)
    }
}

/// The first index in `order` at which the running sum of `probs` exceeds `u` (the last
/// index when rounding leaves the sum just short of it).
fn inverse_cdf(order: impl IntoIterator<Item = usize>, probs: &[f32], u: f64) -> usize {
    let mut cumulative = 0.0f64;
    let mut last = 0;
    for i in order {
        cumulative += f64::from(probs[i]);
        last = i;
        if u < cumulative {
            return i;
        }
    }
    last
}

/// A seed from the OS's hashing entropy, for samplers created without one.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}
