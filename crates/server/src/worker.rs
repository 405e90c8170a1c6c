//! A model's engine thread: the one owner of the model and its KV cache (started, and the model
//! loaded, by [`crate::engine_thread`]). It takes submissions from
//! the HTTP handlers over a channel, steps the engine while there is work (requests that
//! arrive meanwhile join the running batch at the next step), and sends each request's tokens
//! back over the request's own channel. A request whose channel has closed (its client went
//! away) is cancelled before the next step, and its cache freed.
//!
//! Embedding jobs ([`Command::Embed`]) queue beside the engine's requests: each turn of the
//! loop runs one engine step and then one step of the oldest embedding job (a few of its inputs
//! in one forward, on a scratch cache of their own: [`kiln_engine::Embedding`]), so neither
//! kind waits for the other to drain, and embeddings take nothing from the engine's cache.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use kiln_core::InferenceBackend;
use kiln_core::TokenId;
use kiln_engine::{
    Completion, Embedding, Engine, EngineError, Event, FinishReason, Pooling, Request, RequestId,
    TokenLogprobs,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::response::finish_reason;
use crate::error::ApiError;
use crate::metrics::{Load, Metrics, Outcome};

/// What the HTTP side asks of the engine thread.
pub(crate) enum Command {
    /// Run these requests (one per choice) and report on `updates`.
    Submit(Submission),
    /// Embed these inputs and answer on the job's channel.
    Embed(EmbedJob),
    /// Stop taking work; finish what runs within the grace period.
    Shutdown,
}

/// One HTTP request's engine requests.
pub(crate) struct Submission {
    /// One per choice, in choice order.
    pub requests: Vec<Request>,
    /// Where its updates go; closed when the client goes away.
    pub updates: UnboundedSender<Update>,
    /// When the HTTP request arrived (time to first token counts from here).
    pub arrived: Instant,
    /// The response id, for the log.
    pub tag: String,
}

impl Submission {
    /// Rows of the batch its requests take (the queue limit counts them).
    pub fn rows(&self) -> usize {
        self.requests.iter().map(Request::rows).sum()
    }
}

/// One HTTP request's inputs to embed.
pub(crate) struct EmbedJob {
    /// Each input's tokens, in input order.
    pub inputs: Vec<Vec<TokenId>>,
    /// How each input's states become one vector.
    pub pooling: Pooling,
    /// Where the vectors (one per input, L2-normalised, in input order) or the error go;
    /// closed when the client goes away, which drops the job.
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>,
    /// The response id, for the log.
    pub tag: String,
}

/// An embedding job in the queue.
struct Embedder {
    job: Embedding,
    reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, ApiError>>,
    tag: String,
    arrived: Instant,
}

/// What the engine thread reports about a submission.
#[derive(Debug)]
pub(crate) enum Update {
    /// Every choice is queued.
    Accepted,
    /// The engine refused the submission; nothing runs.
    Rejected(ApiError),
    /// A new token of choice `choice`, with the text it completes.
    Token {
        choice: usize,
        token: TokenId,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// Held-back text released at the end of choice `choice`.
    Text { choice: usize, text: String },
    /// Choice `choice` ended.
    Finished {
        choice: usize,
        completion: Completion,
    },
    /// The engine failed (500), or the server stopped (503), before the choice ended.
    Failed(ApiError),
}

/// Where one engine request's events go.
struct Route {
    updates: UnboundedSender<Update>,
    choice: usize,
    arrived: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    /// Rows of the batch it takes (beams), which the queue limit counts.
    rows: usize,
    tag: String,
}

/// Shared counters the engine thread keeps up to date.
pub(crate) struct Shared<'a> {
    pub metrics: &'a Metrics,
    /// The model's name, which its gauges are published under.
    pub model: &'a str,
    /// Tokens per KV cache block (1 for a cache without blocks).
    pub block_tokens: usize,
    /// Rows of engine requests accepted and not yet ended (the queue limit counts them).
    pub in_flight: &'a AtomicUsize,
}

/// Serves submissions until a shutdown (the server stopping, or the model unloading) has
/// drained (or the grace period ran out) or every sender is gone.
pub(crate) fn run<B: InferenceBackend>(
    engine: &mut Engine<'_, B>,
    commands: &Receiver<Command>,
    shared: &Shared<'_>,
    grace: Duration,
) {
    let mut worker = Worker {
        routes: HashMap::new(),
        embeds: VecDeque::new(),
        shared,
    };
    let mut deadline: Option<Instant> = None;
    loop {
        // Idle: sleep until something arrives. Busy: take what has arrived, then step.
        let mut next = if engine.is_idle() && worker.embeds.is_empty() {
            if deadline.is_some() {
                break;
            }
            match commands.recv() {
                Ok(command) => Some(command),
                Err(_) => break,
            }
        } else {
            None
        };
        loop {
            let command = match next.take() {
                Some(c) => c,
                None => match commands.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        deadline.get_or_insert_with(|| far_or(Instant::now(), grace));
                        break;
                    }
                },
            };
            match command {
                Command::Submit(s) if deadline.is_some() => {
                    shared.in_flight.fetch_sub(s.rows(), Ordering::Relaxed);
                    let _ = s.updates.send(Update::Rejected(ApiError::shutting_down()));
                }
                Command::Submit(s) => worker.submit(engine, s),
                Command::Embed(job) if deadline.is_some() => {
                    let _ = job.reply.send(Err(ApiError::shutting_down()));
                }
                Command::Embed(job) => worker.queue_embedding(job),
                Command::Shutdown => {
                    deadline.get_or_insert_with(|| far_or(Instant::now(), grace));
                }
            }
        }
        worker.cancel_abandoned(engine);
        if deadline.is_some_and(|d| Instant::now() >= d) {
            worker.fail_all(engine, &ApiError::cut_off());
        }
        if !engine.is_idle() {
            match engine.step() {
                Ok(events) => worker.route(events),
                Err(e) => {
                    tracing::error!(target: "kiln::serve", error = %e, "engine step failed; failing every request in flight");
                    worker.fail_all(
                        engine,
                        &ApiError::internal(format!("the engine failed: {e}")),
                    );
                }
            }
        }
        worker.embed_step(engine);
        let (running, waiting) = engine.load();
        let usage = engine.cache().usage();
        let blocks = |tokens: usize| tokens / shared.block_tokens.max(1);
        shared.metrics.set_load(
            shared.model,
            Load {
                running,
                waiting,
                kv_blocks_used: blocks(usage.used),
                kv_blocks_cached: blocks(usage.cached),
                prefix: engine.prefix_stats(),
                speculation: engine.speculation_stats(),
                embedding_jobs: worker.embeds.len(),
            },
        );
    }
    worker.fail_all(engine, &ApiError::cut_off());
}

