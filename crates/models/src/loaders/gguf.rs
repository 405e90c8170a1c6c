//! llama.cpp GGUF files (`*.gguf`): the family from `general.architecture` and its
//! hyper-parameters from the metadata under that prefix ([`crate::family::GgufFamily`]),
//! weights kept in their blocks or dequantized at load, the tokenizer from `tokenizer.ggml.*`
//! and the chat template from `tokenizer.chat_template`.
//!
//! For the families llama.cpp converts that way (Llama), `attn_q` / `attn_k` rows are in
//! Meta's interleaved RoPE order and are permuted back to the rotate-half order kiln uses.
//! Llama 3.1's scaled RoPE is stored as the tensor `rope_freqs.weight` (one divisor per
//! frequency), applied as it is, as llama.cpp does.

use std::path::Path;

use kiln_core::{Dtype, InferenceBackend, TokenId};

use super::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat, WeightStorage};
use crate::config::TransformerConfig;
use crate::decoder::TensorNames;
use crate::error::{ModelError, Result};
use crate::family;
use crate::gguf::GgufFile;
use crate::info::ModelInfo;
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

/// The file's family (by `general.architecture`) and its validated configuration.
pub(super) fn config(file: &GgufFile) -> Result<TransformerConfig> {
    let arch = file.string("general.architecture")?;
    match family::from_gguf_architecture(arch) {
        Some((_, gguf)) => (gguf.config)(file),
        None => Err(ModelError::UnsupportedArchitecture {
            path: file.path().to_path_buf(),
            architecture: arch.to_string(),
            supported: family::gguf_names(),
        }),
    }
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
    let model = family::load_weights(
        config,
        TensorNames::Gguf,
        &reporting,
        options.dtype,
        options.weights,
        options.activations,
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
