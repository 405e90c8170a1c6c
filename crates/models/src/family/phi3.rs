//! Phi-3 and Phi-3.5 (mini): Llama's block with Q, K and V in one `qkv_proj` and the gate and
//! up projections in one `gate_up_proj` (llama.cpp: `attn_qkv`, and `ffn_up` without an
//! `ffn_gate`), read as fused layers by [`decoder::load`]; LongRoPE for the 128k models
//! (`rope_scaling` `longrope`, `su` in early configs; GGUF: `rope_factors_long` /
//! `rope_factors_short`); a `sliding_window` on every layer when the config has one. llama.cpp
//! keeps Q/K rows in the rotate-half order (its NEOX RoPE type).

use std::path::Path;

use serde_json::Value;

use super::{Blocks, Family, GgufFamily, validated};
use crate::config::{Architecture, TransformerConfig};
use crate::decoder::{self, HfConfig, HfDefaults};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Phi-3 / Phi-3.5 mini.
pub static FAMILY: Family = Family {
    architecture: Architecture::Phi3,
    name: "phi3",
    models: "Phi-3 / Phi-3.5 mini",
    hf_model_types: &["phi3"],
    hf_config,
    gguf: Some(GgufFamily {
        architecture: "phi3",
        config: gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Decoder,
};

/// `Phi3Config`'s defaults (transformers 5.24: Phi-3-mini-4k's shape).
const DEFAULTS: HfDefaults = HfDefaults {
    vocab_size: 32064,
    hidden_size: 3072,
    intermediate_size: 8192,
    num_hidden_layers: 32,
    num_attention_heads: 32,
    num_key_value_heads: None,
    head_dim: None,
    max_position_embeddings: 4096,
    bos_token_id: Some(1),
    eos_token_id: Some(32000),
    sliding_window: None,
    tie_word_embeddings: false,
    hidden_act: "silu",
    rms_norm_eps: 1e-5,
};

fn hf_config(mut value: Value, path: &Path) -> Result<TransformerConfig> {
    // `Phi3Config.convert_rope_params_to_dict`: the early names of LongRoPE ("su", and "yarn"
    // as Phi-3 used it) mean `longrope`.
    for key in ["rope_scaling", "rope_parameters"] {
        if let Some(Value::Object(rope)) = value.get_mut(key) {
            let kind = rope
                .get("rope_type")
                .or_else(|| rope.get("type"))
                .and_then(Value::as_str);
            if matches!(kind, Some("su" | "yarn")) {
                rope.remove("type");
                rope.insert("rope_type".into(), "longrope".into());
            }
        }
    }
    let keys = HfConfig::read(value, path, DEFAULTS)?;
    let config = keys.decoder_config(path, Architecture::Phi3)?;
    validated(config, path)
}

fn gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    let mut config = decoder::gguf_config(file, "phi3", Architecture::Phi3)?;
    // llama.cpp's converter writes the window (0: none); llama.cpp itself leaves it off for
    // Phi-3 (its PR 13676), transformers applies it on every layer, and kiln follows
    // transformers.
    if let Some(window) = file
        .unsigned_opt("phi3.attention.sliding_window")?
        .filter(|w| *w > 0)
    {
        config.attention_windows = vec![Some(window as usize); config.n_layers];
    }
    validated(config, file.path())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;

    fn parse(json: &str) -> Result<TransformerConfig> {
        hf_config(
            serde_json::from_str(json).unwrap(),
            Path::new("config.json"),
        )
    }

    /// `transformers.Phi3Config()`'s reading of the same keys (5.24).
    #[test]
    fn missing_keys_take_transformers_defaults() {
        let c = parse("{}").unwrap();
        assert_eq!(
            (
                c.vocab,
                c.d_model,
                c.d_ff,
                c.n_layers,
                c.n_kv_heads,
                c.head_dim
            ),
            (32064, 3072, 8192, 32, 32, 96)
        );
        assert_eq!((c.max_positions, c.norm_eps), (4096, 1e-5));
        assert!(!c.qkv_bias && !c.out_bias && !c.tied_head);
        assert!(c.attention_windows.is_empty());
        let c = parse(r#"{"num_hidden_layers": 2, "sliding_window": 2047}"#).unwrap();
        assert_eq!(c.attention_windows, vec![Some(2047); 2]);
    }

    /// Phi-3.5-mini's `rope_scaling` as the hub has it (transformers-4 keys: the original
    /// context at the top level, `type` "su" in the oldest files) reads as LongRoPE with
    /// transformers' attention factor; a factor list of the wrong length and a partial rotary
    /// factor are named.
    #[test]
    fn longrope_reads_as_the_hub_writes_it() {
        let factors = |n: usize, f: f32| serde_json::to_string(&vec![f; n]).unwrap();
        let json = format!(
            r#"{{"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 131072,
                "original_max_position_embeddings": 4096,
                "rope_scaling": {{"type": "su", "short_factor": {}, "long_factor": {}}}}}"#,
            factors(8, 1.5),
            factors(8, 4.0)
        );
        let c = parse(&json).unwrap();
        let crate::config::PositionKind::Rope(rope) = &c.positions else {
            panic!("Phi-3 has RoPE")
        };
        let Some(RopeScaling::LongRope(s)) = &rope.scaling else {
            panic!("{:?}", rope.scaling)
        };
        assert_eq!((s.factor, s.original_max_positions), (32.0, 4096));
        // sqrt(1 + ln 32 / ln 4096), as transformers computes it.
        assert!(
            (s.attention_factor - 1.190_238).abs() < 2e-6,
            "{}",
            s.attention_factor
        );
        assert_eq!(s.factors_for(4096)[0], 1.5);
        assert_eq!(s.factors_for(4097)[0], 4.0);

        let err = parse(&json.replace(&factors(8, 4.0), &factors(7, 4.0)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("7 long factors"), "{err}");
        let err = parse(r#"{"partial_rotary_factor": 0.75}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("partial_rotary_factor 0.75"), "{err}");
    }
}
