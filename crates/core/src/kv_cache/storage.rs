//! [`SlotStorage`]: the K/V tensors of every layer, shared by all cache kinds.

use std::ops::Range;

use burn::tensor::backend::Backend;

use crate::backend::InferenceBackend;
use burn::tensor::{FloatDType, Int, Tensor};

use crate::tensor::int_tensor;

use super::encoding;
use super::plan::{ReadPlan, WriteRun};
use super::{HostKv, KvLayout};
use crate::dtype::KvDtype;

/// Per layer one K and one V tensor of shape `[targets, n_kv_heads, slots, width]`, `width`
/// being `head_dim` for the float precisions and the rows' Q8_0 blocks as f16 words for Q8_0
/// ([`KvDtype::stored_width`], [`super::encoding`]).
///
/// A *target* is a sequence's row (dense caches) or a block (paged cache); a *slot* is a
/// token's place in it. Head-major, like attention's operands: a read is one gather of whole
/// `[slots, head_dim]` runs that attention takes as it is, with no strided copy per layer
/// (with token-major slots burn-flex copied the transposed K/V element by element, most of a
/// batched decode step). A write pays instead: `n_kv_heads` short runs per sequence.
#[derive(Debug)]
pub(crate) struct SlotStorage<B: InferenceBackend> {
    layout: KvLayout,
    dtype: KvDtype,
    device: B::Device,
    targets: usize,
    slots: usize,
    k: Vec<Tensor<B, 4>>,
    v: Vec<Tensor<B, 4>>,
}

/// The device-side form of a [`ReadPlan`], built once per forward and shared by every layer.
#[derive(Debug, Clone)]
pub enum ReadIndex<B: Backend> {
    /// One row per sequence; the first `keys` slots of each.
    Rows {
        /// The row of each sequence.
        rows: RowPick<B>,
        /// Slots read from each row.
        keys: usize,
        /// The head blocks read, as [`CachedKv::table`] lists them.
        table: Vec<usize>,
    },
    /// Each sequence's block table, padded to `blocks_per_row`, as indices into the pool
    /// viewed as `[blocks * n_kv_heads, slots, head_dim]`: for row `r`, head `h`, the `i`-th
    /// block `b` of its table is `b * n_kv_heads + h`.
    Blocks {
        /// Row-major `[rows, n_kv_heads, blocks_per_row]`, flattened.
        head_blocks: Tensor<B, 1, Int>,
        /// Sequences read.
        rows: usize,
        /// Blocks per sequence.
        blocks_per_row: usize,
        /// `head_blocks` on the host, as [`CachedKv::table`] lists them.
        table: Vec<usize>,
    },
}

/// Which rows of a dense cache a step reads, in order.
#[derive(Debug, Clone)]
pub enum RowPick<B: Backend> {
    /// Consecutive rows in ascending order (the common case: rows are handed out lowest
    /// first), read as a slice: no gather, and on burn-flex one copy fewer.
    Range(Range<usize>),
    /// Any other rows, gathered. `[rows]`
    Select(Tensor<B, 1, Int>),
}

impl<B: Backend> RowPick<B> {
    fn new(rows: &[usize], device: &B::Device) -> Self {
        match rows.first() {
            Some(&first) if rows.iter().enumerate().all(|(i, &r)| r == first + i) => {
                RowPick::Range(first..first + rows.len())
            }
            _ => RowPick::Select(int_tensor(rows.iter().copied(), device)),
        }
    }
}

impl<B: InferenceBackend> ReadIndex<B> {
    /// Uploads a read plan for a cache of `n_kv_heads` heads; `None` when there is nothing to
    /// read.
    pub fn new(plan: &ReadPlan, n_kv_heads: usize, device: &B::Device) -> Option<Self> {
        match plan {
            ReadPlan::None => None,
            ReadPlan::Rows { rows, keys } => Some(ReadIndex::Rows {
                rows: RowPick::new(rows, device),
                keys: *keys,
                // A row's head `h` is head block `row * n_kv_heads + h`, of all its slots.
                table: rows
                    .iter()
                    .flat_map(|r| (0..n_kv_heads).map(move |h| r * n_kv_heads + h))
                    .collect(),
            }),
            ReadPlan::Blocks {
                blocks,
                blocks_per_row,
            } => {
                let table: Vec<usize> = blocks
                    .chunks(*blocks_per_row)
                    .flat_map(|table| {
                        (0..n_kv_heads).flat_map(move |h| {
                            table.iter().map(move |b| b.index() * n_kv_heads + h)
                        })
                    })
                    .collect();
                Some(ReadIndex::Blocks {
                    head_blocks: int_tensor(table.iter().copied(), device),
                    rows: blocks.len() / blocks_per_row,
                    blocks_per_row: *blocks_per_row,
                    table,
                })
            }
        }
    }
}

