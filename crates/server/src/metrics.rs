//! `/metrics`: what the engines are doing, in Prometheus' text format (version 0.0.4). Each
//! loaded model's engine thread writes its gauges after every step, and the counters and
//! histograms as tokens and requests finish; a scrape adds the engines up (the fleet's lines
//! per model, loads and memory, follow: [`crate::fleet`]).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kiln_engine::{PrefixStats, SpecCounts};

/// Upper bounds of the latency histograms' buckets, in seconds (vLLM's for time to first token
/// and inter-token latency, merged).
const LATENCY_BUCKETS: [f64; 20] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0,
];

/// A cumulative histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, count) in LATENCY_BUCKETS.iter().zip(&mut self.counts) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in LATENCY_BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// The server's numbers.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Each loaded model's engine, by its name: `/metrics` sums them.
    engines: Mutex<BTreeMap<String, EngineGauges>>,
    /// The counts of engines since unloaded, so that the counters never go back.
    retired: Mutex<Counts>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished_stop: AtomicU64,
    finished_length: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    rejected: AtomicU64,
    preemptions: AtomicU64,
    embedding_requests: AtomicU64,
    embedding_inputs: AtomicU64,
    embedding_tokens: AtomicU64,
    time_to_first_token: Mutex<Histogram>,
    inter_token_latency: Mutex<Histogram>,
}

/// One engine's fixed sizes and its state after its last step.
#[derive(Debug, Clone, Copy, Default)]
struct EngineGauges {
    capacity: Capacity,
    load: Load,
}

/// An engine's fixed sizes, as [`Metrics::set_capacity`] publishes them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Capacity {
    /// Most sequences at once.
    pub max_batch: usize,
    /// The KV pool, in blocks.
    pub blocks: usize,
    /// Tokens per block (1 for a cache without blocks).
    pub block_tokens: usize,
    /// Bytes of the KV pool.
    pub bytes: u64,
}

/// The engine's state after a step, as [`Metrics::set_load`] publishes it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Load {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// KV blocks held by running requests.
    pub kv_blocks_used: usize,
    /// KV blocks no request holds that keep a cached prefix.
    pub kv_blocks_cached: usize,
    /// Prompt tokens looked up in the prefix cache and found there.
    pub prefix: PrefixStats,
    /// Speculative decoding's counts over finished requests.
    pub speculation: SpecCounts,
    /// Embedding requests queued or running on the engine thread.
    pub embedding_jobs: usize,
}

/// Every engine's gauges added up, and their counts with those of engines since unloaded.
#[derive(Debug, Default)]
struct Totals {
    running: u64,
    waiting: u64,
    max_batch: u64,
    blocks_used: u64,
    blocks_cached: u64,
    blocks_total: u64,
    block_tokens: u64,
    cache_bytes: u64,
    embedding_jobs: u64,
    counts: Counts,
}

/// The engines' counts since the start: the prefix cache's and speculative decoding's.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    prefix: PrefixStats,
    spec: SpecCounts,
}

impl Counts {
    /// Adds an engine's counts, as its last [`Load`] gave them.
    fn add(&mut self, load: &Load) {
        self.prefix.queried += load.prefix.queried;
        self.prefix.hits += load.prefix.hits;
        self.spec.drafted += load.speculation.drafted;
        self.spec.accepted += load.speculation.accepted;
        self.spec.forwards += load.speculation.forwards;
        self.spec.tokens += load.speculation.tokens;
    }
}

/// How a request left the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Finished with `finish_reason: "stop"` (EOS or a stop string).
    Stop,
    /// Finished with `finish_reason: "length"`.
    Length,
    /// Its client went away.
    Cancelled,
    /// The engine failed or the server stopped under it.
    Failed,
}

impl Metrics {
    /// The fixed sizes of `model`'s engine.
    pub fn set_capacity(&self, model: &str, capacity: Capacity) {
        lock(&self.engines)
            .entry(model.to_string())
            .or_default()
            .capacity = capacity;
    }

    /// `model`'s engine's state after a step.
    pub fn set_load(&self, model: &str, load: Load) {
        lock(&self.engines)
            .entry(model.to_string())
            .or_default()
            .load = load;
    }

    /// `model`'s engine has stopped (its model unloaded): its gauges go, its counts stay.
    pub fn retire(&self, model: &str) {
        if let Some(gone) = lock(&self.engines).remove(model) {
            lock(&self.retired).add(&gone.load);
        }
    }

