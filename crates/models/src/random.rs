//! Models with random weights in the shape of real ones ([`KnownShape`]), for measuring speed at
//! sizes whose weights cannot be downloaded here (`kiln bench --shape llama-3.2-1b`). The
//! weights follow transformers' initialisation (normal, std 0.02; norms 1, biases 0), so the
//! activations stay in a realistic range; the tokens they produce mean nothing.

use std::collections::HashMap;
use std::str::FromStr;

use kiln_core::attention::Scoring;
use kiln_core::{Dtype, InferenceBackend, TokenId};
use kiln_kernels::{GgmlType, QuantMatrix};
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::{
    Architecture, Llama3Scaling, MlpKind, NormKind, PositionKind, RopeConfig, RopeScaling,
    TransformerConfig,
};
use crate::decoder::TensorNames;
use crate::error::{ModelError, Result};
use crate::family::{self, Blocks};
use crate::host::HostTensor;
use crate::transformer::Transformer;
use crate::weights::{QuantizedTensor, TensorSource};

/// Published model shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownShape {
    /// Llama 3.2 1B (16 layers, width 2048, GQA 32/8, tied head, vocabulary 128256).
    Llama32_1b,
    /// Llama 3.1 8B (32 layers, width 4096, GQA 32/8, vocabulary 128256).
    Llama31_8b,
    /// Qwen2.5 0.5B (24 layers, width 896, GQA 14/2, Q/K/V biases, tied head).
    Qwen25_05b,
    /// Qwen3 0.6B (28 layers, width 1024, GQA 16/8, head_dim 128, per-head Q/K norms, tied).
    Qwen3_06b,
    /// Gemma 2 2B (26 layers, width 2304, GQA 8/4, head_dim 256, windows on alternate layers,
    /// vocabulary 256000).
    Gemma2_2b,
    /// Gemma 3 1B (26 layers, width 1152, GQA 4/1, head_dim 256, vocabulary 262144).
    Gemma3_1b,
    /// Phi-3 mini 4k (3.8B: 32 layers, width 3072, 32 heads of 96, window 2047, vocabulary
    /// 32064).
    Phi3Mini,
    /// GPT-2 small (124M).
    Gpt2,
    /// GPT-2 XL (1.5B).
    Gpt2Xl,
    /// SantaCoder (GPT-BigCode 1.1B: 24 layers, width 2048, multi-query).
    SantaCoder,
}

impl KnownShape {
    /// Every shape, in the order shown to users.
    pub const ALL: [KnownShape; 10] = [
        KnownShape::Llama32_1b,
        KnownShape::Llama31_8b,
        KnownShape::Qwen25_05b,
        KnownShape::Qwen3_06b,
        KnownShape::Gemma2_2b,
        KnownShape::Gemma3_1b,
        KnownShape::Phi3Mini,
        KnownShape::Gpt2,
        KnownShape::Gpt2Xl,
        KnownShape::SantaCoder,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            KnownShape::Llama32_1b => "llama-3.2-1b",
            KnownShape::Llama31_8b => "llama-3.1-8b",
            KnownShape::Qwen25_05b => "qwen2.5-0.5b",
            KnownShape::Qwen3_06b => "qwen3-0.6b",
            KnownShape::Gemma2_2b => "gemma-2-2b",
            KnownShape::Gemma3_1b => "gemma-3-1b",
            KnownShape::Phi3Mini => "phi-3-mini",
            KnownShape::Gpt2 => "gpt2",
            KnownShape::Gpt2Xl => "gpt2-xl",
            KnownShape::SantaCoder => "santacoder",
        }
    }

    /// The configuration, as in the model's published `config.json`.
    pub fn config(self) -> TransformerConfig {
        match self {
            KnownShape::Llama32_1b => llama3(2048, 16, 32, 8, 64, 8192, 32.0, true),
            KnownShape::Llama31_8b => llama3(4096, 32, 32, 8, 128, 14336, 8.0, false),
            KnownShape::Qwen25_05b => TransformerConfig {
                architecture: Architecture::Qwen2,
                qkv_bias: true,
                ..qwen(896, 24, 14, 2, 64, 4864, 32_768)
            },
            KnownShape::Qwen3_06b => TransformerConfig {
                architecture: Architecture::Qwen3,
                qk_norm: true,
                ..qwen(1024, 28, 16, 8, 128, 3072, 40_960)
            },
            KnownShape::Gemma2_2b => published(
                &family::gemma::GEMMA2,
                serde_json::json!({
                    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 8192,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "eos_token_id": [1, 107]
                }),
            ),
            KnownShape::Gemma3_1b => published(
                &family::gemma::GEMMA3,
                serde_json::json!({
                    "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
                    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
                    "head_dim": 256, "max_position_embeddings": 32768,
                    "query_pre_attn_scalar": 256, "sliding_window": 512,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "eos_token_id": [1, 106]
                }),
            ),
            KnownShape::Phi3Mini => published(
                &family::phi3::FAMILY,
                serde_json::json!({
                    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                    "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 32, "max_position_embeddings": 4096,
                    "original_max_position_embeddings": 4096, "sliding_window": 2047,
                    "bos_token_id": 1, "eos_token_id": 32000
                }),
            ),
            KnownShape::Gpt2 => gpt2_config(768, 12, 12),
            KnownShape::Gpt2Xl => gpt2_config(1600, 48, 25),
            KnownShape::SantaCoder => published(
                &family::gpt2::BIGCODE,
                serde_json::json!({
                    "vocab_size": 49280, "n_positions": 2048, "n_embd": 2048, "n_layer": 24,
                    "n_head": 16, "n_inner": 8192, "multi_query": true,
                    "bos_token_id": 49152, "eos_token_id": 49152
                }),
            ),
        }
    }
}

