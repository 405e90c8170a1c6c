//! The stand-in models of `kiln_core::testing`, which the engine's tests run on: their rows
//! follow their functions, they plan the cache, and a recording counts what it was fed.

use kiln_core::kv_cache::DynamicKvCache;
use kiln_core::tensor::host_f32;
use kiln_core::testing::{Recording, Scripted, Soft};
use kiln_core::{Batch, CausalLm, Dtype, LogitsFor, Position, SeqId, TokenId};

type B = burn::backend::Flex;

fn batch() -> Batch {
    let mut batch = Batch::new();
    let tokens = |ids: &[u32]| ids.iter().copied().map(TokenId).collect::<Vec<_>>();
    batch
        .push(SeqId(0), &tokens(&[3, 4, 5]), Position(0))
        .expect("a valid span");
    batch
        .push(SeqId(1), &tokens(&[7]), Position(9))
        .expect("a valid span");
    batch
}

#[test]
fn stand_ins_give_their_rows_and_plan_the_cache() {
    let scripted = Recording::new(Scripted {
        script: |token, position| (token + position) % 32,
    });
    let layout = scripted.inner.shape().kv_layout();
    let mut cache = DynamicKvCache::<B>::new(layout, Dtype::F32, &Default::default());
    let logits = scripted
        .forward(&batch(), &mut cache, LogitsFor::LastOfEachSequence)
        .expect("the forward runs");
    assert_eq!(logits.dims(), [2, Scripted::VOCAB]);
    let rows = host_f32(logits);
    let hot: Vec<usize> = rows
        .chunks(Scripted::VOCAB)
        .map(|row| row.iter().position(|&x| x == 10.0).expect("one hot value"))
        .collect();
    // Last tokens: 5 at position 2, 7 at position 9.
    assert_eq!(hot, [7, 16]);
    assert_eq!(scripted.forwards(), [(2, 4)]);
    assert_eq!(scripted.tokens_fed(), 4);

    let soft = Soft {
        logit: |token, position, v| (token * 10 + position + v) as f32,
        vocab: 5,
    };
    let mut cache =
        DynamicKvCache::<B>::new(soft.shape().kv_layout(), Dtype::F32, &Default::default());
    let all = CausalLm::<B>::forward(&soft, &batch(), &mut cache, LogitsFor::All)
        .expect("the forward runs");
    assert_eq!(all.dims(), [4, 5]);
    assert_eq!(host_f32(all)[..5], soft.row(3, 0)[..]);
}
