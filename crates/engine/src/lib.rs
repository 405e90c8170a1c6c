//! kiln-engine
