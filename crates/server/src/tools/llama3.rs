//! Llama 3.1 / 3.2 JSON calls: `{"name": ..., "parameters": {...}}` as the whole reply,
//! optionally after `<|python_tag|>` (a special token, usually decoded away), several
//! separated by `;` (vLLM's `llama3_json` parser). A reply that is not such JSON is content.

use serde_json::Value;

use super::{Parsed, call_from};

const PYTHON_TAG: &str = "<|python_tag|>";

/// `text`'s content and calls.
pub fn parse(text: &str) -> Parsed {
    let trimmed = text.trim_start();
    let body = trimmed.strip_prefix(PYTHON_TAG).unwrap_or(trimmed).trim();
    if !body.starts_with('{') {
        return Parsed::text(text);
    }
    let mut calls = Vec::new();
    // Objects one after another, `;` (and whitespace) between them.
    let mut rest = body;
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let call = match stream.next() {
            Some(Ok(value)) => call_from(&value, &["parameters", "arguments"]),
            _ => None,
        };
        let Some(call) = call else {
            return Parsed::text(text);
        };
        calls.push(call);
        let after = rest[stream.byte_offset()..].trim_start();
        rest = after.strip_prefix(';').unwrap_or(after).trim_start();
    }
    if calls.is_empty() {
        return Parsed::text(text);
    }
    Parsed {
        content: None,
        calls,
    }
}
