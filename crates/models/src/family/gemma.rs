//! Gemma 2 and Gemma 3 (text), from Hugging Face folders. Both are the shared rotary decoder
//! with, as data in the configuration:
//!
//! - GeGLU (`gelu_pytorch_tanh`) instead of SwiGLU;
//! - RMSNorm weights stored as `w` for a scale of `1 + w` (the loader adds the 1);
//! - sandwich norms: `post_attention_layernorm` on the attention output and
//!   `post_feedforward_layernorm` on the MLP output before each residual, the pre-MLP norm
//!   being `pre_feedforward_layernorm`;
//! - token embeddings times `√hidden_size`;
//! - attention scores scaled by `query_pre_attn_scalar^-0.5`, not `head_dim^-0.5`;
//! - a window on the layers `layer_types` calls `sliding_attention` (by default every other
//!   layer from the first in Gemma 2, five of every six in Gemma 3).
//!
//! Gemma 2 adds soft caps on attention scores (`attn_logit_softcapping`, 50) and on the output
//! logits (`final_logit_softcapping`, 30). Gemma 3 drops them and adds Qwen3-style per-head
//! norms on queries and keys (also `1 + w`) and a RoPE of its own for the windowed layers
//! (`rope_parameters.sliding_attention`, base 10,000; the full layers' base is 1,000,000,
//! with any scaling).
//!
//! Their GGUF files (`gemma2`, `gemma3`) hold the same model as llama.cpp reads it: norms
//! stored as `1 + w` already (its converter adds the 1), the window on every other layer
//! (Gemma 2) or five layers of six (Gemma 3) unless `attention.sliding_window_pattern` says
//! otherwise, scores scaled by `head_dim^-0.5` (`hidden / heads` for the 27B models:
//! `query_pre_attn_scalar` is not in the file), Gemma 3's windowed layers on
//! `rope.freq_base_swa` (10,000 by default).
//!
//! Gemma 3's multimodal checkpoints (`model_type` `gemma3`: 4B, 12B, 27B) load as their text
//! model: the `text_config` is read as a `gemma3_text` config, the language model's tensors
//! are found under the wrapper's prefix (`weights::LanguageModelSource`), and the vision
//! tower is left in the file; prompts are text only.

use std::path::Path;

use kiln_core::attention::Scoring;
use serde_json::Value;