impl<B: InferenceBackend> SlotStorage<B> {
    /// Zero-filled storage for `targets` targets of `slots` slots each.
    ///
    /// # Panics
    /// If `dtype` cannot hold rows of the layout's width (Q8_0 needs whole blocks of 32: the
    /// engine and the command line check first).
    pub fn new(
        layout: KvLayout,
        targets: usize,
        slots: usize,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Self {
        let dtype = dtype.into();
        assert!(
            dtype.holds_rows_of(layout.head_dim),
            "a {dtype} KV cache cannot hold heads of {} values",
            layout.head_dim
        );
        let make = || {
            (0..layout.n_layers)
                .map(|_| Self::zeros(layout, targets, slots, dtype, device))
                .collect()
        };
        Self {
            layout,
            dtype,
            device: device.clone(),
            targets,
            slots,
            k: make(),
            v: make(),
        }
    }

    fn zeros(
        layout: KvLayout,
        targets: usize,
        slots: usize,
        dtype: KvDtype,
        device: &B::Device,
    ) -> Tensor<B, 4> {
        // Zero words are Q8_0 blocks of zeros too.
        Tensor::zeros(
            [
                targets,
                layout.n_kv_heads,
                slots,
                dtype.stored_width(layout.head_dim),
            ],
            (device, dtype.storage().burn()),
        )
    }

    /// Elements of a stored row.
    fn width(&self) -> usize {
        self.dtype.stored_width(self.layout.head_dim)
    }

    /// The layout stored.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The precision stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Rows or blocks per layer.
    pub fn targets(&self) -> usize {
        self.targets
    }

    /// Slots per target.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Reallocates to at least `targets` x `slots`, keeping what is stored (the dynamic
    /// cache's growth; a copy of everything, so callers double their sizes).
    pub fn grow(&mut self, targets: usize, slots: usize) {
        let targets = targets.max(self.targets);
        let slots = slots.max(self.slots);
        if targets == self.targets && slots == self.slots {
            return;
        }
        let (old_targets, old_slots) = (self.targets, self.slots);
        let (layout, dtype, device) = (self.layout, self.dtype, self.device.clone());
        let width = self.width();
        for tensor in self.k.iter_mut().chain(self.v.iter_mut()) {
            let bigger = Self::zeros(layout, targets, slots, dtype, &device);
            let old = std::mem::replace(tensor, bigger);
            let ranges = [0..old_targets, 0..layout.n_kv_heads, 0..old_slots, 0..width];
            B::write_in_place(tensor, ranges, old);
        }
        self.targets = targets;
        self.slots = slots;
    }

    /// Writes the runs of one layer's new K/V, in place.
    ///
    /// # Shapes
    /// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`, or already in the stored form
    ///   ([`encoding::encode`])
    pub fn write(&mut self, layer: usize, runs: &[WriteRun], k: Tensor<B, 3>, v: Tensor<B, 3>) {
        let (heads, dim, width) = (self.layout.n_kv_heads, self.layout.head_dim, self.width());
        for (store, new) in [(&mut self.k[layer], k), (&mut self.v[layer], v)] {
            let new = encoding::encode(self.dtype, new, dim);
            for run in runs {
                // Unsqueezed before the swap, so both stay views: reshaping the swapped view
                // would make burn-flex copy it value by value (`write_in_place` copies it once).
                let values = new
                    .clone()
                    .slice([run.tokens.clone()])
                    .unsqueeze_dim::<4>(0)
                    .swap_dims(1, 2);
                let slots: Range<usize> = run.slot..run.slot + run.tokens.len();
                B::write_in_place(
                    store,
                    [run.target..run.target + 1, 0..heads, slots, 0..width],
                    values,
                );
            }
        }
    }

    /// Writes one layer's new K/V at the places of `index`, in place.
    ///
    /// # Shapes
    /// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]`, or already in the stored form
    pub fn write_places(
        &mut self,
        layer: usize,
        index: &crate::attention::StepIndex<B>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) {
        let dim = self.layout.head_dim;
        let (k, v) = (
            encoding::encode(self.dtype, k, dim),
            encoding::encode(self.dtype, v, dim),
        );
        B::write_kv_places(&mut self.k[layer], &mut self.v[layer], index, k, v);
    }

    /// One layer's K and V tensors (handles to the storage itself).
    pub fn layer(&self, layer: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        (self.k[layer].clone(), self.v[layer].clone())
    }

    /// One layer's K/V as the rows of a step read them: where they are stored, and which
    /// parts each row reads. Nothing is copied; [`CachedKv::gather`] copies.
    pub fn read<'a>(&self, layer: usize, index: &'a ReadIndex<B>) -> CachedKv<'a, B> {
        CachedKv {
            k: self.k[layer].clone(),
            v: self.v[layer].clone(),
            dtype: self.dtype,
            head_dim: self.layout.head_dim,
            index,
        }
    }

    /// Copies `src`'s slots of every layer over `dst`'s (copy-on-write of a shared block).
    pub fn copy_target(&mut self, src: usize, dst: usize) {
        self.copy_target_slots(src, dst, 0..self.slots);
    }

    /// Copies slots `slots` of target `src` over the same slots of `dst`, in every layer (a
    /// forked row).
    pub fn copy_target_slots(&mut self, src: usize, dst: usize, slots: Range<usize>) {
        if slots.is_empty() || src == dst {
            return;
        }
        let (heads, width) = (self.layout.n_kv_heads, self.width());
        for tensor in self.k.iter_mut().chain(self.v.iter_mut()) {
            let values = tensor
                .clone()
                .slice([src..src + 1, 0..heads, slots.clone(), 0..width]);
            B::write_in_place(
                tensor,
                [dst..dst + 1, 0..heads, slots.clone(), 0..width],
                values,
            );
        }
    }

    /// Copies the K/V at `places` (`(target, slot)`, one per token) of every layer to the
    /// host.
    ///
    /// # Shapes
    /// - returns per layer `(k, v)`, each `[places.len(), n_kv_heads, head_dim]` as f32
    pub fn gather_host(&self, places: &[(usize, usize)]) -> HostKv {
        if places.is_empty() {
            // Nothing to read: skip downloading every layer.
            return vec![(Vec::new(), Vec::new()); self.layout.n_layers];
        }
        let (heads, slots, dim) = (self.layout.n_kv_heads, self.slots, self.layout.head_dim);
        let host = |t: &Tensor<B, 4>| -> Vec<f32> {
            // [targets, heads, slots, dim] on the host, read token by token.
            let all: Vec<f32> = crate::tensor::host_f32(encoding::decode(
                self.dtype,
                t.clone(),
                dim,
                burn::tensor::FloatDType::F32,
            ));
            let mut out = Vec::with_capacity(places.len() * heads * dim);
            for &(target, slot) in places {
                for h in 0..heads {
                    let at = ((target * heads + h) * slots + slot) * dim;
                    out.extend_from_slice(&all[at..at + dim]);
                }
            }
            out
        };
        self.k
            .iter()
            .zip(&self.v)
            .map(|(k, v)| (host(k), host(v)))
            .collect()
    }
}

