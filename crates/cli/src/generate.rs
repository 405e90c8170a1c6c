//! `kiln generate`: continue one prompt, or many (`--prompts-file`) served together by the
//! engine: packed prefill, batched decode, the paged cache by default.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kiln_core::backend::BackendTask;
use kiln_core::{CausalLm, InferenceBackend, TokenId};
use kiln_engine::{Completion, EngineSettings, Event, Request, Run, Snapshot, SpecCounts, Timings};
use kiln_models::LoadedModel;
use serde_json::json;

use crate::engine_args::{self, EngineArgs, GENERATE};
use crate::exit::UsageError;
use crate::model_args::{BeamArgs, ModelArgs, SamplingArgs, SpeculationArgs, StructuredArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The prompt, fed as it is (no chat template; BOS is added where the model's tokenizer
    /// adds it). `-` reads it from stdin, as does giving none while stdin is a pipe.
    prompt: Option<String>,
    /// The prompt, as an option rather than an argument (`--prompt -` reads stdin).
    #[arg(long = "prompt", value_name = "TEXT", conflicts_with = "prompt")]
    prompt_option: Option<String>,
    /// The prompt as token ids, e.g. `1,2,3` (nothing added, nothing templated).
    #[arg(long, value_name = "IDS", value_delimiter = ',', conflicts_with_all = ["prompt", "prompt_option"])]
    token_ids: Option<Vec<u32>>,
    /// Many prompts, served together: one per line (blank lines skipped), or a `.jsonl` file
    /// of objects with a "prompt" field (for prompts with newlines).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_option", "token_ids"])]
    prompts_file: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Most new tokens per prompt.
    #[arg(
        long,
        short = 'n',
        value_name = "N",
        default_value_t = 128,
        help_heading = "Generation"
    )]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// End a sequence where this text appears (not included in the output); repeatable.
    #[arg(
        long,
        value_name = "TEXT",
        help_heading = "Generation",
        conflicts_with = "num_beams"
    )]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long, help_heading = "Generation")]
    ignore_eos: bool,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    speculation: SpeculationArgs,
    #[command(flatten)]
    beam: BeamArgs,
    #[command(flatten)]
    structured: StructuredArgs,
    /// Whitespace JSON output (--json-schema, --json-object, a grammar's `%json`) may have
    /// between its tokens: `compact` (none), `bounded` (one space, or one or two newlines and
    /// up to 20 spaces of indentation, as llama.cpp), or `free` (any).
    #[arg(long, value_name = "MODE", default_value = "bounded", value_parser = ["compact", "bounded", "free"], help_heading = "Structured output")]
    json_whitespace: String,
    /// Prefill the prompt, save its KV cache to FILE, then generate as usual.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "prompts_file",
        help_heading = "Snapshots"
    )]
    save_snapshot: Option<PathBuf>,
    /// Start from a KV-cache snapshot (saved with --save-snapshot by the same model and
    /// dtype) instead of a prompt: only the prompt's last token is computed.
    #[arg(long, value_name = "FILE", help_heading = "Snapshots", conflicts_with_all = ["prompt", "prompt_option", "token_ids", "prompts_file", "save_snapshot"])]
    from_snapshot: Option<PathBuf>,
    /// Print JSON instead of streaming text: one object per prompt, in input order.
    #[arg(long, help_heading = "Output")]
    json: bool,
    /// No summary line on stderr.
    #[arg(long, short, help_heading = "Output")]
    quiet: bool,
}

pub fn run(mut args: Args) -> Result<()> {
    args.sampling.params()?;
    args.speculation.speculation()?;
    args.beam.beam()?;
    let other_input =
        args.token_ids.is_some() || args.prompts_file.is_some() || args.from_snapshot.is_some();
    args.prompt = prompt_text(&args, other_input)?;
    if args.prompt.is_none() && !other_input {
        return Err(UsageError(NO_PROMPT.into()).into());
    }
    let settings = args.engine.settings(&GENERATE)?;
    let texts = match &args.prompts_file {
        Some(path) => Some(read_prompts(path)?),
        None => None,
    };
    let backend = args.model.backend;
    let task = Task {
        args,
        texts,
        settings,
    };
    crate::device::run_on(backend, false, task)?
}

const NO_PROMPT: &str = "no prompt: give one as an argument, `-` to read stdin, --token-ids, --prompts-file or --from-snapshot";

