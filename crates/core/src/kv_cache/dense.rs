//! The row-per-sequence caches (static, dynamic, sliding) share this implementation; they differ
//! in [`Policy`]: how rows and slots are sized and whether slots wrap around.

use std::collections::HashMap;

use crate::backend::InferenceBackend;

use burn::tensor::Tensor;

use super::plan::{FreshSpan, HistorySpan, Incoming, ReadPlan, StepPlan, WriteRun, incoming};
use super::storage::{CachedKv, ReadIndex, SlotStorage};
use super::{CacheError, CacheKind, CacheUsage, HostKv, KvLayout};
use crate::batch::Batch;
use crate::dtype::KvDtype;
use crate::ids::{Position, SeqId};

/// How a dense cache sizes itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Fixed rows of `max_len` slots.
    Static { max_len: usize },
    /// Rows and slots double when needed.
    Dynamic,
    /// Fixed rows, each a ring of `window + max_step - 1` slots.
    Sliding { window: usize, max_step: usize },
}

#[derive(Debug, Clone)]
struct DenseSeq {
    row: usize,
    /// Tokens appended so far.
    len: usize,
    /// Position stored in each slot of the row.
    slot_positions: Vec<Option<Position>>,
}

/// Storage plus the bookkeeping of which sequence owns which row.
#[derive(Debug)]
pub(crate) struct DenseCache<B: InferenceBackend> {
    policy: Policy,
    storage: SlotStorage<B>,
    /// Free rows, lowest last (popped first).
    free_rows: Vec<usize>,
    seqs: HashMap<SeqId, DenseSeq>,
}

impl<B: InferenceBackend> DenseCache<B> {
    pub fn new(
        policy: Policy,
        layout: KvLayout,
        rows: usize,
        slots: usize,
        dtype: impl Into<KvDtype>,
        device: &B::Device,
    ) -> Self {
        Self {
            policy,
            storage: SlotStorage::new(layout, rows, slots, dtype, device),
            free_rows: (0..rows).rev().collect(),
            seqs: HashMap::new(),
        }
    }

