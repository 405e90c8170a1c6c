//! [`TransformerConfig`]: the validated run-time description of a model, shared by every
//! family. The files' own formats (HF `config.json`, Meta `params.json`, GGUF metadata) are
//! parsed by each family's module ([`crate::family`]) and converted into this; what a family's
//! block does differently is data here (biases, per-head norms, windows), read by the shared
//! layers.

use kiln_core::attention::Scoring;
use kiln_core::{ModelShape, TokenId};

/// Which family a model belongs to: the key of the family registry ([`crate::family`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// GPT-2: learned positions, LayerNorm, GELU (tanh), fused QKV with biases.
    Gpt2,
    /// GPT-BigCode (SantaCoder, StarCoder): GPT-2's block with one key/value head.
    GptBigCode,
    /// Llama 3 / 3.1 / 3.2: RoPE, RMSNorm, SwiGLU, grouped-query attention.
    Llama,
    /// Mistral: Llama's block with a sliding attention window.
    Mistral,
    /// Qwen2 / Qwen2.5: Llama's block with biases on Q, K and V.
    Qwen2,
    /// Qwen3: Llama's block with an RMSNorm on each query and key head before RoPE.
    Qwen3,
    /// Gemma 2: GeGLU, norms around attention and MLP, soft-capped scores and logits,
    /// windows on alternate layers.
    Gemma2,
    /// Gemma 3 (text): Gemma 2's block with per-head norms, no soft caps, five windowed
    /// layers with a local RoPE base to each global one.
    Gemma3,
    /// Phi-3 / Phi-3.5 mini: Llama's block with fused QKV and gate/up projections, LongRoPE.
    Phi3,
}

impl Architecture {
    /// The name shown to users (the family's `model_type`).
    pub fn name(self) -> &'static str {
        self.family().name
    }

    /// The family's entry in the registry.
    pub fn family(self) -> &'static crate::family::Family {
        crate::family::of(self)
    }
}

/// The normalisation layers use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NormKind {
    /// Mean and variance, with a bias (GPT-2).
    LayerNorm,
    /// Root mean square, no bias (Llama).
    RmsNorm,
}

/// How positions enter the model.
#[derive(Debug, Clone, PartialEq)]
pub enum PositionKind {
    /// A learned embedding per position, added to the token embedding (GPT-2).
    Learned,
    /// Rotary embeddings on queries and keys (Llama).
    Rope(RopeConfig),
}

/// Rotary position embedding parameters, in Hugging Face's rotate-half layout.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// The base of the frequencies (`rope_theta`).
    pub theta: f32,
    /// How the frequencies are scaled for longer contexts, if at all.
    pub scaling: Option<RopeScaling>,
    /// One divisor per frequency, as GGUF stores scaled RoPE (`rope_freqs.weight`, llama3
    /// scaling precomputed by llama.cpp's converter); applied after `scaling`.
    pub frequency_divisors: Option<Vec<f32>>,
}

/// A RoPE scaling type (`rope_type` in `rope_parameters` / `rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 / 3.2's `llama3`.
    Llama3(Llama3Scaling),
    /// `linear`: positions divided by `factor`, i.e. every frequency.
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// `yarn` (Qwen2.5 and Qwen3 past 32k tokens).
    Yarn(YarnScaling),
    /// `longrope` (Phi-3 and Phi-3.5's 128k models; "su" in early configs).
    LongRope(LongRopeScaling),
    /// `dynamic` (NTK-aware): the base grows once a sequence passes the model's
    /// `max_position_embeddings`. kiln's context never passes it (it is
    /// [`TransformerConfig::max_positions`] or less), and within it transformers' dynamic
    /// RoPE is the default one, so this changes nothing.
    Dynamic {
        /// The growth factor beyond the context.
        factor: f32,
    },
}

