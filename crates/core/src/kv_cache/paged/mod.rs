//! [`PagedKvCache`]: a pool of fixed-size blocks and a block table per sequence (vLLM's
//! PagedAttention layout, read by gathering each sequence's blocks), with prefix caching:
//! every full block is registered under a key chained over the tokens before it, so a later
//! sequence starting with the same tokens shares those blocks instead of computing them.

mod block_pool;

use std::collections::HashMap;

use burn::tensor::Tensor;

use crate::backend::InferenceBackend;

pub use block_pool::{BlockKey, BlockPool};

use super::plan::{FreshSpan, HistorySpan, ReadPlan, StepPlan, WriteRun, incoming, runs_by_chunk};
use super::storage::{CachedKv, ReadIndex, SlotStorage};
use super::{CacheBook, CacheError, CacheKind, CacheUsage, HostKv, KvCache, KvLayout};
use crate::batch::Batch;
use crate::dtype::KvDtype;
use crate::ids::{BlockId, Position, SeqId, TokenId};

/// The default number of tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Debug, Clone, Default)]
struct PagedSeq {
    blocks: Vec<BlockId>,
    positions: Vec<Position>,
    /// The tokens stored, while prefix caching is on and the positions run 0, 1, 2...
    tokens: Vec<TokenId>,
    /// The key of each full block registered so far, in order.
    keys: Vec<BlockKey>,
    /// False once a token sits at a position other than its index: such a sequence's blocks
    /// are not registered (their K/V depend on positions, not only tokens).
    unhashable: bool,
    /// Leading blocks given back because no later query's window reaches them
    /// ([`CacheBook::set_attention_window`]); `blocks[..forgotten]` are stale and never read.
    forgotten: usize,
    /// The latest position among the forgotten blocks' tokens.
    forgotten_last: Option<Position>,
}

impl PagedSeq {
    /// The blocks it still holds, in order.
    fn live_blocks(&self) -> &[BlockId] {
        &self.blocks[self.forgotten..]
    }
}

/// Per layer a `[n_blocks, n_kv_heads, block_size, head_dim]` pool. Sequences take blocks as
/// they grow and give them back when released; memory is shared by all sequences, so a long
/// one and many short ones fit in the same pool. Running out of blocks is a recoverable
/// [`CacheError::OutOfBlocks`]: the scheduler preempts a sequence and retries.
///
/// With prefix caching on ([`CacheBook::enable_prefix_cache`]) a block that fills up is
/// registered; [`CacheBook::attach_prefix`] gives a new sequence the registered blocks its
/// tokens begin with (shared, reference-counted); a released sequence's registered blocks stay
/// cached until the pool needs them (least recently released first). A shared block is never
/// written: a truncation that would leave a sequence writing into one copies it first, and so
/// does an append into a partial block a fork ([`CacheBook::fork`]) shares.
#[derive(Debug)]
pub struct PagedKvCache<B: InferenceBackend> {
    storage: SlotStorage<B>,
    pool: BlockPool,
    seqs: HashMap<SeqId, PagedSeq>,
    /// The key space (model and dtype) when prefix caching is on.
    prefix_space: Option<BlockKey>,
    /// The model's widest attention window, when every layer has one: blocks that have left
    /// it are given back.
    attention_window: Option<usize>,
}

