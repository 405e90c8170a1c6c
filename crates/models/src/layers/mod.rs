//! The layers every family shares, each configured by [`crate::config::TransformerConfig`]
//! rather than copied per model.

pub mod attention;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rope;
