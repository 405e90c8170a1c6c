//! Qwen2 and Qwen2.5: Llama's block with biases on the Q, K and V projections (not on the
//! output projection), an optional sliding window on the upper layers, and Qwen's defaults.
//! llama.cpp keeps Q/K rows in the rotate-half order (its NEOX RoPE type).

use std::path::Path;

use serde_json::Value;

use super::{Blocks, Family, GgufFamily, validated};
use crate::config::{Architecture, TransformerConfig};
use crate::decoder::{self, HfConfig, HfDefaults};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Qwen2 / Qwen2.5.
pub static FAMILY: Family = Family {
    architecture: Architecture::Qwen2,
    name: "qwen2",
    models: "Qwen2 / Qwen2.5",
    hf_model_types: &["qwen2"],
    hf_config,
    gguf: Some(GgufFamily {
        architecture: "qwen2",
        config: gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Decoder,
};

/// `Qwen2Config`'s defaults (transformers 5); `max_window_layers` defaults to 28.
pub(super) const DEFAULTS: HfDefaults = HfDefaults {
    vocab_size: 151_936,
    hidden_size: 4096,
    intermediate_size: 22016,
    num_hidden_layers: 32,
    num_attention_heads: 32,
    num_key_value_heads: None,
    head_dim: None,
    max_position_embeddings: 32768,
    bos_token_id: None,
    eos_token_id: None,
    sliding_window: Some(4096),
    tie_word_embeddings: false,
    hidden_act: "silu",
    rms_norm_eps: 1e-6,
};

/// `Qwen2Config.max_window_layers`' default.
pub(super) const MAX_WINDOW_LAYERS: usize = 28;

fn hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let keys = HfConfig::read(value, path, DEFAULTS)?;
    let mut config = keys.decoder_config(path, Architecture::Qwen2)?;
    // transformers' Qwen2Attention: bias=True on q, k, v and False on o, whatever
    // `attention_bias` says.
    (config.qkv_bias, config.out_bias) = (true, false);
    config.attention_windows = keys.qwen_windows(path, config.n_layers, MAX_WINDOW_LAYERS)?;
    validated(config, path)
}

fn gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    let mut config = decoder::gguf_config(file, "qwen2", Architecture::Qwen2)?;
    (config.qkv_bias, config.out_bias) = (true, false);
    validated(config, file.path())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Result<TransformerConfig> {
        hf_config(
            serde_json::from_str(json).unwrap(),
            Path::new("config.json"),
        )
    }

    /// `transformers.Qwen2Config()`'s reading of the same keys (5.24).
    #[test]
    fn missing_keys_take_transformers_defaults() {
        let c = config("{}").expect("Qwen2's default shape");
        assert_eq!(
            (
                c.vocab,
                c.d_model,
                c.d_ff,
                c.n_layers,
                c.n_kv_heads,
                c.head_dim
            ),
            (151_936, 4096, 22016, 32, 32, 128)
        );
        assert_eq!((c.max_positions, c.bos, c.eos.len()), (32768, None, 0));
        assert!(c.qkv_bias && !c.out_bias && !c.qk_norm);
        assert!(
            c.attention_windows.is_empty(),
            "no window without use_sliding_window"
        );
    }

    /// The window slides from `max_window_layers` on, or where `layer_types` says, and only
    /// with `use_sliding_window`.
    #[test]
    fn windows_follow_use_sliding_window_and_the_layer_types() {
        let c = config(
            r#"{"num_hidden_layers": 4, "use_sliding_window": true, "sliding_window": 8,
                "max_window_layers": 2}"#,
        )
        .unwrap();
        assert_eq!(c.attention_windows, vec![None, None, Some(8), Some(8)]);
        let c = config(
            r#"{"num_hidden_layers": 2, "use_sliding_window": true, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]}"#,
        )
        .unwrap();
        assert_eq!(c.attention_windows, vec![Some(8), None]);
        let err = config(
            r#"{"num_hidden_layers": 2, "use_sliding_window": true,
                "layer_types": ["sliding_attention"]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("layer_types"), "{err}");
        let err = config(r#"{"num_attention_heads": 6, "num_key_value_heads": 4}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("n_kv_heads"), "{err}");
    }
}
