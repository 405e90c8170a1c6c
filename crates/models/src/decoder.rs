//! The rotary decoder most families are (Llama, Mistral, Qwen2, Qwen3): what their files share.
//! Hugging Face `config.json` keys with each family's defaults ([`HfConfig`]), GGUF metadata
//! under each family's key prefix ([`gguf_config`]), the three tensor namings
//! ([`TensorNames`]), and the loader that assembles the blocks from them ([`load`]). What a
//! family does differently is in its [`TransformerConfig`] (biases, per-head norms, windows),
//! set by its module in [`crate::family`].
//!
//! kiln applies RoPE in HF's rotate-half layout. HF checkpoints are in that layout already;
//! Meta's `wq`/`wk` rows, and llama.cpp's for the families it converts that way
//! ([`crate::family::GgufFamily::qk_rows_interleaved`]), are in the interleaved layout and are
//! permuted on load.

use std::path::Path;

use kiln_core::attention::Scoring;
use kiln_core::{Dtype, InferenceBackend, TokenId};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{
    Architecture, Llama3Scaling, LongRopeScaling, MlpKind, NormKind, PositionKind, RopeConfig,
    RopeScaling, TransformerConfig, YarnScaling,
};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::layers::attention::{Attention, HeadNorms, QkvProjection};
use crate::layers::mlp::{GateActivation, Mlp};
use crate::layers::norm::Norm;
use crate::transformer::{
    Activations, Block, LinearPart, Transformer, WeightLoader, WeightStorage,
};
use crate::weights::TensorSource;

/// A family's `PretrainedConfig` defaults: what a `config.json` that leaves a key out means, as
/// transformers reads it.
#[derive(Debug, Clone, Copy)]
pub struct HfDefaults {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (`None`: as many as the query heads).
    pub num_key_value_heads: Option<usize>,
    /// `head_dim` (`None`: `hidden_size / num_attention_heads`).
    pub head_dim: Option<usize>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `sliding_window`.
    pub sliding_window: Option<usize>,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// The MLP's activation (`hidden_act`, Gemma's `hidden_activation`).
    pub hidden_act: &'static str,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
}

/// The `config.json` keys of a rotary decoder, each as the file has it (absent or null alike
/// are `None`; [`HfConfig::read`] tells them apart where the family's default is not null).
#[derive(Debug, Deserialize)]
struct HfKeys {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    /// transformers 4.x: top level.
    rope_theta: Option<f32>,
    /// transformers 4.x: `{"rope_type" | "type": "llama3", "factor", ...}`.
    rope_scaling: Option<Value>,
    /// transformers 5.x: `{"rope_theta", "rope_type", ...}`.
    rope_parameters: Option<Value>,
    /// Phi-3 (transformers 4.x): the pre-training context, beside `rope_scaling`.
    original_max_position_embeddings: Option<usize>,
    /// Phi-4-mini: RoPE on a fraction of each head (kiln rotates whole heads).
    partial_rotary_factor: Option<f64>,
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
    /// Gemma's name for `hidden_act` (which Gemma's modeling code ignores).
    hidden_activation: Option<String>,
    /// Qwen2/Qwen3: the window applies only when this is true.
    use_sliding_window: Option<bool>,
    /// Qwen2/Qwen3: layers from this one on slide (when `layer_types` is absent).
    max_window_layers: Option<usize>,
    /// transformers 5: `"full_attention"` or `"sliding_attention"` per layer.
    layer_types: Option<Vec<String>>,
}

/// A rotary decoder's `config.json`, its absent keys filled from the family's defaults.
#[derive(Debug)]
pub struct HfConfig {
    keys: HfKeys,
    defaults: HfDefaults,
    bos: Option<u32>,
    eos: Vec<TokenId>,
    sliding_window: Option<usize>,
}

