//! [`Candidates`]: the tokens still in the running and their logits, as processors pass them on.

use crate::ids::TokenId;

/// Token ids with their (processed) logits. Starts as the whole vocabulary in id order;
/// truncating processors shrink it and leave it sorted by logit, highest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    ids: Vec<TokenId>,
    logits: Vec<f32>,
    /// `ids[i] == i` for every `i`: the whole vocabulary, unsorted.
    dense: bool,
    /// `ids` ascend (true until a sort reorders them): a token is found by binary search.
    by_id: bool,
    sorted: bool,
}

impl Candidates {
    /// The whole vocabulary with raw logits.
    pub fn from_logits(logits: &[f32]) -> Self {
        Self {
            ids: (0..logits.len() as u32).map(TokenId).collect(),
            logits: logits.to_vec(),
            dense: true,
            by_id: true,
            sorted: false,
        }
    }

    /// How many tokens remain.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no token remains (processors always keep at least one).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The remaining token ids.
    pub fn ids(&self) -> &[TokenId] {
        &self.ids
    }

    /// The remaining logits, aligned with [`Candidates::ids`].
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Mutable logits (changing them may break the sort order: see [`Candidates::unsort`]).
    pub fn logits_mut(&mut self) -> &mut [f32] {
        &mut self.logits
    }

    /// Declares that the logits were changed in a way that breaks the order.
    pub fn unsort(&mut self) {
        self.sorted = false;
    }

    /// Adds `f(logit)` in place for one token, if it is still a candidate.
    pub fn update(&mut self, token: TokenId, f: impl FnOnce(f32) -> f32) {
        let index = if self.dense {
            Some(token.0 as usize).filter(|&i| i < self.ids.len())
        } else if self.by_id {
            self.ids.binary_search(&token).ok()
        } else {
            self.ids.iter().position(|&t| t == token)
        };
        if let Some(i) = index {
            self.logits[i] = f(self.logits[i]);
            self.sorted = false;
        }
    }

    /// Sorts by logit, highest first; ties keep the lower id first (argmax's choice).
    pub fn sort(&mut self) {
        if self.sorted {
            return;
        }
        let mut order: Vec<usize> = (0..self.ids.len()).collect();
        order.sort_by(|&a, &b| {
            self.logits[b]
                .total_cmp(&self.logits[a])
                .then(self.ids[a].cmp(&self.ids[b]))
        });
        self.apply_order(&order);
        self.sorted = true;
    }

    /// Keeps the first `n` tokens of the sorted order.
    pub fn truncate_sorted(&mut self, n: usize) {
        self.sort();
        self.ids.truncate(n.max(1));
        self.logits.truncate(n.max(1));
    }

    /// Keeps the tokens for which `keep(index, logit)` holds (at least the best one).
    pub fn retain(&mut self, mut keep: impl FnMut(usize, f32) -> bool) {
        let best = self.argmax_index();
        let mut i = 0;
        let mut write = 0;
        while i < self.ids.len() {
            if i == best || keep(i, self.logits[i]) {
                self.ids[write] = self.ids[i];
                self.logits[write] = self.logits[i];
                write += 1;
            }
            i += 1;
        }
        self.ids.truncate(write);
        self.logits.truncate(write);
        self.dense = self.dense && write == i;
    }

    /// Keeps only the tokens for which `allowed(id)` holds, in their current order: a hard
    /// constraint (a grammar's mask), which unlike [`Candidates::retain`] may remove the best
    /// token. If it would remove every token, the best one stays (a chain never ends empty).
    pub fn keep_only(&mut self, allowed: impl Fn(TokenId) -> bool) {
        let before = self.ids.len();
        let best = self.argmax_index();
        let mut write = 0;
        for i in 0..before {
            if allowed(self.ids[i]) {
                self.ids[write] = self.ids[i];
                self.logits[write] = self.logits[i];
                write += 1;
            }
        }
        if write == 0 {
            self.ids[0] = self.ids[best];
            self.logits[0] = self.logits[best];
            write = 1;
        }
        self.ids.truncate(write);
        self.logits.truncate(write);
        self.dense = self.dense && write == before;
    }

    /// Probabilities of the remaining tokens (softmax of their logits, in f64 for the sum).
    pub fn probabilities(&self) -> Vec<f32> {
        let max = self
            .logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f64> = self
            .logits
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .collect();
        let sum: f64 = exps.iter().sum();
        exps.into_iter().map(|e| (e / sum) as f32).collect()
    }

    /// Index of the highest logit (the lowest id among ties).
    pub fn argmax_index(&self) -> usize {
        if self.sorted {
            return 0;
        }
        if self.by_id {
            // Ids ascend, so the lowest id among ties is the first of them.
            return first_max_index(&self.logits);
        }
        let mut best = 0;
        for i in 1..self.logits.len() {
            let (l, b) = (self.logits[i], self.logits[best]);
            if l > b || (l == b && self.ids[i] < self.ids[best]) {
                best = i;
            }
        }
        best
    }

    fn apply_order(&mut self, order: &[usize]) {
        self.ids = order.iter().map(|&i| self.ids[i]).collect();
        self.logits = order.iter().map(|&i| self.logits[i]).collect();
        self.dense = false;
        self.by_id = false;
    }

    /// Keeps the `k` highest logits (and any tied with the k-th, as Hugging Face's top-k
    /// does), sorted.
    pub fn top_k(&mut self, k: usize) {
        if k == 0 || k >= self.len() {
            return;
        }
        if !self.sorted {
            // Partial selection first: sorting a 128k vocabulary for k = 40 is wasteful.
            let mut kth: Vec<f32> = self.logits.clone();
            let (_, threshold, _) = kth.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            let threshold = *threshold;
            self.retain(|_, l| l >= threshold);
            self.sort();
        } else {
            let threshold = self.logits[k - 1];
            let keep = self.logits.iter().take_while(|&&l| l >= threshold).count();
            self.truncate_sorted(keep);
        }
    }
}

/// Index of the first highest value of `values` (0 when empty; a NaN is never the highest
/// unless it comes first).
pub fn first_max_index(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best
}