/// The prompt text: the argument or `--prompt`, with `-` (or nothing, on a pipe, when no
/// `other_input` gives the prompt) meaning stdin. One trailing newline (as `echo` adds) is
/// dropped.
fn prompt_text(args: &Args, other_input: bool) -> Result<Option<String>> {
    let given = args.prompt.as_deref().or(args.prompt_option.as_deref());
    let from_stdin = match given {
        Some("-") => true,
        Some(text) => return Ok(Some(text.to_string())),
        None => !other_input && !std::io::stdin().is_terminal(),
    };
    if !from_stdin {
        return Ok(None);
    }
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|e| UsageError(format!("reading the prompt from stdin: {e}")))?;
    let text = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t))
        .unwrap_or(&text);
    if text.is_empty() {
        let why = if given.is_some() {
            "the prompt read from stdin is empty"
        } else {
            NO_PROMPT
        };
        return Err(UsageError(why.into()).into());
    }
    Ok(Some(text.to_string()))
}

/// One prompt per line, or `{"prompt": ...}` per line of a `.jsonl` file.
fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if jsonl {
            let value: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| UsageError(format!("{} line {}: {e}", path.display(), i + 1)))?;
            let prompt = value
                .get("prompt")
                .and_then(|p| p.as_str())
                .ok_or_else(|| {
                    UsageError(format!(
                        "{} line {}: no \"prompt\" string",
                        path.display(),
                        i + 1
                    ))
                })?;
            prompts.push(prompt.to_string());
        } else {
            prompts.push(line.to_string());
        }
    }
    if prompts.is_empty() {
        bail!(UsageError(format!("{} holds no prompts", path.display())));
    }
    Ok(prompts)
}

struct Task {
    args: Args,
    texts: Option<Vec<String>>,
    settings: EngineSettings,
}

impl Task {
    fn prompts<B: InferenceBackend>(&self, loaded: &LoadedModel<B>) -> Result<Vec<Vec<TokenId>>> {
        if let Some(ids) = &self.args.token_ids {
            return Ok(vec![ids.iter().copied().map(TokenId).collect()]);
        }
        let Some(tokenizer) = &loaded.tokenizer else {
            bail!(UsageError(format!(
                "{} has no tokenizer files: give the prompt with --token-ids",
                loaded.path.display()
            )));
        };
        let texts = match &self.texts {
            Some(texts) => texts.clone(),
            None => vec![self.args.prompt.clone().unwrap_or_default()],
        };
        texts
            .iter()
            .map(|t| Ok(tokenizer.encode(t, true)?))
            .collect()
    }
}

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let args = &self.args;
        let loaded: LoadedModel<B> = args.model.load(&device)?;
        args.model.refuse_idle_activations(&loaded)?;
        let draft = args
            .speculation
            .load_draft(args.model.backend, &loaded, &device)?;
        let snapshot = match &args.from_snapshot {
            Some(path) => Some(Snapshot::load(path)?),
            None => None,
        };
        let prompts = match &snapshot {
            Some(snapshot) => vec![snapshot.tokens.clone()],
            None => self.prompts(&loaded)?,
        };
        if let Some(path) = &args.save_snapshot {
            Snapshot::prefill(&loaded.model, &prompts[0])?.save(path)?;
        }
        let shape = loaded.model.shape();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
        let beam = args.beam.beam()?;
        let kv_dtype = args.model.kv_dtype(&loaded.model)?;
        let run = Run {
            requests: Some(prompts.len()),
            // Each beam is a row of the batch and a sequence of the cache.
            rows_per_request: beam.map_or(1, |b| b.num_beams),
            max_len: (longest + args.max_tokens).min(shape.max_positions),
            ..engine_args::run_for(&loaded.model, kv_dtype, args.model.backend)
        };
        let mut spec = engine_args::spec(&self.settings, &run, &GENERATE)?;
        spec.config.speculation = args.speculation.speculation()?;
        let tokenizer = loaded.tokenizer.as_ref();
        let detok = tokenizer.map(|t| move |ids: &[TokenId]| t.decode(ids, false).ok());
        let draft_model = draft.as_ref().map(|d| &d.model as &dyn CausalLm<B>);
        let mut engine = spec.engine(&loaded.model, kv_dtype, draft_model)?;
        if let Some(detok) = &detok {
            engine = engine.with_detokenizer(detok);
        }
        let sampling = args.sampling.params()?;
        let whitespace = args
            .json_whitespace
            .parse()
            .map_err(|e: kiln_engine::UnknownJsonWhitespace| UsageError(e.to_string()))?;
        let constraint = args.structured.compile_with(&loaded, whitespace)?;
        let eos = if args.ignore_eos {
            Vec::new()
        } else {
            loaded.generation.eos.clone()
        };
        for prompt in &prompts {
            let request = Request {
                prompt: prompt.clone(),
                max_tokens: args.max_tokens,
                sampling: sampling.clone(),
                eos: eos.clone(),
                stop: args.stop.clone(),
                beam,
                constraint: constraint.clone(),
                ..Request::default()
            };
            match &snapshot {
                Some(snapshot) => engine.submit_snapshot(snapshot, request),
                None => engine.submit(request),
            }
            .context("submitting the prompt")?;
        }

        let started = std::time::Instant::now();
        let mut stdout = std::io::stdout().lock();
        let stream = !args.json && prompts.len() == 1;
        let mut printer = OrderedPrinter::new(prompts.len());
        let mut write_error = None;
        let completions = engine.run(|event| {
            let result = match event {
                // Without a tokenizer there is no text: stream the ids.
                Event::Token { token, .. } if stream && tokenizer.is_none() => {
                    write!(stdout, "{token} ").and_then(|()| stdout.flush())
                }
                Event::Token { text, .. } | Event::Text { text, .. } if stream => stdout
                    .write_all(text.as_bytes())
                    .and_then(|()| stdout.flush()),
                Event::Finished(c) if !stream => {
                    printer.finished(c, &prompts, args.json, &mut stdout)
                }
                _ => Ok(()),
            };
            if let Err(e) = result {
                write_error.get_or_insert(e);
            }
        })?;
        if let Some(e) = write_error {
            return Err(e).context("writing to stdout");
        }
        if stream {
            writeln!(stdout)?;
            if let [completion] = completions.as_slice() {
                print_other_beams(completion, &mut stdout)?;
            }
        }
        if !args.quiet {
            eprintln!("{}", summary(&completions, started.elapsed()));
        }
        Ok(())
    }
}

