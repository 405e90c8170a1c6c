//! kiln-core's integration tests in one binary, a module per file: every test binary
//! compiles and links its own copy of the backends' generic code, so one binary per crate
//! keeps the test build short.

mod batch;
mod block_pool;
mod kv_cache_conformance;
mod layer_ops;
mod sampling;
mod sampling_hf;
mod sampling_params;
mod static_cache_in_place;