use super::{Blocks, Family, GgufFamily, validated};
use crate::config::{Architecture, MlpKind, PositionKind, RopeConfig, TransformerConfig};
use crate::decoder::{self, HfConfig, HfDefaults};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Gemma 2.
pub static GEMMA2: Family = Family {
    architecture: Architecture::Gemma2,
    name: "gemma2",
    models: "Gemma 2",
    hf_model_types: &["gemma2"],
    hf_config: gemma2_hf_config,
    gguf: Some(GgufFamily {
        architecture: "gemma2",
        config: gemma2_gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Decoder,
};

/// Gemma 3, its text model.
pub static GEMMA3: Family = Family {
    architecture: Architecture::Gemma3,
    name: "gemma3_text",
    models: "Gemma 3 (text)",
    hf_model_types: &["gemma3_text", "gemma3"],
    hf_config: gemma3_hf_config,
    gguf: Some(GgufFamily {
        architecture: "gemma3",
        config: gemma3_gguf_config,
        qk_rows_interleaved: false,
    }),
    blocks: Blocks::Decoder,
};

/// `Gemma2Config`'s defaults (transformers 5).
const GEMMA2_DEFAULTS: HfDefaults = HfDefaults {
    vocab_size: 256_000,
    hidden_size: 2304,
    intermediate_size: 9216,
    num_hidden_layers: 26,
    num_attention_heads: 8,
    num_key_value_heads: Some(4),
    head_dim: Some(256),
    max_position_embeddings: 8192,
    bos_token_id: Some(2),
    eos_token_id: Some(1),
    sliding_window: Some(4096),
    tie_word_embeddings: true,
    hidden_act: "gelu_pytorch_tanh",
    rms_norm_eps: 1e-6,
};

/// `Gemma3TextConfig`'s defaults (transformers 5).
const GEMMA3_DEFAULTS: HfDefaults = HfDefaults {
    vocab_size: 262_208,
    max_position_embeddings: 131_072,
    ..GEMMA2_DEFAULTS
};

/// Gemma 2's soft caps, where the file leaves them out.
const GEMMA2_ATTENTION_SOFTCAP: f32 = 50.0;
const GEMMA2_FINAL_SOFTCAP: f32 = 30.0;

/// Both generations' `query_pre_attn_scalar` default.
const QUERY_PRE_ATTN_SCALAR: f64 = 256.0;

/// Gemma 3's RoPE bases (`Gemma3TextConfig.default_theta`): full layers, windowed layers.
const GEMMA3_GLOBAL_THETA: f32 = 1_000_000.0;
const GEMMA3_LOCAL_THETA: f32 = 10_000.0;

/// Gemma 3's window pattern: every sixth layer attends to everything
/// (`sliding_window_pattern`).
const GEMMA3_PATTERN: usize = 6;

fn gemma2_hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let extra = GemmaKeys::read(
        &value,
        path,
        Some(GEMMA2_ATTENTION_SOFTCAP),
        Some(GEMMA2_FINAL_SOFTCAP),
    )?;
    let keys = HfConfig::read(value, path, GEMMA2_DEFAULTS)?;
    let mut config = keys.decoder_config(path, Architecture::Gemma2)?;
    extra.apply(&mut config);
    // `Gemma2Config`: "sliding_attention" if bool((i + 1) % 2).
    config.attention_windows = keys.layer_windows(path, config.n_layers, |i| (i + 1) % 2 != 0)?;
    validated(config, path)
}

fn gemma3_hf_config(value: Value, path: &Path) -> Result<TransformerConfig> {
    let value = if value.get("model_type").and_then(Value::as_str) == Some("gemma3") {
        // `Gemma3ForConditionalGeneration`: the language model's configuration.
        match value.get("text_config") {
            Some(text @ Value::Object(_)) => text.clone(),
            _ => {
                return Err(ModelError::config(
                    path,
                    "a gemma3 (multimodal) config needs its `text_config` object",
                ));
            }
        }
    } else {
        value
    };
    let extra = GemmaKeys::read(&value, path, None, None)?;
    let pattern = match value.get("sliding_window_pattern") {
        None | Some(Value::Null) => GEMMA3_PATTERN,
        Some(v) => v.as_u64().filter(|p| *p > 0).ok_or_else(|| {
            ModelError::config(path, "`sliding_window_pattern` must be a positive integer")
        })? as usize,
    };
    let max_positions = value
        .get("max_position_embeddings")
        .and_then(Value::as_u64)
        .map_or(GEMMA3_DEFAULTS.max_position_embeddings, |m| m as usize);
    let (global, local) = gemma3_ropes(&value, path, max_positions)?;
    let keys = HfConfig::read(value, path, GEMMA3_DEFAULTS)?;
    let mut config = keys.decoder_config(path, Architecture::Gemma3)?;
    extra.apply(&mut config);
    config.qk_norm = true;
    config.positions = PositionKind::Rope(global);
    config.local_rope = Some(local);
    config.attention_windows =
        keys.layer_windows(path, config.n_layers, |i| (i + 1) % pattern != 0)?;
    if config.attention_windows.iter().all(Option::is_none) {
        return Err(ModelError::config(
            path,
            "Gemma 3 needs a `sliding_window` for its sliding_attention layers",
        ));
    }
    validated(config, path)
}

/// Gemma 2's window when a GGUF file has no `attention.sliding_window` (llama.cpp's default).
const GEMMA2_GGUF_WINDOW: u64 = 4096;

fn gemma2_gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    let mut config = gemma_gguf_config(file, "gemma2", Architecture::Gemma2, 2)?;
    config.attention_scoring.softcap = file
        .float_opt("gemma2.attn_logit_softcapping")?
        .map(|c| c as f32);
    validated(config, file.path())
}