/// One layer's K/V where the cache keeps them (`[targets, n_kv_heads, slots, width]`, in the
/// cache's [`KvDtype`]) and the read index of a step's history rows: what
/// [`InferenceBackend::cached_attention`] attends over, gathered into one tensor of values
/// ([`gather`](Self::gather)) or read in place through the block table
/// ([`table`](Self::table)).
#[derive(Debug, Clone)]
pub struct CachedKv<'a, B: InferenceBackend> {
    /// The layer's keys as stored. `[targets, n_kv_heads, slots, width]`
    pub k: Tensor<B, 4>,
    /// The layer's values as stored. `[targets, n_kv_heads, slots, width]`
    pub v: Tensor<B, 4>,
    /// How `k` and `v` hold their values (`width` is `dtype.stored_width(head_dim)`).
    pub dtype: KvDtype,
    /// Values per head row.
    pub head_dim: usize,
    index: &'a ReadIndex<B>,
}

impl<B: InferenceBackend> CachedKv<'_, B> {
    /// The head blocks each history row reads, `[rows, n_kv_heads, blocks_per_row]`
    /// flattened: indices into the storage viewed as `[targets * n_kv_heads, slots,
    /// head_dim]`, in key order (a dense cache's row is one block of all its slots, of which
    /// the mask's first columns are read).
    pub fn table(&self) -> &[usize] {
        match self.index {
            ReadIndex::Rows { table, .. } | ReadIndex::Blocks { table, .. } => table,
        }
    }

    /// The K/V the rows read, copied into one tensor each, as values (a Q8_0 cache's blocks
    /// dequantized to f32; a float cache's in its own precision).
    ///
    /// # Shapes
    /// - returns `k`, `v`: `[rows, n_kv_heads, keys, head_dim]`
    pub fn gather(self) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [targets, heads, slots, dim] = self.k.dims();
        let read_one = |store: Tensor<B, 4>| -> Tensor<B, 4> {
            match self.index {
                ReadIndex::Rows {
                    rows: RowPick::Range(rows),
                    keys,
                    ..
                } => store.slice([rows.clone(), 0..heads, 0..*keys]),
                ReadIndex::Rows {
                    rows: RowPick::Select(rows),
                    keys,
                    ..
                } => store
                    .slice([0..targets, 0..heads, 0..*keys])
                    .select(0, rows.clone()),
                ReadIndex::Blocks {
                    head_blocks,
                    rows,
                    blocks_per_row,
                    ..
                } => store
                    .reshape([targets * heads, slots, dim])
                    .select(0, head_blocks.clone())
                    .reshape([*rows, heads, *blocks_per_row * slots, dim]),
            }
        };
        let values = |stored: Tensor<B, 4>| match self.dtype {
            KvDtype::Q8_0 => encoding::decode(self.dtype, stored, self.head_dim, FloatDType::F32),
            _ => stored,
        };
        (values(read_one(self.k)), values(read_one(self.v)))
    }
}