    pub fn kind(&self) -> CacheKind {
        match self.policy {
            Policy::Static { .. } => CacheKind::Static,
            Policy::Dynamic => CacheKind::Dynamic,
            Policy::Sliding { .. } => CacheKind::Sliding,
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.storage.layout()
    }

    /// The precision stored.
    pub fn dtype(&self) -> KvDtype {
        self.storage.dtype()
    }

    pub fn write(&mut self, layer: usize, plan: &StepPlan, k: Tensor<B, 3>, v: Tensor<B, 3>) {
        self.storage.write(layer, &plan.writes, k, v);
    }

    pub fn read<'a>(&self, layer: usize, index: &'a ReadIndex<B>) -> CachedKv<'a, B> {
        self.storage.read(layer, index)
    }

    pub fn write_places(
        &mut self,
        layer: usize,
        index: &crate::attention::StepIndex<B>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) {
        self.storage.write_places(layer, index, k, v);
    }

    pub fn storage(&self, layer: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.storage.layer(layer)
    }

    pub fn export(&self, seq: SeqId) -> Result<HostKv, CacheError> {
        let Some(entry) = self.seqs.get(&seq) else {
            return Ok(self.storage.gather_host(&[]));
        };
        let slots = entry.slot_positions.len();
        if entry.len > slots {
            return Err(CacheError::NotAllHeld {
                seq,
                held: entry.len,
                kept: slots,
            });
        }
        let places: Vec<(usize, usize)> = (0..entry.len).map(|t| (entry.row, t)).collect();
        Ok(self.storage.gather_host(&places))
    }

    pub fn max_sequences(&self) -> Option<usize> {
        match self.policy {
            Policy::Dynamic => None,
            _ => Some(self.storage.targets()),
        }
    }

    pub fn window(&self) -> Option<usize> {
        match self.policy {
            Policy::Sliding { window, .. } => Some(window),
            _ => None,
        }
    }

    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    pub fn usage(&self) -> CacheUsage {
        let slots = self.storage.slots();
        CacheUsage {
            capacity: self.storage.targets() * slots,
            used: self.seqs.values().map(|s| s.len.min(slots)).sum(),
            cached: 0,
            sequences: self.seqs.len(),
        }
    }

    pub fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.free_rows.push(s.row);
            // Keep the lowest free row on top so rows stay packed towards 0.
            self.free_rows.sort_unstable_by(|a, b| b.cmp(a));
        }
    }

    pub fn truncate(&mut self, seq: SeqId, keep: usize) -> Result<(), CacheError> {
        let len = self.seq_len(seq);
        super::check_truncate(seq, keep, len)?;
        if keep == 0 {
            self.release(seq);
            return Ok(());
        }
        // A ring holds `window + max_step - 1` tokens; the token after the kept ones needs the
        // `window - 1` before it, so at most `max_step` may be dropped.
        if let Policy::Sliding { max_step, .. } = self.policy
            && len - keep > max_step
        {
            return Err(CacheError::TruncateTooFar {
                seq,
                dropped: len - keep,
                max: max_step,
            });
        }
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return Ok(());
        };
        let slots = entry.slot_positions.len();
        for token in keep..len {
            entry.slot_positions[token % slots] = None;
        }
        entry.len = keep;
        Ok(())
    }

    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CacheError> {
        let held = self.seq_len(child);
        if held > 0 {
            return Err(CacheError::AlreadyHeld {
                seq: child,
                len: held,
            });
        }
        let Some(source) = self.seqs.get(&parent).cloned() else {
            self.release(child);
            return Ok(());
        };
        if !self.seqs.contains_key(&child) {
            let incoming = [Incoming {
                seq: child,
                tokens: 0..0,
                held: 0,
            }];
            let (rows, slots) = self.check(&incoming)?;
            self.grow_to(rows, slots);
        }
        let row = self.row_for(child).row;
        // A ring's slots hold the last tokens in any order: copy them all; a row copies as
        // far as it is filled.
        let filled = match self.policy {
            Policy::Sliding { .. } => self.storage.slots(),
            _ => source.len.min(self.storage.slots()),
        };
        self.storage.copy_target_slots(source.row, row, 0..filled);
        let entry = self.seqs.get_mut(&child).expect("given a row above");
        entry.len = source.len;
        entry.slot_positions = source.slot_positions;
        entry.slot_positions.resize(self.storage.slots(), None);
        Ok(())
    }

    pub fn clear(&mut self) {
        self.seqs.clear();
        self.free_rows = (0..self.storage.targets()).rev().collect();
    }

    pub fn check_append(&self, seq: SeqId, n_new: usize) -> Result<(), CacheError> {
        let incoming = [Incoming {
            seq,
            tokens: 0..n_new,
            held: self.seq_len(seq),
        }];
        self.check(&incoming).map(|_| ())
    }

    /// Claims rows (and grows a dynamic cache) for a step's sequences before the forward.
    pub fn reserve(&mut self, step: &[(SeqId, usize)]) -> Result<(), CacheError> {
        let incoming: Vec<Incoming> = step
            .iter()
            .map(|&(seq, n)| Incoming {
                seq,
                tokens: 0..n,
                held: self.seq_len(seq),
            })
            .collect();
        let (rows, slots) = self.check(&incoming)?;
        self.grow_to(rows, slots);
        for s in &incoming {
            self.row_for(s.seq);
        }
        Ok(())
    }

    /// `seq`'s entry, with a row taken from the free ones if it has none yet.
    fn row_for(&mut self, seq: SeqId) -> &mut DenseSeq {
        let slots = self.storage.slots();
        let free_rows = &mut self.free_rows;
        self.seqs.entry(seq).or_insert_with(|| DenseSeq {
            row: free_rows.pop().expect("checked: a free row exists"),
            len: 0,
            slot_positions: vec![None; slots],
        })
    }

    /// Validates a step; returns the rows and slots the storage must have for it.
    fn check(&self, incoming: &[Incoming]) -> Result<(usize, usize), CacheError> {
        // A sequence reserved ahead of its first plan already has its row.
        let new_rows = incoming
            .iter()
            .filter(|s| !self.seqs.contains_key(&s.seq))
            .count();
        let longest = incoming
            .iter()
            .map(|s| s.held + s.n_new())
            .max()
            .unwrap_or(0);
        match self.policy {
            Policy::Static { max_len } => {
                if let Some(s) = incoming.iter().find(|s| s.held + s.n_new() > max_len) {
                    return Err(CacheError::SequenceTooLong {
                        seq: s.seq,
                        needed: s.held + s.n_new(),
                        max: max_len,
                    });
                }
            }
            Policy::Sliding { max_step, .. } => {
                if let Some(s) = incoming.iter().find(|s| s.held > 0 && s.n_new() > max_step) {
                    return Err(CacheError::StepTooLarge {
                        seq: s.seq,
                        tokens: s.n_new(),
                        max: max_step,
                    });
                }
            }
            Policy::Dynamic => {
                let rows = (self.storage.targets() - self.free_rows.len() + new_rows)
                    .max(self.storage.targets());
                return Ok((rows, longest.max(self.storage.slots())));
            }
        }
        if new_rows > self.free_rows.len() {
            return Err(CacheError::NoFreeSlot {
                max_sequences: self.storage.targets(),
            });
        }
        Ok((self.storage.targets(), self.storage.slots()))
    }

    pub fn plan(&mut self, batch: &Batch) -> Result<StepPlan, CacheError> {
        let incoming = incoming(batch, |seq| self.seq_len(seq));
        let (rows, slots) = self.check(&incoming)?;
        self.grow_to(rows, slots);

        let ring = matches!(self.policy, Policy::Sliding { .. });
        let slots = self.storage.slots();
        let mut plan = StepPlan {
            n_tokens: batch.n_tokens(),
            window: self.window(),
            writes: Vec::new(),
            fresh: Vec::new(),
            history: Vec::new(),
            read: ReadPlan::None,
        };
        let mut read_rows = Vec::new();
        for s in &incoming {
            let entry = self.row_for(s.seq);
            entry.slot_positions.resize(slots, None);
            // A ring keeps only the last `slots` tokens: older new tokens would be overwritten
            // within this very step, so they are not written at all.
            let skip = if ring {
                s.n_new().saturating_sub(slots)
            } else {
                0
            };
            let first = entry.len + skip;
            let written = s.tokens.start + skip..s.tokens.end;
            for (lap, slot, run) in super::plan::runs_by_chunk(first, written, slots) {
                debug_assert!(ring || lap == 0, "a static or dynamic row never wraps");
                for (i, token) in run.clone().enumerate() {
                    entry.slot_positions[slot + i] = Some(batch.positions()[token]);
                }
                plan.writes.push(WriteRun {
                    target: entry.row,
                    slot,
                    tokens: run,
                });
            }
            entry.len += s.n_new();
            if s.held == 0 {
                plan.fresh.push(FreshSpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                });
            } else {
                read_rows.push(entry.row);
                plan.history.push(HistorySpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                    key_positions: entry.slot_positions.clone(),
                });
            }
        }
        if !read_rows.is_empty() {
            // Read only as far as the fullest row reaches.
            let keys = plan
                .history
                .iter()
                .map(|h| self.seqs[&h.seq].len.min(slots))
                .max()
                .unwrap_or(0);
            for h in &mut plan.history {
                h.key_positions.truncate(keys);
            }
            plan.read = ReadPlan::Rows {
                rows: read_rows,
                keys,
            };
        }
        Ok(plan)
    }

    /// Grows the storage (dynamic policy only ever asks for more than it has).
    fn grow_to(&mut self, rows: usize, slots: usize) {
        let (have_rows, have_slots) = (self.storage.targets(), self.storage.slots());
        if rows <= have_rows && slots <= have_slots {
            return;
        }
        let rows = if rows > have_rows {
            rows.next_power_of_two()
        } else {
            have_rows
        };
        let slots = if slots > have_slots {
            slots.next_power_of_two()
        } else {
            have_slots
        };
        self.storage.grow(rows, slots);
        self.free_rows.extend(have_rows..rows);
        self.free_rows.sort_unstable_by(|a, b| b.cmp(a));
    }
}