    fn totals(&self) -> Totals {
        let mut t = Totals {
            counts: *lock(&self.retired),
            ..Totals::default()
        };
        for e in lock(&self.engines).values() {
            t.running += e.load.running as u64;
            t.waiting += e.load.waiting as u64;
            t.blocks_used += e.load.kv_blocks_used as u64;
            t.blocks_cached += e.load.kv_blocks_cached as u64;
            t.max_batch += e.capacity.max_batch as u64;
            t.blocks_total += e.capacity.blocks as u64;
            t.block_tokens = t.block_tokens.max(e.capacity.block_tokens as u64);
            t.cache_bytes += e.capacity.bytes;
            t.embedding_jobs += e.load.embedding_jobs as u64;
            t.counts.add(&e.load);
        }
        t
    }

    /// Sequences running and waiting, as last published, over every engine.
    pub fn load(&self) -> (u64, u64) {
        let t = self.totals();
        (t.running, t.waiting)
    }

    /// A generated token; `since_previous` is the time since the sequence's previous token,
    /// `None` for its first (whose latency is `first_token`).
    pub fn token(&self, since_previous: Option<Duration>, first_token: Option<Duration>) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = since_previous {
            lock(&self.inter_token_latency).observe(d.as_secs_f64());
        }
        if let Some(d) = first_token {
            lock(&self.time_to_first_token).observe(d.as_secs_f64());
        }
    }

    /// A request left the engine, having read `prompt_tokens` and been preempted
    /// `preemptions` times.
    pub fn finished(&self, outcome: Outcome, prompt_tokens: usize, preemptions: usize) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.preemptions
            .fetch_add(preemptions as u64, Ordering::Relaxed);
        let counter = match outcome {
            Outcome::Stop => &self.finished_stop,
            Outcome::Length => &self.finished_length,
            Outcome::Cancelled => &self.cancelled,
            Outcome::Failed => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A request refused before it reached the engine because the queue was full.
    pub fn rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// An embedding request answered: `inputs` vectors from `tokens` tokens.
    pub fn embedded(&self, inputs: usize, tokens: usize) {
        self.embedding_requests.fetch_add(1, Ordering::Relaxed);
        self.embedding_inputs
            .fetch_add(inputs as u64, Ordering::Relaxed);
        self.embedding_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// The text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let t = self.totals();
        let gauges = [
            (
                "kiln_requests_running",
                "Requests decoding or prefilling now.",
                t.running,
            ),
            (
                "kiln_requests_waiting",
                "Requests queued for a free row or KV space.",
                t.waiting,
            ),
            (
                "kiln_max_batch",
                "Most requests run at once (--max-batch; summed over the loaded models).",
                t.max_batch,
            ),
            (
                "kiln_kv_cache_blocks_used",
                "KV cache blocks holding tokens.",
                t.blocks_used,
            ),
            (
                "kiln_kv_cache_blocks_free",
                "KV cache blocks holding nothing.",
                t.blocks_total
                    .saturating_sub(t.blocks_used + t.blocks_cached),
            ),
            (
                "kiln_kv_cache_blocks_cached",
                "KV cache blocks no request holds that keep a prefix for later requests (evicted least recently used when room is needed).",
                t.blocks_cached,
            ),
            (
                "kiln_kv_cache_blocks_total",
                "KV cache blocks in the pool (the loaded models' pools together).",
                t.blocks_total,
            ),
            (
                "kiln_kv_cache_block_tokens",
                "Tokens per KV cache block.",
                t.block_tokens,
            ),
            (
                "kiln_embedding_requests_waiting",
                "Embedding requests queued or running on the engine threads.",
                t.embedding_jobs,
            ),
            (
                "kiln_kv_cache_bytes",
                "Bytes of the KV cache pool (--kv-cache-mb; the loaded models' pools together).",
                t.cache_bytes,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let (queries, hits) = (t.counts.prefix.queried, t.counts.prefix.hits);
        let spec = t.counts.spec;
        for (name, help, value) in [
            (
                "kiln_prefix_cache_hit_rate",
                "Share of prompt tokens found in the prefix cache since the start.",
                if queries == 0 {
                    0.0
                } else {
                    hits as f64 / queries as f64
                },
            ),
            (
                "kiln_spec_decode_acceptance_rate",
                "Share of speculative draft tokens the model accepted (finished requests).",
                spec.acceptance_rate(),
            ),
            (
                "kiln_spec_decode_tokens_per_forward",
                "Tokens produced per forward of the model that produced any (finished requests; 1 without speculation).",
                spec.tokens_per_forward(),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let counters = [
            (
                "kiln_spec_decode_draft_tokens_total",
                "Speculative draft tokens proposed (finished requests).",
                spec.drafted,
            ),
            (
                "kiln_spec_decode_accepted_tokens_total",
                "Speculative draft tokens accepted (finished requests).",
                spec.accepted,
            ),
            (
                "kiln_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                get(&self.prompt_tokens),
            ),
            (
                "kiln_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                queries,
            ),
            (
                "kiln_prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache (not computed).",
                hits,
            ),
            (
                "kiln_generation_tokens_total",
                "Tokens generated.",
                get(&self.generation_tokens),
            ),
            (
                "kiln_preemptions_total",
                "Times a running request was evicted to make room.",
                get(&self.preemptions),
            ),
            (
                "kiln_requests_rejected_total",
                "Requests refused because the queue was full.",
                get(&self.rejected),
            ),
            (
                "kiln_embedding_requests_total",
                "Embedding requests answered.",
                get(&self.embedding_requests),
            ),
            (
                "kiln_embedding_inputs_total",
                "Inputs embedded (one vector each).",
                get(&self.embedding_inputs),
            ),
            (
                "kiln_embedding_tokens_total",
                "Tokens of embedded inputs.",
                get(&self.embedding_tokens),
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        let name = "kiln_requests_finished_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests that left the engine, by how.\n# TYPE {name} counter"
        );
        for (reason, counter) in [
            ("stop", &self.finished_stop),
            ("length", &self.finished_length),
            ("cancelled", &self.cancelled),
            ("failed", &self.failed),
        ] {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {}", get(counter));
        }
        lock(&self.time_to_first_token).render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        lock(&self.inter_token_latency).render(
            &mut out,
            "kiln_inter_token_latency_seconds",
            "Time between a request's consecutive tokens.",
        );
        out
    }
}

/// The value, even if a thread panicked holding it (the numbers are still numbers).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_counters_add_up() {
        let m = Metrics::default();
        m.token(None, Some(Duration::from_millis(30)));
        m.token(Some(Duration::from_millis(3)), None);
        m.finished(Outcome::Length, 7, 0);
        let text = m.render();
        assert!(text.contains("kiln_generation_tokens_total 2\n"), "{text}");
        assert!(text.contains("kiln_prompt_tokens_total 7\n"));
        assert!(text.contains("kiln_requests_finished_total{reason=\"length\"} 1\n"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.02\"} 0\n"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.04\"} 1\n"));
        assert!(text.contains("kiln_inter_token_latency_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("kiln_inter_token_latency_seconds_count 1\n"));
        assert!(text.contains("kiln_prefix_cache_hit_rate 0\n"));
    }

    #[test]
    fn blocks_the_prefix_cache_and_speculation_are_reported() {
        let m = Metrics::default();
        m.set_capacity(
            "a",
            Capacity {
                max_batch: 4,
                blocks: 10,
                block_tokens: 16,
                bytes: 1 << 20,
            },
        );
        m.set_load(
            "a",
            Load {
                running: 1,
                waiting: 0,
                kv_blocks_used: 3,
                kv_blocks_cached: 5,
                prefix: PrefixStats {
                    queried: 400,
                    hits: 100,
                },
                speculation: SpecCounts {
                    drafted: 40,
                    accepted: 30,
                    forwards: 20,
                    tokens: 50,
                },
                embedding_jobs: 2,
            },
        );
        let text = m.render();
        for line in [
            "kiln_spec_decode_draft_tokens_total 40\n",
            "kiln_spec_decode_accepted_tokens_total 30\n",
            "kiln_spec_decode_acceptance_rate 0.75\n",
            "kiln_spec_decode_tokens_per_forward 2.5\n",
            "kiln_kv_cache_blocks_used 3\n",
            "kiln_kv_cache_blocks_cached 5\n",
            "kiln_kv_cache_blocks_free 2\n",
            "kiln_prefix_cache_queries_total 400\n",
            "kiln_prefix_cache_hits_total 100\n",
            "kiln_prefix_cache_hit_rate 0.25\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn engines_add_up_and_an_unloaded_one_keeps_its_counts() {
        let m = Metrics::default();
        let capacity = Capacity {
            max_batch: 4,
            blocks: 10,
            block_tokens: 16,
            bytes: 100,
        };
        let load = |running, hits| Load {
            running,
            prefix: PrefixStats { queried: 10, hits },
            ..Load::default()
        };
        m.set_capacity("a", capacity);
        m.set_capacity("b", capacity);
        m.set_load("a", load(1, 3));
        m.set_load("b", load(2, 4));
        let text = m.render();
        for line in [
            "kiln_requests_running 3\n",
            "kiln_max_batch 8\n",
            "kiln_kv_cache_blocks_total 20\n",
            "kiln_kv_cache_bytes 200\n",
            "kiln_prefix_cache_hits_total 7\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        m.retire("a");
        let text = m.render();
        for line in [
            "kiln_requests_running 2\n",
            "kiln_max_batch 4\n",
            "kiln_prefix_cache_hits_total 7\n",
            "kiln_prefix_cache_queries_total 20\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
