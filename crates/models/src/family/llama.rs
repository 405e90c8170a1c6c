//! Llama 3 / 3.1 / 3.2 and Mistral: Hugging Face `config.json` (both the transformers-4 keys
//! found on the hub and transformers-5's `rope_parameters`), Meta's `params.json` (Llama only)
//! and GGUF's `llama.*` metadata (llama.cpp converts Mistral to `llama` too). Both are the
//! shared rotary decoder ([`crate::decoder`]) as it is; Mistral adds a sliding window on every
//! layer.

use std::path::Path;

use kiln_core::attention::Scoring;
use serde::Deserialize;
use serde_json::Value;

use super::{Blocks, Family, GgufFamily, validated};
use crate::config::{
    Architecture, Llama3Scaling, MlpKind, NormKind, PositionKind, RopeConfig, RopeScaling,
    TransformerConfig,
};
use crate::decoder::{self, HfConfig, HfDefaults};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Llama 2, 3, 3.1, 3.2 (and what llama.cpp converts as `llama`: TinyLlama, Mistral).
pub static LLAMA: Family = Family {
    architecture: Architecture::Llama,
    name: "llama",
    models: "Llama 2 and 3, TinyLlama, Mistral GGUFs",
    hf_model_types: &["llama"],
    hf_config: llama_hf_config,
    gguf: Some(GgufFamily {
        architecture: "llama",
        config: llama_gguf_config,
        qk_rows_interleaved: true,
    }),
    blocks: Blocks::Decoder,
};

/// Mistral (from a Hugging Face folder; its GGUF files say `llama`).
pub static MISTRAL: Family = Family {
    architecture: Architecture::Mistral,
    name: "mistral",
    models: "Mistral",
    hf_model_types: &["mistral"],
    hf_config: mistral_hf_config,
    gguf: None,
    blocks: Blocks::Decoder,
};

/// `LlamaConfig`'s defaults (transformers 5).
const LLAMA_DEFAULTS: HfDefaults = HfDefaults {
    vocab_size: 32000,
    hidden_size: 4096,
    intermediate_size: 11008,
    num_hidden_layers: 32,
    num_attention_heads: 32,
    num_key_value_heads: None,
    head_dim: None,
    max_position_embeddings: 2048,
    bos_token_id: Some(1),
    eos_token_id: Some(2),
    sliding_window: None,
    tie_word_embeddings: false,
    hidden_act: "silu",
    rms_norm_eps: 1e-6,
};

/// `MistralConfig`'s defaults (transformers 5): a 4,096-token window unless the file says
/// `"sliding_window": null`.
const MISTRAL_DEFAULTS: HfDefaults = HfDefaults {
    intermediate_size: 14336,
    num_key_value_heads: Some(8),
    max_position_embeddings: 131_072,
    sliding_window: Some(4096),
    ..LLAMA_DEFAULTS
};

fn llama_hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let config = HfConfig::read(value, path, LLAMA_DEFAULTS)?;
    validated(config.decoder_config(path, Architecture::Llama)?, path)
}

fn mistral_hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let config = HfConfig::read(value, path, MISTRAL_DEFAULTS)?;
    validated(config.decoder_config(path, Architecture::Mistral)?, path)
}

fn llama_gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    validated(
        decoder::gguf_config(file, "llama", Architecture::Llama)?,
        file.path(),
    )
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

fn default_eps() -> f64 {
    1e-6
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
                scaling: scaling.map(RopeScaling::Llama3),
                frequency_divisors: None,
            }),
            mlp: MlpKind::SwiGlu,
            qkv_bias: false,
            out_bias: false,
            qk_norm: false,
            mlp_bias: false,
            sandwich_norms: false,
            norm_unit_offset: false,
            embed_scale: None,
            attention_scoring: Scoring::default(),
            final_softcap: None,
            local_rope: None,
            tied_head: false,
            bos: None,
            eos: Vec::new(),
            attention_windows: Vec::new(),
        };
        config.validate().map_err(|e| ModelError::config(path, e))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use kiln_core::TokenId;

    fn config(json: &str) -> Result<TransformerConfig> {
        llama_hf_config(
            serde_json::from_str(json).expect("valid JSON"),
            Path::new("config.json"),
        )
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
        assert_eq!((rope.theta, rope.scaling.clone()), (10000.0, None));
        let c = config(r#"{"bos_token_id": null, "eos_token_id": null}"#).expect("loads");
        assert_eq!((c.bos, c.eos.len()), (None, 0));
    }

    /// Mistral's window is on unless the file says `"sliding_window": null`
    /// (`transformers.MistralConfig()` has 4096).
    #[test]
    fn mistral_slides_by_default() {
        let path = Path::new("config.json");
        let parse = |json: &str| mistral_hf_config(serde_json::from_str(json).unwrap(), path);
        let c = parse("{}").expect("Mistral-7B's shape");
        assert_eq!((c.n_kv_heads, c.d_ff, c.max_positions), (8, 14336, 131_072));
        assert_eq!(c.attention_windows, vec![Some(4096); 32]);
        assert_eq!(c.widest_window(), Some(4096), "the paged cache may forget");
        let c = parse(r#"{"sliding_window": null}"#).expect("loads");
        assert!(c.attention_windows.is_empty());
        assert_eq!(c.widest_window(), None);
        assert_eq!(c.architecture.name(), "mistral");
    }
}
