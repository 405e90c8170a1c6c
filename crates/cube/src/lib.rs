//! # kiln-cube
//!
//! kiln's GPU kernels, written once in [cubecl](https://github.com/tracel-ai/cubecl) so the same
//! code runs on CUDA and on wgpu (Vulkan, Metal; Mesa's lavapipe on a machine without a GPU).
//! They take and return burn-cubecl's [`CubeTensor`](burn_cubecl::tensor::CubeTensor)s, the
//! buffers under burn's `CubeBackend`, and replace burn's generic compositions where those cost
//! a launch per elementary operation or copy the KV cache:
//!
//! - [`rowwise`]: RMSNorm (alone, or with the residual addition before it), rotary
//!   embeddings (rotate-half layout; alone, or with the cut of a fused Q/K/V projection into
//!   its parts) and SwiGLU's gating, one launch each;
//! - [`kv`]: a step's new K/V scattered into the cache storage in one launch per layer,
//!   whatever the batch;
//! - [`attention`]: one attention launch per layer for every sequence of a step (fresh prompts
//!   over their own tokens, sequences with history over the cache through its block table),
//!   split over keys for long contexts and combined by a second launch (flash-decoding);
//! - [`matmul`]: products on fixed kernel choices (no autotuning on a request's path) that keep
//!   f32 exact (no TF32);
//! - [`quant`]: weights kept in their GGUF blocks on the device (Q8_0, Q4_0/1, Q5_0/1, Q4_K,
//!   Q5_K, Q6_K), decoded where they are multiplied.
//!
//! Every kernel accumulates in f32 and is checked against a plain host computation in
//! `tests/` on the wgpu backend (lavapipe in CI). The crate knows nothing of kiln's caches,
//! models or engine: its inputs are tensors and index arrays.

pub mod attention;
pub mod kv;
pub mod matmul;
pub mod quant;
pub mod rowwise;
mod util;

pub use util::{CubeError, Result};
