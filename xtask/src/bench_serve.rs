//! `cargo xtask bench-serve [--kiln PATH] [--model GGUF] [--concurrency 1,8,32] [--requests N]
//! [--max-tokens N] [--rounds N]`: `kiln serve` side by side with llama.cpp's `llama-server` on
//! the same GGUF file, the same threads and as many parallel slots, both driven by the same
//! load generator (`scripts/serve/bench_serve.py`, the OpenAI SDK streaming completions with
//! `ignore_eos`, so every request generates exactly `--max-tokens`). Servers alternate in
//! rounds; each server is started fresh per round and runs every concurrency. Prints the
//! medians over rounds (output tokens/s, TTFT p50/p99, ITL p50/p99) and kiln/llama-server
//! ratios, and writes them to `target/bench/serve-<date>.json`.
//!
//! `--shared-prefix N` is the prefix-caching scenario: every request starts with the same
//! system prompt of about N tokens, and a third server joins the rounds, `kiln serve
//! --no-prefix-cache`, so one command shows kiln with and without prefix caching (and
//! llama-server, which reuses each slot's last prompt).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::workspace_root;

const USAGE: &str = "usage: cargo xtask bench-serve [--kiln PATH] [--model GGUF] [--concurrency 1,8,32] [--requests N] [--max-tokens N] [--rounds N] [--shared-prefix TOKENS]";

