//! [`Transformer`]: the decoder every family is, configured by
//! [`TransformerConfig`]. Implements [`CausalLm`].

use std::sync::Arc;

use burn::tensor::{FloatDType, Tensor};
use kiln_core::attention::AttentionPlan;
use kiln_core::backend::QuantWeight;
use kiln_core::kv_cache::{KvCache, StepPlan};
use kiln_core::tensor::int_tensor;
use kiln_core::{Batch, CausalLm, CoreError, Dtype, InferenceBackend, LogitsFor, ModelShape};
use kiln_kernels::{ActPasses, GgmlType, QuantMatrix};

use crate::config::{PositionKind, RopeConfig, RopeScaling, TransformerConfig};
use crate::error::{ModelError, Result};
use crate::host::{HostTensor, half_split_order};
use crate::layers::attention::{Attention, QkvProjection};
use crate::layers::embedding::Embedding;
use crate::layers::linear::{Linear, LinearWeight};
use crate::layers::mlp::Mlp;
use crate::layers::norm::Norm;
use crate::layers::rope::{RopeTables, attention_factor, inverse_frequencies};
use crate::weights::{StackPart, TensorSource};

/// One transformer block: pre-norm attention and pre-norm MLP, each with a residual, and
/// where the family has them (Gemma) norms on each one's output before the residual.
#[derive(Debug, Clone)]
pub struct Block<B: InferenceBackend> {
    /// Before attention.
    pub attn_norm: Norm<B>,
    /// Self-attention.
    pub attn: Attention<B>,
    /// On the attention output ([`TransformerConfig::sandwich_norms`]).
    pub post_attn_norm: Option<Norm<B>>,
    /// Before the MLP.
    pub mlp_norm: Norm<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
    /// On the MLP output ([`TransformerConfig::sandwich_norms`]).
    pub post_mlp_norm: Option<Norm<B>>,
}

/// A RoPE's inverse frequencies and the factor on its cos and sin.
type RopeFrequencies = (Vec<f32>, f32);

/// A decoder-only transformer with its weights on a device.
#[derive(Debug, Clone)]
pub struct Transformer<B: InferenceBackend> {
    config: TransformerConfig,
    dtype: Dtype,
    device: B::Device,
    /// `[vocab, d_model]`
    embed: Embedding<B>,
    /// `[max_positions, d_model]` (learned positions only)
    position_embed: Option<Tensor<B, 2>>,
    blocks: Vec<Block<B>>,
    final_norm: Norm<B>,
    /// `d_model → vocab` (the embedding's own weights when tied)
    head: Linear<B>,
    /// RoPE inverse frequencies and the factor on cos and sin (rotary models only).
    rope: Option<RopeFrequencies>,
    /// The same for the windowed layers, where they differ ([`TransformerConfig::local_rope`]).
    local_rope: Option<RopeFrequencies>,
    /// Configuration, dtype and a digest of some weights (see [`CausalLm::fingerprint`]).
    fingerprint: String,
}

