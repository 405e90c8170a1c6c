//! [`TokenHistory`]: what a sequence has seen, for the penalties.

use std::collections::{HashMap, HashSet};

use crate::ids::TokenId;

/// The prompt and generated tokens of one sequence, with the counts penalties need.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    seen: HashSet<TokenId>,
    generated_counts: HashMap<TokenId, u32>,
    generated: Vec<TokenId>,
}

impl TokenHistory {
    /// A history starting with `prompt`.
    pub fn with_prompt(prompt: &[TokenId]) -> Self {
        Self {
            seen: prompt.iter().copied().collect(),
            ..Self::default()
        }
    }

    /// Records a generated token.
    pub fn push(&mut self, token: TokenId) {
        self.seen.insert(token);
        *self.generated_counts.entry(token).or_default() += 1;
        self.generated.push(token);
    }

    /// Tokens in the prompt or generated (the repetition penalty's set).
    pub fn seen(&self) -> &HashSet<TokenId> {
        &self.seen
    }

    /// How often each token was generated (the presence and frequency penalties' counts).
    pub fn generated_counts(&self) -> &HashMap<TokenId, u32> {
        &self.generated_counts
    }

    /// The generated tokens, in order.
    pub fn generated(&self) -> &[TokenId] {
        &self.generated
    }
}
