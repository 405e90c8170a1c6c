//! llama.cpp GGUF files (`*.gguf`): Llama hyper-parameters from `llama.*` metadata, weights
//! dequantized at load, the tokenizer from `tokenizer.ggml.*` and the chat template from
//! `tokenizer.chat_template`.
//!
//! llama.cpp's converter stores `attn_q` / `attn_k` rows in Meta's interleaved RoPE order;
//! they are permuted back to the rotate-half order kiln uses, as for Meta checkpoints. Llama
//! 3.1's scaled RoPE is stored as the tensor `rope_freqs.weight` (one divisor per frequency),
//! applied as it is, as llama.cpp does.

use std::path::Path;

use kiln_core::{Dtype, InferenceBackend, TokenId};

use super::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat, WeightStorage};
use crate::config::{Architecture, MlpKind, NormKind, PositionKind, RopeConfig, TransformerConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::info::ModelInfo;
use crate::llama::{self, LlamaNames};
use crate::tokenizer::TextTokenizer;
use crate::weights::{LoadProgress, Reporting, TensorSource, file_size};

/// Whether `path` is a GGUF file (by its first four bytes).
pub(super) fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

fn architecture(file: &GgufFile) -> Result<()> {
    let arch = file.string("general.architecture")?;
    if arch == "llama" {
        Ok(())
    } else {
        Err(ModelError::UnsupportedArchitecture {
            path: file.path().to_path_buf(),
            architecture: arch.to_string(),
        })
    }
}

/// The Llama configuration in `llama.*` metadata.
pub(super) fn config(file: &GgufFile) -> Result<TransformerConfig> {
    architecture(file)?;
    let path = file.path();
    let key = |k: &str| format!("llama.{k}");
    let count = |k: &str| -> Result<usize> { Ok(file.unsigned(&key(k))? as usize) };
    let n_heads = count("attention.head_count")?;
    if n_heads == 0 {
        return Err(ModelError::config(path, "llama.attention.head_count is 0"));
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
                "llama.rope.dimension_count is {rot} but heads have {head_dim} dimensions; partial rotary embeddings are not supported"
            ),
        ));
    }
    if let Some(kind) = file.get(&key("rope.scaling.type")).and_then(|v| v.as_str())
        && kind != "none"
    {
        return Err(ModelError::config(
            path,
            format!(
                "llama.rope.scaling.type `{kind}` is not supported (kiln supports llama3 scaling via rope_freqs)"
            ),
        ));
    }
    let vocab = match file.unsigned_opt(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => file.array("tokenizer.ggml.tokens")?.len(),
    };
    let theta = file.float_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
    let rope = RopeConfig {
        theta,
        llama3_scaling: None,
        frequency_divisors: file
            .contains("rope_freqs.weight")
            .then(|| frequency_divisors(file, head_dim))
            .transpose()?,
    };
    let (bos, eos, _) = crate::tokenizer::gguf::special_ids(file)?;
    let config = TransformerConfig {
        architecture: Architecture::Llama,
        vocab,
        d_model,
        n_layers: count("block_count")?,
        n_heads,
        n_kv_heads: file
            .unsigned_opt(&key("attention.head_count_kv"))?
            .map_or(n_heads, |n| n as usize),
        head_dim,
        d_ff: count("feed_forward_length")?,
        max_positions: count("context_length")?,
        norm: NormKind::RmsNorm,
        norm_eps: file
            .float_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        positions: PositionKind::Rope(rope),
        mlp: MlpKind::SwiGlu,
        attention_bias: file.contains("blk.0.attn_q.bias"),
        mlp_bias: false,
        tied_head: !file.contains("output.weight"),
        bos: bos.map(TokenId),
        eos: eos.into_iter().map(TokenId).collect(),
        // llama.cpp's Llama GGUFs carry no attention window (its Mistral conversions drop it).
        attention_windows: Vec::new(),
    };
    config.validate().map_err(|e| ModelError::config(path, e))?;
    Ok(config)
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

fn chat_template(file: &GgufFile) -> Option<String> {
    file.get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .map(str::to_string)
}

/// Describes the file from its metadata and tensor headers (one parse).
pub(super) fn inspect(path: &Path) -> Result<ModelInfo> {
    let file = GgufFile::open(path)?;
    let text = |key: &str| file.get(key).and_then(|v| v.as_str());
    let tokenizer = format!(
        "GGUF vocabulary: tokenizer.ggml.model `{}`, pre-tokenizer `{}`",
        text("tokenizer.ggml.model").unwrap_or("?"),
        text("tokenizer.ggml.pre").unwrap_or("default")
    );
    Ok(ModelInfo {
        path: path.to_path_buf(),
        format: ModelFormat::Gguf,
        config: config(&file)?,
        stored_types: file.stored_types(),
        file_bytes: file_size(path)?,
        tokenizer: Some(tokenizer),
        chat_template: chat_template(&file).is_some(),
        warnings: Vec::new(),
    })
}

pub(super) fn read_config(path: &Path) -> Result<TransformerConfig> {
    config(&GgufFile::open(path)?)
}

pub(super) fn load<B: InferenceBackend>(
    path: &Path,
    options: &LoadOptions,
    device: &B::Device,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedModel<B>> {
    let file = GgufFile::open(path)?;
    let mut config = config(&file)?;
    let mut warnings = config.drop_impossible_special_tokens();
    if options.weights == WeightStorage::Quantized
        && options.dtype != Dtype::F32
        && !B::QUANTIZED_ANY_DTYPE
    {
        return Err(ModelError::config(
            path,
            format!(
                "quantized weights compute in f32 on this backend; {} asks to dequantize, so the \
                 two do not mix",
                options.dtype.name()
            ),
        ));
    }
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    let (bos, eos, add_bos) = crate::tokenizer::gguf::special_ids(&file)?;
    let mut generation = GenerationSettings {
        bos: bos.map(TokenId),
        eos: eos.into_iter().map(TokenId).collect(),
        add_bos,
    };
    generation.drop_impossible(config.vocab, &mut warnings);
    let chat_template = chat_template(&file);
    let reporting = Reporting::new(&file, progress);
    let model = llama::load(
        config,
        LlamaNames::Gguf,
        &reporting,
        options.dtype,
        options.weights,
        device,
    )?;
    reporting.finish();
    Ok(LoadedModel {
        model,
        tokenizer: Some(tokenizer),
        generation,
        chat_template,
        format: ModelFormat::Gguf,
        path: path.to_path_buf(),
        warnings,
    })
}