impl HfConfig {
    /// Parses `value` (the whole `config.json`) with `defaults` for the keys it leaves out. A
    /// key present as `null` stays null (transformers keeps an explicit `"bos_token_id": null`).
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` when a key has the wrong type.
    pub fn read(value: Value, path: &Path, defaults: HfDefaults) -> Result<Self> {
        let default_or = |key: &str, default: Option<Value>| match value.get(key) {
            None => default,
            Some(v) => Some(v.clone()),
        };
        let bos = default_or("bos_token_id", defaults.bos_token_id.map(Value::from));
        let eos = default_or("eos_token_id", defaults.eos_token_id.map(Value::from));
        let window = default_or("sliding_window", defaults.sliding_window.map(Value::from));
        let keys: HfKeys =
            serde_json::from_value(value).map_err(|e| ModelError::config(path, e.to_string()))?;
        let number = |v: Option<Value>, key: &str| -> Result<Option<u64>> {
            match v {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    ModelError::config(path, format!("`{key}` must be a non-negative integer"))
                }),
            }
        };
        Ok(Self {
            bos: number(bos, "bos_token_id")?.map(|id| id as u32),
            eos: token_ids(eos.as_ref()),
            sliding_window: number(window, "sliding_window")?.map(|w| w as usize),
            keys,
            defaults,
        })
    }

    /// The Llama-shaped configuration these keys describe, for `architecture`: a gated MLP
    /// (SwiGLU or GeGLU as the activation says), RMSNorm, RoPE, biases on all four attention
    /// projections when `attention_bias`, every layer windowed when there is a
    /// `sliding_window` (Mistral's reading). Families adjust it ([`Self::layer_windows`]) and
    /// then [`TransformerConfig::validate`] it.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` for an activation other than SiLU or tanh GELU,
    /// an unsupported RoPE scaling or no heads.
    pub fn decoder_config(
        &self,
        path: &Path,
        architecture: Architecture,
    ) -> Result<TransformerConfig> {
        let (k, d) = (&self.keys, &self.defaults);
        let (key, act) = match (&k.hidden_activation, &k.hidden_act) {
            (Some(act), _) => ("hidden_activation", act.as_str()),
            (None, Some(act)) => ("hidden_act", act.as_str()),
            (None, None) => ("hidden_act", d.hidden_act),
        };
        let mlp = match act {
            "silu" | "swish" => MlpKind::SwiGlu,
            "gelu_pytorch_tanh" | "gelu_new" => MlpKind::GeGlu,
            other => {
                return Err(ModelError::config(
                    path,
                    format!(
                        "{key} `{other}` is not supported (kiln's gated MLPs take silu or \
                         gelu_pytorch_tanh)"
                    ),
                ));
            }
        };
        let params = k.rope_parameters.as_ref();
        let theta = k
            .rope_theta
            .or_else(|| {
                params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .map(|t| t as f32)
            })
            .unwrap_or(10000.0);
        let max_positions = k
            .max_position_embeddings
            .unwrap_or(d.max_position_embeddings);
        let scaling = match params.or(k.rope_scaling.as_ref()) {
            Some(Value::Object(v)) => {
                // As transformers' `standardize_rope_params`: a top-level original context
                // belongs to the scaling.
                let mut v = v.clone();
                if let Some(original) = k.original_max_position_embeddings {
                    v.entry("original_max_position_embeddings")
                        .or_insert(original.into());
                }
                rope_scaling(&Value::Object(v), path, max_positions)?
            }
            Some(v) if !v.is_null() => rope_scaling(v, path, max_positions)?,
            _ => None,
        };
        let partial = k.partial_rotary_factor.or_else(|| {
            params
                .and_then(|p| p.get("partial_rotary_factor"))
                .and_then(Value::as_f64)
        });
        if let Some(fraction) = partial.filter(|f| *f != 1.0) {
            return Err(ModelError::config(
                path,
                format!(
                    "partial_rotary_factor {fraction} is not supported (kiln rotates whole heads)"
                ),
            ));
        }
        let n_heads = k.num_attention_heads.unwrap_or(d.num_attention_heads);
        if n_heads == 0 {
            return Err(ModelError::config(
                path,
                "num_attention_heads must be positive",
            ));
        }
        let d_model = k.hidden_size.unwrap_or(d.hidden_size);
        let n_layers = k.num_hidden_layers.unwrap_or(d.num_hidden_layers);
        crate::config::check_layer_count(n_layers).map_err(|e| ModelError::config(path, e))?;
        Ok(TransformerConfig {
            architecture,
            vocab: k.vocab_size.unwrap_or(d.vocab_size),
            d_model,
            n_layers,
            n_heads,
            n_kv_heads: k
                .num_key_value_heads
                .or(d.num_key_value_heads)
                .unwrap_or(n_heads),
            head_dim: k.head_dim.or(d.head_dim).unwrap_or(d_model / n_heads),
            d_ff: k.intermediate_size.unwrap_or(d.intermediate_size),
            max_positions,
            norm: NormKind::RmsNorm,
            norm_eps: k.rms_norm_eps.unwrap_or(d.rms_norm_eps),
            positions: PositionKind::Rope(RopeConfig {
                theta,
                scaling,
                frequency_divisors: None,
            }),
            mlp,
            qkv_bias: k.attention_bias,
            out_bias: k.attention_bias,
            qk_norm: false,
            mlp_bias: k.mlp_bias,
            sandwich_norms: false,
            norm_unit_offset: false,
            embed_scale: None,
            attention_scoring: Scoring::default(),
            final_softcap: None,
            local_rope: None,
            tied_head: k.tie_word_embeddings.unwrap_or(d.tie_word_embeddings),
            bos: self.bos.map(TokenId),
            eos: self.eos.clone(),
            attention_windows: match self.sliding_window {
                Some(w) => vec![Some(w); n_layers],
                None => Vec::new(),
            },
        })
    }

