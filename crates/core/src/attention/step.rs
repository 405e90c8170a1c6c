//! [`StepIndex`]: a step's attention as index arrays, for backends that write the K/V and
//! attend for every sequence of a step in one launch each
//! ([`InferenceBackend::STEP_ATTENTION`](crate::InferenceBackend::STEP_ATTENTION)).
//! All of it is uploaded in one transfer per forward and shared by every layer.
//!
//! Per query token four integers (`tokens`, `[n_tokens, 4]`):
//!
//! | column | fresh token | token with history |
//! |---|---|---|
//! | 0 | −1 | its row in `key_positions` and `table` |
//! | 1 | first batch token of its sequence | 0 |
//! | 2 | its sequence's token count | key slots its row reads |
//! | 3 | its position | its position |
//!
//! A fresh token attends over its own sequence's new K/V (taken from the step, not the
//! cache); a token with history over the key slots of its row, read from the cache storage
//! through the row's blocks. A key is visible when its position is at most the query's and, with
//! a window, less than `window` behind it; an empty slot has position −1.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::batch::Batch;
use crate::kv_cache::{ReadPlan, StepPlan};

/// Integers per query token in [`StepLayout::tokens`].
pub const TOKEN_FIELDS: usize = 4;

/// A step's attention and KV writes as device index arrays (see the module): one buffer,
/// uploaded in one transfer, that kernels read at the offsets of its parts.
#[derive(Debug, Clone)]
pub struct StepIndex<B: Backend> {
    /// Every part below, one after the other. `[len]`
    pub data: Tensor<B, 1, Int>,
    /// Where each part starts in `data`, and the parts' sizes.
    pub layout: StepLayout,
    /// The most keys any query reads.
    pub max_keys: usize,
    /// Keys further back than this many positions are invisible.
    pub window: Option<usize>,
    /// The same arrays on the host, for backends that attend with burn's operations
    /// ([`step_attention_reference`](super::step_attention_reference)).
    pub host: HostStepIndex,
}

/// Where the parts of [`StepIndex::data`] start, and their shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    /// Query tokens in the batch.
    pub n_tokens: usize,
    /// `[n_tokens, TOKEN_FIELDS]` from here.
    pub tokens: usize,
    /// The position of each batch token, `[n_tokens]` from here.
    pub positions: usize,
    /// Where each batch token's K/V go, `(target, slot)` of the cache storage (−1: nowhere),
    /// `[n_tokens, 2]` from here.
    pub places: usize,
    /// Each history row's key slots' positions, −1 for a slot without a token, `[rows, keys]`
    /// from here.
    pub key_positions: usize,
    /// Key slots per history row.
    pub keys: usize,
    /// Each history row's blocks per KV head, as indices into the storage viewed as
    /// `[targets * n_kv_heads, slots, head_dim]` (a dense row is one block of all its slots),
    /// `[rows, n_kv_heads, blocks_per_row]` from here.
    pub table: usize,
    /// Blocks per history row and KV head.
    pub blocks_per_row: usize,
}

/// [`StepIndex`]'s arrays on the host, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostStepIndex {
    /// `[n_tokens, TOKEN_FIELDS]`
    pub tokens: Vec<i32>,
    /// `[n_tokens]`
    pub positions: Vec<i32>,
    /// `[n_tokens, 2]`
    pub places: Vec<i32>,
    /// `[rows, keys]`
    pub key_positions: Vec<i32>,
    /// Keys per row of `key_positions`.
    pub keys: usize,
    /// `[rows, n_kv_heads, blocks_per_row]`
    pub table: Vec<i32>,
    /// Blocks per row and KV head in `table`.
    pub blocks_per_row: usize,
}

fn index(value: usize) -> i32 {
    i32::try_from(value).expect("kiln's caches hold fewer than 2^31 slots")
}

