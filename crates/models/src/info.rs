//! [`ModelInfo`]: what a model is, read from its files without loading its weights (for
//! `kiln info`). [`crate::loaders::inspect`] fills it, each format in its loader.

use std::path::PathBuf;

use crate::config::TransformerConfig;
use crate::loaders::ModelFormat;

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
    /// What loading will accept leniently (see [`crate::LoadedModel::warnings`]).
    pub warnings: Vec<String>,
}