struct Options {
    kiln: Option<PathBuf>,
    model: Option<PathBuf>,
    concurrency: Vec<usize>,
    /// Requests per cell: this many per concurrent client, at least 8.
    requests_per_client: usize,
    max_tokens: usize,
    rounds: usize,
    /// Tokens of a system prompt every request shares (0: none).
    shared_prefix: usize,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        kiln: None,
        model: None,
        concurrency: vec![1, 8, 32],
        requests_per_client: 4,
        max_tokens: 128,
        rounds: 2,
        shared_prefix: 0,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || crate::flag_value(&mut args, arg, USAGE);
        let number = |v: String| crate::positive_number(arg, &v);
        match arg.as_str() {
            "--kiln" => o.kiln = Some(std::path::absolute(value()?)?),
            "--model" => o.model = Some(std::path::absolute(value()?)?),
            "--concurrency" => {
                o.concurrency = value()?
                    .split(',')
                    .map(|v| number(v.to_string()))
                    .collect::<Result<_>>()?;
            }
            "--requests" => o.requests_per_client = number(value()?)?,
            "--max-tokens" => o.max_tokens = number(value()?)?,
            "--rounds" => o.rounds = number(value()?)?,
            "--shared-prefix" => o.shared_prefix = number(value()?)?,
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    Ok(o)
}

/// A server under test: how to start it on a port.
struct ServerKind {
    name: String,
    program: PathBuf,
    args: Vec<String>,
}

pub fn bench_serve(args: &[String]) -> Result<()> {
    let options = parse(args)?;
    let root = workspace_root();
    let kiln = crate::bench::kiln_binary(options.kiln.as_deref())?;
    let model = match &options.model {
        Some(m) => m.clone(),
        None => default_model(&kiln)?,
    };
    let llama_server = crate::llama_cpp::bin_dir()?.join("llama-server");
    let python = crate::python_env(&["openai==3.57.0"])?;
    let threads = crate::bench::kiln_threads();
    let slots = options.concurrency.iter().copied().max().unwrap_or(1);
    let slots_arg = slots.to_string();
    let threads_arg = threads.to_string();
    let model_arg = model.display().to_string();
    let kiln_args: Vec<String> = ["serve", "--model", &model_arg, "--max-batch", &slots_arg]
        .map(String::from)
        .to_vec();
    // 512 tokens of context per slot: the longest question and the output fit.
    let context_per_slot = 512 + options.shared_prefix * 5 / 4;
    let mut servers = vec![
        ServerKind {
            name: "kiln".into(),
            program: kiln.clone(),
            args: kiln_args.clone(),
        },
        ServerKind {
            name: "llama-server".into(),
            program: llama_server,
            args: vec![
                "-m".into(),
                model_arg.clone(),
                "-t".into(),
                threads_arg.clone(),
                "-tb".into(),
                threads_arg.clone(),
                "-np".into(),
                slots_arg.clone(),
                "-c".into(),
                (context_per_slot * slots).to_string(),
                "--host".into(),
                "127.0.0.1".into(),
            ],
        },
    ];
    if options.shared_prefix > 0 {
        servers.insert(
            1,
            ServerKind {
                name: "kiln --no-prefix-cache".into(),
                program: kiln.clone(),
                args: [kiln_args, vec!["--no-prefix-cache".into()]].concat(),
            },
        );
    }
    eprintln!(
        "bench-serve: {} on {threads} threads, {slots} slots, concurrency {:?}, {} rounds{}",
        model.display(),
        options.concurrency,
        options.rounds,
        if options.shared_prefix > 0 {
            format!(", a shared prompt of ~{} tokens", options.shared_prefix)
        } else {
            String::new()
        }
    );
    // results[server][concurrency index] = one JSON cell per round.
    let mut results: Vec<Vec<Vec<Value>>> =
        vec![vec![Vec::new(); options.concurrency.len()]; servers.len()];
    for round in 0..options.rounds {
        for (s, server) in servers.iter().enumerate() {
            let port = free_port()?;
            let mut child = start(server, port)?;
            let url = format!("http://127.0.0.1:{port}");
            let outcome = (|| -> Result<()> {
                wait_healthy(&url, &mut child, &server.name)?;
                for (c, &concurrency) in options.concurrency.iter().enumerate() {
                    let requests = (concurrency * options.requests_per_client).max(8);
                    let output = Command::new(&python)
                        .arg(root.join("scripts/serve/bench_serve.py"))
                        .args(["--url", &url])
                        .args(["--concurrency", &concurrency.to_string()])
                        .args(["--requests", &requests.to_string()])
                        .args(["--max-tokens", &options.max_tokens.to_string()])
                        .args(["--shared-prefix", &options.shared_prefix.to_string()])
                        .output()
                        .context("running scripts/serve/bench_serve.py")?;
                    if !output.status.success() {
                        bail!(
                            "the load generator failed against {}:\n{}",
                            server.name,
                            String::from_utf8_lossy(&output.stderr)
                        );
                    }
                    let cell: Value = serde_json::from_slice(&output.stdout)
                        .context("the load generator printed no JSON")?;
                    eprintln!(
                        "round {} {:>23} c={concurrency:<3} {:>7.1} tok/s  TTFT p50 {:>7.1} ms  ITL p50 {:>6.1} ms{}",
                        round + 1,
                        server.name,
                        cell["output_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                        cell["ttft_p50_ms"].as_f64().unwrap_or(f64::NAN),
                        cell["itl_p50_ms"].as_f64().unwrap_or(f64::NAN),
                        match cell["errors"].as_u64() {
                            Some(n) if n > 0 => format!(
                                "  {n} requests failed, the first: {}",
                                cell["first_error"].as_str().unwrap_or("?")
                            ),
                            _ => String::new(),
                        },
                    );
                    results[s][c].push(cell);
                }
                Ok(())
            })();
            stop(&mut child);
            outcome?;
        }
    }
    let names: Vec<&str> = servers.iter().map(|s| s.name.as_str()).collect();
    let report = summarise(&options, &names, &results, &model, threads);
    let out = root
        .join("target/bench")
        .join(format!("serve-{}.json", crate::bench::today()));
    std::fs::create_dir_all(out.parent().expect("has a parent"))?;
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// Medians over rounds per server and concurrency, printed as a markdown table with ratios.
fn summarise(
    options: &Options,
    names: &[&str],
    results: &[Vec<Vec<Value>>],
    model: &Path,
    threads: usize,
) -> Value {
    let fields = [
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
    ];
    let median_of = |cells: &[Value], field: &str| {
        let mut v: Vec<f64> = cells.iter().filter_map(|c| c[field].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    };
    println!(
        "\n| concurrency | server | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---|---|---|---|---|---|"
    );
    let mut rows = Vec::new();
    for (c, &concurrency) in options.concurrency.iter().enumerate() {
        let mut medians = Vec::new();
        for (s, name) in names.iter().enumerate() {
            let m: Vec<f64> = fields
                .iter()
                .map(|f| median_of(&results[s][c], f))
                .collect();
            println!(
                "| {concurrency} | {name} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                m[0], m[1], m[2], m[3], m[4]
            );
            rows.push(json!({
                "concurrency": concurrency,
                "server": name,
                "medians": fields.iter().zip(&m).map(|(f, v)| (f.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
                "rounds": results[s][c],
            }));
            medians.push(m);
        }
        for (other, name) in names.iter().enumerate().skip(1) {
            let r: Vec<f64> = (0..fields.len())
                .map(|f| medians[0][f] / medians[other][f])
                .collect();
            println!(
                "| {concurrency} | kiln / {name} | **{:.2}x** | {:.2}x | {:.2}x | {:.2}x | {:.2}x |",
                r[0], r[1], r[2], r[3], r[4]
            );
        }
    }
    println!("(throughput: above 1 kiln is faster; latencies: below 1 kiln is faster)");
    json!({
        "model": model.display().to_string(),
        "threads": threads,
        "max_tokens": options.max_tokens,
        "rounds": options.rounds,
        "shared_prefix": options.shared_prefix,
        "cells": rows,
    })
}

fn start(server: &ServerKind, port: u16) -> Result<Child> {
    Command::new(&server.program)
        .args(&server.args)
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", server.program.display()))
}

fn stop(child: &mut Child) {
    // SIGTERM lets both servers stop cleanly; kill if they do not.
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Polls `/health` until it answers 200 (both servers answer 503 while loading).
fn wait_healthy(url: &str, child: &mut Child, name: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("{name} exited with {status} before it was ready");
        }
        let ok = Command::new("curl")
            .args(["-sf", "-o", "/dev/null", &format!("{url}/health")])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{name} did not become healthy in 300 s")
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// The embedded default model's cached file (`kiln info --json`).
fn default_model(kiln: &Path) -> Result<PathBuf> {
    let output = Command::new(kiln)
        .args(["info", "--json"])
        .output()
        .context("running kiln info")?;
    let info: Value =
        serde_json::from_slice(&output.stdout).context("kiln info --json printed no JSON")?;
    info["path"]
        .as_str()
        .map(PathBuf::from)
        .context("kiln info --json gave no path")
}