fn gemma3_gguf_config(file: &GgufFile) -> Result<TransformerConfig> {
    let mut config = gemma_gguf_config(file, "gemma3", Architecture::Gemma3, GEMMA3_PATTERN)?;
    let theta = |key: &str, default: f32| -> Result<f32> {
        Ok(file.float_opt(key)?.map_or(default, |t| t as f32))
    };
    config.positions = PositionKind::Rope(RopeConfig {
        theta: theta("gemma3.rope.freq_base", GEMMA3_GLOBAL_THETA)?,
        scaling: decoder::gguf_rope_scaling(file, "gemma3")?,
        frequency_divisors: None,
    });
    config.local_rope = Some(RopeConfig {
        theta: theta("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_THETA)?,
        scaling: None,
        frequency_divisors: None,
    });
    validated(config, file.path())
}

/// What both Gemma generations' GGUF files say, as llama.cpp's `gemma2` / `gemma3` loaders
/// read it; `pattern` is the generation's default window pattern (a window on layer `i`
/// unless `i % pattern` is `pattern - 1`).
fn gemma_gguf_config(
    file: &GgufFile,
    prefix: &str,
    architecture: Architecture,
    pattern: usize,
) -> Result<TransformerConfig> {
    let mut config = decoder::gguf_config(file, prefix, architecture)?;
    config.mlp = MlpKind::GeGlu;
    config.sandwich_norms = true;
    config.embed_scale = Some((config.d_model as f64).sqrt() as f32);
    // llama.cpp scales queries by 1/sqrt(head_dim), and by 1/sqrt(hidden / heads) for the
    // 27B models (46 layers in Gemma 2, 62 in Gemma 3), as Google's code does.
    let layers_27b = if architecture == Architecture::Gemma2 {
        46
    } else {
        62
    };
    if config.n_layers == layers_27b {
        config.attention_scoring.scale =
            Some(1.0 / ((config.d_model / config.n_heads) as f32).sqrt());
    }
    config.final_softcap = file
        .float_opt(&format!("{prefix}.final_logit_softcapping"))?
        .map(|c| c as f32);
    let window_key = format!("{prefix}.attention.sliding_window");
    let window = match file.unsigned_opt(&window_key)? {
        Some(w) => w,
        None if architecture == Architecture::Gemma2 => GEMMA2_GGUF_WINDOW,
        None => 0,
    };
    if window > 0 {
        let sliding = gguf_window_layers(file, prefix, config.n_layers, pattern)?;
        config.attention_windows = sliding
            .into_iter()
            .map(|s| s.then_some(window as usize))
            .collect();
    }
    Ok(config)
}

/// Which layers have a window: `{prefix}.attention.sliding_window_pattern` as one flag per
/// layer or as a period, else `pattern` (llama.cpp's `load_swa_pattern`).
fn gguf_window_layers(
    file: &GgufFile,
    prefix: &str,
    n_layers: usize,
    pattern: usize,
) -> Result<Vec<bool>> {
    let key = format!("{prefix}.attention.sliding_window_pattern");
    let period = match file.get(&key) {
        None => pattern,
        Some(value) => match value.as_u64() {
            Some(p) if p > 0 => p as usize,
            Some(_) => {
                return Err(ModelError::config(file.path(), format!("{key} is 0")));
            }
            None => {
                let flags: Vec<bool> = file
                    .array(&key)?
                    .iter()
                    .map(|v| v.as_bool())
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        ModelError::config(
                            file.path(),
                            format!("{key} must be a number or one flag per layer"),
                        )
                    })?;
                if flags.len() != n_layers {
                    return Err(ModelError::config(
                        file.path(),
                        format!("{key} has {} flags for {n_layers} layers", flags.len()),
                    ));
                }
                return Ok(flags);
            }
        },
    };
    Ok((0..n_layers).map(|i| i % period < period - 1).collect())
}

