//! Bounds that make constrained JSON end: how much whitespace may sit between its tokens, and
//! how many digits a number's parts may have.
//!
//! A JSON grammar alone lets a small model go on forever while every byte stays valid:
//! whitespace between two tokens, a fraction's digits. llama.cpp's schema grammars bound both
//! (`common/json-schema-to-grammar.cpp`: the `space` rule is `| " " | "\n"{1,2} [ \t]{0,20}`,
//! `integral-part` and `decimal-part` are at most 16 digits); kiln does the same.
//!
//! - Whitespace goes through llguidance's own JSON options (`x-guidance`'s `whitespace_pattern`
//!   or `whitespace_flexible`), set on JSON schemas, `json_object` and every `%json` embed of a
//!   Lark grammar ([`JsonWhitespace`], [`with_whitespace`], [`lark_with_whitespace`]).
//! - Digits: llguidance has no option for them, so [`DigitRuns`] follows the output's JSON
//!   (inside or outside a string, the current run of digits) and removes from the mask every
//!   token that would make a run outside strings longer than [`MAX_JSON_DIGITS`].
//!
//! It knows nothing of tokens' ids or of the matcher: the caller feeds bytes.

use std::fmt;
use std::str::FromStr;

use serde_json::{Map, Value};

/// The most digits in a row a JSON number's integer part, fraction or exponent may have
/// outside strings: llama.cpp's `integral-part` and `decimal-part` (16, about what an f64
/// holds).
pub const MAX_JSON_DIGITS: usize = 16;

/// How much whitespace JSON output may have between its tokens (`--json-whitespace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JsonWhitespace {
    /// None at all: `{"a":1,"b":[2,3]}`.
    Compact,
    /// At each place JSON allows whitespace, at most one space, or one or two newlines then up
    /// to 20 spaces or tabs of indentation (llama.cpp's `space` rule): pretty-printed JSON
    /// still fits, an endless run of blank lines does not.
    #[default]
    Bounded,
    /// Any run of JSON whitespace (llguidance's default): a small model may write whitespace
    /// until `max_tokens`.
    Free,
}

/// llguidance's `whitespace_pattern` for [`JsonWhitespace::Bounded`]: llama.cpp's `space`
/// rule, `| " " | "\n"{1,2} [ \t]{0,20}`, as a regex (the empty case is llguidance's: the
/// pattern is optional at each place).
const BOUNDED_WHITESPACE: &str = r"\x20|\x0A{1,2}[\x20\x09]{0,20}";

impl JsonWhitespace {
    /// Every value, in the order the flag lists them.
    pub const ALL: [Self; 3] = [Self::Compact, Self::Bounded, Self::Free];

    /// Its name on the command line: `compact`, `bounded`, `free`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Compact => "compact",
            Self::Bounded => "bounded",
            Self::Free => "free",
        }
    }

    /// llguidance's JSON options (the `x-guidance` keys) that say it.
    fn options(self) -> Map<String, Value> {
        let mut options = Map::new();
        match self {
            Self::Compact => {
                options.insert("whitespace_flexible".into(), false.into());
            }
            Self::Bounded => {
                options.insert("whitespace_pattern".into(), BOUNDED_WHITESPACE.into());
            }
            Self::Free => {
                options.insert("whitespace_flexible".into(), true.into());
            }
        }
        options
    }
}

