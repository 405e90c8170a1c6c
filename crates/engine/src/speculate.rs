//! Speculative decoding: a decoding sequence proposes up to K draft tokens, one forward of the
//! target over the last sampled token and the drafts scores them all, and
//! [`kiln_core::sampling::Sampler::verify`] accepts a prefix of them and supplies the token
//! after it, so one forward yields 1 to K+1 tokens. Greedy output is exactly the
//! non-speculative output; sampled output has exactly its distribution (the standard
//! rejection rule). The engine rolls the cache back over rejected drafts.

use kiln_core::TokenId;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup: the tokens that followed the most recent earlier occurrence of the
    /// context's last n-gram (the longest, from `max_ngram` tokens down to `min_ngram`, that
    /// occurred before). No second model; it pays when the output copies from the input
    /// (rewriting, summarising, editing code) and costs one wider forward when it does not.
    /// Adaptive ([`Speculation::adaptive`]), a match of n tokens drafts at most n: a lone
    /// recurring token vouches for one more, a recurring phrase for a run.
    PromptLookup {
        /// The shortest n-gram looked up (the CLI's default, 1, lets a single recurring token
        /// draft one).
        min_ngram: usize,
        /// The longest n-gram looked up.
        max_ngram: usize,
    },
    /// A smaller (or quantized) model sharing the target's vocabulary proposes the drafts,
    /// one forward per draft token, on its own cache ([`crate::Engine::with_draft_model`]).
    /// Sampled requests draw drafts from the draft model's distribution under the request's
    /// own sampling settings, which verification needs to keep the target's distribution.
    Model,
}

impl DraftSource {
    /// The draft length K used when none is asked for: 3 for prompt lookup, 4 for a draft
    /// model. A lookup's drafts fail more often than a draft model's, and each verification
    /// row costs a share of a step (a fifth row more on a CPU, where the quantized products
    /// take rows four at a time), so lookups want the shorter drafts (`cargo xtask
    /// bench-spec`; docs/benchmarks.md, "Speculative decoding at batch 1").
    pub fn default_draft_tokens(self) -> usize {
        match self {
            DraftSource::PromptLookup { .. } => 3,
            DraftSource::Model => 4,
        }
    }
}

/// Speculative decoding settings ([`crate::EngineConfig::speculation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    /// Where drafts come from.
    pub source: DraftSource,
    /// Most draft tokens proposed per sequence and step (K).
    pub draft_tokens: usize,
    /// Adapt the draft length (up to K) to how likely the drafts are to stand. A draft model:
    /// after a check, the next draft is one longer than what was accepted, so a sequence whose
    /// drafts keep failing proposes one token at a time, and one copying its input goes back
    /// to K. Prompt lookup: a match of n tokens drafts at most n (a better guide to the next
    /// tokens than the last check in replays of the grounded prompt set; docs/benchmarks.md).
    pub adaptive: bool,
    /// Speculate only in steps where at most this many sequences decode (0: in every step).
    /// Verification rows add up over a batch: on a CPU, where an extra row of a forward is
    /// far from free, a batch of a few sequences decodes faster without drafts.
    pub max_batch: usize,
}

impl Speculation {
    /// Why these settings cannot be used, or `None`.
    pub fn problem(&self) -> Option<String> {
        if self.draft_tokens == 0 {
            return Some("speculative decoding needs at least 1 draft token".into());
        }
        match self.source {
            DraftSource::PromptLookup {
                min_ngram,
                max_ngram,
            } if min_ngram == 0 || min_ngram > max_ngram => Some(format!(
                "prompt lookup needs n-grams of 1 token or more, the shortest no longer than the longest (not {min_ngram} to {max_ngram})"
            )),
            DraftSource::PromptLookup { .. } | DraftSource::Model => None,
        }
    }

