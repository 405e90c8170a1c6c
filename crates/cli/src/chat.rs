//! `kiln chat`: a conversation on stdin. Each line is a user turn; the whole conversation is
//! rendered with the model's chat template and the reply streams to stdout. Lines starting
//! with `/` are commands: `/system TEXT`, `/clear`, `/exit`.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;

use anyhow::{Result, anyhow};
use kiln_core::backend::{BackendTask, run_on};
use kiln_core::kv_cache::StaticKvCache;
use kiln_core::{CausalLm, InferenceBackend, TokenId};
use kiln_engine::{GenerateRequest, generate};
use kiln_models::LoadedModel;
use kiln_models::chat::{ChatMessage, ChatTemplate, Role};

use crate::exit::UsageError;
use crate::model_args::{ModelArgs, SamplingArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Most new tokens per reply.
    #[arg(long, short = 'n', default_value_t = 512)]
    max_tokens: usize,
    /// A system message to start the conversation with.
    #[arg(long)]
    system: Option<String>,
}

pub fn run(args: Args) -> Result<()> {
    args.sampling.params()?;
    let backend = args.model.backend;
    run_on(backend, Task(args))?
}

struct Task(Args);

/// What a line of input asks for.
enum Input<'a> {
    Say(&'a str),
    System(&'a str),
    Clear,
    Exit,
    Unknown(&'a str),
}

fn parse(line: &str) -> Input<'_> {
    let line = line.trim();
    let Some(command) = line.strip_prefix('/') else {
        return Input::Say(line);
    };
    let (name, rest) = command.split_once(' ').unwrap_or((command, ""));
    match name {
        "exit" | "quit" => Input::Exit,
        "clear" => Input::Clear,
        "system" => Input::System(rest.trim()),
        _ => Input::Unknown(name),
    }
}

/// The text a template inserts for token `id`, or "".
fn token_text<B: InferenceBackend>(loaded: &LoadedModel<B>, id: Option<TokenId>) -> String {
    match (&loaded.tokenizer, id) {
        (Some(t), Some(id)) => t.inner().id_to_token(id.0).unwrap_or_default(),
        _ => String::new(),
    }
}

impl BackendTask for Task {
    type Output = Result<()>;

    fn run<B: InferenceBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let loaded: LoadedModel<B> = args.model.load(&device)?;
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
        let eos_text = token_text(&loaded, loaded.generation.eos.first().copied());
        let template = ChatTemplate::new(
            source,
            &token_text(&loaded, loaded.generation.bos),
            &eos_text,
        )?;
        let sampling = args.sampling.params()?;
        let shape = loaded.model.shape();

        let interactive = std::io::stdin().is_terminal();
        let mut system = args.system.clone();
        let mut turns: Vec<ChatMessage> = Vec::new();
        let mut stdout = std::io::stdout();
        let mut lines = std::io::stdin().lock().lines();
        loop {
            if interactive {
                eprint!("> ");
            }
            let Some(line) = lines.next() else { break };
            let line = line?;
            let text = match parse(&line) {
                Input::Exit => break,
                Input::Clear => {
                    turns.clear();
                    continue;
                }
                Input::System(text) => {
                    system = (!text.is_empty()).then(|| text.to_string());
                    turns.clear();
                    continue;
                }
                Input::Unknown(name) => {
                    eprintln!("unknown command /{name} (commands: /system TEXT, /clear, /exit)");
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
            let prompt = tokenizer.encode(&template.render(&messages, true)?, false)?;
            let room = (prompt.len() + args.max_tokens)
                .min(shape.max_positions)
                .max(1);
            let mut cache =
                StaticKvCache::<B>::new(shape.kv_layout(), 1, room, args.model.dtype, &device)?;
            let request = GenerateRequest {
                prompt,
                max_tokens: args.max_tokens,
                sampling: sampling.clone(),
                eos: loaded.generation.eos.clone(),
            };
            let mut stream = tokenizer.inner().decode_stream(true);
            let result = generate(&loaded.model, &mut cache, &request, |token| {
                if let Ok(Some(piece)) = stream.step(token.0)
                    && (stdout.write_all(piece.as_bytes()).is_err() || stdout.flush().is_err())
                {
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            });
            writeln!(stdout)?;
            match result {
                Ok(generation) => {
                    let reply = tokenizer.decode(&generation.tokens, true)?;
                    turns.push(ChatMessage::new(Role::Assistant, reply));
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
