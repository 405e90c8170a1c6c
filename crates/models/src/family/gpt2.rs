//! GPT-2 (every size, from one configuration) and GPT-BigCode (SantaCoder, StarCoder): Hugging
//! Face `config.json` and weight names.
//!
//! GPT-2's HF checkpoints store `c_attn`, `c_proj` and `c_fc` as `Conv1D`, i.e. `[d_in,
//! d_out]`: loaded as they are, never transposed. Checkpoints may name tensors with or without
//! the `transformer.` prefix, and old ones carry `attn.bias` / `attn.masked_bias` causal-mask
//! buffers, which are ignored. The output head is the token embedding.
//!
//! GPT-BigCode is GPT-2's block with multi-query attention: one key/value head, its fused
//! `c_attn` giving all query heads, then the one key head, then the one value head; its layers
//! are `nn.Linear` (`[d_out, d_in]`). Its multi-head form (`multi_query` false) interleaves
//! each head's Q, K and V in `c_attn` and is refused by name (every released GPT-BigCode model
//! is multi-query).

use std::path::Path;

use kiln_core::attention::Scoring;
use kiln_core::{Dtype, InferenceBackend, TokenId};
use serde::Deserialize;

use serde_json::Value;

use super::{Blocks, Family, GgufFamily};
use crate::config::{Architecture, MlpKind, NormKind, PositionKind, TransformerConfig};
use crate::decoder::TensorNames;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::layers::attention::{Attention, QkvProjection};
use crate::layers::mlp::Mlp;
use crate::layers::norm::Norm;
use crate::transformer::{Activations, Block, Transformer, WeightLoader, WeightStorage};
use crate::weights::TensorSource;

