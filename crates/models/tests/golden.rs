//! Every fixture's logits and greedy continuations against Hugging Face transformers
//! (`scripts/reference/make_model_fixtures.py`), on cpu and on wgpu.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

mod common;

use common::*;
use kiln_core::{Dtype, InferenceBackend};

/// f32 logits within 1e-4 of transformers, for every position of every prompt.
fn logits_match<B: InferenceBackend>() {
    for name in FIXTURES {
        let loaded = load::<B>(name, Dtype::F32);
        let (_, cases) = reference(name);
        for (i, case) in cases.iter().enumerate() {
            let ours = all_logits(&loaded.model, &case.prompt);
            let diff = max_abs_diff(&ours, &case.logits);
            assert!(diff <= 1e-4, "{name} prompt {i}: max |diff| {diff}");
        }
    }
}

/// Greedy 20-token continuations equal transformers' (with cache), token for token, both
/// with kiln's KV cache and by full recomputation.
fn greedy_matches<B: InferenceBackend>() {
    for name in FIXTURES {
        let loaded = load::<B>(name, Dtype::F32);
        let (_, cases) = reference(name);
        for (i, case) in cases.iter().enumerate() {
            let cached = greedy_cached(&loaded.model, &case.prompt, case.greedy.len());
            assert_eq!(cached, case.greedy, "{name} prompt {i}: cached greedy");
            if i == 0 {
                let recomputed = greedy_recompute(&loaded.model, &case.prompt, case.greedy.len());
                assert_eq!(recomputed, cached, "{name} prompt {i}: recompute vs cache");
            }
        }
    }
}

mod cpu {
    type B = burn::backend::Flex;

    #[test]
    fn logits_match_transformers() {
        super::logits_match::<B>();
    }

    #[test]
    fn greedy_matches_transformers() {
        super::greedy_matches::<B>();
    }
}

mod wgpu {
    type B = burn::backend::Wgpu;

    #[test]
    fn logits_match_transformers() {
        super::logits_match::<B>();
    }

    #[test]
    fn greedy_matches_transformers() {
        super::greedy_matches::<B>();
    }
}
