//! Loading a model and its tokenizer from a path: a Hugging Face folder (`config.json`), a
//! Meta original folder (`params.json`), a `torch.distributed.checkpoint` folder in Meta's
//! layout (`.metadata` + `params.json`, torchtitan's) or a llama.cpp GGUF file. [`load`]
//! detects which.

mod gguf;
mod hf;
mod meta;

/// Re-exported where [`LoadOptions`] names it; it lives beside [`crate::transformer::WeightLoader`],
/// which honours it, so that the model's code needs nothing from the loaders.
pub use crate::transformer::{Activations, WeightStorage};
pub use meta::LLAMA3_CHAT_TEMPLATE;

use meta::Checkpoint;

use std::path::{Path, PathBuf};

use kiln_core::{Dtype, InferenceBackend, TokenId};

use crate::config::TransformerConfig;
use crate::error::{ModelError, Result};
use crate::info::ModelInfo;
use crate::tokenizer::TextTokenizer;
use crate::transformer::Transformer;
use crate::weights::LoadProgress;

/// The formats kiln reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    /// `config.json` + safetensors (single or sharded).
    HuggingFace,
    /// `params.json` + `consolidated.00.pth` + `tokenizer.model`.
    MetaOriginal,
    /// A `torch.distributed.checkpoint` folder (torchtitan): `.metadata` + `*.distcp` holding
    /// Meta's tensor names (under `model.` or not), with Meta's `params.json` and
    /// `tokenizer.model`. Loaded as [`ModelFormat::MetaOriginal`] is, to the same model.
    TorchDistributed,
    /// One llama.cpp `.gguf` file (weights, tokenizer and chat template).
    Gguf,
}

impl ModelFormat {
    /// The name shown to users.
    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::HuggingFace => "huggingface",
            ModelFormat::MetaOriginal => "meta",
            ModelFormat::TorchDistributed => "torch-dcp",
            ModelFormat::Gguf => "gguf",
        }
    }
}

/// How to load.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Precision of weights and activations (weights are cast at load).
    pub dtype: Dtype,
    /// Meta and torch-dcp folders only: the llama3 RoPE scaling factor when `params.json` does not say
    /// (8 for Llama 3.1, the default; 32 for Llama 3.2 1B and 3B).
    pub rope_scaling_factor: Option<f32>,
    /// Whether GGUF weights in a type with a CPU kernel (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) stay
    /// quantized instead of being dequantized to `dtype`. Other formats ignore it.
    pub weights: WeightStorage,
    /// How the CPU kernels quantize a quantized product's activations (GGUF weights kept
    /// quantized only).
    pub activations: Activations,
    /// The longest sequence the run serves (llama.cpp's `-c`, vLLM's `--max-model-len`), at
    /// most the model's own context; `None` for the model's. It also picks LongRoPE's factors
    /// ([`crate::config::LongRopeScaling::factors_for`]).
    pub context: Option<usize>,
}

