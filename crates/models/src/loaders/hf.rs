//! Hugging Face folders: `config.json`, `model.safetensors` or shards with
//! `model.safetensors.index.json`, `tokenizer.json` (or GPT-2's `vocab.json` + `merges.txt`),
//! `generation_config.json` (EOS ids), `tokenizer_config.json` (BOS handling, chat template).

use std::path::Path;

use kiln_core::InferenceBackend;
use serde_json::Value;

use super::{GenerationSettings, LoadOptions, LoadedModel, ModelFormat};
use crate::config::TransformerConfig;
use crate::decoder::{TensorNames, token_ids};
use crate::error::{ModelError, Result};
use crate::family;
use crate::info::ModelInfo;
use crate::tokenizer::TextTokenizer;
use crate::weights::{
    LanguageModelSource, LoadProgress, Reporting, SafetensorsSource, TensorSource, file_size,
    read_text,
};

fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(&read_text(path)?)
        .map_err(|e| ModelError::config(path, format!("invalid JSON: {e}")))
}

/// Reads and validates `config.json`.
pub(super) fn read_config(dir: &Path) -> Result<TransformerConfig> {
    let path = dir.join("config.json");
    let value = read_json(&path)?;
    let model_type = value
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let architecture = value
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or(model_type)
        .to_string();
    match family::from_hf_model_type(model_type) {
        Some(family) => (family.hf_config)(value, &path),
        None => Err(ModelError::UnsupportedArchitecture {
            path,
            architecture: if architecture.is_empty() {
                "(no model_type)".into()
            } else {
                architecture
            },
            supported: family::names(),
        }),
    }
}

fn weights(dir: &Path) -> Result<SafetensorsSource> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        return SafetensorsSource::open_index(&index);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return SafetensorsSource::open(&single);
    }
    Err(ModelError::MissingFile {
        path: single,
        what: "weights (model.safetensors or model.safetensors.index.json)",
    })
}

/// Which tokenizer files a folder has, in the order they are preferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenizerFiles {
    /// `tokenizer.json`.
    Json,
    /// GPT-2's `vocab.json` + `merges.txt`.
    VocabMerges,
}

impl TokenizerFiles {
    fn find(dir: &Path) -> Option<Self> {
        if dir.join("tokenizer.json").exists() {
            Some(Self::Json)
        } else if dir.join("vocab.json").exists() && dir.join("merges.txt").exists() {
            Some(Self::VocabMerges)
        } else {
            None
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Json => "tokenizer.json (Hugging Face tokenizers)",
            Self::VocabMerges => "vocab.json + merges.txt (byte-level BPE)",
        }
    }
}

fn tokenizer(dir: &Path) -> Result<Option<TextTokenizer>> {
    match TokenizerFiles::find(dir) {
        Some(TokenizerFiles::Json) => {
            TextTokenizer::from_tokenizer_json(&dir.join("tokenizer.json")).map(Some)
        }
        Some(TokenizerFiles::VocabMerges) => {
            TextTokenizer::from_vocab_merges(&dir.join("vocab.json"), &dir.join("merges.txt"))
                .map(Some)
        }
        None => Ok(None),
    }
}

/// Describes the folder from `config.json`, the safetensors headers and the tokenizer files.
pub(super) fn inspect(dir: &Path) -> Result<ModelInfo> {
    let source = weights(dir)?;
    let file_bytes = source
        .files()
        .iter()
        .map(|f| file_size(f))
        .sum::<Result<u64>>()?;
    // Lenient, as a description should be: an unreadable template just means none (loading
    // reports it as an error).
    let chat_template = tokenizer_config(dir)
        .and_then(|config| chat_template(dir, config.as_ref()))
        .is_ok_and(|t| t.is_some());
    Ok(ModelInfo {
        path: dir.to_path_buf(),
        format: ModelFormat::HuggingFace,
        config: read_config(dir)?,
        stored_types: source.stored_types(),
        file_bytes,
        tokenizer: TokenizerFiles::find(dir).map(|t| t.describe().to_string()),
        chat_template,
        warnings: Vec::new(),
    })
}

