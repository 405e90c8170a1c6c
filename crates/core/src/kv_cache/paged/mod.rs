//! [`PagedKvCache`]: a pool of fixed-size blocks and a block table per sequence (vLLM's
//! PagedAttention layout, read by gathering each sequence's blocks).

mod block_pool;

use std::collections::HashMap;

use crate::backend::InferenceBackend;

pub use block_pool::BlockPool;

use super::plan::{FreshSpan, HistorySpan, ReadPlan, StepPlan, WriteRun, incoming, runs_by_chunk};
use super::{CacheBook, CacheError, CacheKind, CacheUsage, KvCache, KvLayout, SlotStorage};
use crate::batch::Batch;
use crate::dtype::Dtype;
use crate::ids::{BlockId, Position, SeqId};

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone, Default)]
struct PagedSeq {
    blocks: Vec<BlockId>,
    positions: Vec<Position>,
}

/// Per layer a `[n_blocks, block_size, n_kv_heads, head_dim]` pool. Sequences take blocks as
/// they grow and give them back when released; memory is shared by all sequences, so a long
/// one and many short ones fit in the same pool. Running out of blocks is a recoverable
/// [`CacheError::OutOfBlocks`]: the scheduler preempts a sequence and retries.
#[derive(Debug)]
pub struct PagedKvCache<B: InferenceBackend> {
    storage: SlotStorage<B>,
    pool: BlockPool,
    seqs: HashMap<SeqId, PagedSeq>,
}

impl<B: InferenceBackend> PagedKvCache<B> {
    /// A pool of `n_blocks` blocks of `block_size` tokens.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] if either size is 0.
    pub fn new(
        layout: KvLayout,
        n_blocks: usize,
        block_size: usize,
        dtype: Dtype,
        device: &B::Device,
    ) -> Result<Self, CacheError> {
        if n_blocks == 0 || block_size == 0 {
            return Err(CacheError::InvalidConfig(
                "a paged cache needs at least one block of one token".into(),
            ));
        }
        Ok(Self {
            storage: SlotStorage::new(layout, n_blocks, block_size, dtype, device),
            pool: BlockPool::new(n_blocks),
            seqs: HashMap::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.storage.slots()
    }

    /// The block pool (read-only: the cache alone allocates).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The blocks `seq` owns, in order.
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| s.blocks.as_slice())
    }

    /// Blocks that appending `n_new` tokens to a sequence holding `held` needs beyond those
    /// it owns.
    pub fn blocks_needed(&self, held: usize, n_new: usize) -> usize {
        let bs = self.block_size();
        (held + n_new).div_ceil(bs) - held.div_ceil(bs)
    }
}

impl<B: InferenceBackend> CacheBook for PagedKvCache<B> {
    fn kind(&self) -> CacheKind {
        CacheKind::Paged
    }

    fn layout(&self) -> KvLayout {
        self.storage.layout()
    }

    fn usage(&self) -> CacheUsage {
        CacheUsage {
            capacity: self.pool.total() * self.block_size(),
            used: self.pool.used_count() * self.block_size(),
            sequences: self.seqs.len(),
        }
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.positions.len())
    }

    fn check_append(&self, seq: SeqId, n_new: usize) -> Result<(), CacheError> {
        let needed = self.blocks_needed(self.seq_len(seq), n_new);
        if needed > self.pool.free_count() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.pool.free_count(),
            });
        }
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.pool.free(&s.blocks);
        }
    }

    fn truncate(&mut self, seq: SeqId, keep: usize) -> Result<(), CacheError> {
        let len = self.seq_len(seq);
        super::check_truncate(seq, keep, len)?;
        if keep == 0 {
            self.release(seq);
            return Ok(());
        }
        let blocks_kept = keep.div_ceil(self.block_size());
        if let Some(entry) = self.seqs.get_mut(&seq) {
            entry.positions.truncate(keep);
            let dropped = entry.blocks.split_off(blocks_kept);
            self.pool.free(&dropped);
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.seqs.clear();
        self.pool.reset();
    }
}

impl<B: InferenceBackend> KvCache<B> for PagedKvCache<B> {
    fn plan(&mut self, batch: &Batch) -> Result<StepPlan, CacheError> {
        let incoming = incoming(batch, |seq| self.seq_len(seq));
        let needed: usize = incoming
            .iter()
            .map(|s| self.blocks_needed(s.held, s.n_new()))
            .sum();
        if needed > self.pool.free_count() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.pool.free_count(),
            });
        }

        let bs = self.block_size();
        let mut plan = StepPlan {
            n_tokens: batch.n_tokens(),
            window: None,
            writes: Vec::new(),
            fresh: Vec::new(),
            history: Vec::new(),
            read: ReadPlan::None,
        };
        for s in &incoming {
            let extra = self.blocks_needed(s.held, s.n_new());
            let new_blocks = self
                .pool
                .allocate(s.seq, extra)
                .expect("checked: enough blocks are free");
            let entry = self.seqs.entry(s.seq).or_default();
            entry.blocks.extend(new_blocks);
            for (chunk, slot, run) in runs_by_chunk(s.held, s.tokens.clone(), bs) {
                plan.writes.push(WriteRun {
                    target: entry.blocks[chunk].index(),
                    slot,
                    tokens: run,
                });
            }
            entry
                .positions
                .extend_from_slice(&batch.positions()[s.tokens.clone()]);
            if s.held == 0 {
                plan.fresh.push(FreshSpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                });
            } else {
                plan.history.push(HistorySpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                    key_positions: entry.positions.iter().copied().map(Some).collect(),
                });
            }
        }
        if !plan.history.is_empty() {
            let blocks_per_row = plan
                .history
                .iter()
                .map(|h| self.seqs[&h.seq].blocks.len())
                .max()
                .unwrap_or(0);
            let mut blocks = Vec::with_capacity(plan.history.len() * blocks_per_row);
            for h in &mut plan.history {
                let table = &self.seqs[&h.seq].blocks;
                // Padding repeats a block of the same row; its slots are masked out.
                blocks.extend(table.iter().copied());
                blocks.extend(std::iter::repeat_n(table[0], blocks_per_row - table.len()));
                h.key_positions.resize(blocks_per_row * bs, None);
            }
            plan.read = ReadPlan::Blocks {
                blocks,
                blocks_per_row,
            };
        }
        Ok(plan)
    }

    fn storage(&self) -> &SlotStorage<B> {
        &self.storage
    }

    fn storage_mut(&mut self) -> &mut SlotStorage<B> {
        &mut self.storage
    }
}