    /// The most drafts a sequence proposes next, after `accepted` of its last drafts stood.
    pub fn next_limit(&self, accepted: usize) -> usize {
        match self.source {
            DraftSource::Model if self.adaptive => (accepted + 1).min(self.draft_tokens),
            DraftSource::Model | DraftSource::PromptLookup { .. } => self.draft_tokens,
        }
    }

    /// Up to `limit` draft tokens to follow `context`, for the sources that need no model
    /// (empty for [`DraftSource::Model`], whose drafts [`crate::Engine`] computes).
    pub fn draft(&self, context: &[TokenId], limit: usize) -> Vec<TokenId> {
        let k = self.draft_tokens.min(limit);
        if k == 0 {
            return Vec::new();
        }
        match self.source {
            DraftSource::PromptLookup {
                min_ngram,
                max_ngram,
            } => longest_match(context, min_ngram, max_ngram).map_or_else(Vec::new, |found| {
                let k = if self.adaptive { k.min(found.ngram) } else { k };
                found.draft(context, k)
            }),
            DraftSource::Model => Vec::new(),
        }
    }
}

/// Where prompt lookup found the context's end before: the length of the n-gram matched and
/// where the tokens that followed it start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupMatch {
    /// Tokens matched (`min_ngram..=max_ngram`).
    pub ngram: usize,
    /// Index in the context of the first token after the earlier occurrence.
    pub continuation: usize,
}

impl LookupMatch {
    /// Up to `k` of the tokens that followed the occurrence in `context` (the context the
    /// match was found in).
    pub fn draft(&self, context: &[TokenId], k: usize) -> Vec<TokenId> {
        context[self.continuation..(self.continuation + k).min(context.len())].to_vec()
    }
}

/// Prompt lookup's search: for n from `max_ngram` down to `min_ngram`, the last n tokens of
/// `context` are looked for earlier in it; the most recent earlier occurrence of the longest
/// that occurs. `None` when no such suffix recurs.
pub fn longest_match(
    context: &[TokenId],
    min_ngram: usize,
    max_ngram: usize,
) -> Option<LookupMatch> {
    let len = context.len();
    for n in (min_ngram.max(1)..=max_ngram.min(len.saturating_sub(1))).rev() {
        let tail = &context[len - n..];
        // Occurrences that end before the context does; the latest is the most relevant.
        if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == tail) {
            return Some(LookupMatch {
                ngram: n,
                continuation: start + n,
            });
        }
    }
    None
}

/// Speculation's counts for one request, or summed over an engine's requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SpecCounts {
    /// Draft tokens proposed.
    pub drafted: u64,
    /// Of those, accepted by the target.
    pub accepted: u64,
    /// Forwards of the target that produced tokens (the prompt's last and every decode step).
    pub forwards: u64,
    /// Tokens those forwards produced.
    pub tokens: u64,
}

impl SpecCounts {
    /// Accepted drafts per proposed draft (0 when none was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens per target forward (1 without speculation).
    pub fn tokens_per_forward(&self) -> f64 {
        if self.forwards == 0 {
            0.0
        } else {
            self.tokens as f64 / self.forwards as f64
        }
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: &SpecCounts) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.forwards += other.forwards;
        self.tokens += other.tokens;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    /// Fixed-length prompt lookup: up to `k` tokens after [`longest_match`]'s occurrence.
    fn prompt_lookup(
        context: &[TokenId],
        min_ngram: usize,
        max_ngram: usize,
        k: usize,
    ) -> Vec<TokenId> {
        longest_match(context, min_ngram, max_ngram)
            .map_or_else(Vec::new, |found| found.draft(context, k))
    }

