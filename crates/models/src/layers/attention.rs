//! Self-attention: projections, per-head norms and RoPE where configured, then kiln-core's
//! cached attention.

use burn::tensor::Tensor;
use kiln_core::InferenceBackend;
use kiln_core::attention::{AttentionPlan, attend};
use kiln_core::kv_cache::KvCache;

use super::linear::Linear;
use super::norm::Norm;
use super::rope::RopeTables;

/// The Q, K and V projections: fused (GPT-2's `c_attn`) or separate (Llama).
#[derive(Debug, Clone)]
pub enum QkvProjection<B: InferenceBackend> {
    /// One `[d_model, (n_heads + 2 n_kv_heads) head_dim]` matrix, split after (GPT-2's
    /// `c_attn`, or Llama's three fused by [`QkvProjection::fuse_or_split`]).
    Fused(Linear<B>),
    /// Three matrices.
    Split {
        /// `[d_model, n_heads head_dim]`
        q: Linear<B>,
        /// `[d_model, n_kv_heads head_dim]`
        k: Linear<B>,
        /// `[d_model, n_kv_heads head_dim]`
        v: Linear<B>,
    },
}

impl<B: InferenceBackend> QkvProjection<B> {
    /// Separate Q, K and V, fused when [`Linear::fuse_outputs`] can.
    pub fn fuse_or_split(q: Linear<B>, k: Linear<B>, v: Linear<B>) -> Self {
        match Linear::fuse_outputs(&[&q, &k, &v]) {
            Some(qkv) => QkvProjection::Fused(qkv),
            None => QkvProjection::Split { q, k, v },
        }
    }
}

/// RMSNorms over each query and each key head, before RoPE (Qwen3).
#[derive(Debug, Clone)]
pub struct HeadNorms<B: InferenceBackend> {
    /// Over every query head. `gamma`: `[head_dim]`
    pub q: Norm<B>,
    /// Over every key head. `gamma`: `[head_dim]`
    pub k: Norm<B>,
}

impl<B: InferenceBackend> HeadNorms<B> {
    /// # Shapes
    /// - `x`: `[n, heads, head_dim]` → same
    fn apply(norm: &Norm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, heads, hd] = x.dims();
        norm.forward(x.reshape([n * heads, hd]))
            .reshape([n, heads, hd])
    }
}

/// One attention layer.
#[derive(Debug, Clone)]
pub struct Attention<B: InferenceBackend> {
    /// Q, K, V.
    pub qkv: QkvProjection<B>,
    /// `[n_heads head_dim, d_model]`
    pub out: Linear<B>,
    /// Norms over each query and key head before RoPE, where the family has them.
    pub head_norms: Option<HeadNorms<B>>,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl<B: InferenceBackend> Attention<B> {
    /// # Shapes
    /// - `x`: `[n_tokens, d_model]` → `[n_tokens, d_model]`
    pub fn forward(
        &self,
        x: Tensor<B, 2>,
        layer: usize,
        cache: &mut dyn KvCache<B>,
        plan: &AttentionPlan<B>,
        rope: Option<&RopeTables<B>>,
    ) -> Tensor<B, 2> {
        let n = x.dims()[0];
        let hd = self.head_dim;
        // With head norms, RoPE comes after them: the projection is cut unrotated.
        let (split_rope, late_rope) = match &self.head_norms {
            None => (rope, None),
            Some(_) => (None, rope),
        };
        let (q, k, v) = match &self.qkv {
            QkvProjection::Fused(proj) => {
                // Cut into heads and rotated together ([`InferenceBackend::split_heads_rope`]).
                let [q, k, v] = B::split_heads_rope(
                    proj.forward(x),
                    [self.n_heads, self.n_kv_heads],
                    hd,
                    split_rope.map(RopeTables::tables),
                );
                (q, k, v)
            }
            QkvProjection::Split { q, k, v } => {
                let q = q.forward(x.clone()).reshape([n, self.n_heads, hd]);
                let k = k.forward(x.clone()).reshape([n, self.n_kv_heads, hd]);
                let v = v.forward(x).reshape([n, self.n_kv_heads, hd]);
                match split_rope {
                    Some(rope) => (rope.apply(q), rope.apply(k), v),
                    None => (q, k, v),
                }
            }
        };
        let (q, k) = match &self.head_norms {
            None => (q, k),
            Some(norms) => {
                let q = HeadNorms::apply(&norms.q, q);
                let k = HeadNorms::apply(&norms.k, k);
                match late_rope {
                    Some(rope) => (rope.apply(q), rope.apply(k)),
                    None => (q, k),
                }
            }
        };
        self.out.forward(attend(cache, layer, plan, q, k, v))
    }
}
