//! [`inspect`]: what a model is, read from its files without loading its weights (for
//! `kiln info`, and for sizing a cache before loading).

use std::path::{Path, PathBuf};

use crate::config::TransformerConfig;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::loaders::{LoadOptions, ModelFormat, detect_format, read_config};
use crate::weights::{PthSource, SafetensorsSource, TensorSource};

/// A model's description.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// The path read.
    pub path: PathBuf,
    /// The file format.
    pub format: ModelFormat,
    /// The architecture and its sizes.
    pub config: TransformerConfig,
    /// Elements per storage type in the weight files, most first (`Q4_1`, `F32`…).
    pub stored_types: Vec<(String, usize)>,
    /// Bytes of weight files on disk.
    pub file_bytes: u64,
    /// How text becomes tokens, or `None` when the model comes without a tokenizer.
    pub tokenizer: Option<String>,
    /// Whether the files carry a chat template (Meta checkpoints use Llama 3's).
    pub chat_template: bool,
}

/// Describes the model at `path` from its configuration, tensor headers and tokenizer files.
///
/// # Errors
/// As [`crate::load`], for the files it reads.
pub fn inspect(path: &Path, options: &LoadOptions) -> Result<ModelInfo> {
    let format = detect_format(path)?;
    let config = read_config(path, options)?;
    let (stored_types, file_bytes, tokenizer, chat_template) = match format {
        ModelFormat::Gguf => {
            let file = GgufFile::open(path)?;
            let pre = file
                .get("tokenizer.ggml.pre")
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            let model = file
                .get("tokenizer.ggml.model")
                .and_then(|v| v.as_str())
                .unwrap_or("?");
            (
                file.stored_types(),
                file_size(path)?,
                Some(format!(
                    "GGUF vocabulary: tokenizer.ggml.model `{model}`, pre-tokenizer `{pre}`"
                )),
                file.get("tokenizer.chat_template").is_some(),
            )
        }
        ModelFormat::HuggingFace => {
            let index = path.join("model.safetensors.index.json");
            let source = if index.exists() {
                SafetensorsSource::open_index(&index)?
            } else {
                SafetensorsSource::open(&path.join("model.safetensors"))?
            };
            let bytes = source
                .files()
                .into_iter()
                .map(|f| file_size(&f))
                .sum::<Result<u64>>()?;
            let tokenizer = if path.join("tokenizer.json").exists() {
                Some("tokenizer.json (Hugging Face tokenizers)".to_string())
            } else if path.join("vocab.json").exists() && path.join("merges.txt").exists() {
                Some("vocab.json + merges.txt (byte-level BPE)".to_string())
            } else {
                None
            };
            let template = std::fs::read_to_string(path.join("tokenizer_config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .is_some_and(|v| v.get("chat_template").is_some());
            (source.stored_types(), bytes, tokenizer, template)
        }
        ModelFormat::MetaOriginal => {
            let weights = path.join("consolidated.00.pth");
            let source = PthSource::open(&weights)?;
            let tokenizer = path
                .join("tokenizer.model")
                .exists()
                .then(|| "tokenizer.model (tiktoken BPE, Llama 3 special tokens)".to_string());
            (source.stored_types(), file_size(&weights)?, tokenizer, true)
        }
    };
    Ok(ModelInfo {
        path: path.to_path_buf(),
        format,
        config,
        stored_types,
        file_bytes,
        tokenizer,
        chat_template,
    })
}

fn file_size(path: &Path) -> Result<u64> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
}
