//! kiln's criterion benchmarks live in `benches/benches/`; run them with
//! `cargo bench -p kiln-benches`. This library holds what they share.
