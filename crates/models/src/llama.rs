//! Llama 3 / 3.1 / 3.2: Hugging Face `config.json` (both the transformers-4 keys found on the
//! hub and transformers-5's `rope_parameters`), Meta's `params.json`, and both weight namings.
//!
//! kiln applies RoPE in HF's rotate-half layout. HF checkpoints are in that layout already;
//! Meta's `wq`/`wk` rows are in the interleaved layout and are permuted on load.

use std::path::Path;

use kiln_core::{Dtype, InferenceBackend, TokenId};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{
    Architecture, Llama3Scaling, MlpKind, NormKind, PositionKind, RopeConfig, TransformerConfig,
};
use crate::error::{ModelError, Result};
use crate::layers::attention::{Attention, QkvProjection};
use crate::layers::mlp::Mlp;
use crate::layers::norm::Norm;
use crate::loaders::WeightStorage;
use crate::transformer::{Block, Transformer, WeightLoader};
use crate::weights::TensorSource;

/// The keys of a Llama `config.json` kiln reads. A key the file leaves out takes
/// `LlamaConfig`'s default, as transformers does.
#[derive(Debug, Deserialize)]
pub struct LlamaHfConfig {
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::hidden_size")]
    hidden_size: usize,
    #[serde(default = "defaults::intermediate_size")]
    intermediate_size: usize,
    #[serde(default = "defaults::num_layers_or_heads")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::num_layers_or_heads")]
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "defaults::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    /// transformers 4.x: top level.
    rope_theta: Option<f32>,
    /// transformers 4.x: `{"rope_type" | "type": "llama3", "factor", ...}`.
    rope_scaling: Option<Value>,
    /// transformers 5.x: `{"rope_theta", "rope_type", ...}`.
    rope_parameters: Option<Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default = "defaults::bos_token_id")]
    bos_token_id: Option<u32>,
    #[serde(default = "defaults::eos_token_id")]
    eos_token_id: Option<Value>,
    /// Mistral: every layer attends over the last `sliding_window` positions (null: all).
    #[serde(default)]
    sliding_window: Option<usize>,
}

/// `LlamaConfig`'s defaults (transformers 5).
mod defaults {
    pub fn vocab_size() -> usize {
        32000
    }
    pub fn hidden_size() -> usize {
        4096
    }
    pub fn intermediate_size() -> usize {
        11008
    }
    pub fn num_layers_or_heads() -> usize {
        32
    }
    pub fn max_position_embeddings() -> usize {
        2048
    }
    pub fn bos_token_id() -> Option<u32> {
        Some(1)
    }
    pub fn eos_token_id() -> Option<serde_json::Value> {
        Some(2.into())
    }
}

fn default_eps() -> f64 {
    1e-6
}

fn default_act() -> String {
    "silu".into()
}

