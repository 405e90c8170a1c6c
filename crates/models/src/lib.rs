//! kiln-models
