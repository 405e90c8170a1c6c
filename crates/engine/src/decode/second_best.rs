//! A toy decoding mode, for the tests: always the second most likely token. It shows what a
//! new mode takes: this file, and one registry line ([`crate::Engine::with_mode`] here, or a
//! line in [`super::standard_modes`] for every engine). Nothing in the scheduler, the runner
//! or [`crate::Engine::step`] knows it exists.

use std::any::Any;

use kiln_core::sampling::Sampler;
use kiln_core::{InferenceBackend, TokenId};

use super::{Decoder, DecodingMode, ModeContext, Rows, StepContext};
use crate::error::EngineError;
use crate::finish::FinishReason;
use crate::request::Request;
use crate::sequence::SeqState;
use crate::speculate::SpecCounts;

/// The second-highest logit's token (the lower id on ties).
///
/// # Shapes
/// `logits`: `[vocab]`.
fn second_best(logits: &[f32]) -> TokenId {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    TokenId(ids[1] as u32)
}

#[derive(Default)]
struct SecondBest {
    counts: SpecCounts,
}

impl Decoder for SecondBest {
    fn consume(
        &mut self,
        seq: &mut SeqState,
        n: usize,
        rows: Rows<'_>,
        cx: &mut StepContext<'_>,
    ) -> Result<Option<FinishReason>, EngineError> {
        if !seq.feed_done(n) {
            return Ok(None);
        }
        self.counts.forwards += 1;
        self.counts.tokens += 1;
        let token = second_best(rows.logits);
        if seq.request.eos.contains(&token) {
            return Ok(Some(FinishReason::Eos));
        }
        if seq.accept(token, None, cx.detok, cx.events) {
            return Ok(Some(FinishReason::Stop));
        }
        Ok((seq.generated.len() >= seq.budget).then_some(FinishReason::Length))
    }

    fn counts(&self) -> SpecCounts {
        self.counts
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Serves every request that is not a beam search.
struct SecondBestMode;

impl<B: InferenceBackend> DecodingMode<B> for SecondBestMode {
    fn name(&self) -> &'static str {
        "second best"
    }

    fn serves(&self, request: &Request) -> bool {
        request.beam.is_none()
    }

    fn decoder(
        &mut self,
        _seq: &SeqState,
        _sampler: Sampler,
        _cx: &ModeContext<'_>,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        Ok(Box::new(SecondBest::default()))
    }
}

#[cfg(test)]
mod tests {
    use kiln_core::kv_cache::{CacheKind, DynamicKvCache};
    use kiln_core::{Batch, CausalLm, LogitsFor, Position, SeqId};

    use super::*;
    use crate::{CacheSpec, Engine, EngineConfig};

    type B = burn::backend::Flex;

    /// The continuation a full recompute picks: the whole context through a fresh cache
    /// each time, the second-best token of the last row.
    fn recomputed(model: &dyn CausalLm<B>, prompt: &[TokenId], n: usize) -> Vec<TokenId> {
        let mut context = prompt.to_vec();
        for _ in 0..n {
            let mut cache =
                DynamicKvCache::<B>::new(model.shape().kv_layout(), model.dtype(), &model.device());
            let mut batch = Batch::new();
            batch.push(SeqId(0), &context, Position(0)).unwrap();
            let logits = model
                .forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)
                .unwrap();
            context.push(second_best(&kiln_core::tensor::host_f32(logits)));
        }
        context.split_off(prompt.len())
    }

    #[test]
    fn a_mode_registered_in_one_line_decodes_every_request() {
        let path = std::path::Path::new("../models/tests/fixtures/llama-tiny");
        let loaded = kiln_models::load::<B>(path, &Default::default(), &Default::default())
            .expect("the fixture loads");
        let model = &loaded.model;
        let prompts: Vec<Vec<TokenId>> = [vec![1, 2, 3, 4, 5], vec![7, 8], vec![1, 2, 3, 9]]
            .into_iter()
            .map(|p| p.into_iter().map(TokenId).collect())
            .collect();
        for kind in [CacheKind::Paged, CacheKind::Static] {
            let spec = CacheSpec {
                kind,
                ..CacheSpec::paged(4, 64)
            };
            let cache = spec
                .build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())
                .unwrap();
            let mut engine = Engine::new(model, cache, EngineConfig::default())
                .unwrap()
                .with_mode(Box::new(SecondBestMode));
            for prompt in &prompts {
                engine
                    .submit(Request {
                        prompt: prompt.clone(),
                        max_tokens: 6,
                        ..Request::default()
                    })
                    .unwrap();
            }
            let done = engine.run(|_| {}).unwrap();
            for (prompt, completion) in prompts.iter().zip(&done) {
                let expected = recomputed(model, prompt, completion.tokens.len());
                assert_eq!(
                    completion.tokens, expected,
                    "{kind} cache, prompt {prompt:?}"
                );
            }
        }
    }
}