/// Prints completions in input order as soon as every earlier one is done.
struct OrderedPrinter {
    done: Vec<Option<Completion>>,
    next: usize,
}

impl OrderedPrinter {
    fn new(n: usize) -> Self {
        Self {
            done: vec![None; n],
            next: 0,
        }
    }

    fn finished(
        &mut self,
        completion: &Completion,
        prompts: &[Vec<TokenId>],
        json: bool,
        out: &mut impl Write,
    ) -> std::io::Result<()> {
        let index = completion.id.0 as usize;
        self.done[index] = Some(completion.clone());
        while let Some(Some(c)) = self.done.get(self.next) {
            let i = self.next;
            if json {
                writeln!(out, "{}", report_json(i, &prompts[i], c, prompts.len() > 1))?;
            } else {
                writeln!(out, "[{i}] {}", c.text.as_deref().unwrap_or_default())?;
                print_other_beams(c, out)?;
            }
            self.done[i] = None;
            self.next += 1;
        }
        out.flush()
    }
}

/// The hypotheses after the best of a beam search that returns several
/// (`--num-return-sequences`), each under a line with its rank, score and how it ended.
fn print_other_beams(c: &Completion, out: &mut impl Write) -> std::io::Result<()> {
    for (rank, h) in c.beams.iter().enumerate().skip(1) {
        let reason = format!("{:?}", h.finish_reason).to_lowercase();
        writeln!(out, "--- beam {rank} (score {:.4}, {reason})", h.score)?;
        let text = match &h.text {
            Some(text) => text.clone(),
            None => h.tokens.iter().map(|t| format!("{t} ")).collect(),
        };
        writeln!(out, "{text}")?;
    }
    Ok(())
}

