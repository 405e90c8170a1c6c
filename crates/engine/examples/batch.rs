//! Many prompts through the engine at once on a paged KV cache: packed prefill, batched
//! decode, each request ending on its own (EOS, a stop string or its token budget), text
//! streamed as it is made.
//!
//! ```text
//! cargo run --release -p kiln-engine --example batch
//! ```

use kiln_core::sampling::SamplingParams;
use kiln_core::{CausalLm, InferenceBackend, TokenId};
use kiln_engine::{CacheSpec, Engine, EngineConfig, Event, Request};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, load};

type B = burn::backend::Flex;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = SMOLLM2_135M_INSTRUCT.ensure(&kiln_home()?, &mut |_| {})?;
    let device = B::inference_device();
    let loaded = load::<B>(&path, &LoadOptions::default(), &device)?;
    let model = &loaded.model;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .ok_or("the GGUF has a tokenizer")?;

    // A pool of 16-token blocks shared by every sequence: 4 sequences of up to 256 tokens.
    let config = EngineConfig {
        max_batch: 4,
        ..EngineConfig::default()
    };
    let cache = CacheSpec::paged(config.max_batch, 256).build::<B>(
        model.shape().kv_layout(),
        model.dtype(),
        &device,
    )?;
    let detokenize = |ids: &[TokenId]| tokenizer.decode(ids, false).ok();
    let mut engine = Engine::new(model, cache, config)?.with_detokenizer(&detokenize);

    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "The three primary colors are",
        "Water boils at",
        "My favourite fruit is",
    ];
    for (i, prompt) in prompts.iter().enumerate() {
        engine.submit(Request {
            prompt: tokenizer.encode(prompt, true)?,
            max_tokens: 24 + 8 * i,
            sampling: SamplingParams::greedy(),
            eos: loaded.generation.eos.clone(),
            stop: vec!["\n\n".into()],
            ..Request::default()
        })?;
    }
    // More prompts than `max_batch`: the last two wait until a sequence finishes.
    let mut completions = engine.run(|event| {
        if let Event::Finished(done) = event {
            eprintln!("request {} finished ({:?})", done.id.0, done.finish_reason);
        }
    })?;
    // Completions come in the order they finish.
    completions.sort_by_key(|c| c.id.0);
    for (prompt, done) in prompts.iter().zip(&completions) {
        let text = done.text.as_deref().unwrap_or_default();
        println!("[{}] {prompt}{text}", done.id.0);
        println!(
            "    {} tokens, first after {:.0} ms",
            done.tokens.len(),
            done.timings.time_to_first_token.as_secs_f64() * 1e3
        );
    }
    assert_eq!(engine.cache().usage().sequences, 0, "every block is back");
    Ok(())
}