impl RopeScaling {
    /// Its `rope_type`.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Llama3(_) => "llama3",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Yarn(_) => "yarn",
            RopeScaling::LongRope(_) => "longrope",
            RopeScaling::Dynamic { .. } => "dynamic",
        }
    }

    /// The context extension factor.
    pub fn factor(&self) -> f32 {
        match self {
            RopeScaling::Llama3(s) => s.factor,
            RopeScaling::Linear { factor } => *factor,
            RopeScaling::Yarn(s) => s.factor,
            RopeScaling::LongRope(s) => s.factor,
            RopeScaling::Dynamic { factor } => *factor,
        }
    }
}

/// LongRoPE (transformers' `_compute_longrope_parameters`, llama.cpp's `rope_factors_long` /
/// `rope_factors_short`): each frequency divided by a factor of its own, from one list for
/// contexts within the original one and another for longer contexts.
///
/// Which list applies is decided by the run's context, as llama.cpp (`n_ctx`) and vLLM
/// (`max_model_len`) decide it: the long factors when the context exceeds
/// `original_max_positions`, for every position, so that keys in the cache never change
/// rotation mid-sequence. transformers decides by the length reached so far (and recomputes
/// the cache when it crosses over); the two agree on every sequence within the original
/// context when the context is too, and on every sequence past it.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRopeScaling {
    /// `max_position_embeddings / original_max_position_embeddings`, or the file's `factor`.
    pub factor: f32,
    /// The context length the model was pre-trained with.
    pub original_max_positions: usize,
    /// One divisor per frequency for contexts up to `original_max_positions`.
    pub short_factors: Vec<f32>,
    /// One divisor per frequency for longer contexts.
    pub long_factors: Vec<f32>,
    /// Multiplies cos and sin: `attention_factor`, by default
    /// `√(1 + ln(factor) / ln(original_max_positions))` (1 for a factor ≤ 1), whichever list
    /// applies.
    pub attention_factor: f32,
}

impl LongRopeScaling {
    /// The divisors for a run whose context is `context` positions.
    pub fn factors_for(&self, context: usize) -> &[f32] {
        if context > self.original_max_positions {
            &self.long_factors
        } else {
            &self.short_factors
        }
    }

    /// The default attention factor for `factor` over an original context of `original`.
    pub fn default_attention_factor(factor: f64, original: usize) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt()
        }
    }
}

/// YaRN's parameters (transformers' `_compute_yarn_parameters`, llama.cpp's `rope_yarn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnScaling {
    /// How much longer the context is than the original.
    pub factor: f32,
    /// The context length the model was pre-trained with.
    pub original_max_positions: usize,
    /// Rotations per original context above which a frequency is kept (`beta_fast`, 32).
    pub beta_fast: f32,
    /// Rotations below which it is fully interpolated (`beta_slow`, 1).
    pub beta_slow: f32,
    /// Multiplies cos and sin (`attention_factor`; by default `0.1 ln(factor) + 1`).
    pub attention_factor: f32,
    /// Whether the ramp's ends are rounded to whole dimensions (`truncate`, true).
    pub truncate: bool,
}

/// The `llama3` `rope_type` of Llama 3.1 and 3.2.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// How much low frequencies are slowed (8 for 3.1, 32 for 3.2 1B/3B).
    pub factor: f32,
    /// Wavelengths above `original / low_freq_factor` are fully scaled.
    pub low_freq_factor: f32,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// The context length the model was pre-trained with.
    pub original_max_positions: usize,
}

/// The feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// `down(gelu_tanh(up(x)))` (GPT-2's `gelu_new`).
    GeluTanh,
    /// `down(silu(gate(x)) * up(x))` (Llama).
    SwiGlu,
    /// `down(gelu_tanh(gate(x)) * up(x))` (Gemma's `gelu_pytorch_tanh`).
    GeGlu,
}