    /// Qwen2's and Qwen3's windows (transformers' `Qwen2Config.__post_init__`): the window
    /// exists only with `use_sliding_window`; it applies to the layers `layer_types` calls
    /// `sliding_attention`, or when that is absent to the layers from `max_window_layers` on.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` when `layer_types` has the wrong length or an
    /// unknown entry.
    pub fn qwen_windows(
        &self,
        path: &Path,
        n_layers: usize,
        max_window_layers: usize,
    ) -> Result<Vec<Option<usize>>> {
        if !self.keys.use_sliding_window.unwrap_or(false) {
            return Ok(Vec::new());
        }
        let first = self.keys.max_window_layers.unwrap_or(max_window_layers);
        self.layer_windows(path, n_layers, |i| i >= first)
    }

    /// Per layer, the `sliding_window` on the layers `layer_types` calls `sliding_attention`
    /// or, when the file has no `layer_types`, on those `sliding_by_default` picks (the
    /// family's pattern); no windows at all without a `sliding_window`.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` when `layer_types` has the wrong length or an
    /// unknown entry.
    pub fn layer_windows(
        &self,
        path: &Path,
        n_layers: usize,
        sliding_by_default: impl Fn(usize) -> bool,
    ) -> Result<Vec<Option<usize>>> {
        let Some(window) = self.sliding_window else {
            return Ok(Vec::new());
        };
        let Some(types) = &self.keys.layer_types else {
            return Ok((0..n_layers)
                .map(|i| sliding_by_default(i).then_some(window))
                .collect());
        };
        if types.len() != n_layers {
            return Err(ModelError::config(
                path,
                format!(
                    "layer_types lists {} layers for num_hidden_layers {n_layers}",
                    types.len()
                ),
            ));
        }
        types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(None),
                "sliding_attention" => Ok(Some(window)),
                other => Err(ModelError::config(
                    path,
                    format!(
                        "layer_types entry `{other}` is not supported (full_attention or \
                         sliding_attention)"
                    ),
                )),
            })
            .collect()
    }
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

/// One RoPE from a transformers-5 `rope_parameters` object (`rope_theta`, `rope_type` and its
/// keys), `default_theta` where it has no `rope_theta`; `max_positions` as for
/// [`rope_scaling`].
///
/// # Errors
/// As [`rope_scaling`], and a `rope_theta` that is not a positive number.
pub(crate) fn rope_config(
    params: &Value,
    default_theta: f32,
    path: &Path,
    max_positions: usize,
) -> Result<RopeConfig> {
    let theta = match params.get("rope_theta") {
        None | Some(Value::Null) => default_theta,
        Some(v) => v
            .as_f64()
            .filter(|t| t.is_finite() && *t > 0.0)
            .ok_or_else(|| ModelError::config(path, "`rope_theta` must be a positive number"))?
            as f32,
    };
    Ok(RopeConfig {
        theta,
        scaling: rope_scaling(params, path, max_positions)?,
        frequency_divisors: None,
    })
}

