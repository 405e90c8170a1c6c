//! kiln's KV caches with a model of your own: a toy one-layer attention model implements
//! [`CausalLm`] using [`kiln_core::attention`] over whatever cache it is handed. Two prompts
//! run packed in one forward, then decode together; every cache kind must give the tokens of
//! a full recompute (no cache reuse at all).
//!
//! ```text
//! cargo run --release -p kiln-core --example own_model
//! ```

use burn::tensor::{Distribution, Tensor};
use kiln_core::attention::{AttentionPlan, attend};
use kiln_core::kv_cache::{
    DynamicKvCache, KvCache, KvLayout, PagedKvCache, SlidingKvCache, StaticKvCache,
};
use kiln_core::tensor::int_tensor;
use kiln_core::{Batch, CausalLm, Dtype, LogitsFor, ModelShape, Position, SeqId, TokenId};

type B = burn::backend::Flex;
use burn::backend::flex::FlexDevice;

const VOCAB: usize = 64;
const HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const D: usize = HEADS * HEAD_DIM;

/// Embedding, one attention layer (no positions, no residual: a toy), the embedding as the head.
struct Toy {
    embed: Tensor<B, 2>,
    wq: Tensor<B, 2>,
    wk: Tensor<B, 2>,
    wv: Tensor<B, 2>,
}

impl Toy {
    fn new(device: &FlexDevice) -> Self {
        let random =
            |rows, cols| Tensor::random([rows, cols], Distribution::Normal(0.0, 0.5), device);
        Self {
            embed: random(VOCAB, D),
            wq: random(D, D),
            wk: random(D, D),
            wv: random(D, D),
        }
    }
}

impl CausalLm<B> for Toy {
    fn shape(&self) -> ModelShape {
        ModelShape {
            n_layers: 1,
            n_heads: HEADS,
            n_kv_heads: HEADS,
            head_dim: HEAD_DIM,
            vocab: VOCAB,
            max_positions: 1024,
        }
    }

    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn device(&self) -> FlexDevice {
        self.embed.device()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> kiln_core::Result<Tensor<B, 2>> {
        let device = self.device();
        // The cache says where the new K/V go and what each sequence attends over.
        let step = cache.plan(batch)?;
        let plan = AttentionPlan::new(batch, step, HEADS, HEADS, &device);
        let ids = int_tensor(batch.tokens().iter().map(|t| t.0 as usize), &device);
        let x = self.embed.clone().select(0, ids); // [tokens, D]
        let n = batch.n_tokens();
        let split = |t: Tensor<B, 2>| t.reshape([n, HEADS, HEAD_DIM]);
        let q = split(x.clone().matmul(self.wq.clone()));
        let k = split(x.clone().matmul(self.wk.clone()));
        let v = split(x.clone().matmul(self.wv.clone()));
        let h = attend(cache, 0, &plan, q, k, v); // [tokens, D]
        let all = h.matmul(self.embed.clone().transpose()); // [tokens, VOCAB]
        Ok(match logits.rows(batch)? {
            None => all,
            Some(rows) => all.select(0, int_tensor(rows, &device)),
        })
    }
}

fn argmax(row: &[f32]) -> TokenId {
    let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
    TokenId(best as u32)
}

/// Greedy continuations of `prompts`, decoded together on `cache`.
fn generate(
    model: &Toy,
    cache: &mut dyn KvCache<B>,
    prompts: &[Vec<TokenId>],
    n: usize,
) -> Vec<Vec<TokenId>> {
    let mut out = vec![Vec::new(); prompts.len()];
    let mut batch = Batch::new();
    for (i, prompt) in prompts.iter().enumerate() {
        batch
            .push(SeqId(i as u64), prompt, Position(0))
            .expect("valid batch");
    }
    for _ in 0..n {
        let logits = model
            .forward(&batch, cache, LogitsFor::LastOfEachSequence)
            .expect("fits");
        let rows: Vec<f32> = logits.into_data().iter::<f32>().collect();
        batch = Batch::new();
        for (i, row) in rows.chunks(VOCAB).enumerate() {
            let token = argmax(row);
            out[i].push(token);
            let position = Position((prompts[i].len() + out[i].len() - 1) as u32);
            batch
                .push(SeqId(i as u64), &[token], position)
                .expect("valid batch");
        }
    }
    out
}

/// The reference: every step recomputes each sequence from scratch on a fresh cache.
fn recompute(model: &Toy, prompts: &[Vec<TokenId>], n: usize) -> Vec<Vec<TokenId>> {
    let layout = model.shape().kv_layout();
    prompts
        .iter()
        .map(|prompt| {
            let mut context = prompt.clone();
            for _ in 0..n {
                let mut fresh = DynamicKvCache::<B>::new(layout, Dtype::F32, &model.device());
                let batch = Batch::single(SeqId(0), &context, Position(0)).expect("valid batch");
                let logits = model
                    .forward(&batch, &mut fresh, LogitsFor::LastOfEachSequence)
                    .expect("fits");
                let row: Vec<f32> = logits.into_data().iter::<f32>().collect();
                context.push(argmax(&row));
            }
            context[prompt.len()..].to_vec()
        })
        .collect()
}

fn main() {
    let device = FlexDevice;
    <B as burn::tensor::backend::Backend>::seed(&device, 7);
    let model = Toy::new(&device);
    let layout: KvLayout = model.shape().kv_layout();
    let prompts: Vec<Vec<TokenId>> = vec![
        [3, 14, 15, 9, 26].map(TokenId).to_vec(),
        [5, 35].map(TokenId).to_vec(),
    ];
    let n = 12;
    let expected = recompute(&model, &prompts, n);
    let caches: Vec<Box<dyn KvCache<B>>> = vec![
        Box::new(StaticKvCache::new(layout, 2, 32, Dtype::F32, &device).expect("valid sizes")),
        Box::new(DynamicKvCache::new(layout, Dtype::F32, &device)),
        Box::new(PagedKvCache::new(layout, 8, 4, Dtype::F32, &device).expect("valid sizes")),
        // A window wider than any sequence sees everything, like the others.
        Box::new(SlidingKvCache::new(layout, 2, 64, 8, Dtype::F32, &device).expect("valid sizes")),
    ];
    for mut cache in caches {
        let tokens = generate(&model, cache.as_mut(), &prompts, n);
        let usage = cache.usage();
        println!(
            "{:>7} cache: {} slots used of {}, tokens {:?}",
            cache.kind().to_string(),
            usage.used,
            usage.capacity,
            tokens
                .iter()
                .map(|t| t.iter().map(|id| id.0).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        assert_eq!(
            tokens,
            expected,
            "{} cache differs from a recompute",
            cache.kind()
        );
    }
    println!("every cache kind gives the tokens of a full recompute");
}
