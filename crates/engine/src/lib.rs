//! # kiln-engine
//!
//! Prefill and decode over any [`kiln_core::CausalLm`]:
//! - [`Engine`]: many requests at once over one KV cache of any kind ([`CacheSpec`]): packed
//!   prefill of fresh prompts, batched decode, chunked prefill, admission of new requests
//!   whenever there is room, preemption when the cache runs out, EOS / stop strings / length,
//!   streaming text ([`Event`]).
//! - [`generate`]: one sequence, the plain loop the engine is tested against.
//! - [`snapshot`]: a prefilled prompt's KV cache saved to a file and resumed later.
//!
//! The engine knows models only through `CausalLm`, and text only through a [`Detokenizer`].

pub mod cache;
pub mod detok;
pub mod engine;
pub mod error;
pub mod generate;
pub mod request;
mod sequence;
pub mod snapshot;
pub mod stop;

pub use cache::CacheSpec;
pub use detok::Detokenizer;
pub use engine::{Engine, EngineConfig};
pub use error::EngineError;
pub use generate::{FinishReason, GenerateRequest, Generation, generate};
pub use request::{Completion, Event, Request, RequestId, Timings};
pub use snapshot::Snapshot;