/// Parses a `rope_scaling` / `rope_parameters` object; `max_positions` is the configuration's
/// context (YaRN's factor when the object has none).
pub(crate) fn rope_scaling(
    value: &Value,
    path: &Path,
    max_positions: usize,
) -> Result<Option<RopeScaling>> {
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
    let optional = |key: &str| value.get(key).and_then(Value::as_f64);
    let scaling = match kind {
        "default" => return Ok(None),
        "llama3" => RopeScaling::Llama3(Llama3Scaling {
            factor: number("factor")? as f32,
            low_freq_factor: number("low_freq_factor")? as f32,
            high_freq_factor: number("high_freq_factor")? as f32,
            original_max_positions: number("original_max_position_embeddings")? as usize,
        }),
        "linear" => RopeScaling::Linear {
            factor: number("factor")? as f32,
        },
        "yarn" => {
            let original = number("original_max_position_embeddings")?;
            let factor = optional("factor").unwrap_or(max_positions as f64 / original);
            // transformers' get_mscale: 0.1 m ln(factor) + 1, or 1 for factor ≤ 1.
            let mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match (
                optional("attention_factor"),
                optional("mscale"),
                optional("mscale_all_dim"),
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                _ => mscale(1.0),
            };
            RopeScaling::Yarn(YarnScaling {
                factor: factor as f32,
                original_max_positions: original as usize,
                beta_fast: optional("beta_fast").filter(|b| *b != 0.0).unwrap_or(32.0) as f32,
                beta_slow: optional("beta_slow").filter(|b| *b != 0.0).unwrap_or(1.0) as f32,
                attention_factor: attention_factor as f32,
                truncate: value
                    .get("truncate")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
            })
        }
        "longrope" => {
            let original = number("original_max_position_embeddings")? as usize;
            if original == 0 {
                return Err(ModelError::config(
                    path,
                    "rope scaling `original_max_position_embeddings` must be positive",
                ));
            }
            let factor = optional("factor").unwrap_or(max_positions as f64 / original as f64);
            let factors = |key: &str| -> Result<Vec<f32>> {
                value
                    .get(key)
                    .and_then(Value::as_array)
                    .and_then(|items| {
                        items
                            .iter()
                            .map(|f| f.as_f64().map(|f| f as f32))
                            .collect::<Option<Vec<f32>>>()
                    })
                    .ok_or_else(|| {
                        ModelError::config(
                            path,
                            format!("longrope scaling needs `{key}`, a list of numbers"),
                        )
                    })
            };
            RopeScaling::LongRope(LongRopeScaling {
                factor: factor as f32,
                original_max_positions: original,
                short_factors: factors("short_factor")?,
                long_factors: factors("long_factor")?,
                attention_factor: optional("attention_factor")
                    .unwrap_or_else(|| LongRopeScaling::default_attention_factor(factor, original))
                    as f32,
            })
        }
        "dynamic" => RopeScaling::Dynamic {
            factor: number("factor")? as f32,
        },
        other => {
            return Err(ModelError::config(
                path,
                format!(
                    "rope type `{other}` is not supported (kiln supports default, llama3, linear, \
                     yarn, longrope and dynamic)"
                ),
            ));
        }
    };
    let factor = scaling.factor();
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::config(
            path,
            format!("rope scaling `factor` must be positive, got {factor}"),
        ));
    }
    Ok(Some(scaling))
}

/// The rotary decoder's GGUF metadata under `prefix` (the family's `general.architecture`):
/// sizes, RoPE, epsilon and special tokens, as llama.cpp's `llm_load_hparams` reads them.
/// Biases and per-head norms are read off the tensors present; families that always have them
/// set them after ([`crate::family`]). Not yet validated.
///
/// # Errors
/// A required key missing or of the wrong type, partial rotary embeddings or a RoPE scaling
/// type kiln lacks, each naming the key.
pub fn gguf_config(
    file: &GgufFile,
    prefix: &str,
    architecture: Architecture,
) -> Result<TransformerConfig> {
    let path = file.path();
    let key = |k: &str| format!("{prefix}.{k}");
    let count = |k: &str| -> Result<usize> { Ok(file.unsigned(&key(k))? as usize) };
    let n_heads = count("attention.head_count")?;
    if n_heads == 0 {
        return Err(ModelError::config(
            path,
            format!("{} is 0", key("attention.head_count")),
        ));
    }
    let d_model = count("embedding_length")?;
    let head_dim = match file.unsigned_opt(&key("attention.key_length"))? {
        Some(k) => k as usize,
        None => d_model / n_heads,
    };
    if let Some(rot) = file.unsigned_opt(&key("rope.dimension_count"))?
        && rot as usize != head_dim
    {
        return Err(ModelError::config(
            path,
            format!(
                "{} is {rot} but heads have {head_dim} dimensions; partial rotary embeddings \
                 are not supported",
                key("rope.dimension_count")
            ),
        ));
    }
    let max_positions = count("context_length")?;
    let scaling = match gguf_long_rope(file, prefix, max_positions)? {
        Some(long_rope) => Some(long_rope),
        None => gguf_rope_scaling(file, prefix)?,
    };
    let vocab = match file.unsigned_opt(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => file.array("tokenizer.ggml.tokens")?.len(),
    };
    let theta = file.float_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
    let rope = RopeConfig {
        theta,
        scaling,
        frequency_divisors: file
            .contains("rope_freqs.weight")
            .then(|| frequency_divisors(file, head_dim))
            .transpose()?,
    };
    let (bos, eos, _) = crate::tokenizer::gguf::special_ids(file)?;
    let n_layers = count("block_count")?;
    crate::config::check_layer_count(n_layers).map_err(|e| ModelError::config(path, e))?;
    Ok(TransformerConfig {
        architecture,
        vocab,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads: file
            .unsigned_opt(&key("attention.head_count_kv"))?
            .map_or(n_heads, |n| n as usize),
        head_dim,
        d_ff: count("feed_forward_length")?,
        max_positions,
        norm: NormKind::RmsNorm,
        norm_eps: file
            .float_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        positions: PositionKind::Rope(rope),
        mlp: MlpKind::SwiGlu,
        qkv_bias: file.contains("blk.0.attn_q.bias"),
        out_bias: file.contains("blk.0.attn_output.bias"),
        qk_norm: file.contains("blk.0.attn_q_norm.weight"),
        mlp_bias: false,
        sandwich_norms: false,
        norm_unit_offset: false,
        embed_scale: None,
        attention_scoring: Scoring::default(),
        final_softcap: None,
        local_rope: None,
        tied_head: !file.contains("output.weight"),
        bos: bos.map(TokenId),
        eos: eos.into_iter().map(TokenId).collect(),
        // llama.cpp's converter drops attention windows (Mistral's, Qwen2's).
        attention_windows: Vec::new(),
    })
}

