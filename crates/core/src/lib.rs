//! # kiln-core
//!
//! The foundation every other kiln crate stands on. It owns:
//!
//! - **backends** ([`backend`]): [`BackendKind`] (`cuda | wgpu | cpu | ndarray`), the
//!   [`InferenceBackend`] extension of burn's `Backend` trait, run-time probing, and
//!   [`backend::run_on`] to run code generic over `B: Backend` on the kind picked at run time;
//! - **KV caches** ([`kv_cache`]): one [`KvCache`] trait with static, dynamic, sliding-window and
//!   paged implementations, and the attention that reads them ([`attention`]);
//! - **sampling** ([`sampling`]): [`Sampler`], a chain of logits processors built from validated
//!   [`SamplingParams`];
//! - **the model contract** ([`model`]): [`CausalLm`], through which the engine drives any model.
//!
//! It knows no model architecture, no file format and no tokenizer.
//!
//! ```
//! use kiln_core::{SamplingParams, Sampler, sampling::TokenHistory};
//!
//! // Temperature 0 is greedy: the highest logit wins.
//! let params = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
//! let mut sampler = Sampler::new(&params, 4).expect("valid parameters");
//! let token = sampler.sample(&[0.1, 2.0, -1.0, 0.5], &TokenHistory::default());
//! assert_eq!(token.0, 1);
//! ```

pub mod attention;
pub mod backend;
pub mod batch;
pub mod dtype;
pub mod error;
pub mod ids;
pub mod kv_cache;
pub mod layer_ops;
pub mod model;
pub mod sampling;
#[cfg(feature = "cpu")]
pub mod selftest;
pub mod tensor;
#[cfg(feature = "test-support")]
pub mod testing;

pub use backend::{BackendKind, DeviceMemory, InferenceBackend};
pub use batch::{Batch, SeqSpan};
pub use dtype::{Dtype, KvDtype};
pub use error::{CoreError, Result};
pub use ids::{BlockId, Position, SeqId, TokenId};
pub use kv_cache::{CacheError, CacheKind, KvCache, KvLayout};
pub use model::{CausalLm, LogitsFor, ModelShape};
pub use sampling::{Sampler, SamplingError, SamplingParams};
