//! `kiln selftest`: the operations kiln relies on, run on one backend and compared with the
//! same operations on the cpu backend (burn-flex).
//!
//! Each check builds the same inputs on both backends from a fixed seed, so a failure names the
//! operation and the largest difference.

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::attention::{AttentionPlan, attend, sdpa, sdpa_reference};
use crate::backend::InferenceBackend;
use crate::batch::Batch;
use crate::dtype::Dtype;
use crate::ids::{Position, SeqId, TokenId};
use crate::kv_cache::{KvCache, KvLayout, PagedKvCache, StaticKvCache};
use crate::sampling::{Sampler, SamplingParams, TokenHistory};
use crate::tensor::host_f32;

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// What was checked.
    pub name: &'static str,
    /// Largest absolute difference from the reference (0 for exact checks).
    pub max_abs_diff: f32,
    /// Largest difference accepted.
    pub tolerance: f32,
}

impl Check {
    /// Whether the difference is within tolerance.
    pub fn passed(&self) -> bool {
        self.max_abs_diff <= self.tolerance
    }
}

/// The reference backend every other backend is compared with.
pub type Reference = burn::backend::Flex;

/// Runs every check on `B`, comparing with [`Reference`].
pub fn run<B: InferenceBackend>(device: &B::Device) -> Vec<Check> {
    let reference = <Reference as InferenceBackend>::inference_device();
    vec![
        compare(
            "matmul",
            1e-4,
            |r| matmul::<B>(r, device),
            |r| matmul::<Reference>(r, &reference),
        ),
        compare(
            "softmax",
            1e-6,
            |r| softmax::<B>(r, device),
            |r| softmax::<Reference>(r, &reference),
        ),
        compare(
            "attention, causal mask",
            1e-5,
            |r| attention_masked::<B>(r, device, true, false),
            |r| attention_masked::<Reference>(r, &reference, true, true),
        ),
        compare(
            "attention, custom mask (sq != sk)",
            1e-5,
            |r| attention_masked::<B>(r, device, false, false),
            |r| attention_masked::<Reference>(r, &reference, false, true),
        ),
        compare(
            "paged cache: packed prefill + decode, GQA",
            1e-5,
            |r| cached_attention::<B>(r, device),
            |r| cached_attention::<Reference>(r, &reference),
        ),
        compare(
            "static cache: append in place, read back",
            0.0,
            |r| cache_roundtrip::<B>(r, device),
            |r| cache_roundtrip::<Reference>(r, &reference),
        ),
        compare(
            "sampling: device argmax and seeded draws",
            0.0,
            |r| sampling::<B>(r, device),
            |r| sampling::<Reference>(r, &reference),
        ),
    ]
}

/// Seeded inputs, identical for both sides of a comparison.
struct Inputs {
    rng: ChaCha8Rng,
}

impl Inputs {
    fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| self.rng.random::<f32>() * 2.0 - 1.0)
            .collect()
    }

    fn tensor<B: Backend, const D: usize>(
        &mut self,
        shape: [usize; D],
        device: &B::Device,
    ) -> Tensor<B, D> {
        let values = self.values(shape.iter().product());
        Tensor::from_data(TensorData::new(values, shape), device)
    }
}

fn compare(
    name: &'static str,
    tolerance: f32,
    ours: impl Fn(&mut Inputs) -> Vec<f32>,
    reference: impl Fn(&mut Inputs) -> Vec<f32>,
) -> Check {
    let a = ours(&mut Inputs::new(7));
    let b = reference(&mut Inputs::new(7));
    let max_abs_diff = if a.len() == b.len() {
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(
                0.0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    } else {
        f32::INFINITY
    };
    Check {
        name,
        max_abs_diff,
        tolerance,
    }
}

fn matmul<B: Backend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let a = r.tensor::<B, 2>([33, 47], device);
    let b = r.tensor::<B, 2>([47, 29], device);
    host_f32(a.matmul(b))
}

fn softmax<B: Backend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let x = r.tensor::<B, 2>([7, 129], device).mul_scalar(6.0);
    host_f32(burn::tensor::activation::softmax(x, 1))
}

