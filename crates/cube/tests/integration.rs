//! kiln-cube's integration tests in one binary, a module per file: every test binary
//! compiles and links its own copy of the backends' generic code, so one binary per crate
//! keeps the test build short.

mod attention;
mod common;
mod matmul;
mod quant;
mod rowwise;
