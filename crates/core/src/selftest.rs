//! `kiln selftest`: the operations kiln relies on, run on one backend and compared with the
//! same operations on the cpu backend (burn-flex).
//!
//! Each check builds the same inputs on both backends from a fixed seed, so a failure names the
//! operation and the largest difference.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::attention::{AttentionPlan, Scoring, attend};
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

/// Runs every check on `B`, comparing with [`Reference`] (the f16 product only where `B` holds
/// f16).
pub fn run<B: InferenceBackend>(device: &B::Device) -> Vec<Check> {
    let reference = <Reference as InferenceBackend>::inference_device();
    let mut checks = vec![
        compare(
            "linear layer, 3 rows (decode)",
            1e-4,
            |r| linear::<B>(r, device, 3, Dtype::F32, Dtype::F32),
            |r| linear::<Reference>(r, &reference, 3, Dtype::F32, Dtype::F32),
        ),
        compare(
            "linear layer, 97 rows (prefill)",
            1e-4,
            |r| linear::<B>(r, device, 97, Dtype::F32, Dtype::F32),
            |r| linear::<Reference>(r, &reference, 97, Dtype::F32, Dtype::F32),
        ),
        compare(
            "softmax",
            1e-6,
            |r| softmax::<B>(r, device),
            |r| softmax::<Reference>(r, &reference),
        ),
        compare(
            "RMSNorm, rotary embedding, SwiGLU",
            1e-5,
            |r| row_ops::<B>(r, device),
            |r| row_ops::<Reference>(r, &reference),
        ),
        compare(
            "attention, fresh prompts packed (causal)",
            1e-5,
            |r| cached_attention::<B>(r, device, Scenario::Fresh),
            |r| cached_attention::<Reference>(r, &reference, Scenario::Fresh),
        ),
        compare(
            "attention, chunks over a cache (sq != sk)",
            1e-5,
            |r| cached_attention::<B>(r, device, Scenario::Chunks),
            |r| cached_attention::<Reference>(r, &reference, Scenario::Chunks),
        ),
        compare(
            "paged cache: packed prefill + decode, GQA",
            1e-5,
            |r| cached_attention::<B>(r, device, Scenario::PrefillDecode),
            |r| cached_attention::<Reference>(r, &reference, Scenario::PrefillDecode),
        ),
        compare(
            "paged cache, soft-capped scores (Gemma 2)",
            1e-5,
            |r| cached_attention::<B>(r, device, Scenario::SoftCapped),
            |r| cached_attention::<Reference>(r, &reference, Scenario::SoftCapped),
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
    ];
    // Half-precision products (tensor-core tiles on a GPU), where the backend holds f16.
    if B::supports(device, Dtype::F16) {
        checks.insert(
            2,
            compare(
                "linear layer, f16, 40 rows (batched decode)",
                F16_LINEAR_TOLERANCE,
                |r| linear::<B>(r, device, 40, Dtype::F16, Dtype::F16),
                |r| linear::<Reference>(r, &reference, 40, Dtype::F16, Dtype::F32),
            ),
        );
    }
    checks
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

/// One unit in the last place of f16 at the outputs' largest magnitude (8..16: sums of 96
/// products of values in [-1, 1)): the device rounds its f32 sums to f16 once, from sums
/// added in another order than the reference's.
const F16_LINEAR_TOLERANCE: f32 = 8.0 / 1024.0;

/// A linear layer as models run it ([`InferenceBackend::linear_dense`]), its weight stored as
/// the backend's loaders store it ([`InferenceBackend::DENSE_WEIGHTS_OUT_IN`]), on inputs
/// rounded to `inputs`, multiplied in `product` and rounded to `inputs` at the end. f32 for
/// both is the exact product; f16 inputs multiplied in f16 (tensor-core tiles on a GPU) are
/// checked against an f32 product of the same values.
fn linear<B: InferenceBackend>(
    r: &mut Inputs,
    device: &B::Device,
    rows: usize,
    inputs: Dtype,
    product: Dtype,
) -> Vec<f32> {
    let (d_in, d_out) = (96, 80);
    let round = |t: Tensor<B, 2>| t.cast(inputs.burn_float()).cast(product.burn_float());
    let x = round(r.tensor::<B, 2>([rows, d_in], device));
    let w_out_in = round(r.tensor::<B, 2>([d_out, d_in], device));
    let w = if B::DENSE_WEIGHTS_OUT_IN {
        w_out_in.transpose()
    } else {
        // Row-major `[d_in, d_out]`: the transpose made contiguous.
        let values = host_f32(w_out_in.transpose());
        Tensor::<B, 2>::from_data(TensorData::new(values, [d_in, d_out]), device)
            .cast(product.burn_float())
    };
    let y = B::linear_dense(x, &w).cast(inputs.burn_float());
    host_f32(y)
}

fn softmax<B: Backend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let x = r.tensor::<B, 2>([7, 129], device).mul_scalar(6.0);
    host_f32(burn::tensor::activation::softmax(x, 1))
}

/// The fused row operations of a block: RMSNorm, rotary embeddings and SwiGLU's gating.
fn row_ops<B: InferenceBackend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let (n, d, heads, head_dim) = (5, 72, 3, 16);
    let x = r.tensor::<B, 2>([n, d], device);
    let gamma = r.tensor::<B, 1>([d], device);
    let q = r.tensor::<B, 3>([n, heads, head_dim], device);
    let cos = r.tensor::<B, 3>([n, 1, head_dim / 2], device);
    let sin = r.tensor::<B, 3>([n, 1, head_dim / 2], device);
    let gate_up = r.tensor::<B, 2>([n, 2 * d], device);
    let mut out = host_f32(B::rms_norm(x, &gamma, 1e-5));
    out.extend(host_f32(B::rotate_half(q, &cos, &sin)));
    out.extend(host_f32(B::swiglu(gate_up)));
    out
}