/// Implements [`super::CacheBook`] and [`super::KvCache`] for a newtype around [`DenseCache`].
macro_rules! delegate_dense_cache {
    ($name:ident) => {
        impl<B: InferenceBackend> $crate::kv_cache::CacheBook for $name<B> {
            fn kind(&self) -> $crate::kv_cache::CacheKind {
                self.inner.kind()
            }
            fn layout(&self) -> $crate::kv_cache::KvLayout {
                self.inner.layout()
            }
            fn usage(&self) -> $crate::kv_cache::CacheUsage {
                self.inner.usage()
            }
            fn seq_len(&self, seq: $crate::ids::SeqId) -> usize {
                self.inner.seq_len(seq)
            }
            fn window(&self) -> Option<usize> {
                self.inner.window()
            }
            fn max_sequences(&self) -> Option<usize> {
                self.inner.max_sequences()
            }
            fn check_append(
                &self,
                seq: $crate::ids::SeqId,
                n_new: usize,
            ) -> Result<(), $crate::kv_cache::CacheError> {
                self.inner.check_append(seq, n_new)
            }
            fn release(&mut self, seq: $crate::ids::SeqId) {
                self.inner.release(seq)
            }
            fn truncate(
                &mut self,
                seq: $crate::ids::SeqId,
                keep: usize,
            ) -> Result<(), $crate::kv_cache::CacheError> {
                self.inner.truncate(seq, keep)
            }
            fn reserve(
                &mut self,
                step: &[($crate::ids::SeqId, usize)],
            ) -> Result<(), $crate::kv_cache::CacheError> {
                self.inner.reserve(step)
            }
            fn fork(
                &mut self,
                parent: $crate::ids::SeqId,
                child: $crate::ids::SeqId,
            ) -> Result<(), $crate::kv_cache::CacheError> {
                self.inner.fork(parent, child)
            }
            fn clear(&mut self) {
                self.inner.clear()
            }
        }

        impl<B: InferenceBackend> $crate::kv_cache::KvCache<B> for $name<B> {
            fn dtype(&self) -> $crate::dtype::KvDtype {
                self.inner.dtype()
            }
            fn plan(
                &mut self,
                batch: &$crate::batch::Batch,
            ) -> Result<$crate::kv_cache::StepPlan, $crate::kv_cache::CacheError> {
                self.inner.plan(batch)
            }
            fn write(
                &mut self,
                layer: usize,
                plan: &$crate::kv_cache::StepPlan,
                k: burn::tensor::Tensor<B, 3>,
                v: burn::tensor::Tensor<B, 3>,
            ) {
                self.inner.write(layer, plan, k, v)
            }
            fn read<'a>(
                &self,
                layer: usize,
                index: &'a $crate::kv_cache::ReadIndex<B>,
            ) -> $crate::kv_cache::CachedKv<'a, B> {
                self.inner.read(layer, index)
            }
            fn write_places(
                &mut self,
                layer: usize,
                index: &$crate::attention::StepIndex<B>,
                k: burn::tensor::Tensor<B, 3>,
                v: burn::tensor::Tensor<B, 3>,
            ) {
                self.inner.write_places(layer, index, k, v)
            }
            fn storage(
                &self,
                layer: usize,
            ) -> (burn::tensor::Tensor<B, 4>, burn::tensor::Tensor<B, 4>) {
                self.inner.storage(layer)
            }
            fn export(
                &self,
                seq: $crate::ids::SeqId,
            ) -> Result<$crate::kv_cache::HostKv, $crate::kv_cache::CacheError> {
                self.inner.export(seq)
            }
        }
    };
}
pub(crate) use delegate_dense_cache;