/// `{prefix}.rope.scaling.type`: `none` (or absent), `linear` with
/// `{prefix}.rope.scaling.factor` (Gemma 3's global RoPE), or `yarn` as llama.cpp runs it
/// (below). Llama 3.1's scaling is `rope_freqs.weight` instead.
pub(crate) fn gguf_rope_scaling(file: &GgufFile, prefix: &str) -> Result<Option<RopeScaling>> {
    let key = format!("{prefix}.rope.scaling.type");
    let factor_key = format!("{prefix}.rope.scaling.factor");
    let positive = |key: &str, value: f64| {
        if value.is_finite() && value > 0.0 {
            Ok(value)
        } else {
            Err(ModelError::config(
                file.path(),
                format!("{key} must be a positive number, got {value}"),
            ))
        }
    };
    match file.get(&key).and_then(|v| v.as_str()) {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let factor = positive(&factor_key, file.float_opt(&factor_key)?.unwrap_or(1.0))?;
            Ok(Some(RopeScaling::Linear {
                factor: factor as f32,
            }))
        }
        Some("yarn") => gguf_yarn(file, prefix, &factor_key, positive).map(Some),
        Some(kind) => Err(ModelError::config(
            file.path(),
            format!(
                "{key} `{kind}` is not supported in GGUF files (kiln reads llama3 scaling as \
                 rope_freqs.weight, linear and yarn)"
            ),
        )),
    }
}

/// YaRN as llama.cpp reads it from a converted file: `rope.scaling.factor` (1 when absent or
/// 0, as llama.cpp), `rope.scaling.original_context_length` (default: `context_length`),
/// `beta_fast` 32 and `beta_slow` 1 (llama.cpp reads no file keys for them), ramp ends rounded
/// to whole dimensions, and cos and sin multiplied by `rope.scaling.attn_factor` (default 1)
/// times `0.1 ln(factor) + 1` for a factor above 1 (over `0.1 m ln(factor) + 1` with
/// `m = rope.scaling.yarn_log_multiplier` when that is set): llama.cpp's context cancels
/// ggml's own `1 + 0.1 ln(factor)` and applies this instead. Without an explicit
/// `attention_factor` this equals transformers' YaRN for the same `rope_parameters`.
fn gguf_yarn(
    file: &GgufFile,
    prefix: &str,
    factor_key: &str,
    positive: impl Fn(&str, f64) -> Result<f64>,
) -> Result<RopeScaling> {
    let factor = match file.float_opt(factor_key)? {
        None => 1.0,
        Some(0.0) => 1.0,
        Some(f) => positive(factor_key, f)?,
    };
    let original_key = format!("{prefix}.rope.scaling.original_context_length");
    let original = match file.unsigned_opt(&original_key)? {
        Some(n) => n,
        None => file
            .unsigned_opt(&format!("{prefix}.context_length"))?
            .ok_or_else(|| {
                ModelError::config(
                    file.path(),
                    format!("YaRN needs {original_key} or {prefix}.context_length"),
                )
            })?,
    };
    if original == 0 || original > u64::from(u32::MAX) {
        return Err(ModelError::config(
            file.path(),
            format!("{original_key} must be between 1 and 2^32 - 1, got {original}"),
        ));
    }
    let attn_key = format!("{prefix}.rope.scaling.attn_factor");
    let attn = positive(&attn_key, file.float_opt(&attn_key)?.unwrap_or(1.0))?;
    let log_key = format!("{prefix}.rope.scaling.yarn_log_multiplier");
    let log_multiplier = file.float_opt(&log_key)?.unwrap_or(0.0);
    if !log_multiplier.is_finite() {
        return Err(ModelError::config(
            file.path(),
            format!("{log_key} must be a finite number, got {log_multiplier}"),
        ));
    }
    let mscale = |m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    };
    let attention_factor = if log_multiplier == 0.0 {
        attn * mscale(1.0)
    } else {
        attn * mscale(1.0) / mscale(log_multiplier)
    };
    Ok(RopeScaling::Yarn(YarnScaling {
        factor: factor as f32,
        original_max_positions: original as usize,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: attention_factor as f32,
        truncate: true,
    }))
}

