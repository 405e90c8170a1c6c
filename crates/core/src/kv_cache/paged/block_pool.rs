//! [`BlockPool`]: hands out fixed-size blocks of the paged cache; owns no tensor.

use crate::ids::{BlockId, SeqId};
use crate::kv_cache::CacheError;

/// A pool of `total` blocks. Each block is free or owned by exactly one sequence; freed blocks
/// are reused first (last freed, first reused).
#[derive(Debug, Clone)]
pub struct BlockPool {
    owner: Vec<Option<SeqId>>,
    free: Vec<BlockId>,
}

impl BlockPool {
    /// A pool of `total` free blocks.
    pub fn new(total: usize) -> Self {
        Self {
            owner: vec![None; total],
            // Lowest id on top, so a fresh pool hands out 0, 1, 2...
            free: (0..total as u32).rev().map(BlockId).collect(),
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.owner.len()
    }

    /// Blocks not owned by any sequence.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Blocks owned by a sequence.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Who owns `block`.
    pub fn owner(&self, block: BlockId) -> Option<SeqId> {
        self.owner.get(block.index()).copied().flatten()
    }

    /// Takes `n` blocks for `seq`, all or none.
    ///
    /// # Errors
    /// [`CacheError::OutOfBlocks`] if fewer than `n` are free; the pool is unchanged.
    pub fn allocate(&mut self, seq: SeqId, n: usize) -> Result<Vec<BlockId>, CacheError> {
        if n > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
            });
        }
        let taken = self.free.split_off(self.free.len() - n);
        for block in &taken {
            self.owner[block.index()] = Some(seq);
        }
        // split_off leaves the top of the stack at the end: hand out in stack order.
        Ok(taken.into_iter().rev().collect())
    }

    /// Returns `blocks` to the pool. A block that is already free is ignored, so a double free
    /// cannot put a block in the free list twice.
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            if let Some(owner) = self.owner.get_mut(block.index())
                && owner.take().is_some()
            {
                self.free.push(block);
            }
        }
    }

    /// Frees every block.
    pub fn reset(&mut self) {
        *self = Self::new(self.total());
    }

    /// The blocks in the free list, for invariant checks.
    pub fn free_blocks(&self) -> &[BlockId] {
        &self.free
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    #[test]
    fn freed_blocks_are_reused_first() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(SeqId(1), 2).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1)]);
        pool.free(&a[..1]);
        let b = pool.allocate(SeqId(2), 1).unwrap();
        assert_eq!(b, vec![BlockId(0)]);
        assert_eq!(pool.owner(BlockId(0)), Some(SeqId(2)));
    }

    #[test]
    fn out_of_blocks_is_an_error_and_changes_nothing() {
        let mut pool = BlockPool::new(3);
        pool.allocate(SeqId(1), 2).unwrap();
        let err = pool.allocate(SeqId(2), 2).unwrap_err();
        assert_eq!(err, CacheError::OutOfBlocks { needed: 2, free: 1 });
        assert_eq!(pool.free_count(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate { seq: u64, n: usize },
        FreeSeq { seq: u64 },
        FreeOne { seq: u64, index: usize },
        DoubleFree { seq: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..6, 0usize..5).prop_map(|(seq, n)| Op::Allocate { seq, n }),
            (0u64..6).prop_map(|seq| Op::FreeSeq { seq }),
            (0u64..6, 0usize..8).prop_map(|(seq, index)| Op::FreeOne { seq, index }),
            (0u64..6).prop_map(|seq| Op::DoubleFree { seq }),
        ]
    }

    proptest! {
        /// After any sequence of operations: no block is owned twice or both owned and free,
        /// free + used = total, and ownership matches what each sequence was given.
        #[test]
        fn pool_invariants_hold(total in 1usize..24, ops in prop::collection::vec(op(), 0..64)) {
            let mut pool = BlockPool::new(total);
            let mut held: HashMap<u64, Vec<BlockId>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Allocate { seq, n } => {
                        let free_before = pool.free_count();
                        match pool.allocate(SeqId(seq), n) {
                            Ok(blocks) => {
                                prop_assert_eq!(blocks.len(), n);
                                held.entry(seq).or_default().extend(blocks);
                            }
                            Err(CacheError::OutOfBlocks { needed, free }) => {
                                prop_assert!(n > free_before);
                                prop_assert_eq!((needed, free), (n, free_before));
                                prop_assert_eq!(pool.free_count(), free_before);
                            }
                            Err(other) => prop_assert!(false, "unexpected error {other}"),
                        }
                    }
                    Op::FreeSeq { seq } => {
                        pool.free(&held.remove(&seq).unwrap_or_default());
                    }
                    Op::FreeOne { seq, index } => {
                        if let Some(blocks) = held.get_mut(&seq)
                            && index < blocks.len()
                        {
                            let block = blocks.remove(index);
                            pool.free(&[block]);
                        }
                    }
                    Op::DoubleFree { seq } => {
                        let blocks = held.remove(&seq).unwrap_or_default();
                        pool.free(&blocks);
                        pool.free(&blocks);
                    }
                }
                let owned: Vec<BlockId> = held.values().flatten().copied().collect();
                let owned_set: HashSet<BlockId> = owned.iter().copied().collect();
                prop_assert_eq!(owned.len(), owned_set.len(), "a block is owned twice");
                let free_set: HashSet<BlockId> = pool.free_blocks().iter().copied().collect();
                prop_assert_eq!(free_set.len(), pool.free_count(), "a block is free twice");
                prop_assert!(owned_set.is_disjoint(&free_set), "a block is owned and free");
                prop_assert_eq!(pool.free_count() + pool.used_count(), pool.total());
                prop_assert_eq!(pool.used_count(), owned.len());
                for (seq, blocks) in &held {
                    for block in blocks {
                        prop_assert_eq!(pool.owner(*block), Some(SeqId(*seq)));
                    }
                }
            }
        }
    }
}
