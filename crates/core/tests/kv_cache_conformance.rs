//! The conformance suite every cache kind passes, on every backend compiled in: the same
//! appends must give the same attention as a plain host computation over each sequence's full
//! history (windowed for the sliding cache), through packed prefill, batched decode, chunks
//! on sequences with history, and sequences freed and re-added.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::collections::HashMap;

use burn::tensor::backend::Backend;

use burn::tensor::{Tensor, TensorData};
use kiln_core::backend::InferenceBackend;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use kiln_core::attention::{
    AttentionPlan, HostStepIndex, Scoring, StepIndex, attend, step_attention_reference,
};
use kiln_core::batch::Batch;
use kiln_core::dtype::{Dtype, KvDtype};
use kiln_core::ids::{Position, SeqId, TokenId};
use kiln_core::kv_cache::*;
use kiln_kernels::attention::{KvElement, Q8_0Block, dequantize_q8_0, quantize_q8_0};

const LAYOUT: KvLayout = KvLayout {
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 4,
};
const N_HEADS: usize = 4;

/// What one step does to one sequence.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Appends this many tokens.
    Append(usize),
    /// Releases the sequence.
    Release,
    /// Keeps only the first this many tokens.
    Truncate(usize),
    /// Starts the sequence as a copy of this one (beam search's fork).
    Fork(u64),
}

/// One step of the scenario: `(sequence, what happens to it)`.
type Step = Vec<(u64, Op)>;

fn scenario() -> Vec<Step> {
    use Op::{Append, Fork, Release, Truncate};
    vec![
        vec![(0, Append(5)), (1, Append(3))], // packed prefill of two prompts
        vec![(0, Append(1)), (1, Append(1))], // batched decode
        vec![(2, Append(4)), (0, Append(2)), (1, Append(1))], // fresh + chunk + decode, mixed
        vec![(1, Release)],                   // free a sequence...
        vec![(3, Append(6)), (0, Append(1)), (2, Append(1))], // ...and reuse its space
        // Fork a sequence whose last block is partial (paged: 7 tokens in blocks of 4), then
        // both append: each writes its own copy of the shared block.
        vec![(4, Fork(3)), (0, Append(1)), (2, Append(2)), (3, Append(1))],
        vec![(3, Append(1)), (4, Append(2))],
        vec![(4, Release)],
        // Roll two sequences back (as a chat does when a re-rendered prompt diverges), then
        // append over the dropped slots.
        vec![(0, Truncate(9)), (3, Truncate(6))],
        vec![(0, Append(1)), (2, Append(1)), (3, Append(2))],
        vec![(0, Append(1)), (3, Append(1))],
    ]
}

/// One stored token on the host: its position, K and V (all KV heads).
type HostToken = (u32, Vec<f32>, Vec<f32>);

/// Host reference: every K/V each sequence has seen, per layer.
#[derive(Default)]
struct Reference {
    /// seq -> layer -> tokens
    history: HashMap<u64, Vec<Vec<HostToken>>>,
}

struct Rand(ChaCha8Rng);

impl Rand {
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.0.random::<f32>() * 2.0 - 1.0).collect()
    }
}

fn tensor3<B: Backend>(values: Vec<f32>, shape: [usize; 3], device: &B::Device) -> Tensor<B, 3> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Plain attention of one query over keys, in f64.
fn attend_host(q: &[f32], keys: &[(&[f32], &[f32])], scoring: Scoring) -> Vec<f32> {
    let d = q.len();
    let scale = scoring.scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
    let scores: Vec<f64> = keys
        .iter()
        .map(|(k, _)| {
            let s = q
                .iter()
                .zip(*k)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
                * scale;
            match scoring.softcap.map(f64::from) {
                Some(cap) => cap * (s / cap).tanh(),
                None => s,
            }
        })
        .collect();
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    (0..d)
        .map(|j| {
            keys.iter()
                .zip(&exps)
                .map(|((_, v), e)| e / sum * f64::from(v[j]))
                .sum::<f64>() as f32
        })
        .collect()
}

/// Runs the scenario through `cache` and checks every attention output against the host (which
/// takes the K/V rounded to the cache's precision, as attention reads them).
/// `values` (rows of 32 or more) rounded to `dtype`'s precision (and back to f32).
fn round_to(dtype: KvDtype, values: Vec<f32>) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => values,
        KvDtype::Q8_0 => {
            let mut blocks = vec![Q8_0Block::ZERO; values.len() / 32];
            quantize_q8_0(&values, &mut blocks);
            let mut out = vec![0f32; values.len()];
            dequantize_q8_0(&blocks, &mut out);
            out
        }
        KvDtype::F16 => values
            .into_iter()
            .map(|x| burn::tensor::f16::from_f32(x).to_f32())
            .collect(),
        KvDtype::Bf16 => values
            .into_iter()
            .map(|x| burn::tensor::bf16::from_f32(x).to_f32())
            .collect(),
    }
}

