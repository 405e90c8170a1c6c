//! [`generate`]: one sequence, prefill then decode, with a callback per token.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use kiln_core::kv_cache::KvCache;
use kiln_core::sampling::{Sampler, SamplingParams, TokenHistory};
use kiln_core::{
    Batch, CausalLm, CoreError, InferenceBackend, LogitsFor, Position, SeqId, TokenId,
};
use serde::Serialize;

use crate::request::prompt_problem;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// `max_tokens` reached (or the model's context).
    Length,
    /// An end-of-sequence token was sampled (it is not part of the output).
    Eos,
    /// The caller's callback asked to stop.
    Stop,
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The prompt's token ids (BOS included if the model wants one).
    pub prompt: Vec<TokenId>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Tokens that end the sequence.
    pub eos: Vec<TokenId>,
}

/// The result of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids (no EOS).
    pub tokens: Vec<TokenId>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Time of the prefill forward and the first token's sampling (time to first token).
    pub prefill: Duration,
    /// Time of every later step.
    pub decode: Duration,
}

/// Generates one continuation of `request.prompt`, calling `on_token` with each new token
/// (return `ControlFlow::Break` to stop). The cache must not hold this sequence already; it
/// is released at the end.
///
/// # Errors
/// An empty prompt, a prompt that leaves no room in the model's context, invalid sampling
/// parameters, or the cache running out of space.
pub fn generate<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    cache: &mut dyn KvCache<B>,
    request: &GenerateRequest,
    on_token: impl FnMut(TokenId) -> ControlFlow<()>,
) -> Result<Generation, CoreError> {
    let seq = SeqId(0);
    let generation = continue_sequence(model, cache, seq, request, 0, on_token);
    cache.release(seq);
    generation
}

/// Most prompt tokens fed in one forward when the sequence already has history (a sliding
/// cache refuses larger steps; the engine's default `max_step_tokens` is the same).
pub(crate) const HISTORY_CHUNK: usize = 512;

/// Generates a continuation of `request.prompt` on `seq`, whose cache already holds the first
/// `held` prompt tokens: only the rest is computed. On return the cache holds the prompt and
/// every generated token but the last sampled one (which was never fed), less an EOS.
pub(crate) fn continue_sequence<B: InferenceBackend>(
    model: &dyn CausalLm<B>,
    cache: &mut dyn KvCache<B>,
    seq: SeqId,
    request: &GenerateRequest,
    held: usize,
    mut on_token: impl FnMut(TokenId) -> ControlFlow<()>,
) -> Result<Generation, CoreError> {
    let shape = model.shape();
    let prompt = &request.prompt;
    if let Some(why) = prompt_problem(prompt, &shape) {
        return Err(CoreError::ModelInput(why));
    }
    debug_assert!(held < prompt.len(), "at least one prompt token must be fed");
    let mut sampler = Sampler::new(&request.sampling, shape.vocab)?;
    let mut history = TokenHistory::with_prompt(prompt);
    let budget = request.max_tokens.min(shape.max_positions - prompt.len());
    let start = Instant::now();
    let mut prefill = Duration::ZERO;
    let mut finish_reason = FinishReason::Length;
    // A fresh sequence runs its whole prompt at once; history is extended in chunks.
    let chunk = if held == 0 {
        prompt.len()
    } else {
        HISTORY_CHUNK
    };
    let mut fed = held;
    while prompt.len() - fed > chunk {
        let batch = Batch::single(seq, &prompt[fed..fed + chunk], Position(fed as u32))?;
        model.forward(&batch, cache, LogitsFor::LastOfEachSequence)?;
        fed += chunk;
    }
    let mut batch = Batch::single(seq, &prompt[fed..], Position(fed as u32))?;
    for step in 0..budget {
        let logits = model.forward(&batch, cache, LogitsFor::LastOfEachSequence)?;
        let row: Vec<f32> = logits.into_data().iter::<f32>().collect();
        let token = sampler.try_sample(&row, &history)?;
        if step == 0 {
            prefill = start.elapsed();
        }
        if request.eos.contains(&token) {
            finish_reason = FinishReason::Eos;
            break;
        }
        history.push(token);
        if on_token(token).is_break() {
            finish_reason = FinishReason::Stop;
            break;
        }
        let position = Position((prompt.len() + history.generated().len() - 1) as u32);
        batch = Batch::single(seq, &[token], position)?;
    }
    Ok(Generation {
        tokens: history.generated().to_vec(),
        finish_reason,
        prefill,
        decode: start.elapsed().saturating_sub(prefill),
    })
}