impl<B: InferenceBackend> Transformer<B> {
    /// Assembles a model from its parts (the loaders' job).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        config: TransformerConfig,
        dtype: Dtype,
        device: B::Device,
        embed: Embedding<B>,
        position_embed: Option<Tensor<B, 2>>,
        blocks: Vec<Block<B>>,
        final_norm: Norm<B>,
        head: Option<Linear<B>>,
    ) -> Self {
        let head = head.unwrap_or_else(|| embed.as_head());
        let fingerprint = fingerprint(&config, dtype, &embed, &head);
        let (rope, local_rope) = rope_frequencies(&config);
        Self {
            config,
            dtype,
            device,
            embed,
            position_embed,
            blocks,
            final_norm,
            head,
            rope,
            local_rope,
            fingerprint,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    /// Caps the context at `context` positions ([`TransformerConfig::limit_context`]), the
    /// RoPE frequencies chosen for it.
    ///
    /// # Errors
    /// A context of 0 or above the model's, described.
    pub fn limit_context(&mut self, context: usize) -> std::result::Result<(), String> {
        self.config.limit_context(context)?;
        (self.rope, self.local_rope) = rope_frequencies(&self.config);
        self.fingerprint = fingerprint(&self.config, self.dtype, &self.embed, &self.head);
        Ok(())
    }

    /// Every linear layer's weight: the blocks' projections, then the output head.
    fn linear_weights(&self) -> impl Iterator<Item = &LinearWeight<B>> {
        self.blocks
            .iter()
            .flat_map(|b| {
                let qkv: Vec<&Linear<B>> = match &b.attn.qkv {
                    QkvProjection::Fused(l) => vec![l],
                    QkvProjection::Split { q, k, v } => vec![q, k, v],
                };
                qkv.into_iter().chain([&b.attn.out]).chain(b.mlp.linears())
            })
            .chain([&self.head])
            .map(|l| &l.weight)
    }

    /// Whether any linear layer keeps its weights in quantized blocks (the cpu backend's fast
    /// path, rather than the exact one).
    pub fn holds_quantized_weights(&self) -> bool {
        self.linear_weights()
            .any(|w| matches!(w, LinearWeight::Quantized(_)))
    }

    /// Whether any linear layer's product quantizes its activations (`LoadOptions::
    /// activations`): one kept in quantized blocks. 16-bit float matrices, also kept as
    /// stored, and dense ones take f32 activations.
    pub fn quantizes_activations(&self) -> bool {
        self.linear_weights().any(|w| match w {
            LinearWeight::Quantized(m) => !kiln_kernels::float16::is_float16(m.host().ty()),
            LinearWeight::Dense(_) => false,
        })
    }

    /// How the linear layers' weights are held: `(storage, count, bytes)` per kind, e.g.
    /// `("Q4_1 (quantized)", 210, …)`, `("F16 (16-bit)", 211, …)` or `("f32", 211, …)`, most
    /// bytes first. A tied head is counted once more (it reads the embedding's table).
    pub fn weight_summary(&self) -> Vec<(String, usize, usize)> {
        let mut kinds: Vec<(String, usize, usize)> = Vec::new();
        for w in self.linear_weights() {
            let (kind, bytes) = match w {
                LinearWeight::Dense(t) => (
                    self.dtype.name().to_string(),
                    t.dims().iter().product::<usize>() * self.dtype.size_bytes(),
                ),
                LinearWeight::Quantized(m) => (
                    format!("{} ({})", m.host().ty().name(), m.host().storage_kind()),
                    m.host().bytes(),
                ),
            };
            match kinds.iter_mut().find(|(k, _, _)| *k == kind) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += bytes;
                }
                None => kinds.push((kind, 1, bytes)),
            }
        }
        kinds.sort_by_key(|k| std::cmp::Reverse(k.2));
        kinds
    }

    /// Bytes of linear-layer weights one decoded token reads (the output head included):
    /// what bounds decoding by memory bandwidth.
    pub fn linear_weight_bytes(&self) -> usize {
        self.weight_summary().iter().map(|(_, _, b)| b).sum()
    }

    /// Bytes the weights hold as loaded: every linear layer's and the token table's (once
    /// when the head is tied to it). Norms and biases, a few kilobytes, are left out. What a
    /// server counts against its memory budget.
    pub fn held_weight_bytes(&self) -> usize {
        let table = match &self.embed {
            Embedding::Dense(t) => t.dims().iter().product::<usize>() * self.dtype.size_bytes(),
            Embedding::Quantized(m) => m.bytes(),
        };
        // A tied head is the table itself, already counted among the linear layers.
        let table = if self.config.tied_head { 0 } else { table };
        self.linear_weight_bytes() + table
    }

    fn check_input(&self, batch: &Batch) -> kiln_core::Result<()> {
        if batch.is_empty() {
            return Err(CoreError::InvalidBatch("no tokens".into()));
        }
        if let Some(t) = batch
            .tokens()
            .iter()
            .find(|t| t.0 as usize >= self.config.vocab)
        {
            return Err(CoreError::ModelInput(format!(
                "token id {t} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        if let Some(p) = batch
            .positions()
            .iter()
            .find(|p| p.index() >= self.config.max_positions)
        {
            return Err(CoreError::ModelInput(format!(
                "position {p} is past the model's context of {} tokens",
                self.config.max_positions
            )));
        }
        Ok(())
    }
}

impl<B: InferenceBackend> CausalLm<B> for Transformer<B> {
    fn shape(&self) -> ModelShape {
        self.config.shape()
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn attention_window(&self) -> Option<usize> {
        self.config.widest_window()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> kiln_core::Result<Tensor<B, 2>> {
        let x = self.final_states(batch, cache, logits)?;
        let logits = self.head.forward(x).cast(FloatDType::F32);
        Ok(match self.config.final_softcap {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        })
    }

    fn hidden_size(&self) -> Option<usize> {
        Some(self.config.d_model)
    }

    fn hidden_states(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        rows: LogitsFor,
    ) -> kiln_core::Result<Tensor<B, 2>> {
        Ok(self.final_states(batch, cache, rows)?.cast(FloatDType::F32))
    }
}

impl<B: InferenceBackend> Transformer<B> {
    /// The blocks over `batch` and the final norm, on the rows `rows` picks: what the head
    /// reads, and what embeddings pool.
    ///
    /// # Shapes
    /// - returns `[rows, d_model]` in the model's dtype.
    fn final_states(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> kiln_core::Result<Tensor<B, 2>> {
        self.check_input(batch)?;
        let device = &self.device;
        let cfg = &self.config;
        let step = cache.plan(batch)?;
        // The window is the model's, per layer; a sliding cache's ring may narrow it. One
        // plan (masks) per distinct window, usually one.
        let window_of = |layer: usize| match (cfg.attention_window(layer), step.window) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut plans: Vec<(Option<usize>, AttentionPlan<B>)> = Vec::new();
        for layer in 0..cfg.n_layers {
            let window = window_of(layer);
            if !plans.iter().any(|(w, _)| *w == window) {
                let step = StepPlan {
                    window,
                    ..step.clone()
                };
                let plan = AttentionPlan::new(batch, step, cfg.n_heads, cfg.n_kv_heads, device)
                    .with_scoring(cfg.attention_scoring);
                plans.push((window, plan));
            }
        }
        let plan_of = |layer: usize| {
            let window = window_of(layer);
            &plans
                .iter()
                .find(|(w, _)| *w == window)
                .expect("built above")
                .1
        };

        let tokens: Vec<usize> = batch.tokens().iter().map(|t| t.0 as usize).collect();
        let mut x = self.embed.lookup(tokens, device);
        if let Some(scale) = cfg.embed_scale {
            x = x.mul_scalar(scale);
        }
        let tables = |rope: &Option<RopeFrequencies>| {
            rope.as_ref().map(|(inv_freq, factor)| {
                RopeTables::new(
                    inv_freq,
                    *factor,
                    batch.positions(),
                    self.dtype.burn_float(),
                    device,
                )
            })
        };
        let (rope, local_rope) = match &self.position_embed {
            Some(table) => {
                let positions: Vec<usize> = batch.positions().iter().map(|p| p.index()).collect();
                x = x + table.clone().select(0, int_tensor::<B>(positions, device));
                (None, None)
            }
            None => (tables(&self.rope), tables(&self.local_rope)),
        };
        // As `TransformerConfig::rope_of`: the local tables on windowed layers.
        let rope_of = |layer: usize| match (&local_rope, cfg.attention_window(layer)) {
            (Some(local), Some(_)) => Some(local),
            _ => rope.as_ref(),
        };
        // Each block's output is added to the stream by the next norm
        // (`Norm::forward_after`: one launch for the sum and the norm on the GPU backends).
        let mut delta: Option<Tensor<B, 2>> = None;
        for (layer, block) in self.blocks.iter().enumerate() {
            let (stream, h) = block.attn_norm.forward_after(x, delta.take());
            let attended = block
                .attn
                .forward(h, layer, cache, plan_of(layer), rope_of(layer));
            let attended = match &block.post_attn_norm {
                Some(norm) => norm.forward(attended),
                None => attended,
            };
            let (stream, h) = block.mlp_norm.forward_after(stream, Some(attended));
            x = stream;
            let out = block.mlp.forward(h);
            delta = Some(match &block.post_mlp_norm {
                Some(norm) => norm.forward(out),
                None => out,
            });
        }
        let (x, delta) = match logits.rows(batch)? {
            None => (x, delta),
            Some(rows) => {
                let rows = int_tensor::<B>(rows, device);
                (x.select(0, rows.clone()), delta.map(|d| d.select(0, rows)))
            }
        };
        let (_, x) = self.final_norm.forward_after(x, delta);
        Ok(x)
    }
}

/// The RoPE frequencies of `config`'s full layers and of its windowed layers where they
/// differ, for its context.
fn rope_frequencies(
    config: &TransformerConfig,
) -> (Option<RopeFrequencies>, Option<RopeFrequencies>) {
    let frequencies = |rope: &RopeConfig| {
        (
            inverse_frequencies(rope, config.head_dim, config.max_positions),
            attention_factor(rope),
        )
    };
    let rope = match &config.positions {
        PositionKind::Rope(rope) => Some(frequencies(rope)),
        PositionKind::Learned => None,
    };
    (rope, config.local_rope.as_ref().map(frequencies))
}

/// The architecture, dtype, weight storage, LongRoPE's long factors where a context past
/// the original one chose them, and an FNV-1a digest of the first row of the embedding and
/// the first input column of the head: two checkpoints of one architecture differ there.
fn fingerprint<B: InferenceBackend>(
    config: &TransformerConfig,
    dtype: Dtype,
    embed: &Embedding<B>,
    head: &Linear<B>,
) -> String {
    let head_column: Vec<f32> = match &head.weight {
        LinearWeight::Dense(w) => {
            let [_, vocab] = w.dims();
            w.clone()
                .slice([0..1, 0..vocab.min(4096)])
                .cast(FloatDType::F32)
                .into_data()
                .iter::<f32>()
                .collect()
        }
        LinearWeight::Quantized(w) => {
            let w = w.host();
            let mut row = vec![0f32; w.cols()];
            (0..w.rows().min(4096))
                .map(|r| {
                    w.dequantize_row(r, &mut row);
                    row[0]
                })
                .collect()
        }
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for x in embed.first_row().into_iter().chain(head_column) {
        for byte in x.to_bits().to_le_bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    // The head's activation passes stand for the model's: a cache computed with the other
    // precision would be close, not the same.
    let storage = match &head.weight {
        LinearWeight::Quantized(w) => match w.host().activation_passes() {
            ActPasses::Two => " quantized".to_string(),
            passes => format!(" quantized ({} activations)", passes.name()),
        },
        LinearWeight::Dense(_) => String::new(),
    };
    let long_rope = match &config.positions {
        PositionKind::Rope(RopeConfig {
            scaling: Some(RopeScaling::LongRope(s)),
            ..
        }) if config.max_positions > s.original_max_positions => " long-context RoPE",
        _ => "",
    };
    format!(
        "{:?} {}x{} vocab {} {}{storage}{long_rope} weights {hash:016x}",
        config.architecture,
        config.n_layers,
        config.d_model,
        config.vocab,
        dtype.name()
    )
}

/// How quantized weights are held after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightStorage {
    /// Dequantized to the model's dtype: the exact path, equal to transformers on the same
    /// dequantized weights.
    #[default]
    Dequantized,
    /// Kept in their ggml blocks and multiplied by kiln's CPU kernels with activations
    /// quantized to 8 bits per block of 32 (llama.cpp's approach; see docs/kernels.md for its
    /// accuracy). Activations, norms and the KV cache stay in `dtype`, which must be f32.
    Quantized,
}

/// How finely kiln's CPU kernels quantize a quantized product's activations (8 bits per block
/// of 32 in one pass or two, or 16 bits: [`kiln_kernels::ActPasses`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// By weight type: one pass for the K-quants (Q2_K to Q6_K), IQ4_NL/IQ4_XS and Q4_0, whose
    /// files carry weight errors far above the pass's and which llama.cpp multiplies against
    /// 8-bit activations too; two for Q4_1 (the default model's type), Q5_0 and Q5_1; for Q8_0
    /// two on AVX-512 VNNI and otherwise their precision as one 16-bit pass, which the AVX2
    /// tier multiplies in half the instructions. docs/kernels.md states each precision's
    /// accuracy per type.
    #[default]
    Auto,
    /// One pass for every type (llama.cpp's precision): about half the integer work.
    Q8,
    /// Two passes for every type: the products track the exact path to ~1e-7 in KL.
    Q8x2,
}

impl Activations {
    /// `auto`, `q8` or `q8x2`.
    pub fn name(self) -> &'static str {
        match self {
            Activations::Auto => "auto",
            Activations::Q8 => "q8",
            Activations::Q8x2 => "q8x2",
        }
    }

    /// The passes a product of weights in `ty` takes.
    pub fn passes_for(self, ty: GgmlType) -> ActPasses {
        match self {
            Activations::Q8 => ActPasses::One,
            Activations::Q8x2 => ActPasses::Two,
            Activations::Auto => match ty {
                GgmlType::Q2K
                | GgmlType::Q3K
                | GgmlType::Q4K
                | GgmlType::Q5K
                | GgmlType::Q6K
                | GgmlType::Iq4Nl
                | GgmlType::Iq4Xs
                | GgmlType::Q4_0 => ActPasses::One,
                _ => ActPasses::precise_for(ty),
            },
        }
    }
}

impl std::str::FromStr for Activations {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Activations::Auto),
            "q8" => Ok(Activations::Q8),
            "q8x2" => Ok(Activations::Q8x2),
            other => Err(format!(
                "unknown activation precision `{other}`: auto, q8 or q8x2"
            )),
        }
    }
}

impl WeightStorage {
    /// `quantized` or `dequantized`.
    pub fn name(self) -> &'static str {
        match self {
            WeightStorage::Dequantized => "dequantized",
            WeightStorage::Quantized => "quantized",
        }
    }
}

/// One layer of a stack [`WeightLoader::stacked_out_in`] loads, named as
/// [`WeightLoader::linear_out_in`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct LinearPart<'a> {
    /// The weight, stored `[d_out, d_in]`.
    pub weight: &'a str,
    /// Its bias, `[d_out]`, if it has one.
    pub bias: Option<&'a str>,
    /// Output rows.
    pub d_out: usize,
    /// `Some(n)`: the rows are in Meta's interleaved RoPE order for `n` heads, and are
    /// permuted to rotate-half order.
    pub interleaved_heads: Option<usize>,
}

