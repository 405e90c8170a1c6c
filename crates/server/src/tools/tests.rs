//! The parsers on recorded outputs of each format (written from the formats' documentation and
//! the templates' own examples), malformed ones included, and the request's validation.

use serde_json::value::RawValue;

use super::*;

fn call(name: &str, arguments: &str) -> ParsedCall {
    ParsedCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn plan(format: ToolFormat) -> ToolPlan {
    ToolPlan {
        format: Some(format),
        generic_output: false,
        single: false,
    }
}

/// [`ToolRequest::from_values`] of the fields' JSON texts.
fn request_of(
    tools: Option<&RawValue>,
    choice: Option<&RawValue>,
    parallel: Option<bool>,
) -> Result<Option<ToolRequest>, crate::error::ApiError> {
    let value = |raw: &RawValue| serde_json::from_str::<Value>(raw.get()).unwrap();
    ToolRequest::from_values(tools.map(value), choice.map(value), parallel)
}

#[test]
fn hermes_blocks_after_text() {
    // Qwen2.5's template's format, two parallel calls, text before them.
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let parsed = parse(&plan(ToolFormat::Hermes), text);
    assert_eq!(parsed.content.as_deref(), Some("Let me check."));
    assert_eq!(
        parsed.calls,
        vec![
            call("get_weather", r#"{"city":"Paris","days":3}"#),
            call("get_time", r#"{"city":"Paris"}"#)
        ]
    );
}

#[test]
fn hermes_cut_off_block_and_bad_json() {
    let cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n";
    let parsed = hermes::parse(cut);
    assert_eq!(parsed.content, None);
    assert_eq!(
        parsed.calls,
        vec![call("get_weather", r#"{"city":"Oslo"}"#)]
    );
    // Bad JSON: the whole output stays content, as vLLM's parser leaves it.
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    assert_eq!(hermes::parse(bad), Parsed::text(bad));
    assert_eq!(hermes::parse("Just text."), Parsed::text("Just text."));
}

#[test]
fn llama3_json_calls() {
    // Llama 3.1's template: `{"name": ..., "parameters": ...}`; `<|python_tag|>` when kept.
    let parsed = llama3::parse(r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#);
    assert_eq!(parsed.content, None);
    assert_eq!(
        parsed.calls,
        vec![call("get_weather", r#"{"city":"Paris"}"#)]
    );
    let two = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}";
    assert_eq!(
        llama3::parse(two).calls,
        vec![call("a", "{}"), call("b", r#"{"x":1}"#)]
    );
    for text in [
        "The weather is fine.",
        r#"{"name": "get_weather", "parameters": {"city": "#,
        r#"{"city": "Paris"}"#,
    ] {
        assert_eq!(llama3::parse(text), Parsed::text(text), "{text}");
    }
}

#[test]
fn mistral_list_with_or_without_its_marker() {
    let text = r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]"#;
    let parsed = mistral::parse(text);
    assert_eq!(parsed.content, None);
    assert_eq!(
        parsed.calls,
        vec![call("get_weather", r#"{"city":"Paris"}"#)]
    );
    // The marker is a special token the detokenizer skips.
    let bare = r#"[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\"x\": 2}"}]"#;
    assert_eq!(
        mistral::parse(bare).calls,
        vec![call("a", "{}"), call("b", r#"{"x":2}"#)]
    );
    let bad = r#"[TOOL_CALLS][{"name": "a", "arguments": {]"#;
    assert_eq!(mistral::parse(bad), Parsed::text(bad));
    assert_eq!(mistral::parse("[1, 2]"), Parsed::text("[1, 2]"));
}

#[test]
fn generic_json_shapes() {
    let one = r#"{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}"#;
    assert_eq!(
        generic::parse(one).calls,
        vec![call("get_weather", r#"{"city":"Paris"}"#)]
    );
    let many = r#"{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": true}}]}"#;
    assert_eq!(
        generic::parse(many).calls,
        vec![call("a", "{}"), call("b", r#"{"y":true}"#)]
    );
    let response = generic::parse(r#"{"response": "Hello!"}"#);
    assert_eq!(response.content.as_deref(), Some("Hello!"));
    assert!(response.calls.is_empty());
    let cut = r#"{"tool_call": {"name": "a", "argu"#;
    assert_eq!(generic::parse(cut), Parsed::text(cut));
}

#[test]
fn unknown_names_come_back_as_written_and_single_keeps_one() {
    // As vLLM's parsers: the name is the model's; the client decides what an unknown one means.
    let text = "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call><tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
    let mut p = plan(ToolFormat::Hermes);
    assert_eq!(parse(&p, text).calls[0].name, "launch");
    p.single = true;
    assert_eq!(parse(&p, text).calls.len(), 1);
}

#[test]
fn formats_are_read_from_the_templates() {
    let templates = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/tests/fixtures/tool-templates"
    );
    let read = |name: &str| std::fs::read_to_string(format!("{templates}/{name}")).unwrap();
    assert_eq!(
        ToolFormat::detect(&read("qwen2.5.jinja")),
        ToolFormat::Hermes
    );
    assert_eq!(
        ToolFormat::detect(&read("llama3.1.jinja")),
        ToolFormat::Llama3
    );
    assert_eq!(
        ToolFormat::detect(&read("mistral-nemo.jinja")),
        ToolFormat::Mistral
    );
    assert_eq!(
        ToolFormat::detect("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ToolFormat::Generic
    );
    assert_eq!("none".parse::<ToolParser>(), Ok(ToolParser::Off));
    assert!("xml".parse::<ToolParser>().is_err());
}

fn raw(json: &str) -> Box<RawValue> {
    RawValue::from_string(json.to_string()).unwrap()
}

const TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;

#[test]
fn requests_are_validated_naming_the_field() {
    let tools = raw(TOOLS);
    let request = request_of(Some(&tools), None, None).unwrap().unwrap();
    assert_eq!(request.choice, ToolChoice::Auto);
    assert!(request.parallel);
    let named = raw(r#"{"type": "function", "function": {"name": "get_weather"}}"#);
    let request = request_of(Some(&tools), Some(&named), Some(false))
        .unwrap()
        .unwrap();
    assert_eq!(request.choice, ToolChoice::Named("get_weather".into()));
    assert!(
        request_of(None, Some(&raw("\"none\"")), None)
            .unwrap()
            .is_none()
    );

    let param = |tools: Option<&str>, choice: Option<&str>| {
        let tools = tools.map(raw);
        let choice = choice.map(raw);
        request_of(tools.as_deref(), choice.as_deref(), None)
            .unwrap_err()
            .body()["error"]["param"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let unknown = r#"{"type": "function", "function": {"name": "nope"}}"#;
    assert_eq!(param(Some(TOOLS), Some(unknown)), "tool_choice");
    assert_eq!(param(None, Some("\"required\"")), "tool_choice");
    assert_eq!(param(Some(TOOLS), Some("\"sometimes\"")), "tool_choice");
    assert_eq!(param(Some("{}"), None), "tools");
    assert_eq!(
        param(
            Some(
                r#"[{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]"#
            ),
            None
        ),
        "tools[0].function.parameters"
    );
    assert_eq!(
        param(
            Some(r#"[{"type": "function", "function": {"name": ""}}]"#),
            None
        ),
        "tools[0].function.name"
    );
    assert_eq!(
        param(Some(r#"[{"type": "retrieval"}]"#), None),
        "tools[0].type"
    );
}

#[test]
fn forced_choices_constrain_to_the_generic_shape() {
    let tools = raw(TOOLS);
    let required = raw("\"required\"");
    let request = request_of(Some(&tools), Some(&required), Some(false))
        .unwrap()
        .unwrap();
    let mut variables = Map::new();
    let mut constraint = None;
    let plan = plan_for(
        &request,
        ToolFormat::Hermes,
        &mut variables,
        &mut constraint,
    );
    assert!(plan.generic_output && plan.single);
    assert!(variables.contains_key("tools"));
    let Some(("tool_choice", OutputConstraint::JsonSchema(schema))) = constraint else {
        panic!("no schema: {constraint:?}");
    };
    assert_eq!(schema["required"], json!(["tool_call"]));
    assert_eq!(
        schema["properties"]["tool_call"]["properties"]["name"],
        json!({"const": "get_weather"})
    );
    // Another constraint beside a forced call is refused, naming it.
    let mut taken = Some(("response_format", OutputConstraint::JsonObject));
    let err = super::plan(
        Some(&request),
        Some(ToolFormat::Hermes),
        &mut Map::new(),
        &mut taken,
    )
    .unwrap_err();
    assert_eq!(err.body()["error"]["param"], "response_format");
    // Tool calling off.
    let err = super::plan(Some(&request), None, &mut Map::new(), &mut None).unwrap_err();
    assert_eq!(err.body()["error"]["param"], "tools");
}

fn plan_for(
    request: &ToolRequest,
    format: ToolFormat,
    variables: &mut Map<String, Value>,
    constraint: &mut Option<(&'static str, OutputConstraint)>,
) -> ToolPlan {
    super::plan(Some(request), Some(format), variables, constraint).unwrap()
}

#[test]
fn call_ids_are_openai_or_mistral_shaped() {
    let id = call_id(
        Some(ToolFormat::Hermes),
        "chatcmpl-00112233445566778899aabb",
        0,
        1,
    );
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    let m = call_id(
        Some(ToolFormat::Mistral),
        "chatcmpl-00112233445566778899aabb",
        0,
        1,
    );
    assert!(
        m.len() == 9 && m.chars().all(|c| c.is_ascii_alphanumeric()),
        "{m}"
    );
    assert_ne!(
        m,
        call_id(
            Some(ToolFormat::Mistral),
            "chatcmpl-00112233445566778899aabb",
            0,
            2
        )
    );
}
