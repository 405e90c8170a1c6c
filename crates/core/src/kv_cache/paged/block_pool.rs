//! [`BlockPool`]: hands out fixed-size blocks of the paged cache and remembers which full
//! blocks hold which tokens, so later sequences can share them; owns no tensor.
//!
//! A block is in exactly one of three states:
//! - **free**: no reference, no content worth keeping; handed out first;
//! - **used**: referenced by one or more sequences (more than one: *shared*);
//! - **cached**: no reference, but registered under a [`BlockKey`], so a later sequence with
//!   the same tokens can take it back; evicted least-recently-released first when the pool
//!   needs room and no free block is left.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::ids::{BlockId, TokenId};
use crate::kv_cache::CacheError;

/// The identity of a full block's content: a hash chained over every token from the start of
/// its sequence (the parent block's key and this block's tokens), seeded by the key space
/// (model and dtype), so two blocks share a key only when everything before them matches too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub u64);

impl BlockKey {
    /// The key of a block holding `tokens` after the block keyed `parent` (or the key space's
    /// seed for a sequence's first block).
    pub fn chain(parent: BlockKey, tokens: &[TokenId]) -> BlockKey {
        // SipHash with fixed keys: the same on every run, so keys are stable in tests. A hash
        // collision cannot mix contents: a lookup also compares the stored parent and tokens.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        parent.0.hash(&mut hasher);
        for t in tokens {
            t.0.hash(&mut hasher);
        }
        BlockKey(hasher.finish())
    }
}

/// What a registered block holds, checked on lookup.
#[derive(Debug, Clone)]
struct Registration {
    key: BlockKey,
    parent: BlockKey,
    tokens: Vec<TokenId>,
}

/// A pool of `total` blocks with reference counts and a prefix index.
#[derive(Debug, Clone)]
pub struct BlockPool {
    refs: Vec<u32>,
    registered: Vec<Option<Registration>>,
    /// Free blocks (no reference, not registered); the top is handed out first.
    free: Vec<BlockId>,
    /// Cached blocks by the tick they were released at: the first is evicted first.
    cached: BTreeMap<u64, BlockId>,
    /// The tick each cached block sits under in `cached`.
    cached_at: Vec<Option<u64>>,
    index: HashMap<BlockKey, BlockId>,
    tick: u64,
}