struct Worker<'s, 'a> {
    routes: HashMap<RequestId, Route>,
    /// Embedding jobs, oldest first; the first runs a step each turn.
    embeds: VecDeque<Embedder>,
    shared: &'s Shared<'a>,
}

impl Worker<'_, '_> {
    /// Queues every choice of `s`, or none.
    fn submit<B: InferenceBackend>(&mut self, engine: &mut Engine<'_, B>, s: Submission) {
        let rows = s.rows();
        let mut ids = Vec::with_capacity(s.requests.len());
        for request in s.requests {
            let prompt_tokens = request.prompt.len();
            let request_rows = request.rows();
            match engine.submit(request) {
                Ok(id) => ids.push((id, prompt_tokens, request_rows)),
                Err(e) => {
                    for (id, _, _) in ids {
                        engine.cancel(id);
                    }
                    self.shared.in_flight.fetch_sub(rows, Ordering::Relaxed);
                    let _ = s.updates.send(Update::Rejected(api_error(e)));
                    return;
                }
            }
        }
        for (choice, (id, prompt_tokens, rows)) in ids.into_iter().enumerate() {
            self.routes.insert(
                id,
                Route {
                    updates: s.updates.clone(),
                    choice,
                    arrived: s.arrived,
                    first_token: None,
                    last_token: None,
                    prompt_tokens,
                    rows,
                    tag: s.tag.clone(),
                },
            );
        }
        let _ = s.updates.send(Update::Accepted);
    }

    /// Queues an embedding job, or refuses it at once (no inputs, an empty one).
    fn queue_embedding(&mut self, job: EmbedJob) {
        match Embedding::new(job.inputs, job.pooling) {
            Ok(embedding) => self.embeds.push_back(Embedder {
                job: embedding,
                reply: job.reply,
                tag: job.tag,
                arrived: Instant::now(),
            }),
            Err(e) => {
                let _ = job.reply.send(Err(api_error(e)));
            }
        }
    }

    /// One step of the oldest embedding job; answers it when it is done or has failed.
    fn embed_step<B: InferenceBackend>(&mut self, engine: &Engine<'_, B>) {
        let Some(front) = self.embeds.front_mut() else {
            return;
        };
        let outcome = front.job.step(engine.model());
        if outcome.is_ok() && !front.job.is_done() {
            return;
        }
        let Some(done) = self.embeds.pop_front() else {
            return;
        };
        let tokens = done.job.tokens();
        let answer = match outcome {
            Ok(()) => {
                let vectors = done.job.into_vectors();
                self.shared.metrics.embedded(vectors.len(), tokens);
                tracing::info!(
                    target: "kiln::serve",
                    id = %done.tag,
                    prompt_tokens = tokens,
                    total_ms = (done.arrived.elapsed().as_secs_f64() * 1e3).round(),
                    "embedded"
                );
                Ok(vectors)
            }
            Err(e) => {
                tracing::warn!(target: "kiln::serve", id = %done.tag, error = %e, "embedding failed");
                Err(api_error(e))
            }
        };
        let _ = done.reply.send(answer);
    }