impl<B: InferenceBackend> PagedKvCache<B> {
    /// A pool of `n_blocks` blocks of `block_size` tokens, prefix caching off.
    ///
    /// # Errors
    /// [`CacheError::InvalidConfig`] if either size is 0.
    pub fn new(
        layout: KvLayout,
        n_blocks: usize,
        block_size: usize,
        dtype: impl Into<KvDtype>,
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
            prefix_space: None,
            attention_window: None,
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

    /// The blocks `seq` holds, in order (without those it gave back as they left the model's
    /// attention window).
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], PagedSeq::live_blocks)
    }

    /// Gives back `seq`'s leading full blocks that no later query can see: with window `w`,
    /// a query after the last stored position `p` sees keys from `p + 2 - w` on. One block of
    /// slack is kept, so a short rollback (a rejected speculative draft) still finds the keys
    /// its successors attend over. Assumes a sequence's positions only grow, as every caller's
    /// do; [`KvCache::plan`] refuses a query that would need a forgotten key.
    fn forget_out_of_window(&mut self, seq: SeqId) {
        let Some(window) = self.attention_window else {
            return;
        };
        let bs = self.block_size();
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return;
        };
        let Some(last) = entry.positions.last() else {
            return;
        };
        let first_visible = (last.0 as usize + 2).saturating_sub(window + bs);
        // Whole blocks only, never the one the next token goes into.
        while (entry.forgotten + 1) * bs < entry.positions.len() {
            let tokens = &entry.positions[entry.forgotten * bs..][..bs];
            let newest = tokens.iter().copied().max().expect("a full block");
            if newest.0 as usize >= first_visible {
                break;
            }
            self.pool.release(&[entry.blocks[entry.forgotten]]);
            entry.forgotten += 1;
            entry.forgotten_last = entry.forgotten_last.max(Some(newest));
        }
    }

    /// Whether a query at `query` (or later) of `seq` would need a key the cache forgot.
    fn needs_forgotten(&self, seq: SeqId, query: Position) -> bool {
        let (Some(window), Some(entry)) = (self.attention_window, self.seqs.get(&seq)) else {
            return false;
        };
        // The query sees keys from `query + 1 - window` on.
        entry
            .forgotten_last
            .is_some_and(|f| f.0 as usize + window > query.0 as usize)
    }

    /// Blocks that a sequence holding `held` tokens in `owned` blocks needs beyond those to
    /// append `n_new` tokens.
    fn blocks_needed(&self, owned: usize, held: usize, n_new: usize) -> usize {
        (held + n_new)
            .div_ceil(self.block_size())
            .saturating_sub(owned)
    }

    fn owned(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.blocks.len())
    }

    /// The block `seq`'s next token goes into, if it is a partial block another sequence
    /// shares (a fork's): appending must copy it first.
    fn shared_tail(&self, seq: SeqId) -> Option<BlockId> {
        let entry = self.seqs.get(&seq)?;
        let held = entry.positions.len();
        if held.is_multiple_of(self.block_size()) {
            return None;
        }
        let block = entry.blocks[held / self.block_size()];
        (self.pool.refs(block) > 1).then_some(block)
    }

    /// Blocks appending `n_new` tokens to `seq` takes from the pool: new ones, and a private
    /// copy of a shared partial last block.
    fn step_blocks(&self, seq: SeqId, n_new: usize) -> usize {
        let copy = n_new > 0 && self.shared_tail(seq).is_some();
        self.blocks_needed(self.owned(seq), self.seq_len(seq), n_new) + usize::from(copy)
    }

    /// Gives `seq` a private copy of its shared partial last block before it writes there
    /// (copy on write). The caller has checked a block is available.
    fn unshare_tail(&mut self, seq: SeqId, n_new: usize) {
        if n_new == 0 {
            return;
        }
        let Some(shared) = self.shared_tail(seq) else {
            return;
        };
        let [fresh] = self
            .pool
            .allocate(1)
            .expect("checked: a block is available")[..]
        else {
            unreachable!("one block asked for")
        };
        self.storage.copy_target(shared.index(), fresh.index());
        let entry = self.seqs.get_mut(&seq).expect("it has a shared block");
        let at = entry.positions.len() / self.storage.slots();
        entry.blocks[at] = fresh;
        self.pool.release(&[shared]);
    }

    /// Registers every block of `seq` that is full and not registered yet.
    fn register_full_blocks(&mut self, seq: SeqId) {
        let Some(space) = self.prefix_space else {
            return;
        };
        let bs = self.block_size();
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return;
        };
        if entry.unhashable {
            return;
        }
        while entry.keys.len() < entry.tokens.len() / bs {
            let i = entry.keys.len();
            if i < entry.forgotten {
                // Prefix caching was switched on after this block was given back.
                entry.unhashable = true;
                return;
            }
            let parent = entry.keys.last().copied().unwrap_or(space);
            let key = self
                .pool
                .register(entry.blocks[i], parent, &entry.tokens[i * bs..][..bs]);
            entry.keys.push(key);
        }
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
        let bs = self.block_size();
        CacheUsage {
            capacity: self.pool.total() * bs,
            used: self.pool.used_count() * bs,
            cached: self.pool.cached_count() * bs,
            sequences: self.seqs.len(),
        }
    }

    fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.positions.len())
    }

    fn check_append(&self, seq: SeqId, n_new: usize) -> Result<(), CacheError> {
        let needed = self.step_blocks(seq, n_new);
        if needed > self.pool.available() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.pool.available(),
            });
        }
        Ok(())
    }

    fn reserve(&mut self, step: &[(SeqId, usize)]) -> Result<(), CacheError> {
        for &(seq, _) in step {
            self.forget_out_of_window(seq);
        }
        let needed: usize = step.iter().map(|&(seq, n)| self.step_blocks(seq, n)).sum();
        if needed > self.pool.available() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.pool.available(),
            });
        }
        for &(seq, n) in step {
            self.unshare_tail(seq, n);
            let extra = self.blocks_needed(self.owned(seq), self.seq_len(seq), n);
            let blocks = self.pool.allocate(extra).expect("checked: enough blocks");
            self.seqs.entry(seq).or_default().blocks.extend(blocks);
        }
        Ok(())
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            // Last block first: the tail of a cached prefix is evicted before its head.
            let blocks: Vec<BlockId> = s.live_blocks().iter().rev().copied().collect();
            self.pool.release(&blocks);
        }
    }

    fn truncate(&mut self, seq: SeqId, keep: usize) -> Result<(), CacheError> {
        let len = self.seq_len(seq);
        super::check_truncate(seq, keep, len)?;
        if keep == 0 {
            self.release(seq);
            return Ok(());
        }
        let next_query = Position(self.seqs[&seq].positions[keep - 1].0 + 1);
        if self.needs_forgotten(seq, next_query) {
            let positions = &self.seqs[&seq].positions;
            let shortest = (1..=len)
                .find(|&k| !self.needs_forgotten(seq, Position(positions[k - 1].0 + 1)))
                .unwrap_or(len);
            return Err(CacheError::TruncateTooFar {
                seq,
                dropped: len - keep,
                max: len - shortest,
            });
        }
        let bs = self.block_size();
        let blocks_kept = keep.div_ceil(bs);
        let last = blocks_kept - 1;
        let partial = !keep.is_multiple_of(bs);
        let last_block = self.seqs[&seq].blocks[last];
        // The kept tokens' successors will be written into the last kept block: if others
        // share it, this sequence takes a private copy; if it is registered, it leaves the
        // index (its content changes).
        let copy = partial && self.pool.refs(last_block) > 1;
        let replacement = if copy {
            let [fresh] = self.pool.allocate(1)?[..] else {
                unreachable!("one block asked for")
            };
            self.storage.copy_target(last_block.index(), fresh.index());
            Some(fresh)
        } else {
            if partial {
                self.pool.unregister(last_block);
            }
            None
        };
        let entry = self.seqs.get_mut(&seq).expect("a sequence with tokens");
        entry.positions.truncate(keep);
        entry.tokens.truncate(keep);
        entry.keys.truncate(keep / bs);
        let mut dropped = entry.blocks.split_off(blocks_kept);
        if let Some(fresh) = replacement {
            dropped.push(std::mem::replace(&mut entry.blocks[last], fresh));
        }
        dropped.reverse();
        self.pool.release(&dropped);
        Ok(())
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), CacheError> {
        let held = self.seq_len(child);
        if held > 0 {
            return Err(CacheError::AlreadyHeld {
                seq: child,
                len: held,
            });
        }
        // Blocks reserved for the child with no token yet go back first.
        self.release(child);
        let Some(entry) = self.seqs.get(&parent).cloned() else {
            return Ok(());
        };
        // Blocks reserved past the parent's tokens stay the parent's.
        let mut entry = entry;
        entry
            .blocks
            .truncate(entry.positions.len().div_ceil(self.block_size()));
        for &block in entry.live_blocks() {
            self.pool.share(block);
        }
        self.seqs.insert(child, entry);
        Ok(())
    }

    fn clear(&mut self) {
        self.seqs.clear();
        self.pool.reset();
    }

    fn set_attention_window(&mut self, window: Option<usize>) {
        self.attention_window = window;
    }

    fn enable_prefix_cache(&mut self, key_space: u64) -> bool {
        self.prefix_space = Some(BlockKey(key_space));
        true
    }

    fn prefix_cache_enabled(&self) -> bool {
        self.prefix_space.is_some()
    }

    fn shareable(&self, common: usize) -> usize {
        if self.prefix_space.is_none() {
            return 0;
        }
        common / self.block_size() * self.block_size()
    }

    fn cached_prefix(&self, tokens: &[TokenId]) -> usize {
        self.matching_blocks(tokens).len() * self.block_size()
    }

    fn attach_prefix(&mut self, seq: SeqId, tokens: &[TokenId]) -> usize {
        if self.seqs.contains_key(&seq) {
            return 0;
        }
        let matched = self.matching_blocks(tokens);
        if matched.is_empty() {
            return 0;
        }
        let n = matched.len() * self.block_size();
        let mut entry = PagedSeq {
            positions: (0..n as u32).map(Position).collect(),
            tokens: tokens[..n].to_vec(),
            ..PagedSeq::default()
        };
        for (block, key) in matched {
            self.pool.share(block);
            entry.blocks.push(block);
            entry.keys.push(key);
        }
        self.seqs.insert(seq, entry);
        n
    }
}