/// Everything the shared transformer needs to know about a model.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    /// The family.
    pub architecture: Architecture,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden width.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Width of the feed-forward hidden layer.
    pub d_ff: usize,
    /// Context length: positions must be below it.
    pub max_positions: usize,
    /// Normalisation.
    pub norm: NormKind,
    /// Normalisation epsilon.
    pub norm_eps: f64,
    /// Position encoding.
    pub positions: PositionKind,
    /// Feed-forward block.
    pub mlp: MlpKind,
    /// Whether the Q, K and V projections have biases.
    pub qkv_bias: bool,
    /// Whether the attention output projection has a bias.
    pub out_bias: bool,
    /// Whether each query and key head is RMS-normalised (weights `[head_dim]`, shared by the
    /// heads) before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Whether the feed-forward projections have biases.
    pub mlp_bias: bool,
    /// Whether each block also normalises its attention output and its MLP output before
    /// adding them to the stream (Gemma's `post_attention_layernorm` and
    /// `post_feedforward_layernorm`; its pre-MLP norm is then `pre_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// Whether the files store each RMSNorm weight as `w` for a scale of `1 + w` (Gemma's
    /// Hugging Face checkpoints; llama.cpp's converter adds the 1). The loader adds it.
    pub norm_unit_offset: bool,
    /// Multiplies the token embeddings (Gemma: `√d_model`).
    pub embed_scale: Option<f32>,
    /// How attention scores are taken: a scale other than `1/√head_dim` (Gemma's
    /// `query_pre_attn_scalar`), a soft cap (Gemma 2's `attn_logit_softcapping`).
    pub attention_scoring: Scoring,
    /// A soft cap on the output logits, `c tanh(logits / c)` (Gemma 2's
    /// `final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// The RoPE of the layers with an attention window, where it differs from
    /// [`Self::positions`]' (Gemma 3's local base).
    pub local_rope: Option<RopeConfig>,
    /// Whether the output head reuses the token embedding.
    pub tied_head: bool,
    /// Beginning-of-sequence token, if the model has one.
    pub bos: Option<TokenId>,
    /// End-of-sequence tokens (Llama-3 instruct has several).
    pub eos: Vec<TokenId>,
    /// Per layer, the attention window: a query attends to at most this many positions back,
    /// itself included (Mistral's `sliding_window`). Empty: every layer attends to everything.
    /// An attention property of the model, applied with every cache kind (the sliding cache's
    /// own window only narrows it further).
    pub attention_windows: Vec<Option<usize>>,
}

/// The largest vocabulary [`TransformerConfig::validate`] accepts (16.7 M tokens).
pub const MAX_VOCAB: usize = 1 << 24;
/// The largest `d_model` and `d_ff` it accepts.
pub const MAX_WIDTH: usize = 1 << 20;
/// The most layers it accepts.
pub const MAX_LAYERS: usize = 4096;
/// The most heads, and the widest head, it accepts.
pub const MAX_HEADS: usize = 1 << 12;
/// The longest context it accepts (positions are 32-bit).
pub const MAX_POSITIONS: usize = 1 << 31;

/// Refuses a layer count above [`MAX_LAYERS`] as soon as a loader reads it: families build
/// per-layer lists (attention windows) before [`TransformerConfig::validate`] runs, and a
/// Mistral `config.json` claiming 2^36 layers once asked for 64 GiB there.
///
/// # Errors
/// The count, named as [`TransformerConfig::validate`] names it.
pub fn check_layer_count(n_layers: usize) -> Result<(), String> {
    if n_layers > MAX_LAYERS {
        return Err(format!(
            "n_layers is {n_layers}, more than kiln accepts ({MAX_LAYERS})"
        ));
    }
    Ok(())
}

