//! The attention kernel against an f64 reference, and its promise that a query's output does
//! not depend on the keys it cannot see (so batches equal single runs bit for bit).

use half::{bf16, f16};
use kiln_kernels::attention::{
    AttentionShape, KvBlocks, KvElement, Q8_0Block, Scoring, attention, attention_blocks,
    attention_blocks_with, attention_partitioned, dequantize_q8_0, quantize_q8_0,
};
use kiln_kernels::{ThreadPool, Tier};
use proptest::prelude::*;

/// [`attention`] on `tier`: each (batch row, KV head)'s keys one block.
#[allow(clippy::too_many_arguments)]
fn attention_on(
    tier: Tier,
    shape: AttentionShape,
    scoring: Scoring,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
) {
    let table: Vec<usize> = (0..shape.batch * shape.n_kv_heads).collect();
    let kv = KvBlocks {
        k,
        v,
        table: &table,
        block_keys: shape.keys,
    };
    attention_blocks_with(shape, scoring, q, kv, mask, out, pool, tier)
        .expect("the test builds matching shapes");
}

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// softmax(scores(q kᵀ) masked) v in f64, one query head at a time, the scores as `scoring`
/// says (`q·k/√d` by default, then `c tanh(s/c)` with a soft cap `c`).
fn reference_scored(
    shape: AttentionShape,
    scoring: Scoring,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
) -> Vec<f64> {
    let AttentionShape {
        batch,
        n_kv_heads,
        n_rep,
        q_len,
        keys,
        head_dim,
    } = shape;
    let q_rows = n_rep * q_len;
    let mut out = vec![0f64; q.len()];
    for b in 0..batch {
        for kv in 0..n_kv_heads {
            let block = b * n_kv_heads + kv;
            for row in 0..q_rows {
                let i = row % q_len;
                let qv = &q[(block * q_rows + row) * head_dim..][..head_dim];
                let visible: Vec<usize> = (0..keys)
                    .filter(|&j| !mask[(b * q_len + i) * keys + j])
                    .collect();
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        let kv_row = &k[(block * keys + j) * head_dim..][..head_dim];
                        let dot: f64 = qv
                            .iter()
                            .zip(kv_row)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum();
                        let scale = scoring
                            .scale
                            .map_or(1.0 / (head_dim as f64).sqrt(), f64::from);
                        let s = dot * scale;
                        match scoring.softcap.map(f64::from) {
                            Some(cap) => cap * (s / cap).tanh(),
                            None => s,
                        }
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                for (&j, w) in visible.iter().zip(&weights) {
                    let v_row = &v[(block * keys + j) * head_dim..][..head_dim];
                    for d in 0..head_dim {
                        out[(block * q_rows + row) * head_dim + d] += w / sum * v_row[d] as f64;
                    }
                }
            }
        }
    }
    out
}

/// [`reference_scored`] with the default scores.
fn reference(shape: AttentionShape, q: &[f32], k: &[f32], v: &[f32], mask: &[bool]) -> Vec<f64> {
    reference_scored(shape, Scoring::default(), q, k, v, mask)
}

/// The default scores, a custom scale (Gemma's `query_pre_attn_scalar`), and soft caps from
/// ones that bend every score to ones that barely touch them.
fn scorings() -> impl Strategy<Value = Scoring> {
    prop_oneof![
        Just(Scoring::default()),
        (0.05f32..2.0, proptest::option::of(0.3f32..50.0)).prop_map(|(scale, softcap)| Scoring {
            scale: Some(scale),
            softcap,
        }),
        (0.3f32..50.0).prop_map(|cap| Scoring {
            scale: None,
            softcap: Some(cap),
        }),
    ]
}

/// Random queries, keys, values and masks for `shape` (masks hide about 40 % of the keys,
/// sometimes every key of a query).
fn operands(shape: AttentionShape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<bool>) {
    let q = values(
        shape.batch * shape.n_kv_heads * shape.n_rep * shape.q_len * shape.head_dim,
        seed,
    );
    let k = values(
        shape.batch * shape.n_kv_heads * shape.keys * shape.head_dim,
        seed ^ 1,
    );
    let v = values(k.len(), seed ^ 2);
    let mask = values(shape.batch * shape.q_len * shape.keys, seed ^ 3)
        .iter()
        .map(|x| *x > 0.2)
        .collect();
    (q, k, v, mask)
}

