//! A sampler processor of your own: a lipogram, the default model writing without the letter
//! `e`. The processor drops every candidate token whose text contains it; the built-in
//! temperature and top-k run after it. The decode loop is written out by hand, driving the
//! model and a KV cache directly.
//!
//! ```text
//! cargo run --release -p kiln-engine --example custom_processor
//! ```

use std::collections::HashSet;

use kiln_core::kv_cache::DynamicKvCache;
use kiln_core::sampling::{
    Candidates, LogitsProcessor, Selection, Temperature, TokenHistory, TopK,
};
use kiln_core::{Batch, CausalLm, InferenceBackend, LogitsFor, Position, Sampler, SeqId, TokenId};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, load};

type B = burn::backend::Flex;

/// Forbids the tokens in `banned`: a logit of minus infinity is a probability of zero.
/// (`Candidates::retain` would always keep the best token, so it cannot ban.)
#[derive(Debug)]
struct Ban {
    banned: HashSet<TokenId>,
}

impl LogitsProcessor for Ban {
    fn name(&self) -> &'static str {
        "ban"
    }

    fn process(&self, candidates: &mut Candidates, _history: &TokenHistory) {
        let ids = candidates.ids().to_vec();
        for (id, logit) in ids.iter().zip(candidates.logits_mut()) {
            if self.banned.contains(id) {
                *logit = f32::NEG_INFINITY;
            }
        }
        candidates.unsort();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = SMOLLM2_135M_INSTRUCT.ensure(&kiln_home()?, &mut |_| {})?;
    let device = B::inference_device();
    let loaded = load::<B>(&path, &LoadOptions::default(), &device)?;
    let model = &loaded.model;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .ok_or("the GGUF has a tokenizer")?;
    let vocab = model.shape().vocab;

    let banned: HashSet<TokenId> = (0..vocab as u32)
        .map(TokenId)
        .filter(|&id| {
            tokenizer
                .decode(&[id], false)
                .is_ok_and(|text| text.to_lowercase().contains('e'))
        })
        .collect();
    let processors: Vec<Box<dyn LogitsProcessor>> = vec![
        Box::new(Ban { banned }),
        Box::new(Temperature(0.7)),
        Box::new(TopK(40)),
    ];
    let mut sampler = Sampler::with_processors(processors, Selection::Multinomial, vocab, Some(7));
    println!("chain: {:?}", sampler.chain());

    let prompt = tokenizer.encode("A story about a cat:", true)?;
    let mut history = TokenHistory::with_prompt(&prompt);
    let mut cache = DynamicKvCache::<B>::new(model.shape().kv_layout(), model.dtype(), &device);
    let seq = SeqId(0);
    let mut batch = Batch::single(seq, &prompt, Position(0))?;
    for _ in 0..40 {
        let logits = model.forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)?;
        let row: Vec<f32> = logits.into_data().iter::<f32>().collect();
        let token = sampler.try_sample(&row, &history)?;
        if loaded.generation.eos.contains(&token) {
            break;
        }
        history.push(token);
        let position = Position((prompt.len() + history.generated().len() - 1) as u32);
        batch = Batch::single(seq, &[token], position)?;
    }
    let text = tokenizer.decode(history.generated(), true)?;
    println!("A story about a cat:{text}");
    assert!(!text.to_lowercase().contains('e'), "the ban holds");
    Ok(())
}
