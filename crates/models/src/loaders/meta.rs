//! Meta-layout Llama folders: `params.json`, `tokenizer.model` and the weights under Meta's
//! names (`tok_embeddings.weight`, `layers.N.attention.wq.weight`...), stored either as Meta's
//! original `consolidated.00.pth` or as a `torch.distributed.checkpoint` folder (torchtitan's
//! checkpoints: `.metadata` + `*.distcp`). [`Checkpoint`] is the only difference: both build
//! the same model through one path. Single-shard `.pth` only (8B and smaller);
//! `consolidated.01.pth` and beyond are tensor-parallel slices kiln does not merge (a DCP
//! folder's shards are merged: they are chunks of whole tensors).

use std::path::Path;

use kiln_core::InferenceBackend;

use super::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat, WeightStorage};
use crate::config::TransformerConfig;
use crate::decoder::TensorNames;
use crate::error::{ModelError, Result};
use crate::family::{self, llama::MetaParams};
use crate::info::ModelInfo;
use crate::tokenizer::TextTokenizer;
use crate::weights::{
    DcpSource, LoadProgress, PthSource, Reporting, TensorSource, file_size, read_text,
};

/// How a Meta-layout folder stores its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Checkpoint {
    /// `consolidated.00.pth` (Meta's downloads).
    Consolidated,
    /// `.metadata` + `*.distcp` (`torch.distributed.checkpoint`, torchtitan).
    TorchDistributed,
}

/// An opened checkpoint and the bytes its files take.
struct Opened {
    source: Box<dyn TensorSource>,
    file_bytes: u64,
}

impl Checkpoint {
    fn format(self) -> ModelFormat {
        match self {
            Checkpoint::Consolidated => ModelFormat::MetaOriginal,
            Checkpoint::TorchDistributed => ModelFormat::TorchDistributed,
        }
    }

    fn open(self, dir: &Path) -> Result<Opened> {
        match self {
            Checkpoint::Consolidated => {
                if dir.join("consolidated.01.pth").exists() {
                    return Err(ModelError::UnknownFormat {
                        path: dir.to_path_buf(),
                        reason: "multi-shard Meta checkpoints (consolidated.01.pth...) are not \
                                 supported; use the Hugging Face version of the model"
                            .into(),
                    });
                }
                let path = dir.join("consolidated.00.pth");
                let source = PthSource::open(&path)?;
                Ok(Opened {
                    source: Box::new(source),
                    file_bytes: file_size(&path)?,
                })
            }
            Checkpoint::TorchDistributed => {
                let source = DcpSource::open(dir)?;
                Ok(Opened {
                    file_bytes: source.bytes_on_disk(),
                    source: Box::new(source),
                })
            }
        }
    }
}

fn params(dir: &Path) -> Result<MetaParams> {
    let path = dir.join("params.json");
    serde_json::from_str(&read_text(&path)?).map_err(|e| ModelError::config(&path, e.to_string()))
}

fn d_ff(source: &dyn TensorSource) -> Result<usize> {
    let w1 = source.read("layers.0.feed_forward.w1.weight")?;
    Ok(w1.shape[0])
}

/// The configuration from `params.json` and the checkpoint (which alone knows `d_ff`).
fn config(
    dir: &Path,
    source: &dyn TensorSource,
    options: &LoadOptions,
) -> Result<TransformerConfig> {
    params(dir)?.to_config(
        &dir.join("params.json"),
        d_ff(source)?,
        options.rope_scaling_factor,
    )
}

pub(super) fn read_config(
    dir: &Path,
    checkpoint: Checkpoint,
    options: &LoadOptions,
) -> Result<TransformerConfig> {
    config(dir, checkpoint.open(dir)?.source.as_ref(), options)
}

/// Describes the folder from `params.json` and the checkpoint's index (opened once).
pub(super) fn inspect(
    dir: &Path,
    checkpoint: Checkpoint,
    options: &LoadOptions,
) -> Result<ModelInfo> {
    let opened = checkpoint.open(dir)?;
    Ok(ModelInfo {
        path: dir.to_path_buf(),
        format: checkpoint.format(),
        config: config(dir, opened.source.as_ref(), options)?,
        stored_types: opened.source.stored_types(),
        file_bytes: opened.file_bytes,
        tokenizer: dir
            .join("tokenizer.model")
            .exists()
            .then(|| "tokenizer.model (tiktoken BPE, Llama 3 special tokens)".to_string()),
        chat_template: true,
        warnings: Vec::new(),
    })
}

pub(super) fn load<B: InferenceBackend>(
    dir: &Path,
    checkpoint: Checkpoint,
    options: &LoadOptions,
    device: &B::Device,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedModel<B>> {
    let opened = checkpoint.open(dir)?;
    let source = opened.source.as_ref();
    let mut config = config(dir, source, options)?;
    let tokenizer_path = dir.join("tokenizer.model");
    let tokenizer = if tokenizer_path.exists() {
        Some(TextTokenizer::from_tiktoken(&tokenizer_path)?)
    } else {
        None
    };
    let mut generation = match &tokenizer {
        Some(tok) => GenerationSettings {
            bos: tok.token_id("<|begin_of_text|>"),
            eos: ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
                .iter()
                .filter_map(|t| tok.token_id(t))
                .collect(),
            add_bos: true,
        },
        None => GenerationSettings::default(),
    };
    let mut warnings = Vec::new();
    generation.drop_impossible(config.vocab, &mut warnings);
    config.bos = generation.bos;
    config.eos = generation.eos.clone();
    let reporting = Reporting::new(source, progress);
    let model = family::load_weights(
        config,
        TensorNames::Meta,
        &reporting,
        options.dtype,
        WeightStorage::Dequantized,
        options.activations,
        device,
    )?;
    reporting.finish();
    Ok(LoadedModel {
        model,
        tokenizer,
        generation,
        chat_template: Some(LLAMA3_CHAT_TEMPLATE.to_string()),
        format: checkpoint.format(),
        path: dir.to_path_buf(),
        warnings,
    })
}

/// Llama-3's chat format (Meta's `ChatFormat`), as a Jinja template.
pub const LLAMA3_CHAT_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