/// GPT-2, every size.
pub static FAMILY: Family = Family {
    architecture: Architecture::Gpt2,
    name: "gpt2",
    models: "GPT-2",
    hf_model_types: &["gpt2"],
    hf_config,
    gguf: Some(GgufFamily {
        architecture: "gpt2",
        config: gpt2_gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Gpt2,
};

/// GPT-BigCode.
pub static BIGCODE: Family = Family {
    architecture: Architecture::GptBigCode,
    name: "gpt_bigcode",
    models: "GPT-BigCode: SantaCoder, StarCoder",
    hf_model_types: &["gpt_bigcode"],
    hf_config: bigcode_hf_config,
    gguf: Some(GgufFamily {
        architecture: "starcoder",
        config: starcoder_gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::GptBigCode,
};

fn hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    serde_json::from_value::<Gpt2HfConfig>(value)
        .map_err(|e| ModelError::config(path, e.to_string()))?
        .to_config(path, Architecture::Gpt2)
}

fn bigcode_hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    serde_json::from_value::<Gpt2HfConfig>(value)
        .map_err(|e| ModelError::config(path, e.to_string()))?
        .to_config(path, Architecture::GptBigCode)
}

/// The keys of a GPT-2 `config.json` kiln reads. A key the file leaves out takes
/// `GPT2Config`'s default, as transformers does (so does a missing `bos_token_id`, whose
/// default 50256 is dropped with a warning when the vocabulary is smaller).
#[derive(Debug, Deserialize)]
pub struct Gpt2HfConfig {
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::n_positions")]
    n_positions: usize,
    #[serde(default = "defaults::n_embd")]
    n_embd: usize,
    #[serde(default = "defaults::n_layer")]
    n_layer: usize,
    #[serde(default = "defaults::n_head")]
    n_head: usize,
    n_inner: Option<usize>,
    #[serde(default = "defaults::layer_norm_epsilon")]
    layer_norm_epsilon: f64,
    #[serde(default = "defaults::activation_function")]
    activation_function: String,
    /// transformers divides attention scores by sqrt(head_dim) only when this is true.
    #[serde(default = "defaults::yes")]
    scale_attn_weights: bool,
    /// transformers also divides them by the layer number when this is true.
    #[serde(default)]
    scale_attn_by_inverse_layer_idx: bool,
    #[serde(default = "defaults::special_token")]
    bos_token_id: Option<u32>,
    #[serde(default = "defaults::special_token")]
    eos_token_id: Option<u32>,
    /// GPT-BigCode: one key/value head (its default); absent from GPT-2's.
    multi_query: Option<bool>,
}

/// `GPT2Config`'s defaults (transformers 5).
mod defaults {
    pub fn vocab_size() -> usize {
        50257
    }
    pub fn n_positions() -> usize {
        1024
    }
    pub fn n_embd() -> usize {
        768
    }
    pub fn n_layer() -> usize {
        12
    }
    pub fn n_head() -> usize {
        12
    }
    pub fn layer_norm_epsilon() -> f64 {
        1e-5
    }
    pub fn activation_function() -> String {
        "gelu_new".into()
    }
    pub fn yes() -> bool {
        true
    }
    pub fn special_token() -> Option<u32> {
        Some(50256)
    }
}

impl Gpt2HfConfig {
    /// The validated configuration of `architecture` (GPT-2 or GPT-BigCode, whose
    /// `GPTBigCodeConfig` has GPT-2's keys and defaults but for `multi_query` and a
    /// `gelu_pytorch_tanh` activation, the same function).
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` for an unsupported activation or attention, or
    /// inconsistent sizes.
    pub fn to_config(&self, path: &Path, architecture: Architecture) -> Result<TransformerConfig> {
        if !matches!(
            self.activation_function.as_str(),
            "gelu_new" | "gelu_pytorch_tanh"
        ) {
            return Err(ModelError::config(
                path,
                format!(
                    "activation_function `{}` is not supported (GPT-2 uses gelu_new)",
                    self.activation_function
                ),
            ));
        }
        // Attention that transformers would compute differently is refused, never ignored.
        if self.scale_attn_by_inverse_layer_idx {
            return Err(ModelError::config(
                path,
                "scale_attn_by_inverse_layer_idx true is not supported (kiln scales a model's \
                 attention scores alike in every layer)",
            ));
        }
        let n_kv_heads = match (architecture, self.multi_query) {
            (Architecture::GptBigCode, None | Some(true)) => 1,
            (Architecture::GptBigCode, Some(false)) => {
                return Err(ModelError::config(
                    path,
                    "multi_query false is not supported (GPT-BigCode's multi-head layout \
                     interleaves each head's Q, K and V; released models are multi-query)",
                ));
            }
            (_, Some(true)) => {
                return Err(ModelError::config(
                    path,
                    "multi_query is GPT-BigCode's; a gpt2 model has none",
                ));
            }
            (_, _) => self.n_head,
        };
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(ModelError::config(
                path,
                format!(
                    "n_embd ({}) must be a multiple of n_head ({})",
                    self.n_embd, self.n_head
                ),
            ));
        }
        let config = TransformerConfig {
            architecture,
            vocab: self.vocab_size,
            d_model: self.n_embd,
            n_layers: self.n_layer,
            n_heads: self.n_head,
            n_kv_heads,
            head_dim: self.n_embd / self.n_head,
            d_ff: self.n_inner.unwrap_or(4 * self.n_embd),
            max_positions: self.n_positions,
            norm: NormKind::LayerNorm,
            norm_eps: self.layer_norm_epsilon,
            positions: PositionKind::Learned,
            mlp: MlpKind::GeluTanh,
            qkv_bias: true,
            out_bias: true,
            qk_norm: false,
            mlp_bias: true,
            sandwich_norms: false,
            norm_unit_offset: false,
            embed_scale: None,
            // transformers: `scaling = head_dim**-0.5 if scale_attn_weights else 1.0`.
            attention_scoring: Scoring {
                scale: (!self.scale_attn_weights).then_some(1.0),
                softcap: None,
            },
            final_softcap: None,
            local_rope: None,
            tied_head: true,
            bos: self.bos_token_id.map(TokenId),
            eos: self.eos_token_id.map(TokenId).into_iter().collect(),
            attention_windows: Vec::new(),
        };
        config.validate().map_err(|e| ModelError::config(path, e))?;
        Ok(config)
    }
}

/// How a GPT-2-block checkpoint stores its linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearLayout {
    /// GPT-2's `Conv1D`: `[d_in, d_out]`.
    Conv1d,
    /// GPT-BigCode's `nn.Linear`: `[d_out, d_in]`.
    Linear,
}

/// Loads GPT-2-block weights named as `names` (HF's, or llama.cpp's: `attn_qkv`, `ffn_up`,
/// `position_embd`, ... with every linear layer `[d_out, d_in]`), the HF linear layers stored
/// as `layout` says; the fused `c_attn` gives `n_heads` query heads then `n_kv_heads` key and
/// value heads. A GGUF's `output.weight`, where there is one, is the head; else the token
/// embedding is. `storage` applies to a GGUF's linear layers and token embedding (with it the
/// tied head), as for the rotary decoder; the position embedding is always dense.
///
/// # Errors
/// A missing tensor or one whose shape disagrees with `config`, naming file and tensor; Meta
/// naming (GPT-2 has no Meta checkpoints).
#[allow(clippy::too_many_arguments)] // the loader's inputs, each different
pub fn load<B: InferenceBackend>(
    config: TransformerConfig,
    names: TensorNames,
    layout: LinearLayout,
    source: &dyn TensorSource,
    dtype: Dtype,
    storage: WeightStorage,
    activations: Activations,
    device: &B::Device,
) -> Result<Transformer<B>> {
    let prefix = if source.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let layout = match names {
        TensorNames::HuggingFace => layout,
        TensorNames::Gguf => LinearLayout::Linear,
        TensorNames::Meta => {
            return Err(ModelError::config(
                source.describe(),
                "GPT-2 and GPT-BigCode have no Meta checkpoints",
            ));
        }
    };
    let w = WeightLoader::<B> {
        source,
        dtype,
        device,
        storage,
        activations,
    };
    let (d, ff) = (config.d_model, config.d_ff);
    // HF's names (`h.3.attn.c_attn`) in this file's naming.
    let name = |s: &str| match names {
        TensorNames::Gguf => gguf_name(s),
        _ => format!("{prefix}{s}"),
    };
    let norm = |base: &str| -> Result<Norm<B>> {
        Ok(Norm {
            kind: NormKind::LayerNorm,
            gamma: w.vector(&name(&format!("{base}.weight")), d)?,
            beta: Some(w.vector(&name(&format!("{base}.bias")), d)?),
            eps: config.norm_eps,
        })
    };
    let linear = |base: &str, d_in: usize, d_out: usize| {
        let (weight, bias) = (
            name(&format!("{base}.weight")),
            name(&format!("{base}.bias")),
        );
        match layout {
            LinearLayout::Conv1d => w.linear_in_out(&weight, Some(&bias), d_in, d_out),
            LinearLayout::Linear => w.linear_out_in(&weight, Some(&bias), d_in, d_out, None),
        }
    };
    let qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim;
    let mut blocks = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let h = format!("h.{i}");
        blocks.push(Block {
            attn_norm: norm(&format!("{h}.ln_1"))?,
            attn: Attention {
                qkv: QkvProjection::Fused(linear(&format!("{h}.attn.c_attn"), d, qkv_out)?),
                out: linear(&format!("{h}.attn.c_proj"), d, d)?,
                n_heads: config.n_heads,
                head_norms: None,
                n_kv_heads: config.n_kv_heads,
                head_dim: config.head_dim,
            },
            post_attn_norm: None,
            mlp_norm: norm(&format!("{h}.ln_2"))?,
            mlp: Mlp::GeluTanh {
                up: linear(&format!("{h}.mlp.c_fc"), d, ff)?,
                down: linear(&format!("{h}.mlp.c_proj"), ff, d)?,
            },
            post_mlp_norm: None,
        });
    }
    let embed = w.embedding(&name("wte.weight"), config.vocab, d)?;
    let positions = w.matrix(&name("wpe.weight"), config.max_positions, d)?;
    let final_norm = norm("ln_f")?;
    let head = match names {
        TensorNames::Gguf if source.contains("output.weight") => {
            Some(w.linear_out_in("output.weight", None, d, config.vocab, None)?)
        }
        _ => None,
    };
    Ok(Transformer::from_parts(
        config,
        dtype,
        device.clone(),
        embed,
        Some(positions),
        blocks,
        final_norm,
        head,
    ))
}

/// llama.cpp's name for a GPT-2-block tensor HF calls `hf` (`h.3.attn.c_attn.weight` →
/// `blk.3.attn_qkv.weight`).
fn gguf_name(hf: &str) -> String {
    let (stem, kind) = hf.rsplit_once('.').unwrap_or((hf, ""));
    let renamed = match stem {
        "wte" => "token_embd".to_string(),
        "wpe" => "position_embd".to_string(),
        "ln_f" => "output_norm".to_string(),
        _ => {
            let rest = stem.strip_prefix("h.").unwrap_or(stem);
            let (layer, part) = rest.split_once('.').unwrap_or((rest, ""));
            let part = match part {
                "ln_1" => "attn_norm",
                "attn.c_attn" => "attn_qkv",
                "attn.c_proj" => "attn_output",
                "ln_2" => "ffn_norm",
                "mlp.c_fc" => "ffn_up",
                "mlp.c_proj" => "ffn_down",
                other => other,
            };
            format!("blk.{layer}.{part}")
        }
    };
    format!("{renamed}.{kind}")
}

/// GPT-2's (`gpt2`) and StarCoder's (`starcoder`: GPT-BigCode) GGUF metadata, as llama.cpp's
/// loaders read it. llama.cpp scales attention scores by `head_dim^-0.5` whatever the HF
/// config's `scale_attn_weights` said (the key is not in the file).
///
/// # Errors
/// A required key missing, a StarCoder file with more than one key/value head, inconsistent
/// sizes.
fn gguf_config(
    file: &GgufFile,
    prefix: &str,
    architecture: Architecture,
) -> Result<TransformerConfig> {
    let path = file.path();
    let count =
        |k: &str| -> Result<usize> { Ok(file.unsigned(&format!("{prefix}.{k}"))? as usize) };
    let n_heads = count("attention.head_count")?;
    let d_model = count("embedding_length")?;
    let n_kv_heads = file
        .unsigned_opt(&format!("{prefix}.attention.head_count_kv"))?
        .map_or(n_heads, |n| n as usize);
    if architecture == Architecture::GptBigCode && n_kv_heads != 1 {
        return Err(ModelError::config(
            path,
            format!(
                "{prefix}.attention.head_count_kv is {n_kv_heads}: only multi-query GPT-BigCode \
                 (one key/value head) is supported"
            ),
        ));
    }
    let (bos, eos, _) = crate::tokenizer::gguf::special_ids(file)?;
    // The model the HF config with these values describes (its checks included).
    let mut config = Gpt2HfConfig {
        vocab_size: file.array("tokenizer.ggml.tokens")?.len(),
        n_positions: count("context_length")?,
        n_embd: d_model,
        n_layer: count("block_count")?,
        n_head: n_heads,
        n_inner: Some(count("feed_forward_length")?),
        layer_norm_epsilon: file
            .float_opt(&format!("{prefix}.attention.layer_norm_epsilon"))?
            .unwrap_or(1e-5),
        activation_function: defaults::activation_function(),
        scale_attn_weights: true,
        scale_attn_by_inverse_layer_idx: false,
        bos_token_id: bos,
        eos_token_id: None,
        multi_query: (architecture == Architecture::GptBigCode).then_some(true),
    }
    .to_config(path, architecture)?;
    config.eos = eos.into_iter().map(TokenId).collect();
    config.tied_head = !file.contains("output.weight");
    Ok(config)
}

fn gpt2_gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    gguf_config(file, "gpt2", Architecture::Gpt2)
}

fn starcoder_gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    gguf_config(file, "starcoder", Architecture::GptBigCode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Result<TransformerConfig> {
        let parsed: Gpt2HfConfig = serde_json::from_str(json).expect("valid JSON");
        parsed.to_config(Path::new("config.json"), Architecture::Gpt2)
    }

    /// A key left out takes `GPT2Config`'s default, as in transformers (read off
    /// `transformers.GPT2Config()`, 5.24).
    #[test]
    fn missing_keys_take_transformers_defaults() {
        let c = config(r#"{"model_type": "gpt2"}"#).expect("GPT-2 small's shape");
        assert_eq!(
            (c.vocab, c.max_positions, c.d_model, c.n_layers, c.n_heads),
            (50257, 1024, 768, 12, 12)
        );
        assert_eq!((c.d_ff, c.norm_eps), (3072, 1e-5));
        assert_eq!(
            (c.bos, c.eos.clone()),
            (Some(TokenId(50256)), vec![TokenId(50256)])
        );
        let c = config(r#"{"bos_token_id": null, "eos_token_id": null}"#).expect("loads");
        assert_eq!((c.bos, c.eos.len()), (None, 0));
    }

    /// Attention that transformers scales differently is read (unscaled scores) or refused by
    /// name (a scale per layer), not run wrongly.
    #[test]
    fn attention_scaling_is_read_or_refused() {
        let c = config(r#"{"scale_attn_weights": false}"#).unwrap();
        assert_eq!(c.attention_scoring.scale, Some(1.0));
        let err = config(r#"{"scale_attn_by_inverse_layer_idx": true}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("scale_attn_by_inverse_layer_idx"), "{err}");
        assert!(config(r#"{"reorder_and_upcast_attn": true}"#).is_ok());
    }

    /// `transformers.GPTBigCodeConfig()`: GPT-2's sizes with one key/value head; its
    /// multi-head form and a gpt2 config claiming multi-query are refused by name.
    #[test]
    fn gpt_bigcode_is_multi_query() {
        let parse =
            |json: &str| bigcode_hf_config(serde_json::from_str(json).unwrap(), Path::new("c"));
        let c = parse("{}").unwrap();
        assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (12, 1, 64));
        assert_eq!(c.architecture, Architecture::GptBigCode);
        let err = parse(r#"{"multi_query": false}"#).unwrap_err().to_string();
        assert!(err.contains("multi_query"), "{err}");
        let err = config(r#"{"multi_query": true}"#).unwrap_err().to_string();
        assert!(err.contains("multi_query"), "{err}");
    }
}
