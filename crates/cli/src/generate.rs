//! `kiln generate`: continue a prompt.

use std::io::Write;
use std::ops::ControlFlow;

use anyhow::{Result, bail};
use kiln_core::backend::{BackendTask, run_on};
use kiln_core::kv_cache::StaticKvCache;
use kiln_core::{CausalLm, InferenceBackend, TokenId};
use kiln_engine::{GenerateRequest, Generation, generate};
use kiln_models::LoadedModel;
use serde_json::json;

use crate::exit::UsageError;
use crate::model_args::{ModelArgs, SamplingArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The prompt. Fed as it is (no chat template); BOS is added where the model's tokenizer
    /// adds it.
    prompt: Option<String>,
    /// The prompt as token ids, e.g. `1,2,3` (nothing added, nothing templated).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    token_ids: Option<Vec<u32>>,
    #[command(flatten)]
    model: ModelArgs,
    /// Most new tokens.
    #[arg(long, short = 'n', default_value_t = 128)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// No summary line on stderr.
    #[arg(long, short)]
    quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    args.sampling.params()?;
    if args.prompt.is_none() && args.token_ids.is_none() {
        return Err(UsageError("give a prompt or --token-ids".into()).into());
    }
    let backend = args.model.backend;
    run_on(backend, Task(args))?
}

struct Task(Args);

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let loaded: LoadedModel<B> = args.model.load(&device)?;
        let prompt = prompt_ids(&args, &loaded)?;
        let shape = loaded.model.shape();
        let room = (prompt.len() + args.max_tokens)
            .min(shape.max_positions)
            .max(1);
        let mut cache =
            StaticKvCache::<B>::new(shape.kv_layout(), 1, room, args.model.dtype, &device)?;
        let request = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: args.max_tokens,
            sampling: args.sampling.params()?,
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
            loaded.path.display()
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
