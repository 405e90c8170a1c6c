//! The request parsers: fuzzed, measured for memory, and checked field by field.

use super::*;

use crate::harness::{Fields, Seed, Target, fuzz, peak_of};

/// Bodies of both endpoints, with every field kind the parser reads, mutated (bytes
/// flipped and cut, JSON values swapped for other types and extreme numbers): each parses
/// to a request or a 400, never a panic, and within 4 bytes of memory per body byte.
#[test]
fn fuzz_request_bodies() {
    let bodies = [
        (
            "chat",
            r#"{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stop": ["
", "END"], "n": 2, "seed": 3, "logprobs": true, "top_logprobs": 2, "stream": true, "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}, "user": "u"}"#,
        ),
        (
            "completions",
            r#"{"prompt": ["a", "b"], "max_tokens": 4, "n": 2, "logprobs": 2, "stop": "x", "presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_p": 0.05, "ignore_eos": true, "regex": "[a-z]+"}"#,
        ),
        (
            "completions",
            r#"{"prompt": [[1, 2, 3], [4]], "num_beams": 4, "length_penalty": 0.5, "early_stopping": "never", "max_completion_tokens": 6}"#,
        ),
        (
            "completions",
            r#"{"prompt": [1, 2, 3], "grammar": "start: /[a-z]+/", "echo": false, "suffix": null}"#,
        ),
        (
            "chat",
            r#"{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100, "17": -100, "3": 2.5}, "temperature": 0}"#,
        ),
    ];
    let seeds: Vec<Seed> = bodies
        .iter()
        .map(|(name, body)| Seed {
            name: (*name).to_string(),
            bytes: body.as_bytes().to_vec(),
            fields: Fields {
                json: Some(0..body.len()),
                header_end: body.len(),
                ..Fields::default()
            },
        })
        .collect();
    let run = |seed: &Seed, input: &[u8]| {
        let (_, peak) = peak_of(|| {
            if seed.name == "chat" {
                ChatRequest::parse(input).and_then(|r| {
                    r.template_variables()?;
                    r.generation()
                })
            } else {
                CompletionRequest::parse(input).and_then(|r| {
                    r.prompt.as_ref().map(Prompt::inputs).transpose()?;
                    r.generation()
                })
            }
        });
        assert!(
            peak <= 4 * input.len() + (64 << 10),
            "{peak} bytes for {} bytes",
            input.len()
        );
    };
    fuzz(&Target {
        name: "request-body",
        seeds,
        max_alloc: 16 << 20,
        run: &run,
    });
}

