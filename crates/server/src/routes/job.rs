//! A validated request turned into the engine's requests ([`Job`]), and its submission to the
//! engine thread ([`submit`]): the queue limit, counted in rows of the batch, and the engine's
//! own refusals.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kiln_core::TokenId;
use kiln_engine::Request;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::{AppState, Ready, unix_time};
use crate::api::Generation;
use crate::api::response::Usage;
use crate::error::ApiError;
use crate::fleet::Lease;
use crate::tools::ToolPlan;
use crate::worker::{Command, Submission, Update};

/// The shape of a job's output: a chat's (reasoning, content and tool calls read from the
/// text) or a text completion's (the text as it is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    /// The `object` of a whole OpenAI answer.
    pub fn object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        }
    }

    /// The `object` of an OpenAI stream chunk.
    pub fn chunk_object(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        }
    }
}

/// Which API's request a job answers: the shape of its output, its id and the request field
/// that holds its prompt (what a 400 about it names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Origin {
    pub endpoint: Endpoint,
    /// The id's prefix, separator included (`chatcmpl-`, `msg_`).
    pub id_prefix: &'static str,
    pub prompt_field: &'static str,
}

impl Origin {
    /// `/v1/chat/completions`.
    pub const CHAT: Self = Self::new(Endpoint::Chat, "chatcmpl-", "messages");
    /// `/v1/completions`.
    pub const COMPLETIONS: Self = Self::new(Endpoint::Completions, "cmpl-", "prompt");
    /// Anthropic's `/v1/messages`.
    pub const MESSAGES: Self = Self::new(Endpoint::Chat, "msg_", "messages");
    /// OpenAI's `/v1/responses`.
    pub const RESPONSES: Self = Self::new(Endpoint::Chat, "resp_", "input");
    /// Ollama's `/api/chat`.
    pub const OLLAMA_CHAT: Self = Self::new(Endpoint::Chat, "chatcmpl-", "messages");
    /// Ollama's `/api/generate`: a text's output, whether or not the prompt went through the
    /// chat template.
    pub const OLLAMA_GENERATE: Self = Self::new(Endpoint::Completions, "cmpl-", "prompt");

    const fn new(endpoint: Endpoint, id_prefix: &'static str, prompt_field: &'static str) -> Self {
        Self {
            endpoint,
            id_prefix,
            prompt_field,
        }
    }
}

/// A validated request ready for the engine: one prompt per entry, `n` choices each.
pub(super) struct Job {
    pub endpoint: Endpoint,
    /// The request field that holds the prompt.
    prompt_field: &'static str,
    pub id: String,
    pub created: u64,
    /// The model it runs on.
    pub ready: Arc<Ready>,
    /// Its hold on the model: not unloaded while the job lives (until its answer is sent, or
    /// its client leaves).
    _lease: Lease,
    pub prompts: Vec<Vec<TokenId>>,
    pub generation: Generation,
    pub arrived: Instant,
    /// How a chat's output is read for tool calls (off: all text is content).
    pub tools: ToolPlan,
    /// For a chat whose reasoning is split ([`crate::reasoning`]): whether its output starts
    /// inside `<think>` (the prompt opened it). `None`: no split.
    pub thinking: Option<bool>,
    /// The engine requests, one per choice (a beam search: one per prompt); taken when
    /// submitted.
    requests: Vec<Request>,
}

impl Job {
    /// A job of `prompts` with its engine requests, or why they cannot run.
    pub fn new(
        state: &AppState,
        lease: Lease,
        origin: Origin,
        prompts: Vec<Vec<TokenId>>,
        generation: Generation,
        arrived: Instant,
    ) -> Result<Self, ApiError> {
        let endpoint = origin.endpoint;
        let mut job = Self {
            endpoint,
            prompt_field: origin.prompt_field,
            id: state.response_id(origin.id_prefix),
            created: unix_time(),
            ready: lease.ready().clone(),
            _lease: lease,
            prompts,
            generation,
            arrived,
            tools: ToolPlan::off(),
            thinking: None,
            requests: Vec::new(),
        };
        job.requests = job.requests()?;
        // Rows of the batch it takes: the queue limit counts them, and a request that
        // takes more than the server ever runs or queues could never start.
        let rows: usize = job.requests.iter().map(Request::rows).sum();
        let most = job.ready.max_batch + state.options.max_queue;
        if rows > most {
            let field = if job.generation.beam.is_some() {
                "num_beams"
            } else if job.prompts.len() > 1 {
                job.prompt_field
            } else {
                "n"
            };
            return Err(ApiError::invalid_field(
                field,
                format!(
                    "this request runs {rows} sequences (prompts × n, or prompts × num_beams); \
                     the server runs and queues at most {most} (--max-batch + --max-queue)"
                ),
            ));
        }
        let group = state.next_number();
        for request in &mut job.requests {
            request.group = Some(group);
        }
        Ok(job)
    }

