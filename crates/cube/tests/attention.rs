//! The step attention kernel and the KV write against plain host loops, on wgpu: fresh
//! prompts over their own tokens, history rows over paged blocks and dense rows, grouped
//! heads, windows, and keys split over several cubes.

#![allow(clippy::unwrap_used)]

use crate::common::*;
use kiln_cube::attention::{StepIndex, TOKEN_FIELDS, attention};
use kiln_kernels::attention::Scoring;

/// Softmax attention of one query over the keys it sees (each `(k, v)` a head_dim row), the
/// scores as `scoring` says.
fn reference(q: &[f32], keys: &[(&[f32], &[f32])], scoring: Scoring) -> Vec<f32> {
    let dim = q.len();
    if keys.is_empty() {
        return vec![0.0; dim];
    }
    let scores: Vec<f32> = keys
        .iter()
        .map(|(k, _)| scoring.score(q.iter().zip(*k).map(|(a, b)| a * b).sum::<f32>(), dim))
        .collect();
    let max = scores.iter().copied().fold(f32::MIN, f32::max);
    let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f32 = weights.iter().sum();
    let mut out = vec![0f32; dim];
    for (w, (_, v)) in weights.iter().zip(keys) {
        for (o, x) in out.iter_mut().zip(*v) {
            *o += w / sum * x;
        }
    }
    out
}

/// One buffer holding the parts, as kiln-core uploads it.
#[allow(clippy::too_many_arguments)]
fn step_index(
    tokens: &[i32],
    positions: &[i32],
    places: &[i32],
    key_positions: &[i32],
    keys: usize,
    table: &[i32],
    blocks_per_row: usize,
    max_keys: usize,
    window: Option<usize>,
) -> StepIndex<R> {
    let mut data = Vec::new();
    let mut start = |part: &[i32]| {
        let at = data.len();
        data.extend_from_slice(part);
        at
    };
    let (tokens_at, positions_at, places_at, key_positions_at, table_at) = (
        start(tokens),
        start(positions),
        start(places),
        start(key_positions),
        start(table),
    );
    StepIndex {
        n_tokens: positions.len(),
        data: i32s(&data, &[data.len()]),
        tokens: tokens_at,
        positions: positions_at,
        places: places_at,
        key_positions: key_positions_at,
        keys,
        table: table_at,
        blocks_per_row,
        max_keys,
        window,
    }
}

struct Storage {
    k: Vec<f32>,
    v: Vec<f32>,
    shape: [usize; 4],
}

impl Storage {
    /// Random keys and values for a storage of `shape`, from `seed` and `seed + 1`.
    fn random(shape: [usize; 4], seed: u64) -> Self {
        let len = shape.iter().product();
        Storage {
            k: random(len, seed),
            v: random(len, seed + 1),
            shape,
        }
    }

    fn row(&self, target: usize, head: usize, slot: usize) -> std::ops::Range<usize> {
        let [_, heads, slots, dim] = self.shape;
        let at = ((target * heads + head) * slots + slot) * dim;
        at..at + dim
    }
}

/// One history row: its blocks (per KV head the same targets here), key positions.
struct History {
    blocks: Vec<usize>,
    key_positions: Vec<i32>,
}