impl fmt::Display for JsonWhitespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not one of [`JsonWhitespace::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown JSON whitespace {0:?}: expected compact, bounded or free")]
pub struct UnknownJsonWhitespace(pub String);

impl FromStr for JsonWhitespace {
    type Err = UnknownJsonWhitespace;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| UnknownJsonWhitespace(s.to_string()))
    }
}

/// `schema` with `whitespace`'s llguidance options in its top-level `x-guidance` object,
/// unless the schema already says how to treat whitespace there (its own choice wins). `true`
/// becomes `{}` (the same language) so it can carry them; anything else that is not an object
/// is left for llguidance to refuse.
pub fn with_whitespace(schema: Value, whitespace: JsonWhitespace) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => Value::Object(Map::new()),
        other => other,
    };
    let Value::Object(map) = &mut schema else {
        return schema;
    };
    let guidance = map
        .entry("x-guidance")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(options) = guidance
        && !options.contains_key("whitespace_flexible")
        && !options.contains_key("whitespace_pattern")
    {
        options.extend(whitespace.options());
    }
    schema
}

/// Lark `grammar` with [`with_whitespace`] applied to the schema after each `%json`. Strings
/// (`"…"`), regexes (`/…/`) and comments (`// …`) are stepped over, so a `%json` written
/// inside one is left alone; a `%json` whose schema does not parse is left for llguidance to
/// report.
pub fn lark_with_whitespace(grammar: &str, whitespace: JsonWhitespace) -> String {
    const KEYWORD: &str = "%json";
    let bytes = grammar.as_bytes();
    let mut out = String::with_capacity(grammar.len());
    let mut copied = 0; // bytes of `grammar` already in `out`
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i = skip_quoted(bytes, i, b'"'),
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                i = bytes[i..]
                    .iter()
                    .position(|&b| b == b'\n')
                    .map_or(bytes.len(), |n| i + n);
            }
            b'/' => i = skip_quoted(bytes, i, b'/'),
            b'%' if grammar[i..].starts_with(KEYWORD) => {
                let start = i + KEYWORD.len();
                let mut stream =
                    serde_json::Deserializer::from_str(&grammar[start..]).into_iter::<Value>();
                match stream.next() {
                    Some(Ok(schema @ Value::Object(_))) => {
                        let end = start + stream.byte_offset();
                        out.push_str(&grammar[copied..start]);
                        out.push(' ');
                        out.push_str(&with_whitespace(schema, whitespace).to_string());
                        copied = end;
                        i = end;
                    }
                    _ => i = start,
                }
            }
            _ => i += 1,
        }
    }
    out.push_str(&grammar[copied..]);
    out
}

/// The index just past the `quote`-delimited literal opening at `start` (backslash escapes
/// inside; an unclosed one runs to the end of the line, as Lark's lexer would refuse it there).
fn skip_quoted(bytes: &[u8], start: usize, quote: u8) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'\n' => return i,
            b if b == quote => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Where the output's JSON stands, byte by byte, for the digit bound: inside a string or not,
/// and how many digits in a row end it outside strings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DigitRuns {
    in_string: bool,
    /// The last byte was a backslash inside a string.
    escaped: bool,
    /// Digits in a row at the end, outside strings.
    run: usize,
}

impl DigitRuns {
    /// After `bytes`; `false` when some run of digits outside strings went past
    /// [`MAX_JSON_DIGITS`] on the way.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        let mut within = true;
        for &b in bytes {
            if self.in_string {
                match b {
                    _ if self.escaped => self.escaped = false,
                    b'\\' => self.escaped = true,
                    b'"' => self.in_string = false,
                    _ => {}
                }
            } else if b.is_ascii_digit() {
                self.run += 1;
                within &= self.run <= MAX_JSON_DIGITS;
            } else {
                self.run = 0;
                self.in_string = b == b'"';
            }
        }
        within
    }

    /// Whether some token could now make a run too long, when no token in the vocabulary has
    /// more than `longest_token_run` digits in a row: only outside a string, once the run so
    /// far and such a token could pass the bound (strings and fresh runs cannot).
    pub fn at_risk(&self, longest_token_run: usize) -> bool {
        longest_token_run > MAX_JSON_DIGITS
            || (!self.in_string && self.run + longest_token_run > MAX_JSON_DIGITS)
    }

    /// Whether a token of `bytes` may come next without passing the bound.
    pub fn allows(&self, bytes: &[u8]) -> bool {
        let mut next = *self;
        next.push(bytes)
    }
}

