//! Qwen3 (dense): Llama's block with an RMSNorm over each query and key head (one `[head_dim]`
//! weight each, shared by the heads) between the projection and RoPE, a `head_dim` of its own
//! (128 by default, not hidden / heads), and biases on all four projections only when
//! `attention_bias` says so.

use std::path::Path;

use serde_json::Value;

use super::{Blocks, Family, GgufFamily, validated};
use crate::config::{Architecture, TransformerConfig};
use crate::decoder::{self, HfConfig, HfDefaults};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Qwen3.
pub static FAMILY: Family = Family {
    architecture: Architecture::Qwen3,
    name: "qwen3",
    models: "Qwen3",
    hf_model_types: &["qwen3"],
    hf_config,
    gguf: Some(GgufFamily {
        architecture: "qwen3",
        config: gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Decoder,
};

/// `Qwen3Config`'s defaults (transformers 5): Qwen2's, with `head_dim` 128.
const DEFAULTS: HfDefaults = HfDefaults {
    head_dim: Some(128),
    ..super::qwen2::DEFAULTS
};

fn hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let keys = HfConfig::read(value, path, DEFAULTS)?;
    let mut config = keys.decoder_config(path, Architecture::Qwen3)?;
    config.qk_norm = true;
    config.attention_windows =
        keys.qwen_windows(path, config.n_layers, super::qwen2::MAX_WINDOW_LAYERS)?;
    validated(config, path)
}

fn gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    let mut config = decoder::gguf_config(file, "qwen3", Architecture::Qwen3)?;
    config.qk_norm = true;
    validated(config, file.path())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `transformers.Qwen3Config()`'s reading of the same keys (5.24).
    #[test]
    fn missing_keys_take_transformers_defaults() {
        let parse = |json: &str| hf_config(serde_json::from_str(json).unwrap(), Path::new("c"));
        let c = parse(r#"{"hidden_size": 1024, "num_attention_heads": 16}"#).unwrap();
        assert_eq!((c.head_dim, c.n_kv_heads, c.vocab), (128, 16, 151_936));
        assert!(c.qk_norm && !c.qkv_bias && !c.out_bias);
        let c = parse(r#"{"attention_bias": true}"#).unwrap();
        assert!(c.qkv_bias && c.out_bias);
    }

    /// Qwen3's documented long-context setting (`rope_scaling` yarn, factor 4 over 32,768
    /// positions, transformers-4 keys) and transformers-5's `rope_parameters` read alike; the
    /// attention factor is transformers' `get_mscale(4)`; a rope type kiln lacks is named.
    #[test]
    fn yarn_scaling_is_read_from_either_key_generation() {
        use crate::config::{PositionKind, RopeScaling};
        let parse = |json: &str| hf_config(serde_json::from_str(json).unwrap(), Path::new("c"));
        let old = parse(
            r#"{"rope_theta": 1000000.0, "max_position_embeddings": 131072,
                "rope_scaling": {"type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 32768}}"#,
        )
        .unwrap();
        let new = parse(
            r#"{"max_position_embeddings": 131072,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0,
                                    "factor": 4.0, "original_max_position_embeddings": 32768}}"#,
        )
        .unwrap();
        assert_eq!(old, new);
        let PositionKind::Rope(rope) = &new.positions else {
            panic!("rotary")
        };
        let Some(RopeScaling::Yarn(yarn)) = rope.scaling else {
            panic!("yarn")
        };
        assert_eq!((yarn.factor, yarn.original_max_positions), (4.0, 32768));
        assert!((yarn.attention_factor - 1.138_629_4).abs() < 1e-6);
        let err = parse(r#"{"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`mrope`"), "{err}");
    }
}
