//! The paged cache's block pool: allocation, release, sharing, prefix registration and
//! eviction (moved from the pool's module: kiln-core's tests live in its integration binary).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::kv_cache::{BlockKey, BlockPool, CacheError};
use kiln_core::{BlockId, TokenId};
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