    /// Choices in all: choice `i` continues prompt `i / n` (OpenAI's order).
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.generation.n
    }

    /// Choices each engine request answers: with beam search one request per prompt returns
    /// all `n` (its best hypotheses), otherwise one request per choice.
    pub fn choices_per_request(&self) -> usize {
        if self.generation.beam.is_some() {
            self.generation.n
        } else {
            1
        }
    }

    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    /// The usage object, from each choice's cached prompt tokens.
    pub fn usage(&self, completion_tokens: usize, cached_by_choice: &[usize]) -> Usage {
        // A prompt counts once however many choices continue it, and so do its cached
        // tokens: those of its first choice (its siblings may have shared what it computed).
        let cached = cached_by_choice
            .chunks(self.generation.n.max(1))
            .map(|choices| choices.first().copied().unwrap_or(0))
            .sum();
        Usage::new(self.prompt_tokens(), completion_tokens, cached)
    }

    /// The engine requests, one per choice (a beam search: one per prompt).
    fn requests(&self) -> Result<Vec<Request>, ApiError> {
        let ready = &self.ready;
        let g = &self.generation;
        let constraint = match &g.constraint {
            None => None,
            Some((field, constraint)) => {
                let Some(grammars) = &ready.grammars else {
                    return Err(ApiError::invalid_field(
                        field,
                        "this model names no end-of-sequence token: its output cannot be \
                         constrained",
                    ));
                };
                Some(
                    grammars
                        .compile(constraint)
                        .map_err(|e| ApiError::invalid_field(field, e.to_string()))?,
                )
            }
        };
        // The vocabulary is known here, not where the body was validated.
        g.sampling
            .check_vocab(ready.shape.vocab)
            .map_err(|e| ApiError::invalid_field("logit_bias", e.to_string()))?;
        let limit = ready.sequence_tokens();
        let param = self.prompt_field;
        let mut requests = Vec::with_capacity(self.choices());
        for prompt in &self.prompts {
            if let Some(why) = kiln_engine::prompt_problem(prompt, &ready.shape) {
                return Err(if prompt.len() >= ready.shape.max_positions {
                    ApiError::context_length_exceeded(param, why)
                } else {
                    ApiError::invalid_field(param, why)
                });
            }
            // The engine knows the context; the pool this server gave the cache may be smaller.
            if prompt.len() >= limit {
                return Err(ApiError::context_length_exceeded(
                    param,
                    format!(
                        "the prompt has {} tokens; the server's KV cache holds {limit} tokens \
                         (--kv-cache-mb), and at least one must be left to generate",
                        prompt.len()
                    ),
                ));
            }
            let eos = if g.ignore_eos {
                Vec::new()
            } else {
                ready.eos.clone()
            };
            let mut request = Request {
                prompt: prompt.clone(),
                eos,
                beam: g.beam,
                ..Request::default()
            };
            // What each of its sequences may generate when it runs alone in the cache: for a
            // beam search, what no search can outgrow however it forks.
            let room = ready.cache.room_per_sequence(&request, limit);
            if let Some(beam) = g.beam {
                request.max_tokens = match g.max_tokens {
                    Some(m) if m > room => {
                        return Err(ApiError::invalid_field(
                            "max_tokens",
                            format!(
                                "{m} tokens for each of {} beams do not fit in the server's KV \
                                 cache ({limit} tokens, {} of them the prompt's): at most {room}",
                                beam.num_beams,
                                prompt.len()
                            ),
                        ));
                    }
                    _ if room == 0 => {
                        return Err(ApiError::invalid_field(
                            "num_beams",
                            format!(
                                "{} beams do not fit in the server's KV cache beside the prompt \
                                 ({limit} tokens, {} of them the prompt's)",
                                beam.num_beams,
                                prompt.len()
                            ),
                        ));
                    }
                    Some(m) => m,
                    None => room,
                };
                requests.push(request);
                continue;
            }
            // Without a limit, or with one past the room, generate up to the room.
            request.max_tokens = g.max_tokens.map_or(room, |m| m.min(room));
            for choice in 0..g.n {
                requests.push(Request {
                    sampling: g.sampling_for(choice),
                    stop: g.stop.clone(),
                    logprobs: g.logprobs,
                    constraint: constraint.clone(),
                    ..request.clone()
                });
            }
        }
        Ok(requests)
    }
}

/// Queues the job's requests on the engine thread, or refuses them: the queue is full, the
/// server is stopping, or the engine refused them.
pub(super) async fn submit(
    state: &AppState,
    job: &mut Job,
) -> Result<UnboundedReceiver<Update>, ApiError> {
    let requests = std::mem::take(&mut job.requests);
    if state.fleet.stopping() {
        return Err(ApiError::shutting_down());
    }
    // Rows, not requests: a beam search of 8 beams queues as 8.
    let n: usize = requests.iter().map(Request::rows).sum();
    let limit = job.ready.max_batch + state.options.max_queue;
    let in_flight = &job.ready.in_flight;
    let before = in_flight.fetch_add(n, Ordering::SeqCst);
    if before + n > limit {
        in_flight.fetch_sub(n, Ordering::SeqCst);
        state.metrics.rejected();
        return Err(ApiError::queue_full(state.options.max_queue));
    }
    let (tx, mut rx) = unbounded_channel();
    let submission = Submission {
        requests,
        updates: tx,
        arrived: job.arrived,
        tag: job.id.clone(),
    };
    if job
        .ready
        .commands
        .send(Command::Submit(submission))
        .is_err()
    {
        in_flight.fetch_sub(n, Ordering::SeqCst);
        return Err(ApiError::shutting_down());
    }
    match rx.recv().await {
        Some(Update::Accepted) => Ok(rx),
        Some(Update::Rejected(e)) => Err(e),
        Some(other) => Err(ApiError::internal(format!(
            "the engine answered {other:?} before accepting the request"
        ))),
        None => Err(ApiError::shutting_down()),
    }
}
