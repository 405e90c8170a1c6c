//! Attention over a packed batch and a KV cache.
//!
//! A forward pass builds one [`AttentionPlan`] from the cache's [`StepPlan`] (masks and index
//! tensors, uploaded once) and every layer calls [`attend`]. The plan splits the batch in two
//! groups:
//!
//! - **fresh** sequences (nothing cached yet, e.g. new prompts) run as *one packed sequence*
//!   with a block-causal mask: a token sees the earlier tokens of its own prompt only, and no
//!   padding is computed (TorchTitan's packed prefill);
//! - sequences **with history** (decode steps, chunked prefill, chat turns) run one row each:
//!   their new queries attend over the K/V the cache holds for them, padded to the longest row
//!   and masked by position.
//!
//! Masks are explicit boolean tensors (`true` = masked) built from positions, never
//! `is_causal`: burn 0.21's kernels disagree on how `is_causal` aligns when query and key
//! lengths differ; a mask is `[rows, q_len, keys]`, shared by the heads. Grouped-query
//! attention never copies K/V: both groups hand their token-major queries to a backend hook
//! ([`InferenceBackend::packed_attention`], [`InferenceBackend::cached_attention`]), which
//! regroups a row's queries as `[rows, n_kv_heads, n_rep * q_len, head_dim]` so each KV head
//! serves its `n_rep` query heads in one call of the attention kernel (the HF/Meta rule: query
//! head `h` uses KV head `h / n_rep`); the defaults regroup through burn's permutes, the cpu
//! backend by row copies. On the cpu backend that call sums over each query's visible keys
//! only, so a sequence's outputs do not depend on what it was batched with.

mod step;

use burn::tensor::backend::Backend;

pub use kiln_kernels::attention::Scoring;
pub use step::{HostStepIndex, StepIndex, StepLayout, TOKEN_FIELDS};

use crate::backend::InferenceBackend;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, FloatDType, Int, Tensor, TensorData};

use crate::batch::Batch;
use crate::ids::Position;
use crate::kv_cache::{CachedKv, KvCache, ReadIndex, StepPlan};
use crate::tensor::int_tensor;

/// The fresh group: packed prompts, block-causal.
#[derive(Debug, Clone)]
struct FreshGroup<B: Backend> {
    /// Batch tokens of the group, when it is not simply the whole batch in order. `[len]`
    gather: Option<Tensor<B, 1, Int>>,
    /// `[1, len, len]`
    mask: Tensor<B, 3, Bool>,
}

/// The history group: one padded row per sequence.
#[derive(Debug, Clone)]
struct HistoryGroup<B: Backend> {
    rows: usize,
    max_new: usize,
    /// Batch token for each padded query slot (padding points at token 0). `[rows * max_new]`
    gather: Tensor<B, 1, Int>,
    /// The padded query slots that hold a real token, in group order. `[n_tokens_in_group]`
    keep: Tensor<B, 1, Int>,
    /// `[rows, max_new, keys]`
    mask: Tensor<B, 3, Bool>,
    read: ReadIndex<B>,
}

/// Everything attention needs for one forward pass, shared by all layers.
#[derive(Debug, Clone)]
pub struct AttentionPlan<B: Backend> {
    step: StepPlan,
    n_heads: usize,
    n_kv_heads: usize,
    fresh: Option<FreshGroup<B>>,
    history: Option<HistoryGroup<B>>,
    /// Maps `[fresh tokens, history tokens]` back to batch order, when they differ. `[n_tokens]`
    unpermute: Option<Tensor<B, 1, Int>>,
    /// The whole step as index arrays, for backends that attend in one launch
    /// ([`InferenceBackend::STEP_ATTENTION`]); the groups above are not built then.
    step_index: Option<StepIndex<B>>,
    /// How `q·k` becomes a score, the same in every layer.
    scoring: Scoring,
}

impl<B: InferenceBackend> AttentionPlan<B> {
    /// Builds the masks and indices for `batch` from the cache's plan for it.
    ///
    /// # Panics
    /// If `n_heads` is not a multiple of `n_kv_heads` (a model configuration error caught when
    /// the model is built).
    pub fn new(
        batch: &Batch,
        step: StepPlan,
        n_heads: usize,
        n_kv_heads: usize,
        device: &B::Device,
    ) -> Self {
        assert!(
            n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads),
            "n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
        );
        if B::STEP_ATTENTION {
            let host = HostStepIndex::new(batch, &step, n_kv_heads);
            let step_index = StepIndex::upload(host, step.window, device);
            return Self {
                step,
                n_heads,
                n_kv_heads,
                fresh: None,
                history: None,
                unpermute: None,
                step_index: Some(step_index),
                scoring: Scoring::default(),
            };
        }
        let positions = batch.positions();
        let window = step.window;