fn tokens(ids: &[u32]) -> Vec<TokenId> {
    ids.iter().copied().map(TokenId).collect()
}

/// What [`cached_attention`] feeds through the cache.
#[derive(Debug, Clone, Copy)]
enum Scenario {
    /// Two fresh prompts packed into one step.
    Fresh,
    /// A prompt, then chunks of 3 and 4 tokens attending over it.
    Chunks,
    /// Two prompts packed, then a decode step each.
    PrefillDecode,
    /// [`Scenario::PrefillDecode`] with scores scaled and soft-capped as Gemma 2 takes them
    /// (its own scale, `c tanh(s / c)`), the cap small enough to bend them.
    SoftCapped,
}

/// Steps of a [`Scenario`] through a paged cache with grouped-query attention (4 query heads,
/// 2 KV heads), every step's attention output.
fn cached_attention<B: InferenceBackend>(
    r: &mut Inputs,
    device: &B::Device,
    scenario: Scenario,
) -> Vec<f32> {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let n_heads = 4;
    let mut cache = PagedKvCache::<B>::new(layout, 8, 4, Dtype::F32, device)
        .expect("valid cache configuration");
    let ok = "a valid batch";
    let batch = |seqs: &[(u64, &[u32], u32)]| {
        let mut batch = Batch::new();
        for &(seq, ids, start) in seqs {
            batch
                .push(SeqId(seq), &tokens(ids), Position(start))
                .expect(ok);
        }
        batch
    };
    let steps = match scenario {
        Scenario::Fresh => vec![batch(&[(0, &[1, 2, 3, 4, 5], 0), (1, &[6, 7, 8], 0)])],
        Scenario::Chunks => vec![
            batch(&[(0, &[1, 2, 3, 4, 5], 0)]),
            batch(&[(0, &[6, 7, 8], 5)]),
            batch(&[(0, &[9, 10, 11, 12], 8)]),
        ],
        Scenario::PrefillDecode | Scenario::SoftCapped => vec![
            batch(&[(0, &[1, 2, 3, 4, 5], 0), (1, &[6, 7, 8], 0)]),
            batch(&[(0, &[9], 5), (1, &[10], 3)]),
        ],
    };
    let mut out = Vec::new();
    for batch in steps {
        let n = batch.n_tokens();
        let step = cache.plan(&batch).expect("the cache has room");
        let scoring = match scenario {
            Scenario::SoftCapped => Scoring {
                scale: Some(0.6),
                softcap: Some(0.8),
            },
            _ => Scoring::default(),
        };
        let plan = AttentionPlan::new(&batch, step, n_heads, layout.n_kv_heads, device)
            .with_scoring(scoring);
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

/// Greedy tokens picked as the engine picks them ([`InferenceBackend::argmax_rows`], on the
/// device where it can), then seeded multinomial draws over logits read back from it.
fn sampling<B: InferenceBackend>(r: &mut Inputs, device: &B::Device) -> Vec<f32> {
    let vocab = 257;
    let logits = r.tensor::<B, 2>([3, vocab], device).mul_scalar(4.0);
    let argmax: Vec<f32> = B::argmax_rows(logits.clone())
        .into_iter()
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