fn run_conformance<B: InferenceBackend>(cache: &mut dyn KvCache<B>, device: &B::Device) {
    run_conformance_in_window(cache, None, device);
}

/// [`run_conformance`] for a model whose every layer attends inside `model_window`: the cache
/// is told ([`CacheBook::set_attention_window`]), the masks narrow to it as a model's forward
/// narrows them, and the host reference sees only the window.
fn run_conformance_in_window<B: InferenceBackend>(
    cache: &mut dyn KvCache<B>,
    model_window: Option<usize>,
    device: &B::Device,
) {
    cache.set_attention_window(model_window);
    let window = match (cache.window(), model_window) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let layout = cache.layout();
    let (hkv, d) = (layout.n_kv_heads, layout.head_dim);
    let n_rep = N_HEADS / hkv;
    let mut rand = Rand(ChaCha8Rng::seed_from_u64(3));
    let mut reference = Reference::default();
    // Dense caches read consecutive rows as a slice and others with a gather: both must run.
    let (mut sliced_rows, mut gathered_rows) = (false, false);
    for (step_index, step) in scenario().into_iter().enumerate() {
        let mut batch = Batch::new();
        for (seq, op) in &step {
            match *op {
                Op::Release => {
                    cache.release(SeqId(*seq));
                    reference.history.remove(seq);
                    assert_eq!(cache.seq_len(SeqId(*seq)), 0);
                }
                Op::Truncate(keep) => {
                    cache.truncate(SeqId(*seq), keep).unwrap();
                    for layer in reference.history.get_mut(seq).into_iter().flatten() {
                        layer.truncate(keep);
                    }
                    assert_eq!(cache.seq_len(SeqId(*seq)), keep);
                }
                Op::Fork(parent) => {
                    cache.fork(SeqId(parent), SeqId(*seq)).unwrap();
                    let copy = reference.history[&parent].clone();
                    reference.history.insert(*seq, copy);
                    assert_eq!(cache.seq_len(SeqId(*seq)), cache.seq_len(SeqId(parent)));
                }
                Op::Append(n) => {
                    let start = reference.history.get(seq).map_or(0, |h| h[0].len()) as u32;
                    assert_eq!(cache.seq_len(SeqId(*seq)), start as usize);
                    let tokens: Vec<TokenId> = (0..n as u32).map(TokenId).collect();
                    batch.push(SeqId(*seq), &tokens, Position(start)).unwrap();
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let t = batch.n_tokens();
        let plan = StepPlan {
            window,
            ..cache.plan(&batch).unwrap()
        };
        // Every other step scores as Gemma 2 does: a scale of its own and a soft cap small
        // enough to bend these scores.
        let scoring = if step_index % 2 == 1 {
            Scoring {
                scale: Some(0.6),
                softcap: Some(0.8),
            }
        } else {
            Scoring::default()
        };
        let plan = AttentionPlan::new(&batch, plan, N_HEADS, hkv, device).with_scoring(scoring);
        match ReadIndex::<B>::new(&plan.step().read, hkv, device) {
            Some(ReadIndex::Rows {
                rows: RowPick::Range(_),
                ..
            }) => sliced_rows = true,
            Some(ReadIndex::Rows {
                rows: RowPick::Select(_),
                ..
            }) => gathered_rows = true,
            _ => {}
        }
        for layer in 0..layout.n_layers {
            let q = rand.values(t * N_HEADS * d);
            let k = round_to(cache.dtype(), rand.values(t * hkv * d));
            let v = round_to(cache.dtype(), rand.values(t * hkv * d));
            let out = attend(
                cache,
                layer,
                &plan,
                tensor3::<B>(q.clone(), [t, N_HEADS, d], device),
                tensor3::<B>(k.clone(), [t, hkv, d], device),
                tensor3::<B>(v.clone(), [t, hkv, d], device),
            );
            let out: Vec<f32> = out.into_data().iter::<f32>().collect();

            // The step index serves the GPU backends, which refuse a Q8_0 cache (its reference
            // reads the storage as values).
            if cache.dtype() != KvDtype::Q8_0 {
                // The step's attention in burn's operations from a step index (the default of
                // `InferenceBackend::step_attention`) reads the same K/V the same way.
                let index = StepIndex::<B>::upload(
                    HostStepIndex::new(&batch, plan.step(), hkv),
                    plan.step().window,
                    device,
                );
                let (k_store, v_store) = cache.storage(layer);
                let by_index: Vec<f32> = step_attention_reference(
                    tensor3::<B>(q.clone(), [t, N_HEADS, d], device),
                    tensor3::<B>(k.clone(), [t, hkv, d], device),
                    tensor3::<B>(v.clone(), [t, hkv, d], device),
                    k_store,
                    v_store,
                    &index,
                    scoring,
                )
                .into_data()
                .iter::<f32>()
                .collect();
                let diff = out
                    .iter()
                    .zip(&by_index)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    diff < 1e-5,
                    "{} cache, step {step_index}, layer {layer}: attend and the step-index reference differ by {diff}",
                    cache.kind()
                );
            }

            // Record the new K/V, then check every token's output.
            for (seq, range) in batch.ranges() {
                let entry = reference
                    .history
                    .entry(seq.0)
                    .or_insert_with(|| vec![Vec::new(); layout.n_layers]);
                for i in range {
                    let pos = batch.positions()[i].0;
                    entry[layer].push((
                        pos,
                        k[i * hkv * d..(i + 1) * hkv * d].to_vec(),
                        v[i * hkv * d..(i + 1) * hkv * d].to_vec(),
                    ));
                }
            }
            for (seq, range) in batch.ranges() {
                let hist = &reference.history[&seq.0][layer];
                for i in range {
                    let q_pos = batch.positions()[i].0;
                    for h in 0..N_HEADS {
                        let kv = h / n_rep;
                        let keys: Vec<(&[f32], &[f32])> = hist
                            .iter()
                            .filter(|(p, _, _)| {
                                *p <= q_pos && window.is_none_or(|w| ((q_pos - p) as usize) < w)
                            })
                            .map(|(_, k, v)| (&k[kv * d..(kv + 1) * d], &v[kv * d..(kv + 1) * d]))
                            .collect();
                        let expected =
                            attend_host(&q[(i * N_HEADS + h) * d..][..d], &keys, scoring);
                        let got = &out[i * N_HEADS * d + h * d..][..d];
                        for (g, e) in got.iter().zip(&expected) {
                            assert!(
                                (g - e).abs() < 1e-4,
                                "{} cache, step {step_index}, layer {layer}, seq {seq}, token {i}, head {h}: {got:?} vs {expected:?}",
                                cache.kind()
                            );
                        }
                    }
                }
            }
        }
    }
    if !matches!(cache.kind(), CacheKind::Paged) {
        assert!(
            sliced_rows && gathered_rows,
            "{} cache: the scenario read rows as a slice ({sliced_rows}) and gathered ({gathered_rows})",
            cache.kind()
        );
    }
    let live = reference.history.len();
    assert_eq!(cache.usage().sequences, live);
    cache.clear();
    assert_eq!(cache.usage().sequences, 0);
    assert_eq!(cache.usage().used, 0);
}

fn all_kinds<B: InferenceBackend>(device: &B::Device) -> Vec<Box<dyn KvCache<B>>> {
    all_kinds_in::<B>(LAYOUT, KvDtype::F32, device)
}

/// Every kind, of `layout`, holding its K/V in `dtype`.
fn all_kinds_in<B: InferenceBackend>(
    layout: KvLayout,
    dtype: KvDtype,
    device: &B::Device,
) -> Vec<Box<dyn KvCache<B>>> {
    vec![
        Box::new(StaticKvCache::new(layout, 4, 32, dtype, device).unwrap()),
        Box::new(DynamicKvCache::new(layout, dtype, device)),
        // A window longer than any sequence: must equal the others.
        Box::new(SlidingKvCache::new(layout, 4, 64, 8, dtype, device).unwrap()),
        // A window shorter than the sequences: the ring wraps, old keys drop out.
        Box::new(SlidingKvCache::new(layout, 4, 3, 2, dtype, device).unwrap()),
        Box::new(PagedKvCache::new(layout, 16, 4, dtype, device).unwrap()),
        Box::new(PagedKvCache::new(layout, 64, 1, dtype, device).unwrap()),
        // Prefix caching registers full blocks as they fill and unregisters them on a
        // truncation into them; attention must not change.
        Box::new(with_prefix_cache(
            PagedKvCache::new(layout, 16, 4, dtype, device).unwrap(),
        )),
    ]
}

fn with_prefix_cache<B: InferenceBackend>(mut cache: PagedKvCache<B>) -> PagedKvCache<B> {
    assert!(cache.enable_prefix_cache(11));
    cache
}

/// Appends `tokens` to `seq` from position `start` and writes random K/V for them.
fn append<B: InferenceBackend>(
    cache: &mut dyn KvCache<B>,
    seq: u64,
    tokens: &[u32],
    start: u32,
    rand: &mut Rand,
    device: &B::Device,
) {
    let ids: Vec<TokenId> = tokens.iter().copied().map(TokenId).collect();
    let batch = Batch::single(SeqId(seq), &ids, Position(start)).unwrap();
    let plan = cache.plan(&batch).unwrap();
    let shape = [tokens.len(), LAYOUT.n_kv_heads, LAYOUT.head_dim];
    for layer in 0..LAYOUT.n_layers {
        let k = tensor3::<B>(rand.values(shape.iter().product()), shape, device);
        let v = tensor3::<B>(rand.values(shape.iter().product()), shape, device);
        cache.write(layer, &plan, k, v);
    }
}

/// The first `n` tokens' K/V of one exported layer list.
fn head(export: &[(Vec<f32>, Vec<f32>)], n: usize) -> HostKv {
    let per_token = LAYOUT.n_kv_heads * LAYOUT.head_dim;
    export
        .iter()
        .map(|(k, v)| (k[..n * per_token].to_vec(), v[..n * per_token].to_vec()))
        .collect()
}

/// Prefix caching on the paged cache: a later sequence with the same leading tokens shares
/// their full blocks (and reads the very K/V the first one wrote), never the last token's
/// block; a released sequence's blocks stay cached until evicted; a truncation into a shared
/// block copies it; positions other than 0, 1, 2... are never shared.
fn prefix_sharing_on<B: InferenceBackend>(device: &B::Device) {
    let mut rand = Rand(ChaCha8Rng::seed_from_u64(5));
    let mut cache =
        with_prefix_cache(PagedKvCache::<B>::new(LAYOUT, 8, 4, Dtype::F32, device).unwrap());
    let prompt: Vec<u32> = (100..110).collect();
    let ids = |t: &[u32]| -> Vec<TokenId> { t.iter().copied().map(TokenId).collect() };
    append(&mut cache, 0, &prompt, 0, &mut rand, device);
    let first = cache.export(SeqId(0)).unwrap();
    assert_eq!(
        cache.cached_prefix(&ids(&prompt)),
        8,
        "two full blocks, not the third"
    );
    assert_eq!(
        cache.cached_prefix(&ids(&prompt[..8])),
        4,
        "never the last token"
    );
    let mut other = prompt.clone();
    other[5] = 7;
    assert_eq!(
        cache.cached_prefix(&ids(&other)),
        4,
        "the chain breaks at block 1"
    );

    // Shared while the first still runs.
    assert_eq!(cache.attach_prefix(SeqId(1), &ids(&prompt)), 8);
    assert_eq!(
        cache.block_table(SeqId(1)),
        &cache.block_table(SeqId(0))[..2]
    );
    assert_eq!(cache.pool().refs(cache.block_table(SeqId(0))[0]), 2);
    assert_eq!(head(&cache.export(SeqId(1)).unwrap(), 8), head(&first, 8));
    assert_eq!(
        cache.attach_prefix(SeqId(1), &ids(&prompt)),
        0,
        "already started"
    );
    append(&mut cache, 1, &prompt[8..], 8, &mut rand, device);
    assert_ne!(
        cache.block_table(SeqId(1))[2],
        cache.block_table(SeqId(0))[2]
    );

    // Cached after release, and taken back.
    cache.release(SeqId(0));
    cache.release(SeqId(1));
    let usage = cache.usage();
    assert_eq!((usage.used, usage.cached, usage.sequences), (0, 8, 0));
    assert_eq!(cache.attach_prefix(SeqId(2), &ids(&prompt)), 8);
    assert_eq!(head(&cache.export(SeqId(2)).unwrap(), 8), head(&first, 8));

    // A truncation into a shared block copies it: the other holder's K/V do not change.
    assert_eq!(cache.attach_prefix(SeqId(3), &ids(&prompt)), 8);
    let shared = cache.block_table(SeqId(3))[1];
    cache.truncate(SeqId(3), 6).unwrap();
    assert_ne!(cache.block_table(SeqId(3))[1], shared, "a private copy");
    assert_eq!(cache.pool().refs(shared), 1);
    assert_eq!(head(&cache.export(SeqId(3)).unwrap(), 6), head(&first, 6));
    append(&mut cache, 3, &[1, 2], 6, &mut rand, device);
    assert_eq!(head(&cache.export(SeqId(2)).unwrap(), 8), head(&first, 8));
    assert_eq!(
        cache.cached_prefix(&ids(&prompt)),
        8,
        "the original is still registered"
    );
    assert_eq!(
        cache.cached_prefix(&ids(&[100, 101, 102, 103, 104, 105, 1, 2, 0])),
        8,
        "and so is the copy, once full"
    );

    // Eviction: a pool that needs room drops cached blocks, last released first.
    cache.clear();
    assert_eq!(
        cache.cached_prefix(&ids(&prompt)),
        0,
        "clear forgets the prefixes"
    );
    append(&mut cache, 4, &prompt, 0, &mut rand, device);
    cache.release(SeqId(4));
    append(
        &mut cache,
        5,
        &(0..28).collect::<Vec<u32>>(),
        0,
        &mut rand,
        device,
    );
    assert_eq!(
        cache.cached_prefix(&ids(&prompt)),
        4,
        "block 1 went first, block 0 is left"
    );
    append(&mut cache, 6, &[9, 9], 0, &mut rand, device);
    assert_eq!(cache.cached_prefix(&ids(&prompt)), 0);

    // Tokens at positions other than their index are never shared.
    cache.clear();
    append(&mut cache, 7, &prompt, 3, &mut rand, device);
    assert_eq!(cache.cached_prefix(&ids(&prompt)), 0);

    // Off: nothing is registered.
    let mut off = PagedKvCache::<B>::new(LAYOUT, 8, 4, Dtype::F32, device).unwrap();
    append(&mut off, 0, &prompt, 0, &mut rand, device);
    assert!(!off.prefix_cache_enabled());
    assert_eq!(off.attach_prefix(SeqId(1), &ids(&prompt)), 0);
}

/// The scheduler's reservation: after `reserve`, the step's plan cannot run out of space, and
/// a refused reservation changes nothing.
fn reserve_on<B: InferenceBackend>(device: &B::Device) {
    let mut rand = Rand(ChaCha8Rng::seed_from_u64(6));
    let mut paged = PagedKvCache::<B>::new(LAYOUT, 3, 2, Dtype::F32, device).unwrap();
    paged.reserve(&[(SeqId(0), 3)]).unwrap();
    assert_eq!(paged.pool().available(), 1);
    assert_eq!(
        paged.reserve(&[(SeqId(1), 3), (SeqId(0), 1)]).unwrap_err(),
        CacheError::OutOfBlocks { needed: 2, free: 1 }
    );
    assert_eq!(
        paged.pool().available(),
        1,
        "a refused reservation takes nothing"
    );
    paged.reserve(&[(SeqId(1), 2)]).unwrap();
    assert_eq!(paged.pool().available(), 0);
    let mut both = one(0, 3, 0);
    both.push(SeqId(1), &[TokenId(4), TokenId(5)], Position(0))
        .unwrap();
    paged.plan(&both).unwrap();
    assert_eq!(paged.seq_len(SeqId(0)), 3);
    paged.release(SeqId(0));
    paged.release(SeqId(1));
    assert_eq!(paged.pool().available(), 3);

    let mut rows = StaticKvCache::<B>::new(LAYOUT, 1, 4, Dtype::F32, device).unwrap();
    rows.reserve(&[(SeqId(0), 2)]).unwrap();
    assert_eq!(
        rows.reserve(&[(SeqId(1), 1)]).unwrap_err(),
        CacheError::NoFreeSlot { max_sequences: 1 }
    );
    append(&mut rows, 0, &[1, 2], 0, &mut rand, device);
    assert_eq!(
        rows.reserve(&[(SeqId(0), 3)]).unwrap_err(),
        CacheError::SequenceTooLong {
            seq: SeqId(0),
            needed: 5,
            max: 4
        }
    );
}

/// Forks: the paged cache shares whole blocks and copies a shared partial block only when a
/// sequence writes into it, and frees everything when both are released; a fork into a
/// sequence with tokens, or into a full static cache, is refused and changes nothing; a
/// reserved empty sequence is forked into.
fn fork_on<B: InferenceBackend>(device: &B::Device) {
    let mut rand = Rand(ChaCha8Rng::seed_from_u64(7));
    let mut paged = PagedKvCache::<B>::new(LAYOUT, 8, 4, Dtype::F32, device).unwrap();
    append(&mut paged, 0, &[1, 2, 3, 4, 5, 6], 0, &mut rand, device);
    let parent = paged.export(SeqId(0)).unwrap();
    paged.fork(SeqId(0), SeqId(1)).unwrap();
    assert_eq!(paged.pool().used_count(), 2, "the fork shares both blocks");
    assert_eq!(paged.block_table(SeqId(0)), paged.block_table(SeqId(1)));
    assert_eq!(paged.export(SeqId(1)).unwrap(), parent);
    assert_eq!(
        paged.fork(SeqId(0), SeqId(1)).unwrap_err(),
        CacheError::AlreadyHeld {
            seq: SeqId(1),
            len: 6
        }
    );
    // Writing into the shared partial block copies it; the full block stays shared.
    assert_eq!(paged.check_append(SeqId(1), 1), Ok(()));
    append(&mut paged, 1, &[9], 6, &mut rand, device);
    assert_eq!(paged.pool().used_count(), 3);
    assert_eq!(
        paged.block_table(SeqId(0))[0],
        paged.block_table(SeqId(1))[0]
    );
    assert_ne!(
        paged.block_table(SeqId(0))[1],
        paged.block_table(SeqId(1))[1]
    );
    assert_eq!(
        paged.export(SeqId(0)).unwrap(),
        parent,
        "the parent is untouched"
    );
    assert_eq!(head(&paged.export(SeqId(1)).unwrap(), 6), parent);
    // The parent now owns its partial block alone and writes in place.
    append(&mut paged, 0, &[7], 6, &mut rand, device);
    assert_eq!(paged.pool().used_count(), 3);
    paged.release(SeqId(0));
    paged.release(SeqId(1));
    assert_eq!(paged.pool().used_count(), 0);
    assert_eq!(paged.pool().available(), 8);

    let mut rows = StaticKvCache::<B>::new(LAYOUT, 2, 8, Dtype::F32, device).unwrap();
    append(&mut rows, 0, &[1, 2, 3], 0, &mut rand, device);
    rows.reserve(&[(SeqId(5), 0)]).unwrap();
    rows.fork(SeqId(0), SeqId(5)).unwrap();
    assert_eq!(
        rows.export(SeqId(5)).unwrap(),
        rows.export(SeqId(0)).unwrap()
    );
    assert_eq!(
        rows.fork(SeqId(0), SeqId(6)).unwrap_err(),
        CacheError::NoFreeSlot { max_sequences: 2 }
    );
    assert_eq!(rows.usage().sequences, 2);
}

fn conformance_on<B: InferenceBackend>(device: &B::Device) {
    for mut cache in all_kinds::<B>(device) {
        run_conformance(cache.as_mut(), device);
    }
}

/// The paged cache serving a model whose every layer has a window of 3 (Mistral's and Phi-3's
/// kind) gives back blocks that have left it, with and without prefix caching: attention is
/// unchanged, truncations and forks included. The sliding ring of the same window, and a
/// dense cache, run beside it.
fn window_conformance_on<B: InferenceBackend>(device: &B::Device) {
    let caches: Vec<Box<dyn KvCache<B>>> = vec![
        Box::new(PagedKvCache::new(LAYOUT, 16, 2, Dtype::F32, device).unwrap()),
        Box::new(PagedKvCache::new(LAYOUT, 64, 1, Dtype::F32, device).unwrap()),
        Box::new(with_prefix_cache(
            PagedKvCache::new(LAYOUT, 16, 2, Dtype::F32, device).unwrap(),
        )),
        Box::new(SlidingKvCache::new(LAYOUT, 4, 3, 2, Dtype::F32, device).unwrap()),
        Box::new(DynamicKvCache::new(LAYOUT, Dtype::F32, device)),
    ];
    for mut cache in caches {
        run_conformance_in_window(cache.as_mut(), Some(3), device);
    }
}

/// A sequence far longer than the paged pool runs through it when the model's window lets
/// the cache forget: blocks behind the window (and one block of slack) go back to the pool;
/// what it forgot cannot be exported, rolled back into or queried again, with named errors;
/// forgotten blocks stay cached while the pool has room; release frees the rest.
fn window_frees_blocks_on<B: InferenceBackend>(device: &B::Device) {
    let mut rand = Rand(ChaCha8Rng::seed_from_u64(8));
    // 5 blocks of 2 tokens: 10 slots for a sequence of 40.
    let mut paged =
        with_prefix_cache(PagedKvCache::<B>::new(LAYOUT, 5, 2, Dtype::F32, device).unwrap());
    paged.set_attention_window(Some(3));
    let tokens: Vec<u32> = (0..40).map(|i| 100 + i).collect();
    append(&mut paged, 0, &tokens[..4], 0, &mut rand, device);
    for i in 4..40 {
        paged.reserve(&[(SeqId(0), 1)]).unwrap();
        append(&mut paged, 0, &tokens[i..=i], i as u32, &mut rand, device);
        // Keys from `i + 2 - 3 - 2` on are kept, in whole blocks, plus the next token's.
        assert!(paged.block_table(SeqId(0)).len() <= 4, "token {i}");
    }
    assert_eq!(paged.seq_len(SeqId(0)), 40);
    // Blocks are given back when the next step is reserved or planned: after position 39,
    // keys from 36 on are kept (window 3 and a block of slack): the blocks of 36-37 and
    // 38-39, and the new one for token 40.
    paged.reserve(&[(SeqId(0), 1)]).unwrap();
    assert_eq!(paged.block_table(SeqId(0)).len(), 3);
    assert_eq!(
        paged.export(SeqId(0)).unwrap_err(),
        CacheError::NotAllHeld {
            seq: SeqId(0),
            held: 40,
            kept: 4
        }
    );
    // Keeping 38 tokens, the next query (38) sees 36.. (kept); keeping 36, it would need 34
    // and 35 (forgotten).
    assert_eq!(
        paged.truncate(SeqId(0), 36).unwrap_err(),
        CacheError::TruncateTooFar {
            seq: SeqId(0),
            dropped: 4,
            max: 2
        }
    );
    assert_eq!(
        paged.seq_len(SeqId(0)),
        40,
        "a refused truncation changes nothing"
    );
    let batch = Batch::single(SeqId(0), &[TokenId(1)], Position(30)).unwrap();
    assert_eq!(
        paged.plan(&batch).unwrap_err(),
        CacheError::KeysForgotten {
            seq: SeqId(0),
            position: Position(30)
        }
    );
    paged.truncate(SeqId(0), 38).unwrap();
    assert_eq!(paged.seq_len(SeqId(0)), 38);
    // The forgotten blocks were registered, so they stay cached until the pool needs them
    // (least recently released first: here the earliest are gone).
    assert!(paged.usage().cached > 0);
    paged.release(SeqId(0));
    assert_eq!(paged.usage().used, 0);
    assert_eq!(paged.pool().available(), 5);

    // Without the window, the same sequence runs out of blocks at 10 tokens.
    let mut plain = PagedKvCache::<B>::new(LAYOUT, 5, 2, Dtype::F32, device).unwrap();
    append(&mut plain, 0, &tokens[..10], 0, &mut rand, device);
    assert_eq!(
        plain.reserve(&[(SeqId(0), 1)]).unwrap_err(),
        CacheError::OutOfBlocks { needed: 1, free: 0 }
    );
}

/// Every kind holding f16, bf16 and Q8_0 K/V (the cpu backend's kernel reads them in place),
/// the scenario's K/V drawn as values those types hold exactly: the host's attention over
/// them. Q8_0 needs heads of whole 32-value blocks.
fn narrow_conformance_on<B: InferenceBackend>(device: &B::Device) {
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        for mut cache in all_kinds_in::<B>(LAYOUT, dtype, device) {
            run_conformance(cache.as_mut(), device);
        }
    }
    let wide = KvLayout {
        head_dim: 64,
        ..LAYOUT
    };
    for mut cache in all_kinds_in::<B>(wide, KvDtype::Q8_0, device) {
        run_conformance(cache.as_mut(), device);
    }
}

fn one(seq: u64, n: usize, start: u32) -> Batch {
    let tokens: Vec<TokenId> = (0..n as u32).map(TokenId).collect();
    Batch::single(SeqId(seq), &tokens, Position(start)).unwrap()
}

/// Out-of-space errors are typed and leave the cache usable.
fn limits_on<B: InferenceBackend>(device: &B::Device) {
    let mut cache = StaticKvCache::<B>::new(LAYOUT, 1, 4, Dtype::F32, device).unwrap();
    cache.plan(&one(0, 3, 0)).unwrap();
    assert_eq!(
        cache.plan(&one(0, 2, 3)).unwrap_err(),
        CacheError::SequenceTooLong {
            seq: SeqId(0),
            needed: 5,
            max: 4
        }
    );
    assert_eq!(
        cache.plan(&one(1, 1, 0)).unwrap_err(),
        CacheError::NoFreeSlot { max_sequences: 1 }
    );
    assert_eq!(
        cache.seq_len(SeqId(0)),
        3,
        "a refused step reserves nothing"
    );
    cache.plan(&one(0, 1, 3)).unwrap();
    cache.release(SeqId(0));
    cache.plan(&one(1, 4, 0)).unwrap();

    let mut paged = PagedKvCache::<B>::new(LAYOUT, 3, 2, Dtype::F32, device).unwrap();
    paged.plan(&one(0, 3, 0)).unwrap();
    // Seq 0's 4th token fits its second block; seq 1's 3 tokens need 2 blocks, 1 is free.
    let mut two = one(1, 3, 0);
    two.push(SeqId(0), &[TokenId(1)], Position(3)).unwrap();
    assert_eq!(
        paged.plan(&two).unwrap_err(),
        CacheError::OutOfBlocks { needed: 2, free: 1 }
    );
    assert_eq!(
        paged.pool().available(),
        1,
        "a refused step reserves nothing"
    );
    assert!(paged.check_append(SeqId(0), 1).is_ok());
    paged.release(SeqId(0));
    assert_eq!(paged.pool().available(), 3);
    paged.plan(&one(1, 6, 0)).unwrap();
    assert_eq!(paged.block_table(SeqId(1)).len(), 3);

    let mut sliding = SlidingKvCache::<B>::new(LAYOUT, 1, 4, 2, Dtype::F32, device).unwrap();
    sliding.plan(&one(0, 10, 0)).unwrap();
    assert_eq!(
        sliding.plan(&one(0, 3, 10)).unwrap_err(),
        CacheError::StepTooLarge {
            seq: SeqId(0),
            tokens: 3,
            max: 2
        }
    );

    // The ring of window 4 + step 2 holds 5 tokens: rolling back 3 would need a dropped key.
    assert_eq!(
        sliding.truncate(SeqId(0), 7).unwrap_err(),
        CacheError::TruncateTooFar {
            seq: SeqId(0),
            dropped: 3,
            max: 2
        }
    );
    assert_eq!(
        sliding.seq_len(SeqId(0)),
        10,
        "a refused truncation changes nothing"
    );
    sliding.truncate(SeqId(0), 8).unwrap();
    sliding.truncate(SeqId(0), 0).unwrap();
    assert_eq!(
        sliding.usage().sequences,
        0,
        "truncating to nothing releases"
    );
    assert_eq!(
        paged.truncate(SeqId(1), 7).unwrap_err(),
        CacheError::TruncateBeyondEnd {
            seq: SeqId(1),
            keep: 7,
            len: 6
        }
    );
    paged.truncate(SeqId(1), 5).unwrap();
    assert_eq!(
        paged.block_table(SeqId(1)).len(),
        3,
        "block 3 still holds token 4"
    );
    paged.truncate(SeqId(1), 4).unwrap();
    assert_eq!(
        paged.pool().available(),
        1,
        "an emptied block goes back to the pool"
    );

    let mut dynamic = DynamicKvCache::<B>::new(LAYOUT, Dtype::F32, device);
    dynamic.plan(&one(0, 100, 0)).unwrap();
    dynamic.plan(&one(1, 3, 0)).unwrap();
    assert!(dynamic.usage().capacity >= 2 * 100);
}

mod flex {
    use super::*;
    type B = burn::backend::Flex;

    #[test]
    fn conformance() {
        conformance_on::<B>(&Default::default());
    }

    #[test]
    fn narrow_conformance() {
        narrow_conformance_on::<B>(&Default::default());
    }

    #[test]
    fn limits() {
        limits_on::<B>(&Default::default());
    }

    #[test]
    fn prefix_sharing() {
        prefix_sharing_on::<B>(&Default::default());
    }

    #[test]
    fn reserve() {
        reserve_on::<B>(&Default::default());
    }

    #[test]
    fn fork() {
        fork_on::<B>(&Default::default());
    }

    #[test]
    fn window_conformance() {
        window_conformance_on::<B>(&Default::default());
    }

    #[test]
    fn window_frees_blocks() {
        window_frees_blocks_on::<B>(&Default::default());
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    type B = burn::backend::NdArray;

    #[test]
    fn conformance() {
        conformance_on::<B>(&Default::default());
    }
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    type B = burn::backend::Wgpu;

    #[test]
    fn conformance() {
        conformance_on::<B>(&Default::default());
    }

    #[test]
    fn limits() {
        limits_on::<B>(&Default::default());
    }

    #[test]
    fn prefix_sharing() {
        prefix_sharing_on::<B>(&Default::default());
    }

    #[test]
    fn window_conformance() {
        window_conformance_on::<B>(&Default::default());
    }
}