        let fresh_tokens: Vec<usize> = step.fresh.iter().flat_map(|f| f.tokens.clone()).collect();
        let history_tokens: Vec<usize> =
            step.history.iter().flat_map(|h| h.tokens.clone()).collect();

        let fresh = (!fresh_tokens.is_empty()).then(|| {
            let len = fresh_tokens.len();
            let mut mask = vec![true; len * len];
            let mut offset = 0;
            for span in &step.fresh {
                let n = span.tokens.len();
                for qi in 0..n {
                    let q_pos = positions[span.tokens.start + qi];
                    for ki in 0..n {
                        let k_pos = positions[span.tokens.start + ki];
                        mask[(offset + qi) * len + offset + ki] = !visible(q_pos, k_pos, window);
                    }
                }
                offset += n;
            }
            let in_order =
                fresh_tokens.iter().enumerate().all(|(i, &t)| i == t) && len == batch.n_tokens();
            FreshGroup {
                gather: (!in_order).then(|| int_tensor(fresh_tokens.iter().copied(), device)),
                mask: bool_tensor(mask, [1, len, len], device),
            }
        });

        let history = ReadIndex::new(&step.read, n_kv_heads, device).map(|read| {
            let rows = step.history.len();
            let max_new = step
                .history
                .iter()
                .map(|h| h.tokens.len())
                .max()
                .unwrap_or(0);
            let keys = step.history.first().map_or(0, |h| h.key_positions.len());
            let mut gather = vec![0usize; rows * max_new];
            let mut keep = Vec::with_capacity(history_tokens.len());
            let mut mask = vec![true; rows * max_new * keys];
            for (r, span) in step.history.iter().enumerate() {
                for (i, token) in span.tokens.clone().enumerate() {
                    gather[r * max_new + i] = token;
                    keep.push(r * max_new + i);
                }
                for i in 0..max_new {
                    let row = &mut mask[(r * max_new + i) * keys..][..keys];
                    match span.tokens.clone().nth(i) {
                        Some(token) => {
                            let q_pos = positions[token];
                            for (slot, k_pos) in span.key_positions.iter().enumerate() {
                                row[slot] = !k_pos.is_some_and(|k| visible(q_pos, k, window));
                            }
                        }
                        // A padding query sees one key so its softmax stays finite; its
                        // output is dropped.
                        None => row[0] = false,
                    }
                }
            }
            HistoryGroup {
                rows,
                max_new,
                gather: int_tensor(gather, device),
                keep: int_tensor(keep, device),
                mask: bool_tensor(mask, [rows, max_new, keys], device),
                read,
            }
        });

        let order: Vec<usize> = fresh_tokens
            .iter()
            .chain(&history_tokens)
            .copied()
            .collect();
        let unpermute = (!order.iter().enumerate().all(|(i, &t)| i == t)).then(|| {
            let mut inverse = vec![0usize; order.len()];
            for (i, &t) in order.iter().enumerate() {
                inverse[t] = i;
            }
            int_tensor(inverse, device)
        });

        Self {
            step,
            n_heads,
            n_kv_heads,
            fresh,
            history,
            unpermute,
            step_index: None,
            scoring: Scoring::default(),
        }
    }

    /// The plan with scores taken as `scoring` says instead of `q·k / √head_dim` (a model's
    /// own scale, Gemma 2's soft cap).
    pub fn with_scoring(self, scoring: Scoring) -> Self {
        Self { scoring, ..self }
    }

    /// The cache's plan this attention plan was built from.
    pub fn step(&self) -> &StepPlan {
        &self.step
    }
}

/// Whether a query at `q` sees a key at `k`: causal, and within the window if there is one.
fn visible(q: Position, k: Position, window: Option<usize>) -> bool {
    k <= q && window.is_none_or(|w| ((q.0 - k.0) as usize) < w)
}

fn bool_tensor<B: Backend>(
    values: Vec<bool>,
    shape: [usize; 3],
    device: &B::Device,
) -> Tensor<B, 3, Bool> {
    crate::tensor::upload(TensorData::new(values, shape), device)
}

