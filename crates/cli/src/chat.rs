//! `kiln chat`: a conversation at the terminal (or on piped stdin). Each line is a user turn;
//! the conversation is rendered with the model's chat template and the reply streams to
//! stdout. With a message on the command line (`kiln chat "Tell me a story"`) it answers that
//! one turn and exits, as `ollama run MODEL "…"` does. The KV cache is kept between turns ([`kiln_engine::Session`]), so a turn computes
//! only its new tokens. Lines starting with `/` are commands (`/help` lists them); Ctrl-C stops
//! the reply being written, not the program.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, anyhow};
use kiln_core::backend::BackendTask;
use kiln_core::sampling::SamplingParams;
use kiln_core::{InferenceBackend, TokenId};
use kiln_engine::{Completion, EngineSettings, Request, Run, Session};
use kiln_models::LoadedModel;
use kiln_models::chat::{ChatMessage, ChatTemplate, Role};

use crate::engine_args::{self, CHAT, EngineArgs};
use crate::exit::UsageError;
use crate::generate::per_second;
use crate::model_args::{ModelArgs, SamplingArgs, StructuredArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// A message to answer once, then exit (stdin is not read). Without it, each line of stdin
    /// is a turn of the conversation.
    #[arg(value_name = "MESSAGE")]
    message: Option<String>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    structured: StructuredArgs,
    /// Most new tokens per reply.
    #[arg(
        long,
        short = 'n',
        value_name = "N",
        default_value_t = 512,
        help_heading = "Generation"
    )]
    max_tokens: usize,
    /// A system message to start the conversation with (the template's default otherwise).
    #[arg(long, value_name = "TEXT", help_heading = "Generation")]
    system: Option<String>,
    /// More variables for the chat template, as a JSON object (llama.cpp's flag, vLLM's
    /// `chat_template_kwargs`): `{"enable_thinking": false}` turns Qwen3's thinking off.
    #[arg(long, value_name = "JSON", value_parser = parse_template_kwargs, help_heading = "Generation")]
    chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

pub fn run(args: Args) -> Result<()> {
    args.sampling.params()?;
    let settings = args.engine.settings(&CHAT)?;
    let backend = args.model.backend;
    crate::device::run_on(backend, false, Task(args, settings))?
}

struct Task(Args, EngineSettings);

const HELP: &str = "\
commands:
  /system TEXT        start over with this system message (/system alone: the default)
  /clear              start over, keeping the system message
  /temperature X      and /top-k N, /top-p P, /min-p M, /repetition-penalty R,
                      /presence-penalty P, /frequency-penalty F, /seed N (or none),
                      /max-tokens N: change how replies are sampled
  /settings           show the sampling settings
  /stats              speed of the last reply and size of the conversation
  /help               this list
  /exit               quit (so does Ctrl-D); Ctrl-C stops a reply";

/// What a line of input asks for.
#[derive(Debug, PartialEq)]
enum Input<'a> {
    Say(&'a str),
    System(&'a str),
    Clear,
    Set(&'a str, &'a str),
    Settings,
    Stats,
    Help,
    Exit,
    Unknown(&'a str),
}

fn parse(line: &str) -> Input<'_> {
    let line = line.trim();
    let Some(command) = line.strip_prefix('/') else {
        return Input::Say(line);
    };
    let (name, rest) = command.split_once(' ').unwrap_or((command, ""));
    let rest = rest.trim();
    match name {
        "exit" | "quit" => Input::Exit,
        "clear" => Input::Clear,
        "system" => Input::System(rest),
        "settings" => Input::Settings,
        "stats" => Input::Stats,
        "help" | "?" => Input::Help,
        knob if Knob::parse(knob).is_some() => Input::Set(knob, rest),
        _ => Input::Unknown(name),
    }
}

/// The settings `/NAME VALUE` changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Knob {
    Temperature,
    TopK,
    TopP,
    MinP,
    RepetitionPenalty,
    PresencePenalty,
    FrequencyPenalty,
    Seed,
    MaxTokens,
}

