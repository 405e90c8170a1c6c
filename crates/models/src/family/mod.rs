//! The family registry: one [`Family`] per model family kiln runs, each owned by its module
//! (its config keys and defaults, its GGUF key prefix, what its block does differently), and
//! one table, [`FAMILIES`], that the loaders, `kiln info` and the docs read. A family's
//! differences from the shared decoder are data in its [`TransformerConfig`]; the weights of
//! every family but GPT-2 load through [`crate::decoder::load`].
//!
//! docs/models.md, "Adding a model family", is the recipe.

pub mod gemma;
pub mod gpt2;
pub mod llama;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;

use std::path::Path;

use kiln_core::{Dtype, InferenceBackend};
use serde_json::Value;

use crate::config::{Architecture, TransformerConfig};
use crate::decoder::{self, TensorNames};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::transformer::{Activations, Transformer, WeightStorage};
use crate::weights::TensorSource;

/// One model family.
#[derive(Debug)]
pub struct Family {
    /// The registry's key, stored in every [`TransformerConfig`].
    pub architecture: Architecture,
    /// Its name (`kiln info`, errors): the `model_type` of its HF config.
    pub name: &'static str,
    /// The models it covers, as users know them (`Qwen2 / Qwen2.5`).
    pub models: &'static str,
    /// The HF `config.json` `model_type` values it reads.
    pub hf_model_types: &'static [&'static str],
    /// The validated configuration from a whole `config.json` (the path names errors).
    pub hf_config: fn(Value, &Path) -> Result<TransformerConfig>,
    /// How llama.cpp's GGUF files of this family are read, if kiln reads them.
    pub gguf: Option<GgufFamily>,
    /// Which loader assembles its blocks.
    pub blocks: Blocks,
}

/// A family's GGUF form.
#[derive(Debug)]
pub struct GgufFamily {
    /// Its `general.architecture`, which is also its metadata keys' prefix.
    pub architecture: &'static str,
    /// The validated configuration from the file's metadata.
    pub config: fn(&GgufFile) -> Result<TransformerConfig>,
    /// Whether llama.cpp's converter stores `attn_q`/`attn_k` rows in Meta's interleaved RoPE
    /// order (its `LLAMA_ROPE_TYPE_NORM` families) rather than rotate-half (`NEOX`).
    pub qk_rows_interleaved: bool,
}

/// Which loader builds a family's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocks {
    /// GPT-2's `Conv1D` layers, fused `c_attn`, learned positions ([`gpt2::load`]).
    Gpt2,
    /// GPT-2's block in `nn.Linear` layers with multi-query attention ([`gpt2::load`]).
    GptBigCode,
    /// The rotary decoder ([`crate::decoder::load`]), shaped by the configuration.
    Decoder,
}

/// Every family, in the order shown to users.
pub static FAMILIES: [&Family; 9] = [
    &llama::LLAMA,
    &llama::MISTRAL,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &gemma::GEMMA2,
    &gemma::GEMMA3,
    &phi3::FAMILY,
    &gpt2::FAMILY,
    &gpt2::BIGCODE,
];

/// `config` once [`TransformerConfig::validate`] passes.
///
/// # Errors
/// [`ModelError::Config`] naming `path` and the inconsistency.
pub(crate) fn validated(config: TransformerConfig, path: &Path) -> Result<TransformerConfig> {
    config.validate().map_err(|e| ModelError::config(path, e))?;
    Ok(config)
}

/// `architecture`'s entry.
pub fn of(architecture: Architecture) -> &'static Family {
    FAMILIES
        .iter()
        .find(|f| f.architecture == architecture)
        .expect("every Architecture is registered")
}

/// The family whose HF config says `model_type`.
pub fn from_hf_model_type(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .into_iter()
        .find(|f| f.hf_model_types.contains(&model_type))
}

/// The family of a GGUF file whose `general.architecture` is `architecture`, and its GGUF form.
pub fn from_gguf_architecture(
    architecture: &str,
) -> Option<(&'static Family, &'static GgufFamily)> {
    FAMILIES.into_iter().find_map(|f| {
        f.gguf
            .as_ref()
            .filter(|g| g.architecture == architecture)
            .map(|g| (f, g))
    })
}

/// The families' names, for errors: `llama, mistral, ...`.
pub fn names() -> String {
    FAMILIES.map(|f| f.name).join(", ")
}

/// The GGUF architectures kiln reads, for errors.
pub fn gguf_names() -> String {
    FAMILIES
        .iter()
        .filter_map(|f| f.gguf.as_ref().map(|g| g.architecture))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Loads the weights of `config`'s family, named as `names`, from `source`.
///
/// # Errors
/// A missing tensor or one whose shape disagrees with `config`, naming file and tensor; a
/// naming the family's loader does not read (GPT-2 from a Meta folder).
pub fn load_weights<B: InferenceBackend>(
    config: TransformerConfig,
    names: TensorNames,
    source: &dyn TensorSource,
    dtype: Dtype,
    storage: WeightStorage,
    activations: Activations,
    device: &B::Device,
) -> Result<Transformer<B>> {
    let family = config.architecture.family();
    let qk_rows_interleaved = match names {
        TensorNames::HuggingFace => false,
        TensorNames::Meta => true,
        TensorNames::Gguf => family.gguf.as_ref().is_some_and(|g| g.qk_rows_interleaved),
    };
    match family.blocks {
        Blocks::Gpt2 => gpt2::load(
            config,
            names,
            gpt2::LinearLayout::Conv1d,
            source,
            dtype,
            storage,
            activations,
            device,
        ),
        Blocks::GptBigCode => gpt2::load(
            config,
            names,
            gpt2::LinearLayout::Linear,
            source,
            dtype,
            storage,
            activations,
            device,
        ),
        Blocks::Decoder => decoder::load(
            config,
            names,
            qk_rows_interleaved,
            source,
            dtype,
            storage,
            activations,
            device,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every architecture has exactly one entry, and names and model types are unique.
    #[test]
    fn the_registry_has_one_entry_per_architecture() {
        for family in FAMILIES {
            assert!(std::ptr::eq(of(family.architecture), family));
            for t in family.hf_model_types {
                assert!(std::ptr::eq(from_hf_model_type(t).unwrap(), family));
            }
            if let Some(g) = &family.gguf {
                assert!(std::ptr::eq(
                    from_gguf_architecture(g.architecture).unwrap().0,
                    family
                ));
            }
        }
        assert_eq!(
            names(),
            "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3, gpt2, gpt_bigcode"
        );
        assert!(from_hf_model_type("phi").is_none());
    }
}