/// Runs the kernel and the reference for a batch whose token `t` is fresh (`Err(span)`: its
/// sequence's batch range) or has history (`Ok(row)`), at `positions[t]`.
#[allow(clippy::too_many_arguments)] // the host reference takes every input the kernel does
fn check(
    n_heads: usize,
    n_kv_heads: usize,
    dim: usize,
    storage: &Storage,
    histories: &[History],
    kinds: &[Result<usize, std::ops::Range<usize>>],
    positions: &[i32],
    window: Option<usize>,
    scoring: Scoring,
    seed: u64,
) {
    let n = kinds.len();
    let q = random(n * n_heads * dim, seed);
    let k_new = random(n * n_kv_heads * dim, seed + 1);
    let v_new = random(n * n_kv_heads * dim, seed + 2);
    let slots = storage.shape[2];
    let keys = histories
        .iter()
        .map(|h| h.key_positions.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let blocks_per_row = histories
        .iter()
        .map(|h| h.blocks.len())
        .max()
        .unwrap_or(1)
        .max(1);

    let mut tokens = Vec::new();
    let mut max_keys = 0;
    for (t, kind) in kinds.iter().enumerate() {
        let (row, start, count) = match kind {
            Ok(row) => (*row as i32, 0, histories[*row].key_positions.len()),
            Err(span) => (-1, span.start, span.len()),
        };
        max_keys = max_keys.max(count);
        tokens.extend([row, start as i32, count as i32, positions[t]]);
    }
    let mut key_positions = vec![-1i32; histories.len().max(1) * keys];
    let mut table = vec![0i32; histories.len().max(1) * n_kv_heads * blocks_per_row];
    for (r, h) in histories.iter().enumerate() {
        key_positions[r * keys..][..h.key_positions.len()].copy_from_slice(&h.key_positions);
        for head in 0..n_kv_heads {
            for (i, b) in h.blocks.iter().enumerate() {
                table[(r * n_kv_heads + head) * blocks_per_row + i] =
                    (b * n_kv_heads + head) as i32;
            }
        }
    }
    let index = step_index(
        &tokens,
        positions,
        &[],
        &key_positions,
        keys,
        &table,
        blocks_per_row,
        max_keys,
        window,
    );
    let ours = host(
        attention(
            f32s(&q, &[n, n_heads, dim]),
            f32s(&k_new, &[n, n_kv_heads, dim]),
            f32s(&v_new, &[n, n_kv_heads, dim]),
            f32s(&storage.k, &storage.shape),
            f32s(&storage.v, &storage.shape),
            &index,
            scoring.scale_for(dim),
            scoring.softcap,
        )
        .unwrap(),
    );

    let visible = |q_pos: i32, k_pos: i32| {
        k_pos >= 0 && k_pos <= q_pos && window.is_none_or(|w| ((q_pos - k_pos) as usize) < w)
    };
    for (t, kind) in kinds.iter().enumerate() {
        for head in 0..n_heads {
            let kv = head / (n_heads / n_kv_heads);
            let mut seen: Vec<(&[f32], &[f32])> = Vec::new();
            match kind {
                Err(span) => {
                    for kt in span.clone() {
                        if visible(positions[t], positions[kt]) {
                            let at = (kt * n_kv_heads + kv) * dim;
                            seen.push((&k_new[at..at + dim], &v_new[at..at + dim]));
                        }
                    }
                }
                Ok(row) => {
                    let h = &histories[*row];
                    for (j, &kp) in h.key_positions.iter().enumerate() {
                        if visible(positions[t], kp) {
                            let range = storage.row(h.blocks[j / slots], kv, j % slots);
                            seen.push((&storage.k[range.clone()], &storage.v[range]));
                        }
                    }
                }
            }
            let expected = reference(&q[(t * n_heads + head) * dim..][..dim], &seen, scoring);
            let got = &ours[(t * n_heads + head) * dim..][..dim];
            let diff = max_abs_diff(got, &expected);
            assert!(diff < 2e-6, "token {t} head {head}: max |diff| {diff}");
        }
    }
}

#[test]
fn fresh_prompts_and_paged_history_in_one_launch() {
    let (n_heads, n_kv_heads, dim, slots) = (4, 2, 16, 4);
    let storage = Storage::random([6, n_kv_heads, slots, dim], 20);
    // Row 0: 6 keys in blocks 2 then 4 (positions 0..6); row 1: 5 keys in blocks 5, 0, one
    // slot empty (position -1) in the middle.
    let histories = [
        History {
            blocks: vec![2, 4],
            key_positions: vec![0, 1, 2, 3, 4, 5],
        },
        History {
            blocks: vec![5, 0],
            key_positions: vec![0, 1, -1, 2, 3],
        },
    ];
    // Batch: a fresh prompt of 3 tokens, row 0 decoding at position 5, a fresh prompt of 2,
    // row 1 feeding 2 tokens at positions 2 and 3 (the second sees one more key).
    let kinds = [
        Err(0..3),
        Err(0..3),
        Err(0..3),
        Ok(0),
        Err(4..6),
        Err(4..6),
        Ok(1),
        Ok(1),
    ];
    let positions = [0, 1, 2, 5, 0, 1, 2, 3];
    // Without a window, then with one; then Gemma 2's scores (a scale of its own and a soft
    // cap small enough to bend these scores).
    let gemma = Scoring {
        scale: Some(0.7),
        softcap: Some(0.5),
    };
    for (window, scoring, seed) in [
        (None, Scoring::default(), 30),
        (Some(2), Scoring::default(), 31),
        (None, gemma, 32),
        (Some(2), gemma, 33),
    ] {
        check(
            n_heads, n_kv_heads, dim, &storage, &histories, &kinds, &positions, window, scoring,
            seed,
        );
    }
}

#[test]
fn many_queries_share_a_cube_per_kv_head() {
    // 40 fresh tokens × 2 KV heads: enough (query, KV head) pairs for the kernel to serve the
    // 4 query heads of each KV head from one cube (192 outputs: two per unit for some); a
    // decoding row beside them.
    let (n_heads, n_kv_heads, dim, slots) = (8, 2, 48, 8);
    let storage = Storage::random([2, n_kv_heads, slots, dim], 60);
    let histories = [History {
        blocks: vec![1, 0],
        key_positions: (0..12).collect(),
    }];
    let mut kinds = vec![Err(0..40); 40];
    kinds.push(Ok(0));
    let mut positions: Vec<i32> = (0..40).collect();
    positions.push(11);
    // Without a window, then with one.
    for (window, seed) in [(None, 62), (Some(5), 63)] {
        check(
            n_heads,
            n_kv_heads,
            dim,
            &storage,
            &histories,
            &kinds,
            &positions,
            window,
            Scoring::default(),
            seed,
        );
    }
}

#[test]
fn long_rows_split_over_cubes_and_wide_heads() {
    // Dense rows: one block of 400 slots per row; row 1 holds 300 keys, so a single decoding
    // query splits its keys over three cubes. head_dim 160 uses two accumulators per unit.
    for (dim, n_heads) in [(64, 2), (160, 2), (64, 8), (160, 8)] {
        let (n_kv_heads, slots) = (1, 400);
        let storage = Storage::random([2, n_kv_heads, slots, dim], 40);
        let histories = [
            History {
                blocks: vec![1],
                key_positions: (0..300).collect(),
            },
            History {
                blocks: vec![0],
                key_positions: (0..7).collect(),
            },
        ];
        let kinds = [Ok(0), Ok(1)];
        let positions = [299, 6];
        // Without a window, then with one.
        for (window, seed) in [(None, 50), (Some(100), 51)] {
            check(
                n_heads,
                n_kv_heads,
                dim,
                &storage,
                &histories,
                &kinds,
                &positions,
                window,
                Scoring::default(),
                seed,
            );
        }
    }
}

#[test]
fn kv_write_scatters_each_token_to_its_place() {
    let (targets, heads, slots, dim) = (3, 2, 4, 8);
    let store_len = targets * heads * slots * dim;
    let k_store = f32s(&vec![0.0; store_len], &[targets, heads, slots, dim]);
    let v_store = f32s(&vec![0.0; store_len], &[targets, heads, slots, dim]);
    let n = 4;
    let k = random(n * heads * dim, 60);
    let v = random(n * heads * dim, 61);
    // Places: target 2 slot 1, target 0 slot 3, skipped, target 1 slot 0.
    let dest = [[2, 1], [0, 3], [-1, 0], [1, 0]];
    // The places sit after other parts in the buffer, as in a real index.
    let index = step_index(
        &[0; 4 * TOKEN_FIELDS],
        &[0, 1, 2, 3],
        dest.as_flattened(),
        &[-1],
        1,
        &[0; 2],
        1,
        0,
        None,
    );
    kiln_cube::kv::write(
        f32s(&k, &[n, heads, dim]),
        f32s(&v, &[n, heads, dim]),
        &index,
        &k_store,
        &v_store,
    )
    .unwrap();
    let (ks, vs) = (host(k_store), host(v_store));
    let mut expected_k = vec![0f32; store_len];
    let mut expected_v = vec![0f32; store_len];
    for (t, &[target, slot]) in dest.iter().enumerate() {
        if target < 0 {
            continue;
        }
        let (target, slot) = (target as usize, slot as usize);
        for h in 0..heads {
            let at = ((target * heads + h) * slots + slot) * dim;
            let from = (t * heads + h) * dim;
            expected_k[at..at + dim].copy_from_slice(&k[from..from + dim]);
            expected_v[at..at + dim].copy_from_slice(&v[from..from + dim]);
        }
    }
    assert_eq!(ks, expected_k);
    assert_eq!(vs, expected_v);
}
