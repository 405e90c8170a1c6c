//! # kiln-models
//!
//! Llama 3 (3, 3.1, 3.2), Mistral, Qwen2/2.5, Qwen3 and GPT-2 in burn, on one set of layers
//! ([`layers`]) configured by [`TransformerConfig`], each family registered in [`family`]; loaders for Hugging Face folders, Meta's original checkpoints (consolidated `.pth` or
//! torchtitan's `torch.distributed.checkpoint` folders) and llama.cpp GGUF files ([`loaders`], [`gguf`]); tokenizers ([`tokenizer`]); chat templates
//! ([`chat`]). Every model implements
//! [`kiln_core::CausalLm`], the only face the engine sees.
//!
//! It knows nothing of scheduling, sampling or the command line.
//!
//! Loading a model (any of the three formats; the format is detected) and running one forward
//! pass over a prompt:
//!
//! ```
//! use kiln_core::kv_cache::DynamicKvCache;
//! use kiln_core::{Batch, CausalLm, LogitsFor, Position, SeqId};
//! use kiln_models::{LoadOptions, load};
//!
//! type B = burn::backend::Flex; // the cpu backend
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let path = std::path::Path::new("tests/fixtures/llama-tiny"); // a Hugging Face folder
//! let loaded = load::<B>(path, &LoadOptions::default(), &Default::default())?;
//! let tokenizer = loaded.tokenizer.as_ref().expect("the folder has tokenizer.json");
//! let prompt = tokenizer.encode("Hello, world", true)?;
//!
//! let model = &loaded.model;
//! let mut cache = DynamicKvCache::<B>::new(model.shape().kv_layout(), model.dtype(), &model.device());
//! let batch = Batch::single(SeqId(0), &prompt, Position(0))?;
//! let logits = model.forward(&batch, &mut cache, LogitsFor::LastOfEachSequence)?;
//! assert_eq!(logits.dims(), [1, model.shape().vocab]);
//! # Ok(())
//! # }
//! ```
//!
//! Rendering a conversation with a model's chat template:
//!
//! ```
//! use kiln_models::chat::{ChatMessage, ChatTemplate, Role};
//!
//! # fn main() -> Result<(), kiln_models::ModelError> {
//! let source = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
//!               {% if add_generation_prompt %}<|assistant|>{% endif %}";
//! let template = ChatTemplate::new(source, "<s>", "</s>")?;
//! let text = template.render(&[ChatMessage::new(Role::User, "Hi!")], true)?;
//! assert_eq!(text, "<|user|>Hi!\n<|assistant|>");
//! # Ok(())
//! # }
//! ```

pub mod chat;
pub mod config;
pub mod decoder;
pub mod default_model;
pub mod error;
pub mod family;
pub mod gguf;
pub mod host;
pub mod info;
pub mod layers;
pub mod loaders;
pub mod random;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, TransformerConfig};
pub use error::{ModelError, Result};
pub use info::ModelInfo;
pub use loaders::{
    Activations, GenerationSettings, LoadOptions, LoadedModel, ModelFormat, WeightStorage, inspect,
    load, load_with_progress,
};
pub use tokenizer::TextTokenizer;
pub use transformer::Transformer;
pub use weights::LoadProgress;