/// The longest run of ASCII digits in `bytes`.
pub fn longest_digit_run(bytes: &[u8]) -> usize {
    bytes
        .split(|b| !b.is_ascii_digit())
        .map(<[u8]>::len)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_whitespace_mode_has_its_name_and_llguidance_options() {
        for w in JsonWhitespace::ALL {
            assert_eq!(w.name().parse::<JsonWhitespace>(), Ok(w));
            assert_eq!(w.to_string(), w.name());
        }
        assert_eq!(JsonWhitespace::default(), JsonWhitespace::Bounded);
        assert!(
            "loose"
                .parse::<JsonWhitespace>()
                .unwrap_err()
                .to_string()
                .contains("compact, bounded or free")
        );
        let schema = with_whitespace(json!({"type": "object"}), JsonWhitespace::Compact);
        assert_eq!(
            schema,
            json!({"type": "object", "x-guidance": {"whitespace_flexible": false}})
        );
    }

    #[test]
    fn a_schema_s_own_whitespace_choice_and_other_options_are_kept() {
        let own = json!({"x-guidance": {"whitespace_pattern": " ?"}});
        assert_eq!(with_whitespace(own.clone(), JsonWhitespace::Bounded), own);
        let other = with_whitespace(
            json!({"x-guidance": {"lenient": true}}),
            JsonWhitespace::Bounded,
        );
        assert_eq!(other["x-guidance"]["lenient"], true);
        assert_eq!(
            other["x-guidance"]["whitespace_pattern"],
            BOUNDED_WHITESPACE
        );
        // `true` is any value: an empty schema says the same and can carry the options.
        assert!(with_whitespace(json!(true), JsonWhitespace::Free)["x-guidance"].is_object());
        assert_eq!(
            with_whitespace(json!(false), JsonWhitespace::Free),
            json!(false)
        );
    }

    #[test]
    fn every_json_embed_of_a_lark_grammar_gets_the_options_and_nothing_else_changes() {
        let grammar = "start: \"say %json {}\" a b // %json {}\na: %json {\"type\": \"integer\"}\nb: /%json {}/ | %json{\"type\":\"string\"}\n";
        let rewritten = lark_with_whitespace(grammar, JsonWhitespace::Compact);
        assert_eq!(
            rewritten,
            "start: \"say %json {}\" a b // %json {}\na: %json {\"type\":\"integer\",\"x-guidance\":{\"whitespace_flexible\":false}}\nb: /%json {}/ | %json {\"type\":\"string\",\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        // No embed, or one that does not parse: unchanged (llguidance reports the latter).
        for g in ["start: \"a\"\n", "start: %json {oops\n"] {
            assert_eq!(lark_with_whitespace(g, JsonWhitespace::Bounded), g);
        }
    }

    #[test]
    fn digit_runs_count_outside_strings_only_and_restart_at_each_part() {
        let sixteen = b"1234567890123456";
        let mut runs = DigitRuns::default();
        assert!(runs.push(b"{\"a\": "));
        assert!(runs.push(sixteen));
        assert!(!runs.allows(b"7"));
        assert!(runs.allows(b"."));
        assert!(runs.push(b"."));
        assert!(runs.push(sixteen));
        assert!(!runs.allows(b"0"));
        assert!(runs.push(b"e-"));
        assert!(runs.push(sixteen));
        assert!(!runs.allows(b"1"));
        // In a string, digits are text: any number of them.
        let mut runs = DigitRuns::default();
        assert!(runs.push(b"[\"id \\\" "));
        assert!(runs.push(&[b'9'; 40]));
        assert!(!runs.at_risk(1));
        assert!(runs.push(b"\", "));
        assert!(runs.push(sixteen));
        assert!(runs.at_risk(1));
        assert!(!runs.push(b"0"));
        assert_eq!(longest_digit_run(b"a12.3456x"), 4);
        assert_eq!(longest_digit_run(b""), 0);
    }
}
