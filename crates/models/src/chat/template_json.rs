//! JSON as chat templates see it in transformers: objects that keep their keys in the order
//! they were written ([`to_template`]), and the `tojson` filter transformers installs
//! ([`tojson`]: Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`, not Jinja's HTML-escaping one).
//!
//! Order and spacing are part of the prompt: Qwen2.5 writes each tool as
//! `{"type": "function", "function": {"name": ...`, and a model trained on that text reads
//! `{"function":{...},"type":"function"}` as something else. minijinja's own maps sort their
//! keys, so objects here are an [`Object`] of their own.
//!
//! What it does not know: which variables a template reads, or tokens.

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// A JSON object with its keys in their written order.
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(
            self.0
                .iter()
                .map(|(k, _)| Value::from(k.as_str()))
                .collect(),
        )
    }
}

/// `value` for a template, its objects' keys in order.
pub fn to_template(value: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Value::from(i),
            (None, Some(u), _) => Value::from(u),
            (_, _, Some(f)) => Value::from(f),
            _ => Value::from(()),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(to_template).collect::<Vec<_>>()),
        Json::Object(map) => ordered(
            map.iter()
                .map(|(k, v)| (k.clone(), to_template(v)))
                .collect(),
        ),
    }
}

/// An object of `entries`, in their order.
pub fn ordered(entries: Vec<(String, Value)>) -> Value {
    Value::from_object(OrderedMap(entries))
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, its arguments by keyword (or `ensure_ascii` first by
/// position, as the Python function takes them).
///
/// # Errors
/// An argument of the wrong type, or an unknown one.
pub fn tojson(value: &Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = match ensure_ascii {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a count",
                )
            })?)),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    // Python's defaults: ", " between items without an indent, "," with one (the newline
    // follows); ": " between a key and its value.
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = Style {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// How `json.dumps` was asked to write.
struct Style {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Style {
    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => match value.as_i64() {
                Some(i) if value.is_integer() => {
                    let _ = write!(out, "{i}");
                }
                _ if value.is_integer() => {
                    let _ = write!(out, "{value}");
                }
                _ => out.push_str(&python_float(f64::try_from(value.clone())?)),
            },
            ValueKind::String => self.string(value.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                let mut entries = Vec::with_capacity(keys.len());
                for key in keys {
                    let item = value.get_item(&key)?;
                    entries.push((key, item));
                }
                self.container(('{', '}'), &entries, depth, out, |(key, item), out| {
                    // Python writes non-string keys (numbers, booleans) as strings.
                    match key.as_str() {
                        Some(k) => self.string(k, out),
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container(('[', ']'), &items, depth, out, |item, out| {
                    self.write(item, depth + 1, out)
                })?;
            }
            _ => self.string(&value.to_string(), out),
        }
        Ok(())
    }

    /// `[...]` or `{...}` of `items`, each written by `each`, laid out as the indent says.
    fn container<T>(
        &self,
        (open, close): (char, char),
        items: &[T],
        depth: usize,
        out: &mut String,
        mut each: impl FnMut(&T, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, depth: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(depth));
            }
        };
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            newline(out, depth + 1);
            each(item, out)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    /// A JSON string as Python writes it: `"`, `\` and control characters escaped (the common
    /// ones by letter), everything else as it is unless `ensure_ascii`.
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `repr(float)` in Python: the shortest text that reads back the same, with `.0` on whole
/// numbers and a two-digit exponent below 1e-4 or from 1e16 (`1e-05`, `1e+16`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let magnitude = f.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        let text = format!("{f:e}");
        let (mantissa, exponent) = text.split_once('e').unwrap_or((&text, "0"));
        let exponent: i32 = exponent.parse().unwrap_or(0);
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let text = format!("{f}");
    if text.contains('.') {
        text
    } else {
        format!("{text}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(json: &str, kwargs: &[(&str, Value)]) -> String {
        let value = to_template(&serde_json::from_str(json).unwrap());
        let kwargs = Kwargs::from_iter(kwargs.iter().map(|(k, v)| (*k, v.clone())));
        tojson(&value, None, kwargs).unwrap().to_string()
    }

    #[test]
    fn writes_as_python_json_dumps() {
        // Expected texts: Python 3.11's json.dumps with the same arguments.
        let doc = r#"{"b": [1, 2.5, 1e-05, 1e16, true, null], "a": "é<\"\n", "c": {}}"#;
        assert_eq!(
            dumps(doc, &[]),
            r#"{"b": [1, 2.5, 1e-05, 1e+16, true, null], "a": "é<\"\n", "c": {}}"#
        );
        assert_eq!(
            dumps(
                doc,
                &[("indent", Value::from(2)), ("sort_keys", Value::from(true))]
            ),
            "{\n  \"a\": \"é<\\\"\\n\",\n  \"b\": [\n    1,\n    2.5,\n    1e-05,\n    1e+16,\n    \
             true,\n    null\n  ],\n  \"c\": {}\n}"
        );
        assert_eq!(
            dumps(
                r#"{"a": "é\u0001"}"#,
                &[("ensure_ascii", Value::from(true))]
            ),
            r#"{"a": "\u00e9\u0001"}"#
        );
        assert_eq!(
            dumps(
                r#"{"a": [1, 2]}"#,
                &[("separators", Value::from(vec![",", ":"]))]
            ),
            r#"{"a":[1,2]}"#
        );
        assert_eq!(python_float(3.0), "3.0");
        assert_eq!(python_float(0.1), "0.1");
    }
}