/// EOS ids: `generation_config.json` wins over `config.json` (instruct models list several
/// there); BOS and whether to add it from `tokenizer_config.json`.
fn generation_settings(
    dir: &Path,
    config: &TransformerConfig,
    tokenizer: Option<&TextTokenizer>,
) -> Result<(GenerationSettings, Option<String>)> {
    let mut settings = GenerationSettings {
        bos: config.bos,
        eos: config.eos.clone(),
        add_bos: false,
    };
    let generation = dir.join("generation_config.json");
    if generation.exists() {
        let value = read_json(&generation)?;
        let eos = token_ids(value.get("eos_token_id"));
        if !eos.is_empty() {
            settings.eos = eos;
        }
        if let Some(bos) = token_ids(value.get("bos_token_id")).first() {
            settings.bos = Some(*bos);
        }
    }
    let tokenizer_config = tokenizer_config(dir)?;
    if let Some(value) = &tokenizer_config {
        let bos_text = value.get("bos_token").and_then(|b| {
            b.as_str()
                .or_else(|| b.get("content").and_then(Value::as_str))
        });
        if let (Some(text), Some(tok)) = (bos_text, tokenizer)
            && let Some(id) = tok.token_id(text)
        {
            settings.bos = Some(id);
        }
        settings.add_bos = value
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    }
    // The tokenizer's own post-processor is what adds BOS; report what it really does.
    if let (Some(tok), Some(bos)) = (tokenizer, settings.bos) {
        settings.add_bos = tok.encode("a", true)?.first() == Some(&bos);
    }
    let chat_template = chat_template(dir, tokenizer_config.as_ref())?;
    Ok((settings, chat_template))
}

/// `tokenizer_config.json`, when the folder has one.
fn tokenizer_config(dir: &Path) -> Result<Option<Value>> {
    let path = dir.join("tokenizer_config.json");
    path.exists().then(|| read_json(&path)).transpose()
}

/// The chat template, where transformers looks for it: `chat_template.jinja` (what
/// transformers 4.47 and later save), else `tokenizer_config.json`'s `chat_template`: a
/// string, or a list of named templates of which kiln takes `default`.
///
/// # Errors
/// An unreadable file, or a `chat_template` that is neither form.
fn chat_template(dir: &Path, tokenizer_config: Option<&Value>) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return read_text(&jinja).map(Some);
    }
    match tokenizer_config.and_then(|config| config.get("chat_template")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(template)) => Ok(Some(template.clone())),
        Some(Value::Array(named)) => Ok(named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string)),
        Some(_) => Err(ModelError::config(
            dir.join("tokenizer_config.json"),
            "`chat_template` is neither a string nor a list of named templates",
        )),
    }
}

pub(super) fn load<B: InferenceBackend>(
    dir: &Path,
    options: &LoadOptions,
    device: &B::Device,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<LoadedModel<B>> {
    let mut config = read_config(dir)?;
    let mut warnings = config.drop_impossible_special_tokens();
    let files = weights(dir)?;
    let language_model = LanguageModelSource::detect(&files);
    let files: &dyn TensorSource = match &language_model {
        Some(adapter) => adapter,
        None => &files,
    };
    let source = Reporting::new(files, progress);
    // A checkpoint's F16/BF16 matrices are kept as stored where asked and the backend's
    // products take the dtype; otherwise (nothing here is quantized) they are converted.
    let weights = if options.dtype == kiln_core::Dtype::F32 || B::QUANTIZED_ANY_DTYPE {
        options.weights
    } else {
        super::WeightStorage::Dequantized
    };
    let model = family::load_weights(
        untie_if_head_present(config, &source),
        TensorNames::HuggingFace,
        &source,
        options.dtype,
        weights,
        options.activations,
        device,
    )?;
    source.finish();
    let tokenizer = tokenizer(dir)?;
    let (mut generation, chat_template) =
        generation_settings(dir, model.config(), tokenizer.as_ref())?;
    generation.drop_impossible(model.config().vocab, &mut warnings);
    Ok(LoadedModel {
        model,
        tokenizer,
        generation,
        chat_template,
        format: ModelFormat::HuggingFace,
        path: dir.to_path_buf(),
        warnings,
    })
}

/// A config that says "tied" while the file carries its own `lm_head.weight` is trusted to
/// the file (some exports keep both); an untied config without the head fails later with a
/// missing-tensor error naming it.
fn untie_if_head_present(
    mut config: TransformerConfig,
    source: &dyn TensorSource,
) -> TransformerConfig {
    let decoder = config.architecture.family().blocks == family::Blocks::Decoder;
    if decoder && config.tied_head && source.contains(TensorNames::HuggingFace.head()) {
        config.tied_head = false;
    }
    config
}