    /// Cancels the requests whose client has gone (their receiver was dropped).
    fn cancel_abandoned<B: InferenceBackend>(&mut self, engine: &mut Engine<'_, B>) {
        self.embeds.retain(|e| !e.reply.is_closed());
        let gone: Vec<RequestId> = self
            .routes
            .iter()
            .filter(|(_, r)| r.updates.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            engine.cancel(id);
            if let Some(route) = self.routes.remove(&id) {
                self.end(&route, Outcome::Cancelled, 0);
                tracing::info!(
                    target: "kiln::serve",
                    id = %route.tag,
                    choice = route.choice,
                    "cancelled: the client went away"
                );
            }
        }
    }

    /// Cancels every request in flight, telling each why.
    fn fail_all<B: InferenceBackend>(&mut self, engine: &mut Engine<'_, B>, why: &ApiError) {
        for embedder in std::mem::take(&mut self.embeds) {
            let _ = embedder.reply.send(Err(why.clone()));
        }
        for (id, route) in std::mem::take(&mut self.routes) {
            engine.cancel(id);
            let _ = route.updates.send(Update::Failed(why.clone()));
            self.end(&route, Outcome::Failed, 0);
        }
    }

    fn end(&self, route: &Route, outcome: Outcome, preemptions: usize) {
        self.shared
            .in_flight
            .fetch_sub(route.rows, Ordering::Relaxed);
        self.shared
            .metrics
            .finished(outcome, route.prompt_tokens, preemptions);
    }

    /// Sends a step's events to their requests.
    fn route(&mut self, events: Vec<Event>) {
        let now = Instant::now();
        for event in events {
            match event {
                Event::Token {
                    id,
                    token,
                    text,
                    logprobs,
                } => {
                    let Some(route) = self.routes.get_mut(&id) else {
                        continue;
                    };
                    let since = route.last_token.map(|t| now.duration_since(t));
                    let first = since.is_none().then(|| now.duration_since(route.arrived));
                    route.first_token.get_or_insert(now);
                    route.last_token = Some(now);
                    self.shared.metrics.token(since, first);
                    let _ = route.updates.send(Update::Token {
                        choice: route.choice,
                        token,
                        text,
                        logprobs,
                    });
                }
                Event::Text { id, text } => {
                    if let Some(route) = self.routes.get(&id) {
                        let choice = route.choice;
                        let _ = route.updates.send(Update::Text { choice, text });
                    }
                }
                Event::Finished(completion) => {
                    let Some(route) = self.routes.remove(&completion.id) else {
                        continue;
                    };
                    let outcome = match completion.finish_reason {
                        FinishReason::Length => Outcome::Length,
                        FinishReason::Eos | FinishReason::Stop => Outcome::Stop,
                    };
                    self.end(&route, outcome, completion.preemptions);
                    log_finished(&route, &completion, now);
                    let _ = route.updates.send(Update::Finished {
                        choice: route.choice,
                        completion,
                    });
                }
            }
        }
    }
}

/// The answer to an engine error: 400 for a request it cannot serve, else 500.
fn api_error(e: EngineError) -> ApiError {
    match e {
        EngineError::InvalidRequest(m) => ApiError::invalid(m),
        other => ApiError::internal(other.to_string()),
    }
}

/// One line per finished request.
fn log_finished(route: &Route, c: &Completion, now: Instant) {
    // From the HTTP request's arrival, not the engine's submission.
    let ttft = route
        .first_token
        .map_or(Duration::ZERO, |t| t.duration_since(route.arrived));
    let total = now.duration_since(route.arrived).as_secs_f64();
    let decode = c.timings.decode.as_secs_f64();
    let rate = if decode > 0.0 {
        c.tokens.len().saturating_sub(1) as f64 / decode
    } else {
        0.0
    };
    tracing::info!(
        target: "kiln::serve",
        id = %route.tag,
        choice = route.choice,
        prompt_tokens = c.prompt_tokens,
        cached_tokens = c.cached_tokens,
        completion_tokens = c.tokens.len(),
        ttft_ms = (ttft.as_secs_f64() * 1e3).round(),
        tokens_per_s = (rate * 10.0).round() / 10.0,
        total_ms = (total * 1e3).round(),
        preemptions = c.preemptions,
        finish_reason = finish_reason(c.finish_reason),
        "finished"
    );
}

/// Most rows of a batch of `max_batch` that one HTTP request's sequences may hold
/// ([`kiln_engine::EngineConfig::max_group_rows`]): half, the other half kept for other
/// clients, so a short request starts beside a large one (`n` choices, several prompts, a beam
/// search) instead of waiting for all of it, and shares each step with at most half a batch
/// of it. A batch under 4 rows has no half to spare: one request may hold all of it.
pub fn rows_for_one_request(max_batch: usize) -> usize {
    if max_batch < 4 {
        max_batch.max(1)
    } else {
        max_batch / 2
    }
}

/// `now + grace`, or a day from now when the sum overflows the clock (a grace of
/// `Duration::MAX` from a library caller).
fn far_or(now: Instant, grace: Duration) -> Instant {
    now.checked_add(grace)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}
