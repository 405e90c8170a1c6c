//! Mistral calls: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects (Mistral
//! 7B v0.3, Nemo; vLLM's `mistral` parser). `[TOOL_CALLS]` is a special token, which kiln's
//! detokenizer skips, so a reply that is such a list from its first character is read as calls
//! too. The text before the marker is content; a list that does not parse is content.

use serde_json::Value;

use super::{Parsed, call_from};

const MARKER: &str = "[TOOL_CALLS]";

/// `text`'s content and calls.
pub fn parse(text: &str) -> Parsed {
    let (before, list) = match text.find(MARKER) {
        Some(at) => (&text[..at], &text[at + MARKER.len()..]),
        None if text.trim_start().starts_with("[{") => ("", text),
        None => return Parsed::text(text),
    };
    let mut stream = serde_json::Deserializer::from_str(list.trim()).into_iter::<Value>();
    let calls = match stream.next() {
        Some(Ok(Value::Array(items))) => items
            .iter()
            .map(|item| call_from(item, &["arguments", "parameters"]))
            .collect::<Option<Vec<_>>>(),
        // One object without the list around it.
        Some(Ok(item @ Value::Object(_))) => {
            call_from(&item, &["arguments", "parameters"]).map(|call| vec![call])
        }
        _ => None,
    };
    match calls {
        Some(calls) if !calls.is_empty() => {
            let content = before.trim();
            Parsed {
                content: (!content.is_empty()).then(|| content.to_string()),
                calls,
            }
        }
        _ => Parsed::text(text),
    }
}
