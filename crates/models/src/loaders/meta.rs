//! Meta's original Llama-3 folders: `params.json`, `consolidated.00.pth`, `tokenizer.model`.
//! Single-shard checkpoints only (8B and smaller); `consolidated.01.pth` and beyond are
//! tensor-parallel slices kiln does not merge.

use std::path::Path;

use kiln_core::InferenceBackend;

use super::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat, WeightStorage};
use crate::config::TransformerConfig;
use crate::decoder::TensorNames;
use crate::error::{ModelError, Result};
use crate::family::{self, llama::MetaParams};
use crate::info::ModelInfo;
use crate::tokenizer::TextTokenizer;
use crate::weights::{LoadProgress, PthSource, Reporting, TensorSource, file_size, read_text};

fn params(dir: &Path) -> Result<MetaParams> {
    let path = dir.join("params.json");
    serde_json::from_str(&read_text(&path)?).map_err(|e| ModelError::config(&path, e.to_string()))
}

fn checkpoint(dir: &Path) -> Result<PthSource> {
    if dir.join("consolidated.01.pth").exists() {
        return Err(ModelError::UnknownFormat {
            path: dir.to_path_buf(),
            reason: "multi-shard Meta checkpoints (consolidated.01.pth...) are not supported; \
                     use the Hugging Face version of the model"
                .into(),
        });
    }
    PthSource::open(&dir.join("consolidated.00.pth"))
}

fn d_ff(source: &dyn TensorSource) -> Result<usize> {
    let w1 = source.read("layers.0.feed_forward.w1.weight")?;
    Ok(w1.shape[0])
}

/// The configuration from `params.json` and the checkpoint (which alone knows `d_ff`).
fn config(dir: &Path, source: &PthSource, options: &LoadOptions) -> Result<TransformerConfig> {
    params(dir)?.to_config(
        &dir.join("params.json"),
        d_ff(source)?,
        options.rope_scaling_factor,
    )
}

pub(super) fn read_config(dir: &Path, options: &LoadOptions) -> Result<TransformerConfig> {
    config(dir, &checkpoint(dir)?, options)
}

/// Describes the folder from `params.json` and the checkpoint's index (opened once).
pub(super) fn inspect(dir: &Path, options: &LoadOptions) -> Result<ModelInfo> {
    let source = checkpoint(dir)?;
    Ok(ModelInfo {
        path: dir.to_path_buf(),
        format: ModelFormat::MetaOriginal,
        config: config(dir, &source, options)?,
        stored_types: source.stored_types(),
        file_bytes: file_size(&dir.join("consolidated.00.pth"))?,
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
    options: &LoadOptions,
    device: &B::Device,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedModel<B>> {
    let source = checkpoint(dir)?;
    let mut config = config(dir, &source, options)?;
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
    let reporting = Reporting::new(&source, progress);
    let model = family::load_weights(
        config,
        TensorNames::Meta,
        &reporting,
        options.dtype,
        WeightStorage::Dequantized,
        device,
    )?;
    reporting.finish();
    Ok(LoadedModel {
        model,
        tokenizer,
        generation,
        chat_template: Some(LLAMA3_CHAT_TEMPLATE.to_string()),
        format: ModelFormat::MetaOriginal,
        path: dir.to_path_buf(),
        warnings,
    })
}

/// Llama-3's chat format (Meta's `ChatFormat`), as a Jinja template.
pub const LLAMA3_CHAT_TEMPLATE: &str = "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