impl LoadOptions {
    /// `config` with its context capped at [`Self::context`].
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` for a context of 0 or above the model's.
    fn limit_context(
        &self,
        mut config: TransformerConfig,
        path: &Path,
    ) -> Result<TransformerConfig> {
        if let Some(context) = self.context {
            config
                .limit_context(context)
                .map_err(|e| ModelError::config(path, e))?;
        }
        Ok(config)
    }
}

/// What generation needs to know beyond the weights.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GenerationSettings {
    /// Beginning-of-sequence token.
    pub bos: Option<TokenId>,
    /// Every token that ends a sequence.
    pub eos: Vec<TokenId>,
    /// Whether encoding a prompt adds BOS (done by the tokenizer's post-processor).
    pub add_bos: bool,
}

impl GenerationSettings {
    /// Drops BOS / EOS ids outside a vocabulary of `vocab` tokens (as
    /// [`crate::config::drop_impossible_special_tokens`]), adding a warning for each to
    /// `warnings` unless the same one is there already (`config.json` and
    /// `generation_config.json` usually repeat the same ids).
    pub(crate) fn drop_impossible(&mut self, vocab: usize, warnings: &mut Vec<String>) {
        for warning in
            crate::config::drop_impossible_special_tokens(&mut self.bos, &mut self.eos, vocab)
        {
            if !warnings.contains(&warning) {
                warnings.push(warning);
            }
        }
    }
}

/// A model with what came with it.
#[derive(Debug)]
pub struct LoadedModel<B: InferenceBackend> {
    /// The weights on the device.
    pub model: Transformer<B>,
    /// The tokenizer, when the folder has one.
    pub tokenizer: Option<TextTokenizer>,
    /// BOS / EOS.
    pub generation: GenerationSettings,
    /// The Jinja chat template (HF `tokenizer_config.json`, GGUF `tokenizer.chat_template`).
    pub chat_template: Option<String>,
    /// The format read.
    pub format: ModelFormat,
    /// The path read.
    pub path: PathBuf,
    /// What the loader accepted but a user should know: lenient readings of the configuration
    /// that transformers makes too (a special token outside the vocabulary, dropped). The
    /// library never prints; the CLI shows these as warnings.
    pub warnings: Vec<String>,
}

/// The format of `path`.
///
/// # Errors
/// [`ModelError::UnknownFormat`] or a missing path.
pub fn detect_format(path: &Path) -> Result<ModelFormat> {
    if !path.exists() {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "model",
        });
    }
    if gguf::is_gguf(path) {
        return Ok(ModelFormat::Gguf);
    }
    if path.is_dir() {
        if path.join("config.json").exists() {
            return Ok(ModelFormat::HuggingFace);
        }
        if path.join(crate::weights::METADATA_FILE).exists() {
            return Ok(ModelFormat::TorchDistributed);
        }
        if path.join("params.json").exists() {
            return Ok(ModelFormat::MetaOriginal);
        }
    }
    Err(ModelError::UnknownFormat {
        path: path.to_path_buf(),
        reason: "expected a Hugging Face folder (config.json), a Meta folder (params.json), a \
                 torch.distributed.checkpoint folder (.metadata and params.json) or a GGUF file"
            .into(),
    })
}

/// Reads the configuration only (for `kiln info` and sizing caches before loading).
/// Special tokens outside the vocabulary are dropped, as [`load`] drops them.
///
/// # Errors
/// As [`load`], for the configuration files.
pub fn read_config(path: &Path, options: &LoadOptions) -> Result<TransformerConfig> {
    let mut config = match detect_format(path)? {
        ModelFormat::HuggingFace => hf::read_config(path),
        ModelFormat::MetaOriginal => meta::read_config(path, Checkpoint::Consolidated, options),
        ModelFormat::TorchDistributed => {
            meta::read_config(path, Checkpoint::TorchDistributed, options)
        }
        ModelFormat::Gguf => gguf::read_config(path),
    }?;
    config.drop_impossible_special_tokens();
    options.limit_context(config, path)
}

/// Describes the model at `path` from its configuration, tensor headers and tokenizer files,
/// without loading its weights.
///
/// # Errors
/// As [`load`], for the files it reads.
pub fn inspect(path: &Path, options: &LoadOptions) -> Result<ModelInfo> {
    let mut info = match detect_format(path)? {
        ModelFormat::HuggingFace => hf::inspect(path),
        ModelFormat::MetaOriginal => meta::inspect(path, Checkpoint::Consolidated, options),
        ModelFormat::TorchDistributed => meta::inspect(path, Checkpoint::TorchDistributed, options),
        ModelFormat::Gguf => gguf::inspect(path),
    }?;
    info.warnings = info.config.drop_impossible_special_tokens();
    info.config = options.limit_context(info.config, path)?;
    Ok(info)
}

/// Loads the model at `path` onto `device`.
///
/// # Errors
/// A [`ModelError`] naming the file (and tensor) at fault; never panics on bad input.
pub fn load<B: InferenceBackend>(
    path: &Path,
    options: &LoadOptions,
    device: &B::Device,
) -> Result<LoadedModel<B>> {
    load_with_progress(path, options, device, &mut |_| {})
}

/// [`load`], calling `progress` as tensors are read, dequantized and uploaded (for a progress
/// bar; the library itself never prints).
///
/// # Errors
/// As [`load`].
pub fn load_with_progress<B: InferenceBackend>(
    path: &Path,
    options: &LoadOptions,
    device: &B::Device,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedModel<B>> {
    B::require_dtype(device, options.dtype)?;
    let mut loaded = match detect_format(path)? {
        ModelFormat::HuggingFace => hf::load(path, options, device, progress),
        ModelFormat::MetaOriginal => {
            meta::load(path, Checkpoint::Consolidated, options, device, progress)
        }
        ModelFormat::TorchDistributed => meta::load(
            path,
            Checkpoint::TorchDistributed,
            options,
            device,
            progress,
        ),
        ModelFormat::Gguf => gguf::load(path, options, device, progress),
    }?;
    if let Some(context) = options.context {
        loaded
            .model
            .limit_context(context)
            .map_err(|e| ModelError::config(path, e))?;
    }
    Ok(loaded)
}