/// Fused attention (or the plain reference) with a causal mask on equal lengths, or a custom
/// mask on unequal lengths.
fn attention_masked<B: Backend>(
    r: &mut Inputs,
    device: &B::Device,
    causal: bool,
    plain: bool,
) -> Vec<f32> {
    let (b, h, d) = (2, 3, 16);
    let (sq, sk) = if causal { (11, 11) } else { (5, 13) };
    let q = r.tensor::<B, 4>([b, h, sq, d], device);
    let k = r.tensor::<B, 4>([b, h, sk, d], device);
    let v = r.tensor::<B, 4>([b, h, sk, d], device);
    let mask: Vec<bool> = (0..b * h * sq * sk)
        .map(|i| {
            let (row, col) = ((i / sk) % sq, i % sk);
            if causal {
                col > row
            } else {
                // Every row keeps its first key, so no row is fully masked.
                col != 0 && (i * 2654435761) % 7 < 3
            }
        })
        .collect();
    let mask: Tensor<B, 4, Bool> = Tensor::from_data(TensorData::new(mask, [b, h, sq, sk]), device);
    let out = if plain {
        sdpa_reference(q, k, v, mask)
    } else {
        sdpa(q, k, v, mask)
    };
    host_f32(out)
}

fn tokens(ids: &[u32]) -> Vec<TokenId> {
    ids.iter().copied().map(TokenId).collect()
}

/// Two prompts packed into one prefill, then one decode step each, through a paged cache with
/// grouped-query attention (4 query heads, 2 KV heads).
fn cached_attention<B: InferenceBackend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let n_heads = 4;
    let mut cache = PagedKvCache::<B>::new(layout, 8, 4, Dtype::F32, device)
        .expect("valid cache configuration");
    let mut prefill = Batch::new();
    let ok = "a valid batch";
    prefill
        .push(SeqId(0), &tokens(&[1, 2, 3, 4, 5]), Position(0))
        .expect(ok);
    prefill
        .push(SeqId(1), &tokens(&[6, 7, 8]), Position(0))
        .expect(ok);
    let mut decode = Batch::new();
    decode.push(SeqId(0), &tokens(&[9]), Position(5)).expect(ok);
    decode
        .push(SeqId(1), &tokens(&[10]), Position(3))
        .expect(ok);
    let mut out = Vec::new();
    for batch in [prefill, decode] {
        let n = batch.n_tokens();
        let step = cache.plan(&batch).expect("the cache has room");
        let plan = AttentionPlan::new(&batch, step, n_heads, layout.n_kv_heads, device);
        let q = r.tensor::<B, 3>([n, n_heads, layout.head_dim], device);
        let k = r.tensor::<B, 3>([n, layout.n_kv_heads, layout.head_dim], device);
        let v = r.tensor::<B, 3>([n, layout.n_kv_heads, layout.head_dim], device);
        out.extend(host_f32(attend(&mut cache, 0, &plan, q, k, v)));
    }
    out
}

/// Writes two steps into a static cache and reads the row back.
fn cache_roundtrip<B: InferenceBackend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: 2,
        head_dim: 4,
    };
    let mut cache =
        StaticKvCache::<B>::new(layout, 2, 8, Dtype::F32, device).expect("valid configuration");
    for (start, len) in [(0u32, 3usize), (3, 2)] {
        let ids: Vec<u32> = (0..len as u32).collect();
        let batch = Batch::single(SeqId(4), &tokens(&ids), Position(start)).expect("valid batch");
        let step = cache.plan(&batch).expect("the cache has room");
        let k = r.tensor::<B, 3>([len, 2, 4], device);
        let v = r.tensor::<B, 3>([len, 2, 4], device);
        cache.write(0, &step, k, v);
    }
    cache
        .export(SeqId(4))
        .expect("a static cache holds every token")
        .into_iter()
        .flat_map(|(k, v)| k.into_iter().chain(v))
        .collect()
}

/// Argmax on the device, then seeded multinomial draws over logits read back from it.
fn sampling<B: Backend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let vocab = 257;
    let logits = r.tensor::<B, 2>([3, vocab], device).mul_scalar(4.0);
    let argmax: Vec<f32> = logits
        .clone()
        .argmax(1)
        .into_data()
        .iter::<i64>()
        .map(|i| i as f32)
        .collect();
    let host_logits = host_f32(logits);
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        seed: Some(11),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(&params, vocab).expect("valid parameters");
    let mut out = argmax;
    for row in host_logits.chunks(vocab) {
        for _ in 0..5 {
            out.push(sampler.sample(row, &TokenHistory::default()).0 as f32);
        }
    }
    out
}