impl BlockPool {
    /// A pool of `total` free blocks.
    pub fn new(total: usize) -> Self {
        Self {
            refs: vec![0; total],
            registered: vec![None; total],
            // Lowest id on top, so a fresh pool hands out 0, 1, 2...
            free: (0..total as u32).rev().map(BlockId).collect(),
            cached: BTreeMap::new(),
            cached_at: vec![None; total],
            index: HashMap::new(),
            tick: 0,
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks with no reference and no content worth keeping.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Blocks with no reference that still hold a registered prefix (evictable).
    pub fn cached_count(&self) -> usize {
        self.cached.len()
    }

    /// Blocks an allocation can take now: free and cached.
    pub fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_count(&self) -> usize {
        self.total() - self.available()
    }

    /// How many sequences reference `block`.
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs.get(block.index()).copied().unwrap_or(0)
    }

    /// Whether `block` is registered in the prefix index (its content must not change).
    pub fn is_registered(&self, block: BlockId) -> bool {
        self.registered
            .get(block.index())
            .is_some_and(Option::is_some)
    }

    /// Takes `n` blocks, each with one reference, all or none: free blocks first, then cached
    /// ones, least recently released first (they leave the prefix index).
    ///
    /// # Errors
    /// [`CacheError::OutOfBlocks`] if fewer than `n` are free or cached; nothing changes.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, CacheError> {
        if n > self.available() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.available(),
            });
        }
        let mut taken = Vec::with_capacity(n);
        for _ in 0..n {
            let block = match self.free.pop() {
                Some(block) => block,
                None => self.evict_oldest(),
            };
            self.refs[block.index()] = 1;
            taken.push(block);
        }
        Ok(taken)
    }

    fn evict_oldest(&mut self) -> BlockId {
        let (_, block) = self
            .cached
            .pop_first()
            .expect("checked: a cached block exists");
        self.cached_at[block.index()] = None;
        self.unregister(block);
        block
    }

    /// Adds a reference to `block`, which must be used or cached (a cached block becomes used
    /// again and can no longer be evicted).
    pub fn share(&mut self, block: BlockId) {
        let i = block.index();
        if let Some(tick) = self.cached_at[i].take() {
            self.cached.remove(&tick);
        }
        debug_assert!(
            self.refs[i] > 0 || self.registered[i].is_some(),
            "sharing a free block"
        );
        self.refs[i] += 1;
    }

    /// Drops one reference from each of `blocks`, in order. A block left without reference
    /// becomes cached if it is registered, free otherwise; so release a sequence's blocks last
    /// first, and its tail is evicted before its head. Releasing an unreferenced block is
    /// ignored, so a double release cannot corrupt the pool.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            let i = block.index();
            if self.refs.get(i).is_none_or(|&r| r == 0) {
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            if self.registered[i].is_some() {
                self.tick += 1;
                self.cached.insert(self.tick, block);
                self.cached_at[i] = Some(self.tick);
            } else {
                self.free.push(block);
            }
        }
    }

    /// Registers a used, full `block` as holding `tokens` after the block keyed `parent`, and
    /// returns its key. If another block already holds that content, `block` stays
    /// unregistered (the two are duplicates; the first one is what lookups find).
    pub fn register(&mut self, block: BlockId, parent: BlockKey, tokens: &[TokenId]) -> BlockKey {
        let key = BlockKey::chain(parent, tokens);
        let i = block.index();
        debug_assert!(self.refs[i] > 0, "registering an unreferenced block");
        if self.registered[i].is_none() && !self.index.contains_key(&key) {
            self.index.insert(key, block);
            self.registered[i] = Some(Registration {
                key,
                parent,
                tokens: tokens.to_vec(),
            });
        }
        key
    }

    /// Removes `block` from the prefix index (its content is about to change). A cached block
    /// becomes free.
    pub fn unregister(&mut self, block: BlockId) {
        let i = block.index();
        if let Some(reg) = self.registered[i].take() {
            self.index.remove(&reg.key);
        }
        if let Some(tick) = self.cached_at[i].take() {
            self.cached.remove(&tick);
            self.free.push(block);
        }
    }

    /// The block registered as holding `tokens` after the block keyed `parent`, and its key.
    pub fn lookup(&self, parent: BlockKey, tokens: &[TokenId]) -> Option<(BlockId, BlockKey)> {
        let key = BlockKey::chain(parent, tokens);
        let block = *self.index.get(&key)?;
        let reg = self.registered[block.index()].as_ref()?;
        (reg.parent == parent && reg.tokens == tokens).then_some((block, key))
    }

    /// Forgets every reference and registration.
    pub fn reset(&mut self) {
        *self = Self::new(self.total());
    }

    /// The blocks in the free list, for invariant checks.
    pub fn free_blocks(&self) -> &[BlockId] {
        &self.free
    }

    /// The cached blocks, next to be evicted first, for invariant checks.
    pub fn cached_blocks(&self) -> Vec<BlockId> {
        self.cached.values().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    const SEED: BlockKey = BlockKey(7);

    fn toks(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().copied().map(TokenId).collect()
    }

    #[test]
    fn released_blocks_are_reused_first() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(2).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1)]);
        pool.release(&a[..1]);
        let b = pool.allocate(1).unwrap();
        assert_eq!(b, vec![BlockId(0)]);
        assert_eq!(pool.refs(BlockId(0)), 1);
    }

    #[test]
    fn out_of_blocks_is_an_error_and_changes_nothing() {
        let mut pool = BlockPool::new(3);
        pool.allocate(2).unwrap();
        let err = pool.allocate(2).unwrap_err();
        assert_eq!(err, CacheError::OutOfBlocks { needed: 2, free: 1 });
        assert_eq!(pool.available(), 1);
    }

    #[test]
    fn a_released_registered_block_is_found_again_until_evicted() {
        let mut pool = BlockPool::new(2);
        let [a] = pool.allocate(1).unwrap()[..] else {
            unreachable!()
        };
        let key = pool.register(a, SEED, &toks(&[1, 2]));
        pool.release(&[a]);
        assert_eq!((pool.free_count(), pool.cached_count()), (1, 1));
        assert_eq!(pool.lookup(SEED, &toks(&[1, 2])), Some((a, key)));
        assert_eq!(pool.lookup(SEED, &toks(&[1, 3])), None);
        assert_eq!(pool.lookup(BlockKey(8), &toks(&[1, 2])), None);
        // The free block goes first; the next allocation evicts the cached one.
        let b = pool.allocate(1).unwrap();
        assert_ne!(b, vec![a]);
        assert_eq!(pool.lookup(SEED, &toks(&[1, 2])), Some((a, key)));
        assert_eq!(pool.allocate(1).unwrap(), vec![a]);
        assert_eq!(pool.lookup(SEED, &toks(&[1, 2])), None);
    }

    #[test]
    fn eviction_takes_the_least_recently_released_first() {
        let mut pool = BlockPool::new(3);
        let blocks = pool.allocate(3).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            pool.register(b, SEED, &toks(&[i as u32]));
        }
        pool.release(&[blocks[2], blocks[0], blocks[1]]);
        assert_eq!(pool.cached_blocks(), vec![blocks[2], blocks[0], blocks[1]]);
        // Taking one back makes it used; a later release puts it last in line.
        pool.share(blocks[2]);
        pool.release(&[blocks[2]]);
        assert_eq!(pool.allocate(2).unwrap(), vec![blocks[0], blocks[1]]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A sequence takes `n` new blocks.
        Allocate { seq: u64, n: usize },
        /// A sequence registers its `index`-th block (if it has one).
        Register {
            seq: u64,
            index: usize,
            content: u32,
        },
        /// A sequence shares the block registered with `content`, if there is one.
        Share { seq: u64, content: u32 },
        /// A sequence releases everything, last block first.
        ReleaseSeq { seq: u64 },
        /// A sequence releases its blocks twice.
        DoubleRelease { seq: u64 },
        /// A sequence unregisters its `index`-th block (about to write into it).
        Unregister { seq: u64, index: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..6, 0usize..5).prop_map(|(seq, n)| Op::Allocate { seq, n }),
            (0u64..6, 0usize..6, 0u32..8).prop_map(|(seq, index, content)| Op::Register {
                seq,
                index,
                content
            }),
            (0u64..6, 0u32..8).prop_map(|(seq, content)| Op::Share { seq, content }),
            (0u64..6).prop_map(|seq| Op::ReleaseSeq { seq }),
            (0u64..6).prop_map(|seq| Op::DoubleRelease { seq }),
            (0u64..6, 0usize..6).prop_map(|(seq, index)| Op::Unregister { seq, index }),
        ]
    }

    proptest! {
        /// After any sequence of allocate / register / share / release / evict: no block is
        /// both referenced and free or cached, free + used + cached = total, every reference
        /// count equals the sequences holding the block, a registered block that some
        /// sequence holds is never evicted (it is still found), and a lookup finds only
        /// what was registered.
        #[test]
        fn pool_invariants_hold(total in 1usize..16, ops in prop::collection::vec(op(), 0..80)) {
            let mut pool = BlockPool::new(total);
            let mut held: HashMap<u64, Vec<BlockId>> = HashMap::new();
            // content -> block, for what the test registered and has not seen evicted
            let mut contents: HashMap<u32, BlockId> = HashMap::new();
            for op in ops {
                match op {
                    Op::Allocate { seq, n } => {
                        let before = pool.available();
                        match pool.allocate(n) {
                            Ok(blocks) => {
                                prop_assert_eq!(blocks.len(), n);
                                for b in &blocks {
                                    contents.retain(|_, c| c != b);
                                }
                                held.entry(seq).or_default().extend(blocks);
                            }
                            Err(CacheError::OutOfBlocks { needed, free }) => {
                                prop_assert!(n > before);
                                prop_assert_eq!((needed, free), (n, before));
                                prop_assert_eq!(pool.available(), before);
                            }
                            Err(other) => prop_assert!(false, "unexpected error {other}"),
                        }
                    }
                    Op::Register { seq, index, content } => {
                        if let Some(&block) = held.get(&seq).and_then(|b| b.get(index))
                            && !contents.contains_key(&content)
                            && !pool.is_registered(block)
                        {
                            pool.register(block, SEED, &toks(&[content]));
                            contents.insert(content, block);
                        }
                    }
                    Op::Share { seq, content } => {
                        let found = pool.lookup(SEED, &toks(&[content]));
                        prop_assert_eq!(found.map(|f| f.0), contents.get(&content).copied());
                        if let Some((block, _)) = found {
                            pool.share(block);
                            held.entry(seq).or_default().push(block);
                        }
                    }
                    Op::ReleaseSeq { seq } => {
                        let mut blocks = held.remove(&seq).unwrap_or_default();
                        blocks.reverse();
                        pool.release(&blocks);
                    }
                    Op::DoubleRelease { seq } => {
                        let blocks = held.remove(&seq).unwrap_or_default();
                        let mut counted: HashMap<BlockId, u32> = HashMap::new();
                        for b in held.values().flatten() {
                            *counted.entry(*b).or_default() += 1;
                        }
                        pool.release(&blocks);
                        // The second release only touches blocks other sequences still hold,
                        // which would corrupt their counts: release only the truly orphaned.
                        let orphaned: Vec<BlockId> =
                            blocks.iter().copied().filter(|b| !counted.contains_key(b)).collect();
                        pool.release(&orphaned);
                    }
                    Op::Unregister { seq, index } => {
                        if let Some(&block) = held.get(&seq).and_then(|b| b.get(index)) {
                            pool.unregister(block);
                            contents.retain(|_, c| *c != block);
                        }
                    }
                }
                let mut counted: HashMap<BlockId, u32> = HashMap::new();
                for b in held.values().flatten() {
                    *counted.entry(*b).or_default() += 1;
                }
                let free: HashSet<BlockId> = pool.free_blocks().iter().copied().collect();
                let cached: HashSet<BlockId> = pool.cached_blocks().into_iter().collect();
                prop_assert_eq!(free.len(), pool.free_count(), "a block is free twice");
                prop_assert!(free.is_disjoint(&cached), "a block is free and cached");
                for b in (0..total as u32).map(BlockId) {
                    let refs = counted.get(&b).copied().unwrap_or(0);
                    prop_assert_eq!(pool.refs(b), refs, "reference count of {:?}", b);
                    if refs > 0 {
                        prop_assert!(!free.contains(&b) && !cached.contains(&b), "{:?} is held and free", b);
                    }
                    if cached.contains(&b) {
                        prop_assert!(pool.is_registered(b), "{:?} is cached unregistered", b);
                    }
                }
                prop_assert_eq!(
                    pool.free_count() + pool.used_count() + pool.cached_count(),
                    pool.total()
                );
                prop_assert_eq!(pool.used_count(), counted.len());
                for (content, block) in &contents {
                    if counted.contains_key(block) {
                        prop_assert_eq!(
                            pool.lookup(SEED, &toks(&[*content])).map(|f| f.0),
                            Some(*block),
                            "a held block was evicted"
                        );
                    }
                }
            }
        }
    }
}