/// The audit's case: a 7 MiB array in a field the server does not know cost 168 MiB
/// (serde's `flatten` kept it). Now no request body costs more than four times its size
/// to parse, whatever its fields hold (the worst: a list of one-digit token ids, two
/// bytes of JSON for four of `u32`, in a vector that grows by doubling).
#[test]
fn parsing_takes_memory_in_proportion_to_the_body() {
    let many = |item: &str| vec![item; 3 << 20].join(",");
    let m = r#""messages": [{"role": "user", "content": "hi"}]"#;
    let bodies = [
        format!(r#"{{{m}, "unknown": [{}]}}"#, many("1")),
        format!(r#"{{{m}, "metadata": {{"a": [{}]}}}}"#, many("[]")),
        format!(r#"{{"prompt": [{}]}}"#, many("7")),
        format!(r#"{{{m}, "response_format": [{}]}}"#, many("1")),
        format!(r#"{{{m}, "stop": [{}]}}"#, many(r#""a""#)),
    ];
    for (i, body) in bodies.iter().enumerate() {
        let (parsed, peak) = peak_of(|| {
            if i == 2 {
                CompletionRequest::parse(body.as_bytes()).map(|_| ())
            } else {
                ChatRequest::parse(body.as_bytes()).and_then(|r| r.generation().map(|_| ()))
            }
        });
        assert!(
            peak <= 4 * body.len(),
            "body {i}: {peak} bytes to parse {} ({parsed:?})",
            body.len()
        );
    }
}

#[test]
fn lists_and_free_form_fields_have_limits() {
    let m = r#""messages": [{"role": "user", "content": "hi"}]"#;
    let chat = |body: String| {
        ChatRequest::parse(body.as_bytes()).and_then(|r| {
            r.template_variables()?;
            r.generation()
        })
    };
    let param = |r: Result<Generation, ApiError>| r.err().and_then(|e| e.param);
    let stops = vec![r#""x""#; 17].join(",");
    assert_eq!(
        param(chat(format!(r#"{{{m}, "stop": [{stops}]}}"#))).as_deref(),
        Some("stop")
    );
    let long = "y".repeat(MAX_STOP_BYTES + 1);
    let err = chat(format!(r#"{{{m}, "stop": "{long}"}}"#)).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("stop"));
    assert!(err.message.contains("4097 bytes"), "{}", err.message);
    let schema = format!(
        r#"{{"type": "json_object", "pad": "{}"}}"#,
        "z".repeat(MAX_JSON_FIELD_BYTES)
    );
    assert_eq!(
        param(chat(format!(r#"{{{m}, "response_format": {schema}}}"#))).as_deref(),
        Some("response_format")
    );
    assert_eq!(
        param(chat(format!(r#"{{{m}, "chat_template_kwargs": [1]}}"#))).as_deref(),
        Some("chat_template_kwargs")
    );
    assert!(
        chat(format!(
            r#"{{{m}, "chat_template_kwargs": {{"enable_thinking": false}}}}"#
        ))
        .is_ok()
    );
    let prompts = vec![r#""p""#; 17].join(",");
    let err =
        CompletionRequest::parse(format!(r#"{{"prompt": [{prompts}]}}"#).as_bytes()).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("prompt"));
    let err = CompletionRequest::parse(br#"{"prompt": ["a", 1]}"#).unwrap_err();
    assert!(err.message.contains("mixes"), "{}", err.message);
    let err = CompletionRequest::parse(br#"{"prompt": [-1]}"#).unwrap_err();
    assert!(err.message.contains("negative"), "{}", err.message);
}

#[test]
fn clients_nulls_and_unknown_fields_are_accepted() {
    let body = br#"{"model": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stop": null, "logprobs": null, "user": "me", "store": false, "max_tokens": null}"#;
    let request: ChatRequest = RequestBody::parse(body).expect("parses");
    let generation = request.generation().expect("valid");
    assert_eq!(generation.n, 1);
    assert!(generation.stop.is_empty());
    assert_eq!(generation.max_tokens, None);
    let text = request.messages[0].content.as_ref().map(Content::text);
    assert_eq!(text, Some(Ok("hi".to_string())));
}

#[test]
fn out_of_range_values_name_their_field() {
    let field = |body: &str| -> Option<String> {
        let request: ChatRequest = match RequestBody::parse(body.as_bytes()) {
            Ok(r) => r,
            Err(e) => return e.param,
        };
        request.generation().err().and_then(|e| e.param)
    };
    let m = r#""messages": [{"role": "user", "content": "hi"}]"#;
    assert_eq!(
        field(&format!(r#"{{{m}, "temperature": -1}}"#)).as_deref(),
        Some("temperature")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "top_p": 0}}"#)).as_deref(),
        Some("top_p")
    );
    assert_eq!(field(&format!(r#"{{{m}, "n": 99}}"#)).as_deref(), Some("n"));
    assert_eq!(
        field(&format!(r#"{{{m}, "max_tokens": 0}}"#)).as_deref(),
        Some("max_tokens")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "top_k": -5}}"#)).as_deref(),
        Some("top_k")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "logprobs": true, "top_logprobs": 21}}"#)).as_deref(),
        Some("top_logprobs")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "presence_penalty": 3}}"#)).as_deref(),
        Some("presence_penalty")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "stop": [""]}}"#)).as_deref(),
        Some("stop")
    );
    assert_eq!(
        field(&format!(r#"{{{m}, "max_tokens": "ten"}}"#)).as_deref(),
        Some("max_tokens")
    );
    assert_eq!(
        field(&format!(
            r#"{{{m}, "stream_options": {{"include_usage": 1}}}}"#
        ))
        .as_deref(),
        Some("stream_options.include_usage")
    );
    assert_eq!(field(r#"{"messages": "hi"}"#).as_deref(), Some("messages"));
    assert_eq!(field(&format!(r#"{{{m}, "temperature": 0.5}}"#)), None);
}

#[test]
fn malformed_json_is_a_400() {
    let err = <ChatRequest as RequestBody>::parse(b"{\"messages\": [").expect_err("truncated");
    assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
    assert!(err.message.contains("not valid JSON"), "{}", err.message);
}

#[test]
fn completion_prompts_take_every_openai_form() {
    for (body, n) in [
        (r#"{"prompt": "a"}"#, 1),
        (r#"{"prompt": ["a", "b"]}"#, 2),
        (r#"{"prompt": [1, 2, 3]}"#, 1),
        (r#"{"prompt": [[1, 2], [3]]}"#, 2),
    ] {
        let request: CompletionRequest = RequestBody::parse(body.as_bytes()).expect(body);
        let inputs = request.prompt.as_ref().map(|p| p.inputs().map(|v| v.len()));
        assert_eq!(inputs, Some(Ok(n)), "{body}");
    }
    let request: CompletionRequest = RequestBody::parse(br#"{"prompt": []}"#).expect("parses");
    assert!(request.prompt.as_ref().is_some_and(|p| p.inputs().is_err()));
}

/// `logit_bias`: `{"token id": bias}` read into the sampling settings in the body's order;
/// a key that is no token id, a bias out of [-100, 100], a duplicate or too many entries is a
/// 400 naming the field (the key in the message), and a huge map is refused without being
/// kept.
#[test]
fn logit_bias_is_read_bounded_and_checked() {
    use kiln_core::TokenId;
    use kiln_core::sampling::MAX_LOGIT_BIAS_TOKENS;

    let generation =
        |body: &str| CompletionRequest::parse(body.as_bytes()).and_then(|r| r.generation());
    let ok =
        generation(r#"{"prompt": "a", "logit_bias": {"5": 100, "7": -100, "3": 0.5}}"#).unwrap();
    assert_eq!(
        ok.sampling.logit_bias,
        [(TokenId(5), 100.0), (TokenId(7), -100.0), (TokenId(3), 0.5)]
    );
    assert_eq!(ok.sampling_for(1).logit_bias, ok.sampling.logit_bias);
    for body in [
        r#"{"prompt": "a", "logit_bias": null}"#,
        r#"{"prompt": "a", "logit_bias": {}}"#,
    ] {
        assert!(generation(body).unwrap().sampling.logit_bias.is_empty());
    }
    for (bias, says) in [
        (r#"{"5": 101}"#, "101"),
        (r#"{"5": -1e300}"#, "inf"),
        (r#"{"abc": 1}"#, r#""abc""#),
        (r#"{"-1": 1}"#, r#""-1""#),
        (r#"{"+1": 1}"#, r#""+1""#),
        (r#"{"4294967296": 1}"#, "4294967296"),
        (r#"{"5": 1, "05": 2}"#, "twice"),
        (r#"{"5": "ten"}"#, "ten"),
        ("[1, 2]", "logit_bias"),
    ] {
        let err = generation(&format!(r#"{{"prompt": "a", "logit_bias": {bias}}}"#)).unwrap_err();
        assert!(
            err.param
                .as_deref()
                .is_some_and(|p| p.starts_with("logit_bias")),
            "{bias}: {err:?}"
        );
        assert!(err.message.contains(says), "{bias}: {}", err.message);
    }
    let entries = |n: usize| {
        (0..n)
            .map(|i| format!(r#""{i}": 1"#))
            .collect::<Vec<_>>()
            .join(",")
    };
    let most = format!(
        r#"{{"prompt": "a", "logit_bias": {{{}}}}}"#,
        entries(MAX_LOGIT_BIAS_TOKENS)
    );
    assert_eq!(
        generation(&most).unwrap().sampling.logit_bias.len(),
        MAX_LOGIT_BIAS_TOKENS
    );
    let huge = format!(
        r#"{{"prompt": "a", "logit_bias": {{{}}}}}"#,
        entries(200_000)
    );
    let (result, peak) = peak_of(|| generation(&huge));
    let err = result.unwrap_err();
    assert_eq!(err.param.as_deref(), Some("logit_bias"));
    assert!(err.message.contains("more than 1024"), "{}", err.message);
    assert!(
        peak < 256 << 10,
        "{peak} bytes to refuse {} bytes",
        huge.len()
    );
    // Beam search takes no bias.
    let err = generation(r#"{"prompt": "a", "num_beams": 2, "logit_bias": {"5": 1}}"#).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("logit_bias"));
}
