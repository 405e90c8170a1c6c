//! # kiln-engine
//!
//! Prefill and decode over any [`kiln_core::CausalLm`]:
//! - [`Engine`]: many requests at once over one KV cache of any kind ([`CacheSpec`]): packed
//!   prefill of fresh prompts, batched decode, chunked prefill, admission of new requests
//!   whenever there is room, preemption when the cache runs out, EOS / stop strings / length,
//!   streaming text ([`Event`]).
//! - [`beam`]: beam search with transformers' semantics ([`Request::beam`]): each beam a
//!   sequence of the batch, forked in the cache as the search goes.
//! - [`generate()`]: one request with a callback per token (an engine with one request).
//! - [`Session`]: one conversation whose KV cache is kept between replies, so each turn
//!   computes only what is new (an engine whose requests continue each other's cache).
//! - [`bench`](mod@bench): one cell of the benchmark matrix (`kiln bench`): an [`Engine`]'s steps
//!   timed, prefill and decode apart.
//! - [`snapshot`]: a prefilled prompt's KV cache saved to a file and resumed later.
//! - [`embed`](mod@embed): embeddings, each input's final hidden states pooled and normalised,
//!   beside generation but outside its KV cache ([`Embedding`]).
//! - [`structured`]: output constrained to a JSON schema, a regex or a grammar
//!   ([`Request::constraint`]).
//!
//! All of them generate through [`Engine::step`], so what the engine does (chunked prefill,
//! prefix caching, preemption) they all do.
//!
//! The engine knows models only through `CausalLm`, and text only through a [`Detokenizer`].
//!
//! Two prompts served together on a paged cache:
//!
//! ```
//! use kiln_core::sampling::SamplingParams;
//! use kiln_core::{CausalLm, TokenId};
//! use kiln_engine::{CacheSpec, Engine, EngineConfig, FinishReason, Request};
//!
//! type B = burn::backend::Flex; // the cpu backend
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let path = std::path::Path::new("../models/tests/fixtures/llama-tiny");
//! let loaded = kiln_models::load::<B>(path, &Default::default(), &Default::default())?;
//! let model = &loaded.model;
//!
//! let cache = CacheSpec::paged(2, 64).build::<B>(model.shape().kv_layout(), model.dtype(), &model.device())?;
//! let mut engine = Engine::new(model, cache, EngineConfig::default())?;
//! for prompt in [vec![1, 2, 3], vec![4, 5]] {
//!     engine.submit(Request {
//!         prompt: prompt.into_iter().map(TokenId).collect(),
//!         max_tokens: 5,
//!         sampling: SamplingParams::greedy(),
//!         ..Request::default()
//!     })?;
//! }
//! let done = engine.run(|_event| {})?; // events stream tokens and text as they come
//! assert_eq!(done.len(), 2);
//! assert!(done.iter().all(|c| c.tokens.len() == 5 && c.finish_reason == FinishReason::Length));
//! # Ok(())
//! # }
//! ```

pub mod beam;
pub mod bench;
pub mod cache;
pub mod config;
mod decode;
pub mod detok;
mod drafter;
pub mod embed;
pub mod engine;
pub mod error;
pub mod finish;
pub mod generate;
pub mod request;
mod runner;
mod scheduler;
mod sequence;
pub mod session;
pub mod snapshot;
pub mod spec;
pub mod speculate;
pub mod stop;
pub mod structured;

pub use beam::{BeamHypothesis, BeamSearch, EarlyStopping, MAX_BEAMS};
pub use cache::CacheSpec;
pub use detok::Detokenizer;
pub use embed::{Embedding, Pooling};
pub use engine::{Engine, EngineConfig, PrefixStats, StepPolicy};
pub use error::EngineError;
pub use finish::FinishReason;
pub use generate::generate;
pub use request::{
    Completion, Event, MAX_TOP_LOGPROBS, Request, RequestId, Timings, TokenLogprobs, prompt_problem,
};
pub use session::Session;
pub use snapshot::Snapshot;
pub use spec::{EngineOptions, EngineSettings, EngineSpec, Run, SpecError, Workload};
pub use speculate::{DraftSource, SpecCounts, Speculation};
pub use structured::{
    Grammar, GrammarCompiler, GrammarMatcher, JsonWhitespace, MAX_JSON_DIGITS, OutputConstraint,
    StructuredError, UnknownJsonWhitespace,
};
