//! # kiln-engine
//!
//! Prefill and decode over any [`kiln_core::CausalLm`]. Today: [`generate`], one sequence,
//! the plain loop (prefill the prompt once, then one token per step through the KV cache)
//! that the batched engine is tested against. The engine knows models only through
//! `CausalLm`, and tokens only as ids.

pub mod generate;

pub use generate::{FinishReason, GenerateRequest, Generation, generate};
