//! Chat templates with tools render exactly what transformers' `apply_chat_template(messages,
//! tools=..., add_generation_prompt=True, tokenize=False)` renders (fixtures from
//! `scripts/reference/make_tool_template_fixtures.py`): Qwen2.5, Llama 3.1 and Mistral Nemo
//! templates, an assistant's tool calls and the tools' results.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use kiln_models::chat::{ChatMessage, ChatTemplate, Role, ToolCall};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tool-templates")
}

/// A fixture's message (transformers' form: arguments as objects) as kiln's.
fn message(m: &Value) -> ChatMessage {
    let content = m["content"].as_str().unwrap_or_default();
    match m["role"].as_str().unwrap() {
        "system" => ChatMessage::new(Role::System, content),
        "user" => ChatMessage::new(Role::User, content),
        "tool" => ChatMessage::tool_result(
            m["tool_call_id"].as_str().unwrap(),
            m["name"].as_str().map(str::to_string),
            content,
        ),
        _ => match m["tool_calls"].as_array() {
            Some(calls) => ChatMessage::tool_calls(
                content,
                calls
                    .iter()
                    .map(|c| ToolCall {
                        id: c["id"].as_str().unwrap().to_string(),
                        name: c["function"]["name"].as_str().unwrap().to_string(),
                        arguments: c["function"]["arguments"].clone(),
                    })
                    .collect(),
            ),
            None => ChatMessage::new(Role::Assistant, content),
        },
    }
}

#[test]
fn tool_conversations_render_as_transformers_renders_them() {
    let body: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("rendered.json")).unwrap())
            .unwrap();
    let cases = body["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let source =
            std::fs::read_to_string(fixtures().join(case["template"].as_str().unwrap())).unwrap();
        let template = ChatTemplate::new(
            &source,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap();
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let mut variables = serde_json::Map::new();
        variables.insert("tools".into(), case["tools"].clone());
        let text = template
            .render_with(&messages, true, &variables)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, case["rendered"].as_str().unwrap(), "{name}");
    }
}
