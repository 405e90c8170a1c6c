//! Every test of kiln-core, in one binary, a module per file: every test binary compiles and
//! links its own copy of the backends' generic code, so one binary per crate keeps the test
//! build short. The crate has no unit-test binary (`[lib] test = false`: it would compile the
//! whole crate a second time); the tests use the public API.

mod batch;
mod block_pool;
mod kv_cache_conformance;
mod layer_ops;
mod logit_bias;
mod sampling;
mod sampling_hf;
mod sampling_params;
mod static_cache_in_place;
mod testing;