/// One layer's attention: writes the new K/V into `cache`, then attends.
///
/// # Shapes
/// - `q`: `[n_tokens, n_heads, head_dim]`, RoPE applied
/// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`, RoPE applied to `k`
/// - returns `[n_tokens, n_heads * head_dim]`, in batch order
pub fn attend<B: InferenceBackend>(
    cache: &mut dyn KvCache<B>,
    layer: usize,
    plan: &AttentionPlan<B>,
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
) -> Tensor<B, 2> {
    let [n_tokens, n_heads, head_dim] = q.dims();
    debug_assert_eq!(n_heads, plan.n_heads);
    debug_assert_eq!(k.dims()[1], plan.n_kv_heads);
    // A step's fresh K/V are attended as they are, a history's as the cache stores them: a
    // cache narrower than the activations (f16 K/V) gets them rounded to its precision first,
    // so that a prompt attends over the same values whether its prefix was computed in this
    // step or found in the cache. The rounded copy is also what the cache stores.
    let (k, v, k_stored, v_stored) = if cache.dtype().burn() == k.dtype() {
        (k.clone(), v.clone(), k, v)
    } else {
        let computed = FloatDType::from(k.dtype());
        let stored = cache.dtype().burn_float();
        let (k_stored, v_stored) = (k.cast(stored), v.cast(stored));
        let (k, v) = (
            k_stored.clone().cast(computed),
            v_stored.clone().cast(computed),
        );
        (k, v, k_stored, v_stored)
    };
    if let Some(index) = &plan.step_index {
        cache.write_places(layer, index, k_stored, v_stored);
        let (k_store, v_store) = cache.storage(layer);
        return B::step_attention(q, k, v, k_store, v_store, index, plan.scoring);
    }
    cache.write(layer, &plan.step, k_stored, v_stored);

    let mut outputs = Vec::with_capacity(2);
    if let Some(fresh) = &plan.fresh {
        let pick = |t: Tensor<B, 3>| match &fresh.gather {
            Some(idx) => t.select(0, idx.clone()),
            None => t,
        };
        outputs.push(B::packed_attention(
            pick(q.clone()),
            pick(k),
            pick(v),
            fresh.mask.clone(),
            plan.scoring,
        ));
    }
    if let Some(hist) = &plan.history {
        let (rows, max_new) = (hist.rows, hist.max_new);
        let q = q
            .select(0, hist.gather.clone())
            .reshape([rows, max_new, n_heads, head_dim]);
        let out = B::cached_attention(
            q,
            cache.read(layer, &hist.read),
            hist.mask.clone(),
            plan.scoring,
        );
        outputs.push(
            out.reshape([rows * max_new, n_heads * head_dim])
                .select(0, hist.keep.clone()),
        );
    }
    let out = Tensor::cat(outputs, 0);
    debug_assert_eq!(out.dims()[0], n_tokens);
    match &plan.unpermute {
        Some(idx) => out.select(0, idx.clone()),
        None => out,
    }
}

