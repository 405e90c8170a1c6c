//! Hermes / Qwen2.5 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
//! blocks, after any text (Qwen2.5's and NousResearch Hermes' templates). As vLLM's
//! `hermes` parser: the text before the first block is the content; a block whose JSON does
//! not parse, or lacks a name, leaves the whole output as content; a last block cut off
//! before `</tool_call>` is read to the end.

use super::{Parsed, call_from};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// `text`'s content and calls.
pub fn parse(text: &str) -> Parsed {
    let Some(first) = text.find(OPEN) else {
        return Parsed::text(text);
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(OPEN) {
        let body_start = start + OPEN.len();
        let (body, next) = match rest[body_start..].find(CLOSE) {
            Some(end) => (
                &rest[body_start..body_start + end],
                &rest[body_start + end + CLOSE.len()..],
            ),
            None => (&rest[body_start..], ""),
        };
        let call = serde_json::from_str(body.trim())
            .ok()
            .and_then(|v| call_from(&v, &["arguments", "parameters"]));
        match call {
            Some(call) => calls.push(call),
            None => return Parsed::text(text),
        }
        rest = next;
    }
    let content = text[..first].trim_end();
    Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    }
}