    #[test]
    fn prompt_lookup_follows_the_latest_occurrence_of_the_longest_suffix() {
        // "7 8" occurs twice before the end: the later one (followed by 4 5) wins.
        let context = ids(&[7, 8, 1, 2, 9, 7, 8, 4, 5, 6, 7, 8]);
        assert_eq!(prompt_lookup(&context, 1, 3, 2), ids(&[4, 5]));
        assert_eq!(prompt_lookup(&context, 1, 3, 10), ids(&[4, 5, 6, 7, 8]));
        // The 2-gram "2 3" occurred before: its match is used (the 1-gram "3" gives the same
        // place here).
        let context = ids(&[1, 2, 3, 9, 1, 2, 3]);
        assert_eq!(prompt_lookup(&context, 1, 2, 3), ids(&[9, 1, 2]));
        assert_eq!(prompt_lookup(&context, 1, 1, 3), ids(&[9, 1, 2]));
        assert!(prompt_lookup(&ids(&[1, 2, 3]), 1, 3, 4).is_empty());
        assert!(prompt_lookup(&ids(&[5]), 1, 3, 4).is_empty());
        assert!(prompt_lookup(&[], 1, 3, 4).is_empty());
        // A run of one token drafts more of it.
        assert_eq!(prompt_lookup(&ids(&[4, 4, 4]), 1, 2, 5), ids(&[4]));
        // With a shortest n-gram of 2, a lone recurring token drafts nothing.
        let context = ids(&[3, 9, 8, 7, 3]);
        assert_eq!(prompt_lookup(&context, 1, 3, 2), ids(&[9, 8]));
        assert!(prompt_lookup(&context, 2, 3, 2).is_empty());
    }

    #[test]
    fn drafts_never_exceed_the_limit() {
        let spec = Speculation {
            source: DraftSource::PromptLookup {
                min_ngram: 1,
                max_ngram: 2,
            },
            draft_tokens: 3,
            adaptive: false,
            max_batch: 0,
        };
        let context = ids(&[1, 2, 3, 4, 5, 1, 2]);
        assert_eq!(spec.draft(&context, 10), ids(&[3, 4, 5]));
        assert_eq!(spec.draft(&context, 1), ids(&[3]));
        assert!(spec.draft(&context, 0).is_empty());
        assert!(spec.problem().is_none());
        let zero = Speculation {
            draft_tokens: 0,
            ..spec
        };
        assert!(zero.problem().is_some());
        let inverted = Speculation {
            source: DraftSource::PromptLookup {
                min_ngram: 3,
                max_ngram: 2,
            },
            ..spec
        };
        assert!(inverted.problem().is_some());
        assert_eq!(spec.next_limit(0), 3, "fixed");
        let adaptive_model = Speculation {
            source: DraftSource::Model,
            adaptive: true,
            ..spec
        };
        assert_eq!(adaptive_model.next_limit(0), 1);
        assert_eq!(adaptive_model.next_limit(1), 2);
        assert_eq!(adaptive_model.next_limit(3), 3);
    }

    #[test]
    fn adaptive_prompt_lookup_drafts_no_more_tokens_than_it_matched() {
        let spec = Speculation {
            source: DraftSource::PromptLookup {
                min_ngram: 1,
                max_ngram: 3,
            },
            draft_tokens: 4,
            adaptive: true,
            max_batch: 0,
        };
        // The last check does not matter: every step may draft up to K.
        assert_eq!(spec.next_limit(0), 4);
        // "1 2 3" recurs: a 3-gram, three tokens (of the five that followed).
        let context = ids(&[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]);
        assert_eq!(
            longest_match(&context, 1, 3),
            Some(LookupMatch {
                ngram: 3,
                continuation: 3
            })
        );
        assert_eq!(spec.draft(&context, 4), ids(&[4, 5, 6]));
        assert_eq!(spec.draft(&context, 2), ids(&[4, 5]));
        // Only the last token recurs: one token.
        let context = ids(&[9, 4, 5, 6, 7, 1, 9]);
        assert_eq!(spec.draft(&context, 4), ids(&[4]));
        // Fixed, the same match drafts K.
        let fixed = Speculation {
            adaptive: false,
            ..spec
        };
        assert_eq!(fixed.draft(&context, 4), ids(&[4, 5, 6, 7]));
    }
}