/// The default [`InferenceBackend::step_attention`], in burn's operations on any backend: for
/// each run of query tokens that read the same keys (a fresh sequence, or a history row), the
/// keys gathered from the step's new K/V or from the storage through the row's blocks, the
/// mask built from positions, and [`sdpa_reference`]. Slow (operations per sequence) and
/// exact: the reference the fused kernels are held to.
///
/// # Shapes
/// - `q`: `[n_tokens, n_heads, head_dim]`; `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`
/// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`, after this step's write
/// - returns `[n_tokens, n_heads * head_dim]` in batch order
pub fn step_attention_reference<B: InferenceBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    k_store: Tensor<B, 4>,
    v_store: Tensor<B, 4>,
    index: &StepIndex<B>,
    scoring: Scoring,
) -> Tensor<B, 2> {
    let host = &index.host;
    let [n, n_heads, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let n_rep = n_heads / n_kv;
    let [targets, _, slots, _] = k_store.dims();
    let device = q.device();
    let dtype = FloatDType::from(q.dtype());
    let fields = |t: usize| &host.tokens[t * TOKEN_FIELDS..][..TOKEN_FIELDS];
    let mut outputs = Vec::new();
    let mut first = 0;
    while first < n {
        let mut end = first + 1;
        while end < n && fields(end)[..3] == fields(first)[..3] {
            end += 1;
        }
        let [row, start, count, _] = *fields(first) else {
            unreachable!("TOKEN_FIELDS is 4")
        };
        let (start, count) = (start as usize, count as usize);
        // [count, n_kv, head_dim] each, and the keys' positions.
        let (keys, values, key_positions) = if row < 0 {
            (
                k.clone().narrow(0, start, count),
                v.clone().narrow(0, start, count),
                host.positions[start..start + count].to_vec(),
            )
        } else {
            let row = row as usize;
            let blocks = host.blocks_per_row;
            let head_blocks: Vec<usize> = host.table[row * n_kv * blocks..][..n_kv * blocks]
                .iter()
                .map(|&b| b as usize)
                .collect();
            let gather = |store: Tensor<B, 4>| {
                store
                    .reshape([targets * n_kv, slots, head_dim])
                    .select(0, int_tensor::<B>(head_blocks.clone(), &device))
                    .reshape([n_kv, blocks * slots, head_dim])
                    .slice([0..n_kv, 0..count])
                    .swap_dims(0, 1)
                    .cast(dtype)
            };
            (
                gather(k_store.clone()),
                gather(v_store.clone()),
                host.key_positions[row * host.keys..][..count].to_vec(),
            )
        };
        // Query head `h` reads KV head `h / n_rep`: [1, n_heads, count, head_dim].
        let by_head = |x: Tensor<B, 3>| {
            x.unsqueeze_dim::<4>(2)
                .expand([count, n_kv, n_rep, head_dim])
                .reshape([count, n_heads, head_dim])
                .swap_dims(0, 1)
                .unsqueeze_dim::<4>(0)
        };
        let queries = end - first;
        let window = index.window;
        let mask: Vec<bool> = (first..end)
            .flat_map(|t| {
                let q_pos = host.positions[t];
                key_positions.iter().map(move |&k_pos| {
                    !(k_pos >= 0
                        && k_pos <= q_pos
                        && window.is_none_or(|w| ((q_pos - k_pos) as usize) < w))
                })
            })
            .collect();
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [1, 1, queries, count]), &device)
                .expand([1, n_heads, queries, count]);
        let q_rows = q
            .clone()
            .narrow(0, first, end - first)
            .swap_dims(0, 1)
            .unsqueeze_dim::<4>(0);
        let out = sdpa_reference(q_rows, by_head(keys), by_head(values), mask, scoring);
        outputs.push(
            out.reshape([n_heads, queries, head_dim])
                .swap_dims(0, 1)
                .reshape([queries, n_heads * head_dim]),
        );
        first = end;
    }
    Tensor::cat(outputs, 0)
}

/// Scaled dot-product attention through burn's fused op, with an explicit mask, the scores as
/// `scoring` says (burn's own scale and soft cap options).
///
/// # Shapes
/// - `q`: `[b, h, sq, d]`; `k`, `v`: `[b, h, sk, d]`; `mask`: `[b, h, sq, sk]` (`true` = masked)
/// - returns `[b, h, sq, d]`
pub fn sdpa<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let options = AttentionModuleOptions {
        scale: scoring.scale.map(f64::from),
        softcap: scoring.softcap.map(f64::from),
        is_causal: false,
    };
    burn::tensor::module::attention(q, k, v, Some(mask), None, options)
}

/// The default [`InferenceBackend::packed_attention`]: the packed row regrouped head-major,
/// [`InferenceBackend::grouped_attention`], and back.
///
/// # Shapes
/// As [`InferenceBackend::packed_attention`].
pub fn sdpa_packed<B: InferenceBackend>(
    q: Tensor<B, 3>,
    k: Tensor<B, 3>,
    v: Tensor<B, 3>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
) -> Tensor<B, 2> {
    let [len, n_heads, head_dim] = q.dims();
    let n_kv = k.dims()[1];
    let n_rep = n_heads / n_kv;
    // [len, n_heads, d] → [1, n_kv, n_rep * len, d].
    let q = q
        .reshape([len, n_kv, n_rep, head_dim])
        .permute([1, 2, 0, 3])
        .reshape([1, n_kv, n_rep * len, head_dim]);
    let k = k.swap_dims(0, 1).unsqueeze_dim::<4>(0);
    let v = v.swap_dims(0, 1).unsqueeze_dim::<4>(0);
    B::grouped_attention(q, k, v, mask, scoring)
        .reshape([n_kv, n_rep, len, head_dim])
        .permute([2, 0, 1, 3])
        .reshape([len, n_heads * head_dim])
}