/// LongRoPE as llama.cpp's converter writes it (Phi-3): the factors as the tensors
/// `rope_factors_short.weight` and `rope_factors_long.weight`, the original context as
/// `{prefix}.rope.scaling.original_context_length` and the factor on cos and sin as
/// `{prefix}.rope.scaling.attn_factor`; `None` without the tensors. Their lengths are checked
/// with the rest of the configuration ([`TransformerConfig::validate`]).
///
/// # Errors
/// The original context missing or 0, a factor tensor without the other.
fn gguf_long_rope(
    file: &GgufFile,
    prefix: &str,
    max_positions: usize,
) -> Result<Option<RopeScaling>> {
    let (short, long) = ("rope_factors_short.weight", "rope_factors_long.weight");
    match (file.contains(short), file.contains(long)) {
        (false, false) => return Ok(None),
        (true, true) => {}
        _ => {
            return Err(ModelError::corrupt(
                file.path(),
                format!("{short} and {long} come in pairs; the file has one of them"),
            ));
        }
    }
    let original_key = format!("{prefix}.rope.scaling.original_context_length");
    let original = file.unsigned(&original_key)? as usize;
    if original == 0 {
        return Err(ModelError::config(
            file.path(),
            format!("{original_key} is 0"),
        ));
    }
    let factor = max_positions as f64 / original as f64;
    let attention_factor = file
        .float_opt(&format!("{prefix}.rope.scaling.attn_factor"))?
        .unwrap_or_else(|| LongRopeScaling::default_attention_factor(factor, original));
    Ok(Some(RopeScaling::LongRope(LongRopeScaling {
        factor: factor as f32,
        original_max_positions: original,
        short_factors: file.read(short)?.data,
        long_factors: file.read(long)?.data,
        attention_factor: attention_factor as f32,
    })))
}

/// The per-frequency divisors of `rope_freqs.weight`.
fn frequency_divisors(file: &GgufFile, head_dim: usize) -> Result<Vec<f32>> {
    let stored = file.read("rope_freqs.weight")?;
    if stored.data.len() != head_dim / 2 {
        return Err(ModelError::ShapeMismatch {
            file: file.describe(),
            tensor: "rope_freqs.weight".into(),
            expected: vec![head_dim / 2],
            got: stored.shape,
        });
    }
    if let Some(bad) = stored.data.iter().find(|d| !(d.is_finite() && **d > 0.0)) {
        return Err(ModelError::corrupt(
            file.path(),
            format!("rope_freqs.weight holds {bad}; divisors must be positive"),
        ));
    }
    Ok(stored.data)
}

/// Tensor names of one checkpoint flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorNames {
    /// transformers' `model.layers.N.self_attn.q_proj.weight`...
    HuggingFace,
    /// Meta's `layers.N.attention.wq.weight`... (Q/K rows interleaved)
    Meta,
    /// llama.cpp's `blk.N.attn_q.weight`...
    Gguf,
}

impl TensorNames {
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

