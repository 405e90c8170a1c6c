//! The layers GPT-2 and Llama share, each configured by [`crate::config::TransformerConfig`]
//! rather than copied per model.

pub mod attention;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rope;
