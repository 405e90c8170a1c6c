//! # kiln-models
//!
//! GPT-2 and Llama-3 (3, 3.1, 3.2) in burn, on one set of layers ([`layers`]) configured by
//! [`TransformerConfig`]; loaders for Hugging Face folders, Meta's original checkpoints and
//! llama.cpp GGUF files ([`loaders`], [`gguf`]); tokenizers ([`tokenizer`]); chat templates
//! ([`chat`]). Every model implements
//! [`kiln_core::CausalLm`], the only face the engine sees.
//!
//! It knows nothing of scheduling, sampling or the command line.

pub mod chat;
pub mod config;
pub mod default_model;
pub mod error;
pub mod gguf;
pub mod gpt2;
pub mod host;
pub mod layers;
pub mod llama;
pub mod loaders;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use config::{Architecture, TransformerConfig};
pub use error::{ModelError, Result};
pub use loaders::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat, load};
pub use tokenizer::TextTokenizer;
pub use transformer::Transformer;