/// The keys both Gemma generations add to the rotary decoder's.
#[derive(Debug)]
struct GemmaKeys {
    query_pre_attn_scalar: f64,
    attention_softcap: Option<f32>,
    final_softcap: Option<f32>,
}

impl GemmaKeys {
    /// Reads them from the whole `config.json`, an absent soft cap taking the generation's
    /// default and a null one none.
    fn read(
        value: &Value,
        path: &Path,
        attention_softcap: Option<f32>,
        final_softcap: Option<f32>,
    ) -> Result<Self> {
        let positive = |key: &str| -> Result<Option<Option<f64>>> {
            match value.get(key) {
                None => Ok(None),
                Some(Value::Null) => Ok(Some(None)),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(Some(Some(x))),
                    _ => Err(ModelError::config(
                        path,
                        format!("`{key}` must be a positive number, got {v}"),
                    )),
                },
            }
        };
        let cap = |key: &str, default: Option<f32>| -> Result<Option<f32>> {
            Ok(positive(key)?.map_or(default, |v| v.map(|x| x as f32)))
        };
        Ok(Self {
            query_pre_attn_scalar: positive("query_pre_attn_scalar")?
                .flatten()
                .unwrap_or(QUERY_PRE_ATTN_SCALAR),
            attention_softcap: cap("attn_logit_softcapping", attention_softcap)?,
            final_softcap: cap("final_logit_softcapping", final_softcap)?,
        })
    }

    /// Gemma's block on a rotary decoder's configuration.
    fn apply(&self, config: &mut TransformerConfig) {
        config.sandwich_norms = true;
        config.norm_unit_offset = true;
        // transformers: `hidden_size**0.5` and `query_pre_attn_scalar**-0.5` in double, used
        // as f32.
        config.embed_scale = Some((config.d_model as f64).sqrt() as f32);
        config.attention_scoring = Scoring {
            scale: Some(self.query_pre_attn_scalar.powf(-0.5) as f32),
            softcap: self.attention_softcap,
        };
        config.final_softcap = self.final_softcap;
    }
}