impl FromStr for KnownShape {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        KnownShape::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = KnownShape::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown shape `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// The configuration `family` reads from the keys of a published `config.json`.
fn published(family: &family::Family, keys: serde_json::Value) -> TransformerConfig {
    (family.hf_config)(keys, std::path::Path::new(family.name))
        .expect("a published configuration is valid")
}

#[allow(clippy::too_many_arguments)] // one row of a table of published shapes
fn llama3(
    d_model: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    d_ff: usize,
    factor: f32,
    tied_head: bool,
) -> TransformerConfig {
    TransformerConfig {
        architecture: Architecture::Llama,
        vocab: 128_256,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        d_ff,
        max_positions: 131_072,
        norm: NormKind::RmsNorm,
        norm_eps: 1e-5,
        positions: PositionKind::Rope(RopeConfig {
            theta: 500_000.0,
            scaling: Some(RopeScaling::Llama3(Llama3Scaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 8192,
            })),
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
        tied_head,
        bos: Some(TokenId(128_000)),
        eos: vec![TokenId(128_001), TokenId(128_008), TokenId(128_009)],
        attention_windows: Vec::new(),
    }
}

/// A Qwen2/Qwen3 shape with neither biases nor head norms (the caller adds its family's).
fn qwen(
    d_model: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    d_ff: usize,
    max_positions: usize,
) -> TransformerConfig {
    TransformerConfig {
        vocab: 151_936,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim,
        d_ff,
        max_positions,
        norm_eps: 1e-6,
        positions: PositionKind::Rope(RopeConfig {
            theta: 1_000_000.0,
            scaling: None,
            frequency_divisors: None,
        }),
        tied_head: true,
        bos: None,
        eos: vec![TokenId(151_645), TokenId(151_643)],
        ..llama3(
            d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, 1.0, true,
        )
    }
}

fn gpt2_config(d_model: usize, n_layers: usize, n_heads: usize) -> TransformerConfig {
    TransformerConfig {
        architecture: Architecture::Gpt2,
        vocab: 50_257,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads: n_heads,
        head_dim: d_model / n_heads,
        d_ff: 4 * d_model,
        max_positions: 1024,
        norm: NormKind::LayerNorm,
        norm_eps: 1e-5,
        positions: PositionKind::Learned,
        mlp: MlpKind::GeluTanh,
        qkv_bias: true,
        out_bias: true,
        qk_norm: false,
        mlp_bias: true,
        sandwich_norms: false,
        norm_unit_offset: false,
        embed_scale: None,
        attention_scoring: Scoring::default(),
        final_softcap: None,
        local_rope: None,
        tied_head: true,
        bos: Some(TokenId(50_256)),
        eos: vec![TokenId(50_256)],
        attention_windows: Vec::new(),
    }
}

/// Random tensors named as in a Hugging Face checkpoint of `config`'s architecture, each the
/// shape the loader expects, generated when read from a seed and the name.
struct RandomSource {
    shapes: HashMap<String, Vec<usize>>,
    seed: u64,
    /// The GGUF type the linear layers and the embedding are stored in, or `None` for f32.
    quantized: Option<GgmlType>,
}

impl RandomSource {
    fn new(config: &TransformerConfig, seed: u64) -> Self {
        let (d, v, ff) = (config.d_model, config.vocab, config.d_ff);
        let (q, kv) = (
            config.n_heads * config.head_dim,
            config.n_kv_heads * config.head_dim,
        );
        let mut shapes: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: &[usize]| shapes.push((name, shape.to_vec()));
        match config.architecture.family().blocks {
            Blocks::Decoder => {
                add("model.embed_tokens.weight".into(), &[v, d]);
                add("model.norm.weight".into(), &[d]);
                if !config.tied_head {
                    add("lm_head.weight".into(), &[v, d]);
                }
                for i in 0..config.n_layers {
                    let l = format!("model.layers.{i}");
                    add(format!("{l}.input_layernorm.weight"), &[d]);
                    add(format!("{l}.post_attention_layernorm.weight"), &[d]);
                    if config.sandwich_norms {
                        add(format!("{l}.pre_feedforward_layernorm.weight"), &[d]);
                        add(format!("{l}.post_feedforward_layernorm.weight"), &[d]);
                    }
                    add(format!("{l}.self_attn.q_proj.weight"), &[q, d]);
                    add(format!("{l}.self_attn.k_proj.weight"), &[kv, d]);
                    add(format!("{l}.self_attn.v_proj.weight"), &[kv, d]);
                    add(format!("{l}.self_attn.o_proj.weight"), &[d, q]);
                    if config.qkv_bias {
                        add(format!("{l}.self_attn.q_proj.bias"), &[q]);
                        add(format!("{l}.self_attn.k_proj.bias"), &[kv]);
                        add(format!("{l}.self_attn.v_proj.bias"), &[kv]);
                    }
                    if config.out_bias {
                        add(format!("{l}.self_attn.o_proj.bias"), &[d]);
                    }
                    if config.qk_norm {
                        add(format!("{l}.self_attn.q_norm.weight"), &[config.head_dim]);
                        add(format!("{l}.self_attn.k_norm.weight"), &[config.head_dim]);
                    }
                    add(format!("{l}.mlp.gate_proj.weight"), &[ff, d]);
                    add(format!("{l}.mlp.up_proj.weight"), &[ff, d]);
                    add(format!("{l}.mlp.down_proj.weight"), &[d, ff]);
                }
            }
            Blocks::Gpt2 | Blocks::GptBigCode => {
                // GPT-2's `Conv1D` stores `[d_in, d_out]`, GPT-BigCode's `nn.Linear`
                // `[d_out, d_in]`; the fused `c_attn` gives every query head, then the key and
                // value heads.
                let bigcode = config.architecture.family().blocks == Blocks::GptBigCode;
                let layer = |d_in: usize, d_out: usize| {
                    if bigcode {
                        [d_out, d_in]
                    } else {
                        [d_in, d_out]
                    }
                };
                add("wte.weight".into(), &[v, d]);
                add("wpe.weight".into(), &[config.max_positions, d]);
                add("ln_f.weight".into(), &[d]);
                add("ln_f.bias".into(), &[d]);
                for i in 0..config.n_layers {
                    let h = format!("h.{i}");
                    for norm in ["ln_1", "ln_2"] {
                        add(format!("{h}.{norm}.weight"), &[d]);
                        add(format!("{h}.{norm}.bias"), &[d]);
                    }
                    add(format!("{h}.attn.c_attn.weight"), &layer(d, q + 2 * kv));
                    add(format!("{h}.attn.c_attn.bias"), &[q + 2 * kv]);
                    add(format!("{h}.attn.c_proj.weight"), &layer(d, d));
                    add(format!("{h}.attn.c_proj.bias"), &[d]);
                    add(format!("{h}.mlp.c_fc.weight"), &layer(d, ff));
                    add(format!("{h}.mlp.c_fc.bias"), &[ff]);
                    add(format!("{h}.mlp.c_proj.weight"), &layer(ff, d));
                    add(format!("{h}.mlp.c_proj.bias"), &[d]);
                }
            }
        }
        Self {
            shapes: shapes.into_iter().collect(),
            seed,
            quantized: None,
        }
    }

    /// The generator for `name`'s values.
    fn rng(&self, name: &str) -> ChaCha8Rng {
        let digest = name
            .bytes()
            .fold(self.seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        ChaCha8Rng::seed_from_u64(digest)
    }
}

/// Random blocks of `ty` for `rows × cols` values: random quants, with each block's f16
/// scales (and minimums) set so that the values stay within about ±0.03, as a trained model's
/// do; only the values' scale matters for speed.
fn random_blocks(ty: GgmlType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut data = vec![0u8; ty.bytes_for(rows * cols).unwrap_or(0)];
    rng.fill_bytes(&mut data);
    let block = ty.type_size();
    // (offset, value) of each f16 field: scale × the largest quant (× the largest sub-block
    // scale for the K types) ≈ 0.03.
    let fields: &[(usize, f32)] = match ty {
        GgmlType::Q8_0 => &[(0, 0.03 / 127.0)],
        GgmlType::Q4_0 | GgmlType::Q5_0 => &[(0, 0.03 / 16.0)],
        GgmlType::Q4_1 | GgmlType::Q5_1 => &[(0, 0.03 / 32.0), (2, -0.015)],
        GgmlType::Q4K | GgmlType::Q5K => &[(0, 0.03 / 63.0 / 31.0), (2, 0.015 / 63.0)],
        GgmlType::Q6K => &[(block - 2, 0.03 / 128.0 / 32.0)],
        GgmlType::Q2K => &[(80, 0.03 / 15.0 / 3.0), (82, 0.015 / 15.0)],
        GgmlType::Q3K => &[(108, 0.03 / 32.0 / 4.0)],
        GgmlType::Iq4Nl => &[(0, 0.03 / 127.0)],
        GgmlType::Iq4Xs => &[(0, 0.03 / 32.0 / 127.0)],
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => &[],
    };
    for b in data.chunks_exact_mut(block) {
        for &(offset, value) in fields {
            b[offset..offset + 2].copy_from_slice(&half::f16::from_f32(value).to_le_bytes());
        }
    }
    data
}

impl TensorSource for RandomSource {
    fn describe(&self) -> String {
        "random weights".into()
    }

    fn contains(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }

    fn read_quantized(&self, name: &str) -> Result<Option<QuantizedTensor>> {
        let (Some(ty), Some(shape)) = (self.quantized, self.shapes.get(name)) else {
            return Ok(None);
        };
        let &[rows, cols] = shape.as_slice() else {
            return Ok(None);
        };
        if !cols.is_multiple_of(ty.block_size()) {
            return Ok(None);
        }
        let data = random_blocks(ty, rows, cols, &mut self.rng(name));
        let matrix = QuantMatrix::new(ty, rows, cols, data).map_err(|e| {
            ModelError::config(self.describe(), format!("random {} blocks: {e}", ty.name()))
        })?;
        Ok(Some(QuantizedTensor {
            file: self.describe(),
            shape: shape.clone(),
            matrix,
        }))
    }

    fn read(&self, name: &str) -> Result<HostTensor> {
        let shape = self
            .shapes
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                file: self.describe(),
                tensor: name.to_string(),
            })?;
        let n: usize = shape.iter().product();
        let is_norm = name.contains("norm") || name.contains("ln_");
        let data = if name.ends_with(".bias") {
            vec![0.0; n]
        } else if is_norm {
            vec![1.0; n]
        } else {
            // Uniform with the standard deviation of transformers' normal(0, 0.02) init:
            // cheaper to draw, and for speed only the scale matters.
            let mut rng = self.rng(name);
            let half_width = 0.02 * 3f32.sqrt();
            (0..n)
                .map(|_| rng.random_range(-half_width..half_width))
                .collect()
        };
        Ok(HostTensor {
            name: name.to_string(),
            file: self.describe(),
            shape: shape.clone(),
            data,
        })
    }

    fn names(&self) -> Vec<String> {
        self.shapes.keys().cloned().collect()
    }

    fn stored_types(&self) -> Vec<(String, usize)> {
        crate::weights::tally(self.shapes.iter().map(|(name, shape)| {
            let ty = match self.quantized {
                Some(ty) if shape.len() == 2 && !name.contains("wpe") => ty.name(),
                _ => "F32",
            };
            (ty.to_string(), shape.iter().product())
        }))
    }
}

/// A model of `shape` with random weights (the same for the same `seed`), on `device`: in
/// `dtype`, or with its linear layers and embedding in random blocks of `quantized` (a type
/// kiln multiplies in its blocks; Llama shapes only), kept quantized as a GGUF file's are.
///
/// # Errors
/// An unsupported dtype on this device; a quantized type without kernels, or one asked of a
/// GPT-2 shape or with a dtype other than f32 on a backend whose kernels take f32 only.
pub fn random_model<B: InferenceBackend>(
    shape: KnownShape,
    dtype: Dtype,
    quantized: Option<GgmlType>,
    activations: crate::transformer::Activations,
    seed: u64,
    device: &B::Device,
) -> Result<Transformer<B>> {
    B::require_dtype(device, dtype)?;
    let config = shape.config();
    let mut source = RandomSource::new(&config, seed);
    let storage = match quantized {
        None => crate::transformer::WeightStorage::Dequantized,
        Some(ty) => {
            let problem = if !kiln_kernels::quant::has_kernel(ty) {
                Some(format!(
                    "{} has no kernel that multiplies its blocks",
                    ty.name()
                ))
            } else if config.architecture.family().blocks != Blocks::Decoder {
                Some("quantized random weights are made for rotary decoder shapes only".to_string())
            } else if dtype != Dtype::F32 && !B::QUANTIZED_ANY_DTYPE {
                Some(format!(
                    "quantized weights compute in f32 on this backend, not {}",
                    dtype.name()
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(ModelError::config(shape.name(), problem));
            }
            source.quantized = Some(ty);
            crate::transformer::WeightStorage::Quantized
        }
    };
    family::load_weights(
        config,
        TensorNames::HuggingFace,
        &source,
        dtype,
        storage,
        activations,
        device,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration built in code need not be valid: its count saturates rather than wrap
    /// (`kiln info` printed wrapped counts).
    #[test]
    fn parameter_counts_saturate_rather_than_wrap() {
        let mut config = KnownShape::Llama32_1b.config();
        config.n_layers = 1 << 40;
        config.d_model = 1 << 40;
        assert_eq!(config.parameters(), usize::MAX);
    }

    #[test]
    fn every_shape_parses_by_name_and_counts_its_published_parameters() {
        for shape in KnownShape::ALL {
            assert_eq!(shape.name().parse::<KnownShape>(), Ok(shape));
            let config = shape.config();
            config.validate().expect("a published shape is valid");
            let stored: usize = RandomSource::new(&config, 0)
                .stored_types()
                .iter()
                .map(|(_, n)| n)
                .sum();
            assert_eq!(config.parameters(), stored, "{}", shape.name());
        }
        // transformers' num_parameters() for the same configurations (the SHAPES of
        // scripts/bench/transformers_bench.py, built on the meta device).
        assert_eq!(KnownShape::Llama32_1b.config().parameters(), 1_235_814_400);
        assert_eq!(KnownShape::Llama31_8b.config().parameters(), 8_030_261_248);
        assert_eq!(KnownShape::Qwen25_05b.config().parameters(), 494_032_768);
        assert_eq!(KnownShape::Qwen3_06b.config().parameters(), 596_049_920);
        assert_eq!(KnownShape::Gpt2.config().parameters(), 124_439_808);
        assert_eq!(KnownShape::Gpt2Xl.config().parameters(), 1_557_611_200);
        assert_eq!(KnownShape::Gemma2_2b.config().parameters(), 2_614_341_888);
        assert_eq!(KnownShape::Gemma3_1b.config().parameters(), 999_885_952);
        assert_eq!(KnownShape::SantaCoder.config().parameters(), 1_124_886_528);
        assert_eq!(KnownShape::Phi3Mini.config().parameters(), 3_821_079_552);
        assert!("llama-7b".parse::<KnownShape>().is_err());
    }
}