/// `tokens / seconds`, or 0 for no time.
pub(crate) fn per_second(tokens: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

fn report_json(
    index: usize,
    prompt: &[TokenId],
    c: &Completion,
    with_index: bool,
) -> serde_json::Value {
    let ttft = c.timings.time_to_first_token.as_secs_f64();
    let decode = c.timings.decode.as_secs_f64();
    let mut value = json!({
        "prompt_tokens": prompt,
        "tokens": c.tokens,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "timings": {
            "time_to_first_token_ms": ttft * 1e3,
            "decode_ms": decode * 1e3,
            "prefill_tokens_per_s": per_second(prompt.len(), ttft),
            "decode_tokens_per_s": per_second(c.tokens.len().saturating_sub(1), decode),
        },
        "cached_tokens": c.cached_tokens,
        "preemptions": c.preemptions,
        "speculation": {
            "drafted_tokens": c.speculation.drafted,
            "accepted_tokens": c.speculation.accepted,
            "acceptance_rate": c.speculation.acceptance_rate(),
            "tokens_per_forward": c.speculation.tokens_per_forward(),
        },
    });
    if !c.beams.is_empty() {
        value["beams"] = json!(c.beams);
    }
    if with_index {
        value["index"] = json!(index);
    }
    value
}

/// How long some sequence was decoding: the union of the spans from each sequence's first
/// token to its last, all timed from the common submission (a prompts file submits every
/// prompt before the run). The rest of the run went to prefill. "The run less the last
/// first token" is the same when the prompts are prefilled together, and wrong when they run
/// one after another (`--max-batch 1`): the last prompt's first token then comes after every
/// other prompt's decode, which that formula counted as prefill.
fn decoding_time(timings: impl Iterator<Item = Timings>) -> Duration {
    let mut spans: Vec<(Duration, Duration)> = timings
        .map(|t| {
            let first = t.time_to_first_token;
            (first, first + t.decode)
        })
        .collect();
    spans.sort_unstable();
    let mut total = Duration::ZERO;
    let mut current: Option<(Duration, Duration)> = None;
    for (start, end) in spans {
        current = match current {
            Some((from, to)) if start <= to => Some((from, to.max(end))),
            Some((from, to)) => {
                total += to - from;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total + current.map_or(Duration::ZERO, |(from, to)| to - from)
}

/// One line: prompts, tokens in and out, and rates over the whole run.
fn summary(completions: &[Completion], elapsed: Duration) -> String {
    let prompt: usize = completions.iter().map(|c| c.prompt_tokens).sum();
    let cached: usize = completions.iter().map(|c| c.cached_tokens).sum();
    let generated: usize = completions.iter().map(|c| c.tokens.len()).sum();
    let ttft = completions
        .iter()
        .map(|c| c.timings.time_to_first_token)
        .max()
        .unwrap_or_default();
    let decoding = decoding_time(completions.iter().map(|c| c.timings));
    let prefilling = elapsed.saturating_sub(decoding).as_secs_f64();
    let decode = decoding.as_secs_f64();
    let decoded = generated.saturating_sub(completions.len());
    let reasons: Vec<String> = completions
        .iter()
        .map(|c| format!("{:?}", c.finish_reason).to_lowercase())
        .collect();
    let reasons = if completions.len() == 1 {
        reasons[0].clone()
    } else {
        format!("{} prompts", completions.len())
    };
    let mut counts = SpecCounts::default();
    for c in completions {
        counts.add(&c.speculation);
    }
    let speculation = if counts.drafted > 0 {
        format!(
            "; speculation: {} of {} drafts accepted ({:.0} %), {:.2} tokens per forward",
            counts.accepted,
            counts.drafted,
            counts.acceptance_rate() * 100.0,
            counts.tokens_per_forward()
        )
    } else {
        String::new()
    };
    let beams = match completions {
        [c] if !c.beams.is_empty() => format!(
            "; beam search: best score {:.4} of {} returned",
            c.beams[0].score,
            c.beams.len()
        ),
        _ => String::new(),
    };
    format!(
        "prompt {prompt} tokens ({cached} cached), generated {generated} tokens ({reasons}); prefill {:.1} tok/s, decode {:.1} tok/s, time to first token {:.0} ms{speculation}{beams}",
        per_second(prompt - cached, prefilling),
        per_second(decoded, decode),
        ttft.as_secs_f64() * 1e3
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first_ms: u64, decode_ms: u64) -> Timings {
        Timings {
            time_to_first_token: Duration::from_millis(first_ms),
            decode: Duration::from_millis(decode_ms),
        }
    }

    #[test]
    fn prompts_run_one_after_another_add_their_decodes() {
        // `--max-batch 1`: each prompt waits for the one before it.
        let spans = [span(100, 900), span(1100, 400), span(1600, 50)];
        assert_eq!(
            decoding_time(spans.into_iter()),
            Duration::from_millis(1350)
        );
    }

    #[test]
    fn prompts_decoded_together_count_once() {
        // Prefilled together, decoding side by side, one finishing early.
        let spans = [span(200, 800), span(210, 500), span(190, 810)];
        assert_eq!(decoding_time(spans.into_iter()), Duration::from_millis(810));
        assert_eq!(decoding_time(std::iter::empty()), Duration::ZERO);
    }
}
