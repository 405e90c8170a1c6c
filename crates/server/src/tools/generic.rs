//! The generic JSON shape (llama.cpp's `common_chat_parse_generic`): the whole reply is one
//! object, `{"tool_call": {"name", "arguments"}}`, `{"tool_calls": [...]}` or
//! `{"response": "..."}` (whose string is the content). Anything else is content as it is.

use serde_json::Value;

use super::{Parsed, call_from};

/// `text`'s content and calls.
pub fn parse(text: &str) -> Parsed {
    let Ok(value) = serde_json::from_str::<Value>(text.trim()) else {
        return Parsed::text(text);
    };
    let calls = if let Some(list) = value.get("tool_calls").and_then(Value::as_array) {
        list.iter()
            .map(|c| call_from(c, &["arguments"]))
            .collect::<Option<Vec<_>>>()
    } else if let Some(call) = value.get("tool_call") {
        call_from(call, &["arguments"]).map(|c| vec![c])
    } else if let Some(response) = value.get("response").and_then(Value::as_str) {
        return Parsed {
            content: Some(response.to_string()),
            calls: Vec::new(),
        };
    } else {
        None
    };
    match calls {
        Some(calls) if !calls.is_empty() => Parsed {
            content: None,
            calls,
        },
        _ => Parsed::text(text),
    }
}
