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
