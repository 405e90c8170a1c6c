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

pub(crate) mod ops;
pub(crate) mod step;

use burn::tensor::backend::Backend;

pub use kiln_kernels::attention::Scoring;
pub use ops::{
    KEY_PADDING, pad_keys, sdpa, sdpa_cached_with, sdpa_grouped, sdpa_packed_with, sdpa_reference,
    step_attention_reference,
};
pub use step::{HostStepIndex, StepIndex, StepLayout, TOKEN_FIELDS};

use crate::backend::InferenceBackend;
use burn::tensor::{Bool, FloatDType, Int, Tensor, TensorData};

use crate::batch::Batch;
use crate::dtype::Dtype;
use crate::ids::Position;
use crate::kv_cache::encoding;
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
    // cache narrower than the activations (f16 or Q8_0 K/V) gets them rounded to its precision
    // first, so that a prompt attends over the same values whether its prefix was computed in
    // this step or found in the cache. The rounded copy is also what the cache stores.
    let dtype = cache.dtype();
    let (k, v, k_stored, v_stored) = if dtype.float().map(Dtype::burn) == Some(k.dtype()) {
        (k.clone(), v.clone(), k, v)
    } else {
        let computed = FloatDType::from(k.dtype());
        let (k_stored, v_stored) = (
            encoding::encode(dtype, k, head_dim),
            encoding::encode(dtype, v, head_dim),
        );
        let (k, v) = (
            encoding::decode(dtype, k_stored.clone(), head_dim, computed),
            encoding::decode(dtype, v_stored.clone(), head_dim, computed),
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

/// The default [`InferenceBackend::packed_attention`]: the packed row regrouped head-major,
/// [`InferenceBackend::grouped_attention`], and back ([`sdpa_packed_with`]).
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
    sdpa_packed_with(q, k, v, mask, scoring, B::grouped_attention)
}

/// The default [`InferenceBackend::cached_attention`]: the K/V gathered into one tensor, then
/// [`sdpa_cached_with`] over [`InferenceBackend::grouped_attention`].
///
/// # Shapes
/// As [`InferenceBackend::cached_attention`].
pub fn sdpa_cached<B: InferenceBackend>(
    q: Tensor<B, 4>,
    kv: CachedKv<'_, B>,
    mask: Tensor<B, 3, Bool>,
    scoring: Scoring,
) -> Tensor<B, 4> {
    let (k, v) = kv.gather();
    sdpa_cached_with(q, k, v, mask, scoring, B::grouped_attention)
}