/// An `eos_token_id` that is a number or a list of numbers.
pub(crate) fn token_ids(value: Option<&Value>) -> Vec<TokenId> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|n| TokenId(n as u32)).into_iter().collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_u64)
            .map(|n| TokenId(n as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Parses a `rope_scaling` / `rope_parameters` object.
fn rope_scaling(value: &Value, path: &Path) -> Result<Option<Llama3Scaling>> {
    let kind = value
        .get("rope_type")
        .or_else(|| value.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f64> {
        value
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| ModelError::config(path, format!("rope scaling lacks `{key}`")))
    };
    match kind {
        "default" => Ok(None),
        "llama3" => Ok(Some(Llama3Scaling {
            factor: number("factor")? as f32,
            low_freq_factor: number("low_freq_factor")? as f32,
            high_freq_factor: number("high_freq_factor")? as f32,
            original_max_positions: number("original_max_position_embeddings")? as usize,
        })),
        other => Err(ModelError::config(
            path,
            format!("rope type `{other}` is not supported (kiln supports default and llama3)"),
        )),
    }
}

impl LlamaHfConfig {
    /// One window per layer when the config has a sliding window, none otherwise.
    fn attention_windows(&self) -> Vec<Option<usize>> {
        match self.sliding_window {
            Some(w) => vec![Some(w); self.num_hidden_layers],
            None => Vec::new(),
        }
    }

    /// The validated configuration.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path`.
    pub fn to_config(&self, path: &Path) -> Result<TransformerConfig> {
        if self.hidden_act != "silu" {
            return Err(ModelError::config(
                path,
                format!(
                    "hidden_act `{}` is not supported (Llama uses silu)",
                    self.hidden_act
                ),
            ));
        }
        let params = self.rope_parameters.as_ref();
        let theta = self
            .rope_theta
            .or_else(|| {
                params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .map(|t| t as f32)
            })
            .unwrap_or(10000.0);
        let scaling = match params.or(self.rope_scaling.as_ref()) {
            Some(v) if !v.is_null() => rope_scaling(v, path)?,
            _ => None,
        };
        let n_heads = self.num_attention_heads;
        if n_heads == 0 {
            return Err(ModelError::config(
                path,
                "num_attention_heads must be positive",
            ));
        }
        let config = TransformerConfig {
            architecture: Architecture::Llama,
            vocab: self.vocab_size,
            d_model: self.hidden_size,
            n_layers: self.num_hidden_layers,
            n_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(n_heads),
            head_dim: self.head_dim.unwrap_or(self.hidden_size / n_heads),
            d_ff: self.intermediate_size,
            max_positions: self.max_position_embeddings,
            norm: NormKind::RmsNorm,
            norm_eps: self.rms_norm_eps,
            positions: PositionKind::Rope(RopeConfig {
                theta,
                llama3_scaling: scaling,
                frequency_divisors: None,
            }),
            mlp: MlpKind::SwiGlu,
            attention_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            tied_head: self.tie_word_embeddings,
            bos: self.bos_token_id.map(TokenId),
            eos: token_ids(self.eos_token_id.as_ref()),
            attention_windows: self.attention_windows(),
        };
        config.validate().map_err(|e| ModelError::config(path, e))?;
        Ok(config)
    }
}

/// Meta's `params.json`.
#[derive(Debug, Deserialize)]
pub struct MetaParams {
    dim: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_eps")]
    norm_eps: f64,
    #[serde(default = "default_meta_theta")]
    rope_theta: f32,
    #[serde(default)]
    use_scaled_rope: bool,
    rope_scaling_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    max_seq_len: Option<usize>,
}

fn default_meta_theta() -> f32 {
    500_000.0
}

/// Llama 3.1's scaling constants; `params.json` says only `use_scaled_rope: true`.
pub const LLAMA31_SCALING: Llama3Scaling = Llama3Scaling {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_positions: 8192,
};

impl MetaParams {
    /// The validated configuration. `d_ff` comes from the weights (`w1`'s rows), since
    /// `multiple_of` and `ffn_dim_multiplier` only round it. The RoPE scaling factor is, in
    /// order: `scaling_factor` (the caller's override, e.g. 32 for Llama 3.2 1B/3B), the file's
    /// `rope_scaling_factor`, else Llama 3.1's 8.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path`.
    pub fn to_config(
        &self,
        path: &Path,
        d_ff: usize,
        scaling_factor: Option<f32>,
    ) -> Result<TransformerConfig> {
        if self.n_heads == 0 {
            return Err(ModelError::config(path, "n_heads must be positive"));
        }
        let scaling = self.use_scaled_rope.then(|| Llama3Scaling {
            factor: scaling_factor
                .or(self.rope_scaling_factor)
                .unwrap_or(LLAMA31_SCALING.factor),
            original_max_positions: self
                .original_max_position_embeddings
                .unwrap_or(LLAMA31_SCALING.original_max_positions),
            ..LLAMA31_SCALING
        });
        let max_positions =
            self.max_seq_len
                .unwrap_or(if self.use_scaled_rope { 131_072 } else { 8192 });
        let config = TransformerConfig {
            architecture: Architecture::Llama,
            vocab: self.vocab_size,
            d_model: self.dim,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads.unwrap_or(self.n_heads),
            head_dim: self.dim / self.n_heads,
            d_ff,
            max_positions,
            norm: NormKind::RmsNorm,
            norm_eps: self.norm_eps,
            positions: PositionKind::Rope(RopeConfig {
                theta: self.rope_theta,
                llama3_scaling: scaling,
                frequency_divisors: None,
            }),
            mlp: MlpKind::SwiGlu,
            attention_bias: false,
            mlp_bias: false,
            tied_head: false,
            bos: None,
            eos: Vec::new(),
            attention_windows: Vec::new(),
        };
        config.validate().map_err(|e| ModelError::config(path, e))?;
        Ok(config)
    }
}

/// Tensor names of one checkpoint flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaNames {
    /// transformers' `model.layers.N.self_attn.q_proj.weight`...
    HuggingFace,
    /// Meta's `layers.N.attention.wq.weight`... (Q/K rows interleaved)
    Meta,
    /// llama.cpp's `blk.N.attn_q.weight`... (Q/K rows interleaved)
    Gguf,
}

impl LlamaNames {
    fn embed(self) -> &'static str {
        match self {
            Self::HuggingFace => "model.embed_tokens.weight",
            Self::Meta => "tok_embeddings.weight",
            Self::Gguf => "token_embd.weight",
        }
    }

    fn final_norm(self) -> &'static str {
        match self {
            Self::HuggingFace => "model.norm.weight",
            Self::Meta => "norm.weight",
            Self::Gguf => "output_norm.weight",
        }
    }

    fn head(self) -> &'static str {
        match self {
            Self::HuggingFace => "lm_head.weight",
            Self::Meta | Self::Gguf => "output.weight",
        }
    }

    /// `(part)` → tensor name prefix (without `.weight` / `.bias`) in layer `i`.
    fn layer(self, i: usize, part: &str) -> String {
        match self {
            Self::HuggingFace => {
                let p = match part {
                    "q" => "self_attn.q_proj",
                    "k" => "self_attn.k_proj",
                    "v" => "self_attn.v_proj",
                    "o" => "self_attn.o_proj",
                    "gate" => "mlp.gate_proj",
                    "up" => "mlp.up_proj",
                    "down" => "mlp.down_proj",
                    "attn_norm" => "input_layernorm",
                    _ => "post_attention_layernorm",
                };
                format!("model.layers.{i}.{p}")
            }
            Self::Meta => {
                let p = match part {
                    "q" => "attention.wq",
                    "k" => "attention.wk",
                    "v" => "attention.wv",
                    "o" => "attention.wo",
                    "gate" => "feed_forward.w1",
                    "up" => "feed_forward.w3",
                    "down" => "feed_forward.w2",
                    "attn_norm" => "attention_norm",
                    _ => "ffn_norm",
                };
                format!("layers.{i}.{p}")
            }
            Self::Gguf => {
                let p = match part {
                    "q" => "attn_q",
                    "k" => "attn_k",
                    "v" => "attn_v",
                    "o" => "attn_output",
                    "gate" => "ffn_gate",
                    "up" => "ffn_up",
                    "down" => "ffn_down",
                    "attn_norm" => "attn_norm",
                    _ => "ffn_norm",
                };
                format!("blk.{i}.{p}")
            }
        }
    }

    /// Whether Q/K rows must be permuted from interleaved to rotate-half order.
    fn interleaved(self) -> bool {
        matches!(self, Self::Meta | Self::Gguf)
    }
}