impl Knob {
    fn parse(name: &str) -> Option<Self> {
        Some(match name.replace('_', "-").as_str() {
            "temperature" | "temp" => Knob::Temperature,
            "top-k" => Knob::TopK,
            "top-p" => Knob::TopP,
            "min-p" => Knob::MinP,
            "repetition-penalty" => Knob::RepetitionPenalty,
            "presence-penalty" => Knob::PresencePenalty,
            "frequency-penalty" => Knob::FrequencyPenalty,
            "seed" => Knob::Seed,
            "max-tokens" => Knob::MaxTokens,
            _ => return None,
        })
    }
}

/// How replies are made; changed by `/temperature` and friends.
#[derive(Debug, Clone)]
struct Settings {
    sampling: SamplingParams,
    max_tokens: usize,
}

impl Settings {
    /// Applies `/name value`, or says why not (the settings are unchanged then).
    fn set(&mut self, name: &str, value: &str) -> Result<String, String> {
        let knob = Knob::parse(name).ok_or_else(|| format!("unknown setting {name}"))?;
        let float = || {
            value
                .parse::<f32>()
                .map_err(|_| format!("/{name} takes a number, got `{value}`"))
        };
        let count = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("/{name} takes a whole number, got `{value}`"))
        };
        let mut next = self.clone();
        let s = &mut next.sampling;
        match knob {
            Knob::Temperature => s.temperature = float()?,
            Knob::TopK => s.top_k = count()?,
            Knob::TopP => s.top_p = float()?,
            Knob::MinP => s.min_p = float()?,
            Knob::RepetitionPenalty => s.repetition_penalty = float()?,
            Knob::PresencePenalty => s.presence_penalty = float()?,
            Knob::FrequencyPenalty => s.frequency_penalty = float()?,
            Knob::Seed => {
                s.seed = match value {
                    "none" | "off" => None,
                    _ => Some(value.parse().map_err(|_| {
                        format!("/seed takes a whole number or `none`, got `{value}`")
                    })?),
                }
            }
            Knob::MaxTokens => match count()? {
                0 => return Err("/max-tokens must be positive".into()),
                n => next.max_tokens = n,
            },
        }
        next.sampling.validate().map_err(|e| e.to_string())?;
        *self = next;
        Ok(self.describe())
    }

    fn describe(&self) -> String {
        let s = &self.sampling;
        let seed = s.seed.map_or("none".to_string(), |seed| seed.to_string());
        format!(
            "temperature {}, top-k {}, top-p {}, min-p {}, repetition-penalty {}, presence-penalty {}, frequency-penalty {}, seed {seed}, max-tokens {}",
            s.temperature,
            s.top_k,
            s.top_p,
            s.min_p,
            s.repetition_penalty,
            s.presence_penalty,
            s.frequency_penalty,
            self.max_tokens
        )
    }
}

/// Ctrl-C while a reply is being written stops it; at the prompt it only says how to quit.
static REPLYING: AtomicBool = AtomicBool::new(false);
static STOP_REPLY: AtomicBool = AtomicBool::new(false);

fn install_ctrl_c(interactive: bool) {
    // Without a handler (it failed to install) Ctrl-C ends the program, as it would anyway.
    let _ = ctrlc::set_handler(move || {
        if REPLYING.load(Ordering::SeqCst) {
            STOP_REPLY.store(true, Ordering::SeqCst);
        } else if interactive {
            eprint!("\n(Ctrl-C stops a reply; /exit or Ctrl-D quits)\n> ");
        }
    });
}

/// The text a template inserts for token `id`, or "".
fn token_text<B: InferenceBackend>(loaded: &LoadedModel<B>, id: Option<TokenId>) -> String {
    match (&loaded.tokenizer, id) {
        (Some(t), Some(id)) => t.inner().id_to_token(id.0).unwrap_or_default(),
        _ => String::new(),
    }
}

