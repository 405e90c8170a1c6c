//! Packed batches: ranges and last indices in packing order, and what a batch refuses.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use kiln_core::{Batch, Position, SeqId, TokenId};

fn toks(ids: &[u32]) -> Vec<TokenId> {
    ids.iter().copied().map(TokenId).collect()
}

#[test]
fn ranges_and_last_indices_follow_packing_order() {
    let mut batch = Batch::new();
    batch
        .push(SeqId(7), &toks(&[1, 2, 3]), Position(0))
        .unwrap();
    batch.push(SeqId(3), &toks(&[4]), Position(10)).unwrap();
    let ranges: Vec<_> = batch.ranges().collect();
    assert_eq!(ranges, vec![(SeqId(7), 0..3), (SeqId(3), 3..4)]);
    assert_eq!(batch.last_indices(), vec![2, 3]);
    assert_eq!(batch.positions()[3], Position(10));
}

#[test]
fn rejects_duplicates_empty_and_non_increasing_positions() {
    let mut batch = Batch::new();
    batch.push(SeqId(1), &toks(&[1]), Position(0)).unwrap();
    assert!(batch.push(SeqId(1), &toks(&[2]), Position(1)).is_err());
    assert!(batch.push(SeqId(2), &[], Position(0)).is_err());
    let bad = vec![Position(3), Position(3)];
    assert!(
        batch
            .push_with_positions(SeqId(3), &toks(&[1, 2]), bad)
            .is_err()
    );
}