impl HostStepIndex {
    /// The index of `step` for `batch`, with `n_kv_heads` heads per block.
    pub fn new(batch: &Batch, step: &StepPlan, n_kv_heads: usize) -> Self {
        let n = batch.n_tokens();
        let positions: Vec<i32> = batch.positions().iter().map(|p| index(p.index())).collect();
        let mut tokens = vec![0i32; n * TOKEN_FIELDS];
        for span in &step.fresh {
            for t in span.tokens.clone() {
                tokens[t * TOKEN_FIELDS..][..TOKEN_FIELDS].copy_from_slice(&[
                    -1,
                    index(span.tokens.start),
                    index(span.tokens.len()),
                    positions[t],
                ]);
            }
        }
        let keys = step
            .history
            .iter()
            .map(|h| h.key_positions.len())
            .max()
            .unwrap_or(0);
        for (row, span) in step.history.iter().enumerate() {
            for t in span.tokens.clone() {
                tokens[t * TOKEN_FIELDS..][..TOKEN_FIELDS].copy_from_slice(&[
                    index(row),
                    0,
                    index(span.key_positions.len()),
                    positions[t],
                ]);
            }
        }
        let mut places = vec![-1i32; n * 2];
        for run in &step.writes {
            for (i, t) in run.tokens.clone().enumerate() {
                places[t * 2] = index(run.target);
                places[t * 2 + 1] = index(run.slot + i);
            }
        }
        let rows = step.history.len();
        let mut key_positions = vec![-1i32; rows.max(1) * keys.max(1)];
        for (row, span) in step.history.iter().enumerate() {
            for (slot, p) in span.key_positions.iter().enumerate() {
                key_positions[row * keys + slot] = p.map_or(-1, |p| index(p.index()));
            }
        }
        let (table, blocks_per_row) = match &step.read {
            ReadPlan::None => (vec![0; n_kv_heads], 1),
            ReadPlan::Rows { rows, .. } => (
                rows.iter()
                    .flat_map(|&r| (0..n_kv_heads).map(move |h| index(r * n_kv_heads + h)))
                    .collect(),
                1,
            ),
            ReadPlan::Blocks {
                blocks,
                blocks_per_row,
            } => (
                blocks
                    .chunks(*blocks_per_row)
                    .flat_map(|table| {
                        (0..n_kv_heads).flat_map(move |h| {
                            table.iter().map(move |b| index(b.index() * n_kv_heads + h))
                        })
                    })
                    .collect(),
                *blocks_per_row,
            ),
        };
        Self {
            tokens,
            positions,
            places,
            key_positions,
            keys: keys.max(1),
            table,
            blocks_per_row,
        }
    }

    /// Rows of the history tables (at least 1: empty steps keep a dummy row).
    pub fn rows(&self) -> usize {
        self.key_positions.len() / self.keys
    }
}

impl<B: Backend> StepIndex<B> {
    /// Uploads `host` in one transfer.
    pub fn upload(host: HostStepIndex, window: Option<usize>, device: &B::Device) -> Self {
        let arrays = [
            &host.tokens,
            &host.positions,
            &host.places,
            &host.key_positions,
            &host.table,
        ];
        let mut starts = [0usize; 5];
        let mut data = Vec::with_capacity(arrays.iter().map(|a| a.len()).sum());
        for (start, array) in starts.iter_mut().zip(arrays) {
            *start = data.len();
            data.extend_from_slice(array);
        }
        let len = data.len();
        let data: Tensor<B, 1, Int> = crate::tensor::upload(TensorData::new(data, [len]), device);
        let max_keys = host
            .tokens
            .chunks(TOKEN_FIELDS)
            .map(|t| t[2] as usize)
            .max()
            .unwrap_or(0);
        let [tokens, positions, places, key_positions, table] = starts;
        Self {
            data,
            layout: StepLayout {
                n_tokens: host.positions.len(),
                tokens,
                positions,
                places,
                key_positions,
                keys: host.keys,
                table,
                blocks_per_row: host.blocks_per_row,
            },
            max_keys,
            window,
            host,
        }
    }
}
