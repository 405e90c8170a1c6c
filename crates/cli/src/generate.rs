//! `kiln generate`: continue a prompt.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use kiln_core::backend::{BackendKind, BackendTask, run_on};
use kiln_core::kv_cache::StaticKvCache;
use kiln_core::sampling::SamplingParams;
use kiln_core::{CausalLm, Dtype, InferenceBackend, TokenId};
use kiln_engine::{GenerateRequest, Generation, generate};
use kiln_models::{LoadOptions, LoadedModel};
use serde_json::json;

use crate::exit::UsageError;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The prompt. Fed as it is (no chat template); BOS is added where the model's tokenizer
    /// adds it.
    prompt: Option<String>,
    /// The prompt as token ids, e.g. `1,2,3` (nothing added, nothing templated).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    token_ids: Option<Vec<u32>>,
    /// Model: a Hugging Face folder (config.json + safetensors) or a Meta folder (params.json).
    #[arg(long, short)]
    model: PathBuf,
    /// Backend: cuda, wgpu, cpu or ndarray.
    #[arg(long, short, default_value = "cpu")]
    backend: BackendKind,
    /// Precision of weights, activations and KV cache: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: Dtype,
    /// Most new tokens.
    #[arg(long, short = 'n', default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Nucleus sampling: keep tokens until their probability reaches P (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than M times the best (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty over prompt and output, Hugging Face semantics (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// OpenAI presence penalty over the output (0 = off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// OpenAI frequency penalty over the output (0 = off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed for sampling; same seed, same output.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Meta folders: the llama3 RoPE scaling factor when params.json lacks it (8 for Llama
    /// 3.1, 32 for 3.2 1B/3B).
    #[arg(long)]
    rope_scaling_factor: Option<f32>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// No summary line on stderr.
    #[arg(long, short)]
    quiet: bool,
}

impl Args {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    args.sampling().validate()?;
    if args.prompt.is_none() && args.token_ids.is_none() {
        return Err(UsageError("give a prompt or --token-ids".into()).into());
    }
    let backend = args.backend;
    run_on(backend, Task(args))?
}

struct Task(Args);

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let options = LoadOptions {
            dtype: args.dtype,
            rope_scaling_factor: args.rope_scaling_factor,
        };
        let loaded: LoadedModel<B> =
            kiln_models::load(&args.model, &options, &device).context("loading the model")?;
        let prompt = prompt_ids(&args, &loaded)?;
        let shape = loaded.model.shape();
        let room = (prompt.len() + args.max_tokens)
            .min(shape.max_positions)
            .max(1);
        let mut cache = StaticKvCache::<B>::new(shape.kv_layout(), 1, room, args.dtype, &device)?;
        let request = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: args.max_tokens,
            sampling: args.sampling(),
            eos: if args.ignore_eos {
                Vec::new()
            } else {
                loaded.generation.eos.clone()
            },
        };
        let tokenizer = loaded.tokenizer.as_ref();
        let mut stdout = std::io::stdout().lock();
        let mut stream = tokenizer.map(|t| t.inner().decode_stream(false));
        let generation = generate(&loaded.model, &mut cache, &request, |token| {
            if !args.json {
                let piece = match stream.as_mut() {
                    Some(stream) => stream.step(token.0).ok().flatten(),
                    None => Some(format!("{token} ")),
                };
                if let Some(piece) = piece
                    && (stdout.write_all(piece.as_bytes()).is_err() || stdout.flush().is_err())
                {
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })?;
        let text = tokenizer
            .map(|t| t.decode(&generation.tokens, false))
            .transpose()?;
        if args.json {
            let value = report_json(&prompt, &generation, text);
            writeln!(stdout, "{value}")?;
        } else {
            writeln!(stdout)?;
        }
        if !args.quiet {
            eprintln!("{}", summary(prompt.len(), &generation));
        }
        Ok(())
    }
}

fn prompt_ids<B: InferenceBackend>(args: &Args, loaded: &LoadedModel<B>) -> Result<Vec<TokenId>> {
    if let Some(ids) = &args.token_ids {
        return Ok(ids.iter().copied().map(TokenId).collect());
    }
    let text = args.prompt.as_deref().unwrap_or_default();
    let Some(tokenizer) = &loaded.tokenizer else {
        bail!(UsageError(format!(
            "{} has no tokenizer files: give the prompt with --token-ids",
            args.model.display()
        )));
    };
    Ok(tokenizer.encode(text, true)?)
}

fn per_second(tokens: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

fn report_json(prompt: &[TokenId], g: &Generation, text: Option<String>) -> serde_json::Value {
    let decoded = g.tokens.len().saturating_sub(1);
    json!({
        "prompt_tokens": prompt,
        "tokens": g.tokens,
        "text": text,
        "finish_reason": g.finish_reason,
        "timings": {
            "prefill_ms": g.prefill.as_secs_f64() * 1e3,
            "decode_ms": g.decode.as_secs_f64() * 1e3,
            "prefill_tokens_per_s": per_second(prompt.len(), g.prefill.as_secs_f64()),
            "decode_tokens_per_s": per_second(decoded, g.decode.as_secs_f64()),
        }
    })
}

fn summary(prompt: usize, g: &Generation) -> String {
    let decoded = g.tokens.len().saturating_sub(1);
    format!(
        "prompt {prompt} tokens, generated {} tokens ({:?}); prefill {:.1} tok/s, decode {:.1} tok/s, time to first token {:.0} ms",
        g.tokens.len(),
        g.finish_reason,
        per_second(prompt, g.prefill.as_secs_f64()),
        per_second(decoded, g.decode.as_secs_f64()),
        g.prefill.as_secs_f64() * 1e3
    )
}