impl<B: InferenceBackend> PagedKvCache<B> {
    /// The registered blocks `tokens` begin with, and their keys: whole blocks only, and
    /// never the last token (a sequence must compute at least one token to have logits).
    fn matching_blocks(&self, tokens: &[TokenId]) -> Vec<(BlockId, BlockKey)> {
        let Some(mut parent) = self.prefix_space else {
            return Vec::new();
        };
        let bs = self.block_size();
        let reusable = tokens.len().saturating_sub(1) / bs;
        let mut found = Vec::new();
        for chunk in tokens.chunks_exact(bs).take(reusable) {
            let Some((block, key)) = self.pool.lookup(parent, chunk) else {
                break;
            };
            found.push((block, key));
            parent = key;
        }
        found
    }
}

impl<B: InferenceBackend> KvCache<B> for PagedKvCache<B> {
    fn dtype(&self) -> KvDtype {
        self.storage.dtype()
    }

    fn plan(&mut self, batch: &Batch) -> Result<StepPlan, CacheError> {
        let incoming = incoming(batch, |seq| self.seq_len(seq));
        for s in &incoming {
            self.forget_out_of_window(s.seq);
            let first = batch.positions()[s.tokens.start];
            if self.needs_forgotten(s.seq, first) {
                return Err(CacheError::KeysForgotten {
                    seq: s.seq,
                    position: first,
                });
            }
        }
        let needed: usize = incoming
            .iter()
            .map(|s| self.step_blocks(s.seq, s.n_new()))
            .sum();
        if needed > self.pool.available() {
            return Err(CacheError::OutOfBlocks {
                needed,
                free: self.pool.available(),
            });
        }

        let bs = self.block_size();
        let tracking = self.prefix_space.is_some();
        let mut plan = StepPlan {
            n_tokens: batch.n_tokens(),
            window: None,
            writes: Vec::new(),
            fresh: Vec::new(),
            history: Vec::new(),
            read: ReadPlan::None,
        };
        for s in &incoming {
            self.unshare_tail(s.seq, s.n_new());
            let extra = self.blocks_needed(self.owned(s.seq), s.held, s.n_new());
            let new_blocks = self
                .pool
                .allocate(extra)
                .expect("checked: enough blocks are free");
            let entry = self.seqs.entry(s.seq).or_default();
            entry.blocks.extend(new_blocks);
            for (chunk, slot, run) in runs_by_chunk(s.held, s.tokens.clone(), bs) {
                let block = entry.blocks[chunk];
                // Checked always: a write here would corrupt another sequence's K/V.
                assert!(
                    self.pool.refs(block) == 1 && !self.pool.is_registered(block),
                    "writing into a shared or registered block"
                );
                plan.writes.push(WriteRun {
                    target: block.index(),
                    slot,
                    tokens: run,
                });
            }
            let positions = &batch.positions()[s.tokens.clone()];
            if tracking && !entry.unhashable {
                let first = entry.positions.len();
                entry.unhashable = positions
                    .iter()
                    .enumerate()
                    .any(|(i, p)| p.0 as usize != first + i);
                entry
                    .tokens
                    .extend_from_slice(&batch.tokens()[s.tokens.clone()]);
            }
            entry.positions.extend_from_slice(positions);
            if s.held == 0 {
                plan.fresh.push(FreshSpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                });
            } else {
                plan.history.push(HistorySpan {
                    seq: s.seq,
                    tokens: s.tokens.clone(),
                    key_positions: entry.positions[entry.forgotten * bs..]
                        .iter()
                        .copied()
                        .map(Some)
                        .collect(),
                });
            }
            self.register_full_blocks(s.seq);
        }
        if !plan.history.is_empty() {
            let blocks_per_row = plan
                .history
                .iter()
                .map(|h| self.seqs[&h.seq].live_blocks().len())
                .max()
                .unwrap_or(0);
            let mut blocks = Vec::with_capacity(plan.history.len() * blocks_per_row);
            for h in &mut plan.history {
                let table = self.seqs[&h.seq].live_blocks();
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

    fn write(&mut self, layer: usize, plan: &StepPlan, k: Tensor<B, 3>, v: Tensor<B, 3>) {
        self.storage.write(layer, &plan.writes, k, v);
    }

    fn read<'a>(&self, layer: usize, index: &'a ReadIndex<B>) -> CachedKv<'a, B> {
        self.storage.read(layer, index)
    }

    fn write_places(
        &mut self,
        layer: usize,
        index: &crate::attention::StepIndex<B>,
        k: Tensor<B, 3>,
        v: Tensor<B, 3>,
    ) {
        self.storage.write_places(layer, index, k, v);
    }

    fn storage(&self, layer: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.storage.layer(layer)
    }

    fn export(&self, seq: SeqId) -> Result<HostKv, CacheError> {
        let bs = self.block_size();
        let forgotten = self.seqs.get(&seq).map_or(0, |s| s.forgotten);
        if forgotten > 0 {
            let held = self.seq_len(seq);
            return Err(CacheError::NotAllHeld {
                seq,
                held,
                kept: held - forgotten * bs,
            });
        }
        let table = self.block_table(seq);
        let places: Vec<(usize, usize)> = (0..self.seq_len(seq))
            .map(|t| (table[t / bs].index(), t % bs))
            .collect();
        Ok(self.storage.gather_host(&places))
    }
}