impl TransformerConfig {
    /// Layer `layer`'s attention window, if it has one.
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        self.attention_windows.get(layer).copied().flatten()
    }

    /// The widest window when every layer has one (keys further back are seen by no layer);
    /// `None` when some layer attends to everything.
    pub fn widest_window(&self) -> Option<usize> {
        if self.attention_windows.is_empty() || self.attention_windows.len() != self.n_layers {
            return None;
        }
        self.attention_windows
            .iter()
            .copied()
            .try_fold(0, |widest, w| w.map(|w| widest.max(w)))
    }

    /// Layer `layer`'s RoPE: [`Self::local_rope`] on a windowed layer where there is one,
    /// else [`Self::positions`]' (`None` for learned positions).
    pub fn rope_of(&self, layer: usize) -> Option<&RopeConfig> {
        match (&self.local_rope, self.attention_window(layer)) {
            (Some(local), Some(_)) => Some(local),
            _ => match &self.positions {
                PositionKind::Rope(rope) => Some(rope),
                PositionKind::Learned => None,
            },
        }
    }

    /// The RoPE of the layers without a window ([`Self::positions`]'), if any.
    fn rope_of_full_layers(&self) -> Option<&RopeConfig> {
        match &self.positions {
            PositionKind::Rope(rope) => Some(rope),
            PositionKind::Learned => None,
        }
    }

    /// Caps the context at `context` positions (llama.cpp's `-c`, vLLM's `--max-model-len`):
    /// fewer positions to size caches for, and LongRoPE's short factors when it fits in the
    /// original context ([`LongRopeScaling::factors_for`]).
    ///
    /// # Errors
    /// A context of 0 or above the model's.
    pub fn limit_context(&mut self, context: usize) -> Result<(), String> {
        if context == 0 || context > self.max_positions {
            return Err(format!(
                "a context of {context} positions: the model allows 1 to {}",
                self.max_positions
            ));
        }
        self.max_positions = context;
        Ok(())
    }

    /// What the engine and caches need.
    pub fn shape(&self) -> ModelShape {
        ModelShape {
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            vocab: self.vocab,
            max_positions: self.max_positions,
        }
    }

    /// Checks the dimensions agree with each other.
    ///
    /// # Errors
    /// A description of the first inconsistency.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab", self.vocab),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("d_ff", self.d_ff),
            ("max_positions", self.max_positions),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        // Far beyond any published model, and small enough that no size derived from them
        // overflows: a file claiming 2^32 layers is refused before anything is allocated.
        let largest = [
            ("vocab", self.vocab, MAX_VOCAB),
            ("d_model", self.d_model, MAX_WIDTH),
            ("d_ff", self.d_ff, MAX_WIDTH),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("n_heads", self.n_heads, MAX_HEADS),
            ("n_kv_heads", self.n_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEADS),
            ("max_positions", self.max_positions, MAX_POSITIONS),
        ];
        if let Some((name, value, max)) = largest.iter().find(|(_, v, max)| v > max) {
            return Err(format!("{name} is {value}, more than kiln accepts ({max})"));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(format!(
                "the norm epsilon must be positive and finite, got {}",
                self.norm_eps
            ));
        }
        if !self.attention_windows.is_empty() && self.attention_windows.len() != self.n_layers {
            return Err(format!(
                "{} attention windows for {} layers",
                self.attention_windows.len(),
                self.n_layers
            ));
        }
        if self.attention_windows.contains(&Some(0)) {
            return Err("sliding_window must be positive".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "n_heads ({}) must be a multiple of n_kv_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if matches!(self.positions, PositionKind::Rope(_)) && !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "RoPE needs an even head_dim, got {}",
                self.head_dim
            ));
        }
        for rope in [self.rope_of_full_layers(), self.local_rope.as_ref()]
            .into_iter()
            .flatten()
        {
            if !(rope.theta.is_finite() && rope.theta > 0.0) {
                return Err(format!(
                    "the RoPE base (rope_theta) must be positive and finite, got {}",
                    rope.theta
                ));
            }
            if let Some(RopeScaling::LongRope(s)) = &rope.scaling {
                for (name, factors) in [("short", &s.short_factors), ("long", &s.long_factors)] {
                    if factors.len() != self.head_dim / 2 {
                        return Err(format!(
                            "longrope has {} {name} factors for heads of {} dimensions (one per \
                             pair: {})",
                            factors.len(),
                            self.head_dim,
                            self.head_dim / 2
                        ));
                    }
                    if let Some(bad) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                        return Err(format!("longrope {name} factor {bad} is not positive"));
                    }
                }
            }
        }
        let positive_or_none = [
            ("the attention scale", self.attention_scoring.scale),
            ("the attention soft cap", self.attention_scoring.softcap),
            ("the final logit soft cap", self.final_softcap),
            ("the embedding scale", self.embed_scale),
        ];
        for (name, value) in positive_or_none {
            if let Some(v) = value
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("{name} must be positive and finite, got {v}"));
            }
        }
        Ok(())
    }

    /// Drops the BOS / EOS ids that lie outside the vocabulary, with a warning for each (see
    /// [`drop_impossible_special_tokens`]).
    pub fn drop_impossible_special_tokens(&mut self) -> Vec<String> {
        drop_impossible_special_tokens(&mut self.bos, &mut self.eos, self.vocab)
    }

    /// Parameter count, as `transformers`' `num_parameters()` counts it: every weight, bias
    /// and norm, the embedding once when the head is tied.
    ///
    /// Saturates at `usize::MAX` rather than wrap: [`TransformerConfig::validate`]'s bounds
    /// keep a valid configuration's count below 2^59, but one built in code need not be
    /// valid, and `kiln info` must never print a wrapped count.
    pub fn parameters(&self) -> usize {
        let sum = |terms: &[usize]| terms.iter().fold(0usize, |a, &b| a.saturating_add(b));
        let product = |factors: &[usize]| factors.iter().fold(1usize, |a, &b| a.saturating_mul(b));
        let (d, f) = (self.d_model, self.d_ff);
        let q = product(&[self.n_heads, self.head_dim]);
        let kv = product(&[self.n_kv_heads, self.head_dim]);
        let qkv = sum(&[q, kv, kv]);
        let attn_bias = sum(&[
            usize::from(self.qkv_bias) * qkv,
            usize::from(self.out_bias) * d,
        ]);
        let qk_norm = product(&[usize::from(self.qk_norm) * 2, self.head_dim]);
        let attn = sum(&[product(&[d, qkv]), product(&[q, d]), attn_bias, qk_norm]);
        let bias = usize::from(self.mlp_bias);
        let mlp = match self.mlp {
            MlpKind::GeluTanh => sum(&[product(&[2, d, f]), bias * sum(&[f, d])]),
            MlpKind::SwiGlu | MlpKind::GeGlu => sum(&[product(&[3, d, f]), bias * sum(&[f, f, d])]),
        };
        let norm = match self.norm {
            NormKind::LayerNorm => product(&[2, d]),
            NormKind::RmsNorm => d,
        };
        let block_norms = if self.sandwich_norms { 4 } else { 2 };
        let embed = product(&[self.vocab, d]);
        let head = if self.tied_head { 0 } else { embed };
        let positions = match self.positions {
            PositionKind::Learned => product(&[self.max_positions, d]),
            PositionKind::Rope(_) => 0,
        };
        let block = sum(&[attn, mlp, product(&[block_norms, norm])]);
        sum(&[
            embed,
            positions,
            product(&[self.n_layers, block]),
            norm,
            head,
        ])
    }
}

/// Removes the BOS / EOS ids at or past `vocab`, returning a warning for each one removed.
///
/// transformers loads and runs such configurations: `GPT2Config(vocab_size=512)` keeps GPT-2's
/// id 50256 for both, as many test checkpoints do. An id outside the vocabulary can never be
/// generated, so as a stop token it changes nothing, and a BOS that cannot be embedded would
/// only make every prompt fail; kiln drops them and says so rather than refusing the model.
pub fn drop_impossible_special_tokens(
    bos: &mut Option<TokenId>,
    eos: &mut Vec<TokenId>,
    vocab: usize,
) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some(id) = bos.take_if(|id| id.0 as usize >= vocab) {
        warnings.push(format!(
            "bos_token_id {id} is outside the vocabulary ({vocab} tokens); ignored, so no BOS is \
             added"
        ));
    }
    eos.retain(|id| {
        let possible = (id.0 as usize) < vocab;
        if !possible {
            warnings.push(format!(
                "eos_token_id {id} is outside the vocabulary ({vocab} tokens) and can never be \
                 generated; dropped from the stop tokens"
            ));
        }
        possible
    });
    warnings
}