/// The default [`InferenceBackend::cached_attention`]: the queries regrouped head-major
/// (`[rows, n_kv_heads, n_rep * q_len, head_dim]`), the K/V gathered into one tensor, cast to
/// `q`'s dtype, [`InferenceBackend::grouped_attention`], and the output regrouped back.
///
/// # Shapes
/// As [`InferenceBackend::cached_attention`].
pub fn sdpa_cached<B: InferenceBackend>(
    q: Tensor<B, 4>,
    kv: CachedKv<'_, B>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let [rows, q_len, n_heads, head_dim] = q.dims();
    let n_kv = kv.k.dims()[1];
    let dtype = FloatDType::from(q.dtype());
    let q = q
        .swap_dims(1, 2)
        .reshape([rows, n_kv, n_heads / n_kv * q_len, head_dim]);
    let (k, v) = kv.gather();
    B::grouped_attention(q, k.cast(dtype), v.cast(dtype), mask, scoring)
        .reshape([rows, n_heads, q_len, head_dim])
        .swap_dims(1, 2)
}

/// [`sdpa`] for grouped queries and a mask shared by the heads: the mask is expanded over
/// them (the default [`InferenceBackend::grouped_attention`]). The keys are first padded to
/// a multiple of [`KEY_PADDING`] with masked zeros ([`pad_keys`]).
///
/// # Shapes
/// As [`InferenceBackend::grouped_attention`].
pub fn sdpa_grouped<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let (k, v, mask) = pad_keys(k, v, mask);
    let [batch, n_kv, q_rows, _] = q.dims();
    let [_, q_len, keys] = mask.dims();
    let mask = mask
        .unsqueeze_dims::<5>(&[1, 2])
        .expand([batch, n_kv, q_rows / q_len.max(1), q_len, keys])
        .reshape([batch, n_kv, q_rows, keys]);
    sdpa(q, k, v, mask, scoring)
}

/// The key count [`sdpa_grouped`] rounds up to: the largest plane (warp, wavefront) a GPU has.
pub const KEY_PADDING: usize = 64;

/// Pads the keys to a multiple of [`KEY_PADDING`] with zero K/V that the mask hides, which
/// leaves the attention's output unchanged.
///
/// Why: burn 0.21's device attention falls back to matmuls whose autotune (cubecl 0.10) keys
/// `q kᵀ` by the key count rounded up to a power of two, but not by whether it is a multiple
/// of the GPU's plane size. Once a vector-matrix kernel that needs that multiple wins the
/// tuning at, say, 32 keys, a later step with 17 keys reuses it and panics ("Rhs dimension
/// n=17 must be a multiple of plane size 8", seen on lavapipe). Padded key counts are always
/// such a multiple.
///
/// # Shapes
/// - `k`, `v`: `[batch, n_kv_heads, keys, head_dim]`, `mask`: `[batch, q_len, keys]`
/// - returns them with `keys` rounded up to a multiple of [`KEY_PADDING`]
pub fn pad_keys<B: Backend>(
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 3, Bool>,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 3, Bool>) {
    let [batch, n_kv, keys, head_dim] = k.dims();
    let padding = keys.next_multiple_of(KEY_PADDING) - keys;
    if padding == 0 {
        return (k, v, mask);
    }
    let device = k.device();
    let zeros = Tensor::<B, 4>::zeros([batch, n_kv, padding, head_dim], (&device, k.dtype()));
    let q_len = mask.dims()[1];
    let hidden = Tensor::<B, 3, Bool>::ones([batch, q_len, padding], &device);
    (
        Tensor::cat(vec![k, zeros.clone()], 2),
        Tensor::cat(vec![v, zeros], 2),
        Tensor::cat(vec![mask, hidden], 2),
    )
}

/// The plain reference: `softmax(scores(q kᵀ) + mask) v` (scores `q·k / √d` unless `scoring`
/// says otherwise), computed in f32 with matmuls. Tests and `kiln selftest` hold [`sdpa`] to it.
///
/// # Shapes
/// Same as [`sdpa`].
pub fn sdpa_reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: Tensor<B, 4, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let dtype = FloatDType::from(q.dtype());
    let [.., head_dim] = q.dims();
    let f32_ = FloatDType::F32;
    let scores = q
        .cast(f32_)
        .matmul(k.cast(f32_).swap_dims(2, 3))
        .mul_scalar(scoring.scale_for(head_dim));
    let scores = match scoring.softcap {
        Some(cap) => scores.div_scalar(cap).tanh().mul_scalar(cap),
        None => scores,
    }
    .mask_fill(mask, f32::NEG_INFINITY);
    burn::tensor::activation::softmax(scores, 3)
        .matmul(v.cast(f32_))
        .cast(dtype)
}