/// `/stats`: the last reply's speed and what the cache holds.
fn stats<B: InferenceBackend>(
    last: Option<&Completion>,
    session: &Session<'_, B>,
    turns: usize,
) -> String {
    let mut out = String::new();
    if let Some(reply) = last {
        let ttft = reply.timings.time_to_first_token.as_secs_f64();
        let computed = reply.prompt_tokens - reply.cached_tokens;
        out += &format!(
            "last reply: {} tokens ({}); prompt {} tokens: {} reused from the cache, {} computed\n\
             time to first token {:.0} ms, prefill {:.1} tok/s, decode {:.1} tok/s\n",
            reply.tokens.len(),
            format!("{:?}", reply.finish_reason).to_lowercase(),
            reply.prompt_tokens,
            reply.cached_tokens,
            computed,
            ttft * 1e3,
            per_second(computed, ttft),
            per_second(
                reply.tokens.len().saturating_sub(1),
                reply.timings.decode.as_secs_f64()
            ),
        );
    } else {
        out += "no reply yet\n";
    }
    let cache = session.cache();
    let usage = cache.usage();
    out += &format!(
        "conversation: {turns} turns, {} tokens in the {} cache ({} of {} slots in use)",
        session.cached().len(),
        cache.kind(),
        usage.used,
        usage.capacity
    );
    out
}

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let Task(args, engine) = self;
        let loaded: LoadedModel<B> = args.model.load(&device)?;
        args.model.refuse_idle_activations(&loaded)?;
        let tokenizer = loaded.tokenizer.as_ref().ok_or_else(|| {
            UsageError(format!(
                "{} has no tokenizer; chat needs one",
                loaded.path.display()
            ))
        })?;
        let source = loaded.chat_template.as_deref().ok_or_else(|| {
            UsageError(format!(
                "{} has no chat template; use `kiln generate`",
                loaded.path.display()
            ))
        })?;
        let constraint = args.structured.compile(&loaded)?;
        let eos_text = token_text(&loaded, loaded.generation.eos.first().copied());
        let template = ChatTemplate::new(
            source,
            &token_text(&loaded, loaded.generation.bos),
            &eos_text,
        )?;
        let kv_dtype = args.model.kv_dtype(&loaded.model)?;
        // One conversation, as long as the context.
        let run = Run {
            requests: Some(1),
            ..engine_args::run_for(&loaded.model, kv_dtype, args.model.backend)
        };
        let spec = engine_args::spec(&engine, &run, &CHAT)?;
        let mut session = spec.session(&loaded.model, kv_dtype)?;
        let mut settings = Settings {
            sampling: args.sampling.params()?,
            max_tokens: args.max_tokens,
        };

        // One turn from the command line, or a conversation on stdin.
        let one_shot = args.message.is_some();
        let interactive = !one_shot && std::io::stdin().is_terminal();
        install_ctrl_c(interactive);
        if interactive {
            eprintln!(
                "kiln chat with {} (/help for commands)",
                loaded.path.display()
            );
        }
        let mut system = args.system.clone();
        let template_kwargs = args.chat_template_kwargs.clone().unwrap_or_default();
        let mut turns: Vec<ChatMessage> = Vec::new();
        let mut last: Option<Completion> = None;
        let mut stdout = std::io::stdout();
        let mut lines: Box<dyn Iterator<Item = std::io::Result<String>>> = match &args.message {
            Some(message) => Box::new(std::iter::once(Ok(message.clone()))),
            None => Box::new(std::io::stdin().lock().lines()),
        };
        loop {
            if interactive {
                eprint!("> ");
            }
            let Some(line) = lines.next() else { break };
            let line = line?;
            // A message given as an argument is said as it is, even when it starts with `/`.
            let input = if one_shot {
                Input::Say(line.trim())
            } else {
                parse(&line)
            };
            let text = match input {
                Input::Exit => break,
                Input::Clear => {
                    turns.clear();
                    session.reset();
                    continue;
                }
                Input::System(text) => {
                    system = (!text.is_empty()).then(|| text.to_string());
                    turns.clear();
                    session.reset();
                    continue;
                }
                Input::Set(name, value) => {
                    match settings.set(name, value) {
                        Ok(now) => eprintln!("{now}"),
                        Err(why) => eprintln!("{why}"),
                    }
                    continue;
                }
                Input::Settings => {
                    eprintln!("{}", settings.describe());
                    continue;
                }
                Input::Stats => {
                    eprintln!("{}", stats(last.as_ref(), &session, turns.len() / 2));
                    continue;
                }
                Input::Help => {
                    eprintln!("{HELP}");
                    continue;
                }
                Input::Unknown(name) => {
                    eprintln!("unknown command /{name} (/help lists them)");
                    continue;
                }
                Input::Say("") => continue,
                Input::Say(text) => text.to_string(),
            };
            turns.push(ChatMessage::new(Role::User, text));
            let messages: Vec<ChatMessage> = system
                .iter()
                .map(|s| ChatMessage::new(Role::System, s.clone()))
                .chain(turns.iter().cloned())
                .collect();
            let request = Request {
                prompt: tokenizer.encode(
                    &template.render_with(&messages, true, &template_kwargs)?,
                    false,
                )?,
                max_tokens: settings.max_tokens,
                sampling: settings.sampling.clone(),
                eos: loaded.generation.eos.clone(),
                constraint: constraint.clone(),
                ..Request::default()
            };
            let mut stream = tokenizer.inner().decode_stream(true);
            STOP_REPLY.store(false, Ordering::SeqCst);
            REPLYING.store(true, Ordering::SeqCst);
            let result = session.reply(request, |token| {
                if STOP_REPLY.load(Ordering::SeqCst) {
                    return ControlFlow::Break(());
                }
                if let Ok(Some(piece)) = stream.step(token.0)
                    && (stdout.write_all(piece.as_bytes()).is_err() || stdout.flush().is_err())
                {
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            });
            REPLYING.store(false, Ordering::SeqCst);
            writeln!(stdout)?;
            match result {
                Ok(reply) => {
                    if STOP_REPLY.load(Ordering::SeqCst) {
                        eprintln!("(stopped)");
                    }
                    let text = tokenizer.decode(&reply.tokens, true)?;
                    turns.push(ChatMessage::new(Role::Assistant, text));
                    last = Some(reply);
                }
                Err(e) => {
                    turns.pop();
                    eprintln!("error: {}", anyhow!(e));
                }
            }
        }
        Ok(())
    }
}