/// Reads tensors from a [`TensorSource`], checks their shapes against the configuration, and
/// uploads them in the model's dtype.
pub struct WeightLoader<'a, B: InferenceBackend> {
    /// Where the tensors are.
    pub source: &'a dyn TensorSource,
    /// The precision to upload in.
    pub dtype: Dtype,
    /// The device to upload to.
    pub device: &'a B::Device,
    /// Whether weights stored in a type with a CPU kernel stay quantized.
    pub storage: WeightStorage,
    /// How the quantized products quantize their activations.
    pub activations: Activations,
}

impl<B: InferenceBackend> WeightLoader<'_, B> {
    /// Reads `name`, failing unless its shape is `expected`.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] or [`ModelError::ShapeMismatch`], naming file and tensor.
    pub fn host(&self, name: &str, expected: &[usize]) -> Result<HostTensor> {
        let tensor = self.source.read(name)?;
        if tensor.shape != expected {
            return Err(ModelError::ShapeMismatch {
                file: tensor.file,
                tensor: name.to_string(),
                expected: expected.to_vec(),
                got: tensor.shape,
            });
        }
        Ok(tensor)
    }

    /// A 1-D tensor of `len`.
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor<B, 1>> {
        Ok(self.host(name, &[len])?.upload(self.dtype, self.device))
    }

    /// `name` in its quantized blocks, when [`WeightStorage::Quantized`] is asked for and the
    /// file stores it in a type with a kernel (16-bit floats only where the backend keeps them:
    /// [`InferenceBackend::KEEPS_16_BIT_WEIGHTS`]); its shape checked against `[rows, cols]`.
    fn quantized(&self, name: &str, rows: usize, cols: usize) -> Result<Option<QuantMatrix>> {
        if self.storage != WeightStorage::Quantized {
            return Ok(None);
        }
        let sixteen_bit = self
            .source
            .stored_type(name)
            .is_some_and(kiln_kernels::float16::is_float16);
        if sixteen_bit && !B::KEEPS_16_BIT_WEIGHTS {
            return Ok(None);
        }
        let Some(tensor) = self.source.read_quantized(name)? else {
            return Ok(None);
        };
        if tensor.shape != [rows, cols] {
            return Err(ModelError::ShapeMismatch {
                file: tensor.file,
                tensor: name.to_string(),
                expected: vec![rows, cols],
                got: tensor.shape,
            });
        }
        let passes = self.activations.passes_for(tensor.matrix.ty());
        Ok(Some(tensor.matrix.with_activation_passes(passes)))
    }

    /// A token table of `[vocab, d_model]`, quantized where asked for and possible.
    pub fn embedding(&self, name: &str, vocab: usize, d_model: usize) -> Result<Embedding<B>> {
        Ok(match self.quantized(name, vocab, d_model)? {
            Some(matrix) => Embedding::Quantized(Arc::new(matrix)),
            None => Embedding::Dense(self.matrix(name, vocab, d_model)?),
        })
    }

    /// A 2-D tensor of `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<B, 2>> {
        Ok(self
            .host(name, &[rows, cols])?
            .upload(self.dtype, self.device))
    }

    /// A layer stored `[d_in, d_out]` (GPT-2's `Conv1D`), with an optional bias.
    pub fn linear_in_out(
        &self,
        weight: &str,
        bias: Option<&str>,
        d_in: usize,
        d_out: usize,
    ) -> Result<Linear<B>> {
        let w = self.host(weight, &[d_in, d_out])?;
        Ok(Linear::dense(
            self.dense_weight(w, false),
            bias.map(|b| self.vector(b, d_out)).transpose()?,
        ))
    }

    /// A dense weight as [`LinearWeight::Dense`] holds it, `[d_in, d_out]`, from `w` stored
    /// `[d_out, d_in]` (`out_in`) or `[d_in, d_out]`: on backends that multiply by rows of
    /// `[d_out, d_in]` ([`InferenceBackend::DENSE_WEIGHTS_OUT_IN`]) the transposed view of
    /// such a tensor, elsewhere a row-major `[d_in, d_out]` tensor.
    fn dense_weight(&self, w: HostTensor, out_in: bool) -> Tensor<B, 2> {
        match (B::DENSE_WEIGHTS_OUT_IN, out_in) {
            (true, true) => w.upload::<B, 2>(self.dtype, self.device).transpose(),
            (true, false) => w
                .transposed()
                .upload::<B, 2>(self.dtype, self.device)
                .transpose(),
            (false, true) => w.transposed().upload(self.dtype, self.device),
            (false, false) => w.upload(self.dtype, self.device),
        }
    }

    /// Layers stored `[d_out, d_in]` that share their input (Q, K and V; gate and up), each
    /// given as [`Self::linear_out_in`] takes it, as one quantized layer, their rows (and
    /// biases) one after the other, the weights repacked once from the file
    /// ([`TensorSource::read_quantized_stack`]). `None` when the weights are not kept
    /// quantized, some parts have a bias and others not, or the source cannot stack them: the
    /// caller loads the parts one by one (and [`Linear::fuse_outputs`] fuses what it can, the
    /// same matrix, repacked then copied).
    ///
    /// # Errors
    /// A corrupt tensor, or a bias of the wrong shape.
    pub fn stacked_out_in(
        &self,
        parts: &[LinearPart<'_>],
        d_in: usize,
    ) -> Result<Option<Linear<B>>> {
        if self.storage != WeightStorage::Quantized {
            return Ok(None);
        }
        let with_bias = parts.iter().filter(|p| p.bias.is_some()).count();
        if with_bias != 0 && with_bias != parts.len() {
            return Ok(None);
        }
        let stack: Vec<StackPart<'_>> = parts
            .iter()
            .map(|part| StackPart {
                name: part.weight,
                shape: [part.d_out, d_in],
                order: part
                    .interleaved_heads
                    .map(|heads| half_split_order(part.d_out, heads)),
            })
            .collect();
        let Some(tensor) = self.source.read_quantized_stack(&stack)? else {
            return Ok(None);
        };
        let passes = self.activations.passes_for(tensor.matrix.ty());
        let matrix = tensor.matrix.with_activation_passes(passes);
        // The parts' biases one after the other, as their rows are.
        let mut bias: Option<HostTensor> = None;
        for part in parts {
            let Some(name) = part.bias else { continue };
            let b = self.bias(name, part.d_out, part.interleaved_heads)?;
            match &mut bias {
                Some(all) => {
                    all.data.extend_from_slice(&b.data);
                    all.shape[0] += part.d_out;
                }
                None => bias = Some(b),
            }
        }
        let bias = bias.map(|b| b.upload(self.dtype, self.device));
        Ok(Some(Linear {
            weight: LinearWeight::Quantized(B::QuantWeight::new(Arc::new(matrix))),
            bias,
        }))
    }

    /// A layer's bias `[d_out]`, with `interleaved_heads = Some(n)` permuted from Meta's
    /// interleaved RoPE order to rotate-half order for `n` heads, as its weight's rows are.
    fn bias(
        &self,
        name: &str,
        d_out: usize,
        interleaved_heads: Option<usize>,
    ) -> Result<HostTensor> {
        let b = self.host(name, &[d_out])?;
        Ok(match interleaved_heads {
            Some(heads) => b.interleaved_to_half_split(heads),
            None => b,
        })
    }

    /// A layer stored `[d_out, d_in]` (PyTorch `nn.Linear`), transposed on load. With
    /// `interleaved_heads = Some(n)`, the output rows are first permuted from Meta's
    /// interleaved RoPE order to rotate-half order for `n` heads.
    pub fn linear_out_in(
        &self,
        weight: &str,
        bias: Option<&str>,
        d_in: usize,
        d_out: usize,
        interleaved_heads: Option<usize>,
    ) -> Result<Linear<B>> {
        if interleaved_heads.is_some() {
            // Reordered as it is repacked, where the source can: a stack of one.
            let part = LinearPart {
                weight,
                bias,
                d_out,
                interleaved_heads,
            };
            if let Some(linear) = self.stacked_out_in(&[part], d_in)? {
                return Ok(linear);
            }
        }
        let b = bias
            .map(|b| self.bias(b, d_out, interleaved_heads))
            .transpose()?;
        if let Some(matrix) = self.quantized(weight, d_out, d_in)? {
            let matrix = match interleaved_heads {
                Some(heads) => matrix.permute_rows(&half_split_order(d_out, heads)),
                None => matrix,
            };
            return Ok(Linear {
                weight: LinearWeight::Quantized(B::QuantWeight::new(Arc::new(matrix))),
                bias: b.map(|b| b.upload(self.dtype, self.device)),
            });
        }
        let mut w = self.host(weight, &[d_out, d_in])?;
        if let Some(heads) = interleaved_heads {
            w = w.interleaved_to_half_split(heads);
        }
        Ok(Linear::dense(
            self.dense_weight(w, true),
            b.map(|b| b.upload(self.dtype, self.device)),
        ))
    }
}
