//! kiln-models' integration tests in one binary, a module per file: every test binary
//! compiles and links its own copy of the backends' generic code, so one binary per crate
//! keeps the test build short.

mod common;
mod dcp;
mod fuzz;
mod gguf;
mod golden;
mod loader_errors;
mod precision;
mod smollm2;
mod tokenizers;
mod tool_templates;