/// `--chat-template-kwargs`: a JSON object.
fn parse_template_kwargs(
    text: &str,
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err("expected a JSON object, e.g. {\"enable_thinking\": false}".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_into_commands() {
        assert_eq!(parse("  hello "), Input::Say("hello"));
        assert_eq!(parse("/exit"), Input::Exit);
        assert_eq!(parse("/system Be brief. "), Input::System("Be brief."));
        assert_eq!(parse("/temperature 0.2"), Input::Set("temperature", "0.2"));
        assert_eq!(parse("/top_k 5"), Input::Set("top_k", "5"));
        assert_eq!(parse("/nonsense"), Input::Unknown("nonsense"));
    }

    #[test]
    fn settings_change_only_when_valid() {
        let mut settings = Settings {
            sampling: SamplingParams::default(),
            max_tokens: 10,
        };
        assert!(settings.set("temperature", "0.5").is_ok());
        assert_eq!(settings.sampling.temperature, 0.5);
        assert!(settings.set("temperature", "-1").is_err());
        assert!(settings.set("top-p", "abc").is_err());
        assert!(settings.set("max-tokens", "0").is_err());
        assert_eq!(settings.sampling.temperature, 0.5);
        assert!(settings.set("seed", "7").is_ok());
        assert_eq!(settings.sampling.seed, Some(7));
        assert!(settings.set("seed", "none").is_ok());
        assert_eq!(settings.sampling.seed, None);
        assert!(settings.set("max-tokens", "3").is_ok());
        assert_eq!(settings.max_tokens, 3);
    }
}
