//! Snapshot files that lie are errors naming the field, never an allocation the file does
//! not justify; and the snapshot reader under the mutation fuzzer (~10 s; longer with
//! `KILN_FUZZ_SECONDS=600 cargo test --profile ci --locked -p kiln-engine --no-default-features
//! --features kiln-core/cpu,kiln-core/ndarray --lib -- fuzz`).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

// The fuzzer kiln-models' tests use: std only, shared by path rather than by a crate.
#[path = "../../../models/tests/fuzz/harness.rs"]
mod harness;

use harness::{Fields, Guard, Seed, Target, fuzz, peak_of};

use super::*;

#[global_allocator]
static GUARD: Guard = Guard;

/// A snapshot of `n_layers` layers over `tokens` tokens, with distinct values.
fn snapshot(n_layers: usize, tokens: usize, n_kv_heads: usize, head_dim: usize) -> Snapshot {
    let per_layer = tokens * n_kv_heads * head_dim;
    let values = |layer: usize, v: usize| -> Vec<f32> {
        (0..per_layer)
            .map(|i| (layer * 1000 + v * 100 + i) as f32 / 7.0)
            .collect()
    };
    Snapshot {
        model: "test-model 1.0".into(),
        dtype: Dtype::F32,
        layout: KvLayout {
            n_layers,
            n_kv_heads,
            head_dim,
        },
        tokens: (0..tokens as u32).map(TokenId).collect(),
        layers: (0..n_layers)
            .map(|l| (values(l, 0), values(l, 1)))
            .collect(),
    }
}

fn bytes_of(snapshot: &Snapshot) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.kv");
    snapshot.save(&path).unwrap();
    std::fs::read(&path).unwrap()
}

/// A file of the current format with `header` as its JSON and `data` after it.
fn file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend((header.len() as u64).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

#[test]
fn a_saved_snapshot_reads_back_equal() {
    let original = snapshot(3, 5, 2, 4);
    assert_eq!(
        Snapshot::from_bytes(&bytes_of(&original)).unwrap(),
        original
    );
}

/// The audit's file: 182 bytes claiming 10^12 layers of no tokens passed the length check
/// (no tokens, no data) and aborted on a 48 TB allocation. Each lying size is now named.
#[test]
fn lying_sizes_are_refused_naming_the_field() {
    let header = |n_layers: u64, n_kv_heads: u64, head_dim: u64, tokens: &str| {
        format!(
            r#"{{"model":"m","dtype":"f32","n_layers":{n_layers},"n_kv_heads":{n_kv_heads},"head_dim":{head_dim},"tokens":[{tokens}]}}"#
        )
    };
    let cases = [
        (
            file(&header(1_000_000_000_000, 8, 64, ""), &[]),
            "`tokens` is empty",
        ),
        (
            file(&header(1_000_000_000_000, 1, 1, "1"), &[0; 8]),
            "`n_layers` is 1000000000000, not between 1 and 65536",
        ),
        (
            file(&header(2, 1 << 40, 1, "1"), &[0; 8]),
            "`n_kv_heads` is 1099511627776",
        ),
        (file(&header(2, 1, 0, "1"), &[]), "`head_dim` is 0"),
        (
            file(&header(2, 2, 4, "1,2"), &[0; 100]),
            "100 data bytes, the header implies 256",
        ),
    ];
    for (bytes, expected) in cases {
        let (result, peak) = peak_of(|| Snapshot::from_bytes(&bytes));
        let err = result.unwrap_err();
        assert!(err.contains(expected), "{err}");
        assert!(peak < 64 << 10, "{peak} bytes to refuse {expected}");
    }

    // The header's length, past the end or past any file.
    let mut bytes = file(&header(1, 1, 1, "1"), &[0; 8]);
    for len in [1 << 20, u64::MAX] {
        bytes[8..16].copy_from_slice(&len.to_le_bytes());
        let err = Snapshot::from_bytes(&bytes).unwrap_err();
        assert!(err.contains(&format!("its length is {len} bytes")), "{err}");
    }

    // Through the file: the path and the reason.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lying.kv");
    std::fs::write(&path, file(&header(1 << 40, 1, 1, "1"), &[0; 8])).unwrap();
    let err = Snapshot::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("lying.kv") && err.contains("`n_layers` is 1099511627776"),
        "{err}"
    );
}

/// Mutated snapshots read as `Ok` or `Err`, never a panic, and in memory at most eight times
/// their bytes (the file's f32s once, plus a K and a V vector per layer: 56 bytes for the 8
/// each layer takes at the least).
#[test]
fn fuzz_snapshot_reader() {
    let seeds: Vec<Seed> = [snapshot(2, 3, 2, 4), snapshot(1, 1, 1, 2)]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let bytes = bytes_of(s);
            let n = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
            Seed {
                name: format!("snapshot {i}"),
                fields: Fields {
                    u64s: vec![8],
                    json: Some(16..16 + n),
                    json_len_at: Some(8),
                    header_end: 16 + n,
                    ..Fields::default()
                },
                bytes,
            }
        })
        .collect();
    let run = |_: &Seed, input: &[u8]| {
        let (result, peak) = peak_of(|| Snapshot::from_bytes(input));
        assert!(
            peak <= 8 * input.len() + (64 << 10),
            "{peak} bytes for a file of {} ({result:?})",
            input.len()
        );
    };
    fuzz(&Target {
        name: "snapshot",
        seeds,
        max_alloc: 64 << 20,
        run: &run,
    });
}