/// How much more than a head of 64 a head of `shape`'s width rounds: the tiles take each
/// score as one chain of FMAs over the head (keys in lanes), whose f32 error grows with its
/// length.
fn wide_head(shape: AttentionShape) -> f64 {
    (shape.head_dim as f64 / 64.0).max(1.0)
}

fn shapes() -> impl Strategy<Value = (AttentionShape, u64)> {
    (
        1usize..3,
        1usize..3,
        1usize..4,
        1usize..20,
        1usize..40,
        // Any width, often a multiple of 16 (the AVX-512 tiles' widths), sometimes wider than
        // the 128 columns AVX2's weighted sum keeps in one window (Gemma's 256).
        prop_oneof![
            4 => 1usize..70,
            4 => (1usize..6).prop_map(|x| x * 16),
            1 => (9usize..17).prop_map(|x| x * 16),
        ],
        any::<u64>(),
    )
        .prop_map(|(batch, n_kv_heads, n_rep, q_len, keys, head_dim, seed)| {
            (
                AttentionShape {
                    batch,
                    n_kv_heads,
                    n_rep,
                    q_len,
                    keys,
                    head_dim,
                },
                seed,
            )
        })
}

/// [`attention_partitioned`] on `tier` over K/V of type `T`, each (batch row, KV head)'s
/// keys one block.
#[allow(clippy::too_many_arguments)]
fn partitioned_on<T: KvElement>(
    tier: Tier,
    shape: AttentionShape,
    partition_keys: usize,
    q: &[f32],
    k: &[T],
    v: &[T],
    mask: &[bool],
    pool: &ThreadPool,
) -> Vec<f32> {
    let table: Vec<usize> = (0..shape.batch * shape.n_kv_heads).collect();
    let kv = KvBlocks {
        k,
        v,
        table: &table,
        block_keys: shape.keys,
    };
    let mut out = vec![f32::NAN; q.len()];
    attention_partitioned(
        shape,
        Scoring::default(),
        q,
        kv,
        mask,
        &mut out,
        pool,
        tier,
        partition_keys,
    )
    .expect("the test builds matching shapes");
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn matches_the_f64_reference(
        (shape, seed) in shapes(),
        scoring in scorings(),
        threads in 1usize..4,
    ) {
        let (q, k, v, mask) = operands(shape, seed);
        let expected = reference_scored(shape, scoring, &q, &k, &v, &mask);
        // f32 rounds a score in proportion to its size: a scale above the default's
        // (1/√head_dim) sharpens the softmax and the tolerance grows with it.
        let sharper = scoring.scale_for(shape.head_dim) * (shape.head_dim as f32).sqrt();
        let tolerance = 1e-5 * f64::from(sharper.max(1.0)) * wide_head(shape);
        for tier in Tier::supported() {
            let mut out = vec![f32::NAN; q.len()];
            attention_on(tier, shape, scoring, &q, &k, &v, &mask, &mut out, &ThreadPool::new(threads));
            for (got, want) in out.iter().zip(&expected) {
                prop_assert!((*got as f64 - want).abs() < tolerance, "{tier}: {got} vs {want}");
            }
        }
    }

    /// Keys in partitions of any size, merged, and f16 or bf16 K/V read in place: the f64
    /// reference over the same (widened) values, on every tier.
    #[test]
    fn partitions_and_narrow_kv_match_the_f64_reference(
        (shape, seed) in shapes(),
        partition_keys in 1usize..12,
        threads in 1usize..4,
    ) {
        let (q, k, v, mask) = operands(shape, seed);
        let pool = ThreadPool::new(threads);
        let (k16, v16): (Vec<f16>, Vec<f16>) =
            (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect());
        let (kb, vb): (Vec<bf16>, Vec<bf16>) =
            (k.iter().map(|&x| bf16::from_f32(x)).collect(), v.iter().map(|&x| bf16::from_f32(x)).collect());
        let widen = |x: &[f16]| x.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
        let widen_b = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<_>>();
        let cases = [
            ("f32", reference(shape, &q, &k, &v, &mask)),
            ("f16", reference(shape, &q, &widen(&k16), &widen(&v16), &mask)),
            ("bf16", reference(shape, &q, &widen_b(&kb), &widen_b(&vb), &mask)),
        ];
        for tier in Tier::supported() {
            for (name, expected) in &cases {
                let out = match *name {
                    "f32" => partitioned_on(tier, shape, partition_keys, &q, &k, &v, &mask, &pool),
                    "f16" => partitioned_on(tier, shape, partition_keys, &q, &k16, &v16, &mask, &pool),
                    _ => partitioned_on(tier, shape, partition_keys, &q, &kb, &vb, &mask, &pool),
                };
                for (got, want) in out.iter().zip(expected) {
                    // Relative past 1: a partial of many partitions rounds with its size.
                    let tolerance = 1e-5 * want.abs().max(1.0) * wide_head(shape);
                    prop_assert!((*got as f64 - want).abs() < tolerance, "{tier} {name}: {got} vs {want}");
                }
            }
        }
    }

    /// Q8_0 keys and values (ggml's blocks of 32, dequantized as they load) in partitions of
    /// any size: the f64 reference over the dequantized values, on every tier, and the same
    /// bits whether a row's partitions run together or apart.
    #[test]
    fn q8_0_kv_matches_the_f64_reference_over_its_values(
        (shape, seed) in shapes(),
        width in 1usize..5,
        partition_keys in 1usize..12,
        threads in 1usize..4,
    ) {
        let shape = AttentionShape { head_dim: 32 * width, ..shape };
        let (q, k, v, mask) = operands(shape, seed);
        let quantize = |x: &[f32]| {
            let mut blocks = vec![Q8_0Block::ZERO; x.len() / 32];
            quantize_q8_0(x, &mut blocks);
            let mut values = vec![0f32; x.len()];
            dequantize_q8_0(&blocks, &mut values);
            (blocks, values)
        };
        let ((kq, kx), (vq, vx)) = (quantize(&k), quantize(&v));
        let expected = reference(shape, &q, &kx, &vx, &mask);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // f32's rounding over heads of up to 128 values and up to 40 one-key partitions reached
        // 1.02e-5; a wrong block (a scale or byte off) errs by 1e-3 or more.
        let tolerance = 3e-5;
        for tier in Tier::supported() {
            let out = partitioned_on(tier, shape, partition_keys, &q, &kq, &vq, &mask, &ThreadPool::new(threads));
            for (got, want) in out.iter().zip(&expected) {
                prop_assert!((*got as f64 - want).abs() < tolerance, "{tier}: {got} vs {want}");
            }
            let one = partitioned_on(tier, shape, partition_keys, &q, &kq, &vq, &mask, &ThreadPool::new(1));
            prop_assert_eq!(bits(&out), bits(&one), "{}", tier);
        }
    }

    /// A row's partitions run as tasks of their own when a step has few rows for the threads
    /// (one thread: together): the same bits either way.
    #[test]
    fn splitting_partitions_over_threads_keeps_the_bits(
        (shape, seed) in shapes(),
        partition_keys in 1usize..12,
    ) {
        let (q, k, v, mask) = operands(shape, seed);
        let k: Vec<f16> = k.into_iter().map(f16::from_f32).collect();
        let v: Vec<f16> = v.into_iter().map(f16::from_f32).collect();
        let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        for tier in Tier::supported() {
            let together = partitioned_on(tier, shape, partition_keys, &q, &k, &v, &mask, &ThreadPool::new(1));
            let split = partitioned_on(tier, shape, partition_keys, &q, &k, &v, &mask, &ThreadPool::new(7));
            prop_assert_eq!(bits(together), bits(split), "{}", tier);
        }
    }

    /// The same query over the same visible keys, once alone and once among masked keys (another
    /// prompt's, or padding), gives the same bits; the masked keys' values are NaN (stale
    /// values past a sequence's end are never multiplied).
    #[test]
    fn masked_keys_do_not_change_the_bits(
        (shape, seed) in shapes(),
        before in 0usize..20,
        after in 0usize..20,
        partition_keys in prop_oneof![Just(kiln_kernels::attention::PARTITION_KEYS), 1usize..12],
    ) {
        let shape = AttentionShape { batch: 1, ..shape };
        let q = values(shape.n_kv_heads * shape.n_rep * shape.q_len * shape.head_dim, seed);
        let k = values(shape.n_kv_heads * shape.keys * shape.head_dim, seed ^ 1);
        let v = values(k.len(), seed ^ 2);
        let causal: Vec<bool> = (0..shape.q_len * shape.keys)
            .map(|x| (x % shape.keys) > (x / shape.keys))
            .collect();
        let pool = ThreadPool::new(2);
        for tier in Tier::supported() {
            let alone = partitioned_on(tier, shape, partition_keys, &q, &k, &v, &causal, &pool);

            // The keys again, with `before` and `after` masked junk keys around them.
            let wide = AttentionShape { keys: before + shape.keys + after, ..shape };
            let junk = values(wide.keys * shape.head_dim, seed ^ 4);
            let stale = vec![f32::NAN; wide.keys * shape.head_dim];
            let widen = |x: &[f32], junk: &[f32]| -> Vec<f32> {
                let mut out = Vec::new();
                for head in x.chunks(shape.keys * shape.head_dim) {
                    out.extend_from_slice(&junk[..before * shape.head_dim]);
                    out.extend_from_slice(head);
                    out.extend_from_slice(&junk[before * shape.head_dim..(before + after) * shape.head_dim]);
                }
                out
            };
            let mut mask = vec![true; shape.q_len * wide.keys];
            for i in 0..shape.q_len {
                for j in 0..shape.keys {
                    mask[i * wide.keys + before + j] = causal[i * shape.keys + j];
                }
            }
            let packed =
                partitioned_on(tier, wide, partition_keys, &q, &widen(&k, &junk), &widen(&v, &stale), &mask, &pool);
            prop_assert_eq!(
                alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                packed.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{}", tier
            );
        }
    }

    /// Keys and values scattered over blocks in shuffled order (a paged cache), read through
    /// their block table, give the same bits as the same keys laid out in one run per head.
    #[test]
    fn block_tables_read_the_same_keys((shape, seed) in shapes(), block_keys in 1usize..9, spare in 0usize..4) {
        let (q, k, v, mask) = operands(shape, seed);
        let pool = ThreadPool::new(2);
        let mut dense = vec![0f32; q.len()];
        attention(shape, Scoring::default(), &q, &k, &v, &mask, &mut dense, &pool).unwrap();

        // Each head's keys in blocks of `block_keys` (the last one padded with junk), the
        // blocks of all heads plus `spare` junk ones stored in a shuffled order.
        let heads = shape.batch * shape.n_kv_heads;
        let per_head = shape.keys.div_ceil(block_keys);
        let blocks = heads * per_head + spare;
        let mut order: Vec<usize> = (0..blocks).collect();
        let shuffle = values(blocks, seed ^ 5);
        order.sort_by(|&a, &b| shuffle[a].total_cmp(&shuffle[b]));
        let block_len = block_keys * shape.head_dim;
        let scatter = |x: &[f32]| -> Vec<f32> {
            let mut store = values(blocks * block_len, seed ^ 6);
            for h in 0..heads {
                for i in 0..per_head {
                    let from = (h * shape.keys + i * block_keys) * shape.head_dim;
                    let len = (block_keys.min(shape.keys - i * block_keys)) * shape.head_dim;
                    let to = order[h * per_head + i] * block_len;
                    store[to..to + len].copy_from_slice(&x[from..from + len]);
                }
            }
            store
        };
        let (k_store, v_store) = (scatter(&k), scatter(&v));
        let kv = KvBlocks { k: &k_store, v: &v_store, table: &order[..heads * per_head], block_keys };
        let mut paged = vec![0f32; q.len()];
        attention_blocks(shape, Scoring::default(), &q, kv, &mask, &mut paged, &pool).unwrap();
        prop_assert_eq!(
            dense.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            paged.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_block_table_naming_a_missing_block_is_an_error() {
    let shape = AttentionShape {
        batch: 1,
        n_kv_heads: 1,
        n_rep: 1,
        q_len: 1,
        keys: 4,
        head_dim: 2,
    };
    let store = [0f32; 8];
    let kv = KvBlocks {
        k: &store,
        v: &store,
        table: &[0, 2],
        block_keys: 2,
    };
    let mut out = [0f32; 2];
    let err = attention_blocks(
        shape,
        Scoring::default(),
        &[0.0; 2],
        kv,
        &[false; 4],
        &mut out,
        ThreadPool::global(),
    );
    assert!(err.unwrap_err().to_string().contains("block 2 of 2"));
}

#[test]
fn wrong_lengths_are_an_error() {
    let shape = AttentionShape {
        batch: 1,
        n_kv_heads: 1,
        n_rep: 1,
        q_len: 2,
        keys: 3,
        head_dim: 4,
    };
    let mut out = vec![0f32; 8];
    let err = attention(
        shape,
        Scoring::default(),
        &[0.0; 8],
        &[0.0; 12],
        &[0.0; 11],
        &[false; 6],
        &mut out,
        ThreadPool::global(),
    );
    assert!(err.unwrap_err().to_string().contains("v has 11 values"));
}