    /// The untied output head.
    pub fn head(self) -> &'static str {
        match self {
            Self::HuggingFace => "lm_head.weight",
            Self::Meta | Self::Gguf => "output.weight",
        }
    }

    /// `(part)` → tensor name prefix (without `.weight` / `.bias`) in layer `i`.
    fn layer(self, i: usize, part: Part) -> String {
        use Part::*;
        match self {
            Self::HuggingFace => {
                let p = match part {
                    Qkv => "self_attn.qkv_proj",
                    Q => "self_attn.q_proj",
                    K => "self_attn.k_proj",
                    V => "self_attn.v_proj",
                    O => "self_attn.o_proj",
                    QNorm => "self_attn.q_norm",
                    KNorm => "self_attn.k_norm",
                    GateUp => "mlp.gate_up_proj",
                    Gate => "mlp.gate_proj",
                    Up => "mlp.up_proj",
                    Down => "mlp.down_proj",
                    AttnNorm => "input_layernorm",
                    MlpNorm | PostAttnNorm => "post_attention_layernorm",
                    PreMlpNorm => "pre_feedforward_layernorm",
                    PostMlpNorm => "post_feedforward_layernorm",
                };
                format!("model.layers.{i}.{p}")
            }
            Self::Meta => {
                let p = match part {
                    Qkv => "attention.wqkv",
                    Q => "attention.wq",
                    K => "attention.wk",
                    V => "attention.wv",
                    O => "attention.wo",
                    QNorm => "attention.q_norm",
                    KNorm => "attention.k_norm",
                    GateUp => "feed_forward.w13",
                    Gate => "feed_forward.w1",
                    Up => "feed_forward.w3",
                    Down => "feed_forward.w2",
                    AttnNorm => "attention_norm",
                    MlpNorm | PreMlpNorm => "ffn_norm",
                    PostAttnNorm => "post_attention_norm",
                    PostMlpNorm => "post_ffn_norm",
                };
                format!("layers.{i}.{p}")
            }
            Self::Gguf => {
                let p = match part {
                    Qkv => "attn_qkv",
                    Q => "attn_q",
                    K => "attn_k",
                    V => "attn_v",
                    O => "attn_output",
                    QNorm => "attn_q_norm",
                    KNorm => "attn_k_norm",
                    Gate => "ffn_gate",
                    // llama.cpp names the fused gate and up projection (Phi-3's) `ffn_up`
                    // too, with no `ffn_gate` beside it.
                    Up | GateUp => "ffn_up",
                    Down => "ffn_down",
                    AttnNorm => "attn_norm",
                    MlpNorm | PreMlpNorm => "ffn_norm",
                    PostAttnNorm => "post_attention_norm",
                    PostMlpNorm => "post_ffw_norm",
                };
                format!("blk.{i}.{p}")
            }
        }
    }
}

/// One tensor of a block.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// Q, K and V in one matrix, in that order (Phi-3's `qkv_proj`).
    Qkv,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    /// The gate's rows, then up's (Phi-3's `gate_up_proj`).
    GateUp,
    Gate,
    Up,
    Down,
    AttnNorm,
    /// The norm before the MLP of a block without sandwich norms (HF names it after
    /// attention).
    MlpNorm,
    /// With sandwich norms: on the attention output, before the MLP, on the MLP output.
    PostAttnNorm,
    PreMlpNorm,
    PostMlpNorm,
}