/// Loads Llama weights.
///
/// # Errors
/// A missing tensor or one whose shape disagrees with `config`, naming file and tensor.
pub fn load<B: InferenceBackend>(
    config: TransformerConfig,
    names: LlamaNames,
    source: &dyn TensorSource,
    dtype: Dtype,
    storage: WeightStorage,
    device: &B::Device,
) -> Result<Transformer<B>> {
    let w = WeightLoader::<B> {
        source,
        dtype,
        device,
        storage,
    };
    let (d, ff, hd) = (config.d_model, config.d_ff, config.head_dim);
    let (q_out, kv_out) = (config.n_heads * hd, config.n_kv_heads * hd);
    let permute = |heads: usize| names.interleaved().then_some(heads);
    let linear =
        |i: usize, part: &str, d_in: usize, d_out: usize, bias: bool, heads: Option<usize>| {
            let base = names.layer(i, part);
            let bias_name = format!("{base}.bias");
            w.linear_out_in(
                &format!("{base}.weight"),
                bias.then_some(bias_name.as_str()),
                d_in,
                d_out,
                heads,
            )
        };
    let norm = |name: &str| -> Result<Norm<B>> {
        Ok(Norm {
            kind: NormKind::RmsNorm,
            gamma: w.vector(name, d)?,
            beta: None,
            eps: config.norm_eps,
        })
    };
    let (ab, mb) = (config.attention_bias, config.mlp_bias);
    let mut blocks = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        blocks.push(Block {
            attn_norm: norm(&format!("{}.weight", names.layer(i, "attn_norm")))?,
            attn: Attention {
                qkv: QkvProjection::fuse_or_split(
                    linear(i, "q", d, q_out, ab, permute(config.n_heads))?,
                    linear(i, "k", d, kv_out, ab, permute(config.n_kv_heads))?,
                    linear(i, "v", d, kv_out, ab, None)?,
                ),
                out: linear(i, "o", q_out, d, ab, None)?,
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: hd,
            },
            mlp_norm: norm(&format!("{}.weight", names.layer(i, "mlp_norm")))?,
            mlp: Mlp::swiglu(
                linear(i, "gate", d, ff, mb, None)?,
                linear(i, "up", d, ff, mb, None)?,
                linear(i, "down", ff, d, mb, None)?,
            ),
        });
    }
    let embed = w.embedding(names.embed(), config.vocab, d)?;
    let final_norm = norm(names.final_norm())?;
    let head = if config.tied_head {
        None
    } else {
        Some(w.linear_out_in(names.head(), None, d, config.vocab, None)?)
    };
    Ok(Transformer::from_parts(
        config,
        dtype,
        device.clone(),
        embed,
        None,
        blocks,
        final_norm,
        head,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Result<TransformerConfig> {
        let parsed: LlamaHfConfig = serde_json::from_str(json).expect("valid JSON");
        parsed.to_config(Path::new("config.json"))
    }

    /// A key left out takes `LlamaConfig`'s default, as in transformers (read off
    /// `transformers.LlamaConfig()`, 5.24); an explicit null stays null.
    #[test]
    fn missing_keys_take_transformers_defaults() {
        let c = config("{}").expect("Llama-2-7B's shape");
        assert_eq!(
            (
                c.vocab,
                c.d_model,
                c.d_ff,
                c.n_layers,
                c.n_heads,
                c.n_kv_heads
            ),
            (32000, 4096, 11008, 32, 32, 32)
        );
        assert_eq!((c.head_dim, c.max_positions, c.norm_eps), (128, 2048, 1e-6));
        assert_eq!((c.bos, c.eos.clone()), (Some(TokenId(1)), vec![TokenId(2)]));
        assert!(!c.tied_head);
        let PositionKind::Rope(rope) = &c.positions else {
            panic!("Llama uses RoPE")
        };
        assert_eq!((rope.theta, rope.llama3_scaling), (10000.0, None));
        let c = config(r#"{"bos_token_id": null, "eos_token_id": null}"#).expect("loads");
        assert_eq!((c.bos, c.eos.len()), (None, 0));
    }
}