/// Gemma 3's two RoPEs, (full layers, windowed layers), as `Gemma3TextConfig` reads them:
/// transformers 5's `rope_parameters` per layer type, or the hub's transformers-4 keys
/// (`rope_theta` and `rope_scaling` for the full layers, `rope_local_base_freq` for the
/// windowed ones).
fn gemma3_ropes(
    value: &Value,
    path: &Path,
    max_positions: usize,
) -> Result<(RopeConfig, RopeConfig)> {
    let by_type = value
        .get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let (full, sliding) = match by_type {
        Some(p) => {
            let layer_type = |key: &str| {
                p.get(key)
                    .filter(|v| !v.is_null())
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({}))
            };
            (
                layer_type("full_attention"),
                layer_type("sliding_attention"),
            )
        }
        None => {
            let mut full = match value.get("rope_scaling") {
                Some(v @ Value::Object(_)) => v.clone(),
                _ => serde_json::json!({}),
            };
            if let Some(theta) = value.get("rope_theta") {
                full["rope_theta"] = theta.clone();
            }
            let mut sliding = serde_json::json!({});
            if let Some(theta) = value.get("rope_local_base_freq") {
                sliding["rope_theta"] = theta.clone();
            }
            (full, sliding)
        }
    };
    Ok((
        decoder::rope_config(&full, GEMMA3_GLOBAL_THETA, path, max_positions)?,
        decoder::rope_config(&sliding, GEMMA3_LOCAL_THETA, path, max_positions)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MlpKind, RopeScaling};

    fn parse(
        family: fn(Value, &Path) -> Result<TransformerConfig>,
        json: &str,
    ) -> Result<TransformerConfig> {
        family(serde_json::from_str(json).unwrap(), Path::new("c"))
    }

    /// `transformers.Gemma2Config()`'s reading of the same keys (5.24): GeGLU, tied head,
    /// windows on layers 0, 2, ..., soft caps 50 and 30, scale 256^-0.5.
    #[test]
    fn gemma2_missing_keys_take_transformers_defaults() {
        let c = parse(gemma2_hf_config, r#"{"num_hidden_layers": 4}"#).unwrap();
        assert_eq!((c.vocab, c.head_dim, c.n_kv_heads), (256_000, 256, 4));
        assert_eq!(c.mlp, MlpKind::GeGlu);
        assert!(c.tied_head && c.sandwich_norms && c.norm_unit_offset && !c.qk_norm);
        assert_eq!(
            c.attention_windows,
            vec![Some(4096), None, Some(4096), None]
        );
        assert_eq!(c.attention_scoring.scale, Some(0.0625));
        assert_eq!(c.attention_scoring.softcap, Some(50.0));
        assert_eq!(c.final_softcap, Some(30.0));
        assert_eq!(c.embed_scale, Some(48.0));
        // Explicit nulls turn the caps off.
        let c = parse(
            gemma2_hf_config,
            r#"{"attn_logit_softcapping": null, "final_logit_softcapping": null}"#,
        )
        .unwrap();
        assert_eq!((c.attention_scoring.softcap, c.final_softcap), (None, None));
    }

    /// `transformers.Gemma3TextConfig()`: windows on five layers of six, per-head norms, no
    /// caps, a local base of 10,000 beside the global 1,000,000; the hub's transformers-4
    /// keys (`rope_local_base_freq`, `rope_scaling` linear 8 on the full layers) read as
    /// transformers 5 reads them.
    #[test]
    fn gemma3_reads_both_ropes_from_either_key_generation() {
        let c = parse(gemma3_hf_config, r#"{"num_hidden_layers": 7}"#).unwrap();
        let windowed: Vec<bool> = c.attention_windows.iter().map(Option::is_some).collect();
        assert_eq!(windowed, [true, true, true, true, true, false, true]);
        assert_eq!(c.widest_window(), None, "a full layer keeps every key");
        assert!(c.qk_norm);
        assert_eq!((c.attention_scoring.softcap, c.final_softcap), (None, None));
        assert_eq!(c.rope_of(0).unwrap().theta, 10_000.0);
        assert_eq!(c.rope_of(5).unwrap().theta, 1_000_000.0);

        let hub = parse(
            gemma3_hf_config,
            r#"{"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}"#,
        )
        .unwrap();
        let v5 = parse(
            gemma3_hf_config,
            r#"{"rope_parameters": {
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}"#,
        )
        .unwrap();
        assert_eq!(hub, v5);
        let PositionKind::Rope(global) = &v5.positions else {
            panic!("rotary")
        };
        assert_eq!(global.scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(v5.local_rope.as_ref().unwrap().scaling, None);
    }

    /// Nonsense values are named.
    #[test]
    fn bad_gemma_keys_are_named() {
        for (json, key) in [
            (r#"{"query_pre_attn_scalar": 0}"#, "query_pre_attn_scalar"),
            (
                r#"{"attn_logit_softcapping": -1}"#,
                "attn_logit_softcapping",
            ),
            (r#"{"hidden_activation": "relu"}"#, "hidden_activation"),
            (r#"{"layer_types": ["sliding_attention"]}"#, "layer_types"),
        ] {
            let err = parse(gemma2_hf_config, json).unwrap_err().to_string();
            assert!(err.contains(key), "{json}: {err}");
        }
        let err = parse(gemma3_hf_config, r#"{"sliding_window": null}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sliding_window"), "{err}");
        let err = parse(gemma3_hf_config, r#"{"rope_theta": -5}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rope_theta"), "{err}");
    }
}