/// Loads a rotary decoder's weights named as `names`. With `qk_rows_interleaved`, the Q and K
/// projections' rows are in Meta's interleaved RoPE order and are permuted to rotate-half.
///
/// # Errors
/// A missing tensor or one whose shape disagrees with `config`, naming file and tensor.
#[allow(clippy::too_many_arguments)] // the loader's inputs, each different
pub fn load<B: InferenceBackend>(
    config: TransformerConfig,
    names: TensorNames,
    qk_rows_interleaved: bool,
    source: &dyn TensorSource,
    dtype: Dtype,
    storage: WeightStorage,
    activations: Activations,
    device: &B::Device,
) -> Result<Transformer<B>> {
    use Part::*;
    let w = WeightLoader::<B> {
        source,
        dtype,
        device,
        storage,
        activations,
    };
    let (d, ff, hd) = (config.d_model, config.d_ff, config.head_dim);
    let (q_out, kv_out) = (config.n_heads * hd, config.n_kv_heads * hd);
    let permute = |heads: usize| qk_rows_interleaved.then_some(heads);
    let linear = |i: usize, part: Part, d_in: usize, d_out: usize, bias: bool, heads| {
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
    // Projections of one input as one quantized layer repacked once from the file where it
    // can stack them (`WeightLoader::stacked_out_in`).
    let stacked = |i: usize, parts: &[(Part, usize, Option<usize>)], bias: bool| {
        let bases: Vec<String> = parts
            .iter()
            .map(|&(part, ..)| names.layer(i, part))
            .collect();
        let (weights, biases): (Vec<String>, Vec<String>) = bases
            .iter()
            .map(|base| (format!("{base}.weight"), format!("{base}.bias")))
            .unzip();
        let parts: Vec<LinearPart<'_>> = parts
            .iter()
            .enumerate()
            .map(|(k, &(_, d_out, interleaved_heads))| LinearPart {
                weight: &weights[k],
                bias: bias.then_some(biases[k].as_str()),
                d_out,
                interleaved_heads,
            })
            .collect();
        w.stacked_out_in(&parts, d)
    };
    let norm = |name: &str, len: usize| -> Result<Norm<B>> {
        let mut gamma = w.host(name, &[len])?;
        if config.norm_unit_offset {
            // In f32, as transformers' `GemmaRMSNorm` takes `1 + w.float()`.
            gamma.data.iter_mut().for_each(|g| *g += 1.0);
        }
        Ok(Norm {
            kind: NormKind::RmsNorm,
            gamma: gamma.upload(dtype, device),
            beta: None,
            eps: config.norm_eps,
        })
    };
    let layer_norm =
        |i: usize, part: Part, len: usize| norm(&format!("{}.weight", names.layer(i, part)), len);
    let (qkv_b, out_b, mlp_b) = (config.qkv_bias, config.out_bias, config.mlp_bias);
    let mut blocks = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let head_norms = if config.qk_norm {
            Some(HeadNorms {
                q: layer_norm(i, QNorm, hd)?,
                k: layer_norm(i, KNorm, hd)?,
            })
        } else {
            None
        };
        let sandwich = |part: Part| {
            config
                .sandwich_norms
                .then(|| layer_norm(i, part, d))
                .transpose()
        };
        let activation = match config.mlp {
            MlpKind::GeGlu => GateActivation::GeluTanh,
            _ => GateActivation::Silu,
        };
        let stored = |part: Part| source.contains(&format!("{}.weight", names.layer(i, part)));
        let qkv = if stored(Qkv) {
            if qk_rows_interleaved {
                return Err(ModelError::config(
                    source.describe(),
                    "a fused QKV projection with interleaved RoPE rows is not supported",
                ));
            }
            QkvProjection::Fused(linear(i, Qkv, d, q_out + 2 * kv_out, qkv_b, None)?)
        } else if let Some(qkv) = stacked(
            i,
            &[
                (Q, q_out, permute(config.n_heads)),
                (K, kv_out, permute(config.n_kv_heads)),
                (V, kv_out, None),
            ],
            qkv_b,
        )? {
            QkvProjection::Fused(qkv)
        } else {
            QkvProjection::fuse_or_split(
                linear(i, Q, d, q_out, qkv_b, permute(config.n_heads))?,
                linear(i, K, d, kv_out, qkv_b, permute(config.n_kv_heads))?,
                linear(i, V, d, kv_out, qkv_b, None)?,
            )
        };
        let mlp = if stored(GateUp) && !stored(Gate) {
            Mlp::GatedFused {
                activation,
                gate_up: linear(i, GateUp, d, 2 * ff, mlp_b, None)?,
                down: linear(i, Down, ff, d, mlp_b, None)?,
            }
        } else if let Some(gate_up) = stacked(i, &[(Gate, ff, None), (Up, ff, None)], mlp_b)? {
            Mlp::GatedFused {
                activation,
                gate_up,
                down: linear(i, Down, ff, d, mlp_b, None)?,
            }
        } else {
            Mlp::gated(
                activation,
                linear(i, Gate, d, ff, mlp_b, None)?,
                linear(i, Up, d, ff, mlp_b, None)?,
                linear(i, Down, ff, d, mlp_b, None)?,
            )
        };
        blocks.push(Block {
            attn_norm: layer_norm(i, AttnNorm, d)?,
            attn: Attention {
                qkv,
                out: linear(i, O, q_out, d, out_b, None)?,
                head_norms,
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: hd,
            },
            post_attn_norm: sandwich(PostAttnNorm)?,
            mlp_norm: if config.sandwich_norms {
                layer_norm(i, PreMlpNorm, d)?
            } else {
                layer_norm(i, MlpNorm, d)?
            },
            mlp,
            post_mlp_norm: sandwich(PostMlpNorm)?,
        });
    }
    let embed = w.embedding(names.embed(), config.vocab, d)?;
    let final_norm = norm(names.final_norm(), d)?;
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
