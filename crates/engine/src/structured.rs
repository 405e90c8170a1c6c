//! Structured output: decoding constrained to a JSON schema, any JSON object, a regular
//! expression or a Lark grammar, so the output always parses.
//!
//! The grammar engine is `llguidance` (what llama.cpp and mistral.rs use): it compiles an
//! [`OutputConstraint`] into a parser over bytes and, at each step, computes the set of tokens
//! whose bytes keep the output inside the language (the *mask*), from a trie of the model's
//! vocabulary.
//!
//! - [`GrammarCompiler`]: built once per tokenizer from its tokens' bytes ([`TokenText`]).
//! - [`Grammar`]: a compiled constraint; invalid or unsupported input is refused here, before
//!   any token is generated. [`crate::Request::constraint`] takes one.
//! - [`GrammarMatcher`]: one sequence's parser state, and a [`LogitsProcessor`] that removes
//!   every token the grammar forbids: the engine runs it first in the sampling chain, so
//!   penalties, top-k, top-p and min-p only ever see allowed tokens. When the grammar is
//!   complete the only allowed tokens are the end-of-sequence ones. It reads the generated
//!   tokens from the [`TokenHistory`], so it also works in a hand-written loop.
//!
//! JSON output is bounded so that it ends (the private `json_bounds` module): whitespace
//! between tokens as the compiler's [`JsonWhitespace`] says (bounded by default), integers
//! within [`MAX_UNBOUNDED_INTEGER`] unless the schema says otherwise, and at most
//! [`MAX_JSON_DIGITS`] digits in a row in a number's integer part, fraction or exponent.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_core::TokenId;
use kiln_core::ids::TokenText;
use kiln_core::sampling::{Candidates, LogitsProcessor, TokenHistory};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

mod json_bounds;

use json_bounds::{DigitRuns, lark_with_whitespace, longest_digit_run, with_whitespace};
pub use json_bounds::{JsonWhitespace, MAX_JSON_DIGITS, UnknownJsonWhitespace};

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// A JSON value valid under this JSON schema (objects, arrays, enums, `const`,
    /// string/number/integer/boolean/null, bounds, `required`, `additionalProperties`,
    /// `$ref` to local definitions, `anyOf`/`oneOf`/`allOf`; keywords llguidance does not
    /// implement are refused).
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression (the whole output).
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect: `start` is the start
    /// rule; `%json {schema}` embeds a JSON schema).
    Lark(String),
}

impl OutputConstraint {
    /// Its kind, as errors and logs name it: `json_schema`, `json_object`, `regex`, `grammar`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json_schema",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Lark(_) => "grammar",
        }
    }

    /// Whether the whole output is JSON (so the digit bound applies to it).
    fn is_json(&self) -> bool {
        matches!(self, Self::JsonSchema(_) | Self::JsonObject)
    }

    fn grammar(&self, whitespace: JsonWhitespace) -> Result<TopLevelGrammar, StructuredError> {
        let invalid = |reason: String| StructuredError::Invalid {
            kind: self.kind(),
            reason,
        };
        Ok(match self {
            Self::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid("a JSON schema is an object (or true/false)".into()));
                }
                TopLevelGrammar::from_json_schema(with_whitespace(
                    bound_integers(schema.clone()),
                    whitespace,
                ))
            }
            Self::JsonObject => TopLevelGrammar::from_json_schema(with_whitespace(
                serde_json::json!({"type": "object"}),
                whitespace,
            )),
            Self::Regex(rx) => {
                // llguidance's lexer takes a subset of regex syntax; check the pattern with a
                // full parser first so a typo reads as a regex error, not a grammar one.
                if let Err(e) = regex_syntax::Parser::new().parse(rx) {
                    let why = match &e {
                        regex_syntax::Error::Parse(e) => {
                            format!("{} at byte {}", e.kind(), e.span().start.offset)
                        }
                        regex_syntax::Error::Translate(e) => {
                            format!("{} at byte {}", e.kind(), e.span().start.offset)
                        }
                        other => other.to_string(),
                    };
                    return Err(invalid(why));
                }
                TopLevelGrammar::from_regex(rx)
            }
            Self::Lark(text) => {
                if text.trim().is_empty() {
                    return Err(invalid("the grammar is empty".into()));
                }
                TopLevelGrammar::from_lark(lark_with_whitespace(text, whitespace))
            }
        })
    }
}

/// The largest integer an unbounded `"type": "integer"` may take: I-JSON's interoperable
/// range (RFC 7493, 2^53 - 1), as llama.cpp's schema converter caps integers at 16 digits.
pub const MAX_UNBOUNDED_INTEGER: i64 = (1 << 53) - 1;

/// `schema` with every integer that has no bound on a side bounded there by
/// [`MAX_UNBOUNDED_INTEGER`]: without it a small model can write digits until `max_tokens`
/// (an endless integer is valid JSON at every step). Data keywords (`enum`, `const`,
/// `default`, `examples`) are left as they are; a property or definition may have any name
/// (one called `default` is a schema like the others).
fn bound_integers(mut schema: Value) -> Value {
    /// A schema: bound it if it is an integer, then walk its keywords.
    fn walk_schema(node: &mut Value) {
        let Value::Object(map) = node else {
            return; // `true` / `false`
        };
        let integer = match map.get("type") {
            Some(Value::String(t)) => t == "integer",
            Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
            _ => false,
        };
        if integer {
            // A bound the schema gives beyond the range keeps the other side open, rather
            // than making the schema empty.
            let limit = MAX_UNBOUNDED_INTEGER as f64;
            let given = |map: &serde_json::Map<String, Value>, keys: [&str; 2]| {
                let values = keys.iter().filter_map(|k| map.get(*k));
                values.map(|v| v.as_f64().unwrap_or(0.0)).next()
            };
            let low = given(map, ["minimum", "exclusiveMinimum"]);
            let high = given(map, ["maximum", "exclusiveMaximum"]);
            if high.is_none() && low.is_none_or(|low| low < limit) {
                map.insert("maximum".into(), MAX_UNBOUNDED_INTEGER.into());
            }
            if low.is_none() && high.is_none_or(|high| high > -limit) {
                map.insert("minimum".into(), (-MAX_UNBOUNDED_INTEGER).into());
            }
        }
        for (keyword, value) in map.iter_mut() {
            match keyword.as_str() {
                "enum" | "const" | "default" | "examples" => {}
                // Maps from names the schema chose to schemas.
                "properties" | "patternProperties" | "$defs" | "definitions"
                | "dependentSchemas" => {
                    if let Value::Object(named) = value {
                        named.values_mut().for_each(walk_schema);
                    }
                }
                // A schema (`items`, `not`, `additionalProperties`, …) or a list of them
                // (`anyOf`, `prefixItems`, …).
                _ => match value {
                    Value::Array(schemas) => schemas.iter_mut().for_each(walk_schema),
                    other => walk_schema(other),
                },
            }
        }
    }
    walk_schema(&mut schema);
    schema
}

/// Why a constraint or a vocabulary was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StructuredError {
    /// The schema, regex or grammar is malformed, or uses something llguidance does not
    /// support (named in `reason`).
    #[error("invalid {kind}: {reason}")]
    Invalid {
        /// [`OutputConstraint::kind`].
        kind: &'static str,
        /// What is wrong, in llguidance's words.
        reason: String,
    },
    /// The vocabulary cannot make a token trie.
    #[error("cannot constrain this tokenizer's output: {0}")]
    Vocabulary(String),
}

/// Compiles constraints for one tokenizer. Building it makes the token trie (tens of
/// milliseconds for a 50k vocabulary); make it once and share it.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    eos: TokenId,
    /// Whitespace JSON output may have ([`GrammarCompiler::with_json_whitespace`]).
    json_whitespace: JsonWhitespace,
    /// The most digits in a row in any token (how close to the digit bound a token can go).
    longest_token_digits: usize,
}

impl fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab())
            .field("eos", &self.eos)
            .field("json_whitespace", &self.json_whitespace)
            .finish()
    }
}

impl GrammarCompiler {
    /// A compiler over the vocabulary `tokens` (one per id, as many as the model's logits
    /// have), whose end-of-sequence token is `eos`; JSON whitespace is
    /// [`JsonWhitespace::Bounded`].
    ///
    /// # Errors
    /// [`StructuredError::Vocabulary`]: an empty vocabulary, or `eos` outside it.
    pub fn new(tokens: &[TokenText], eos: TokenId) -> Result<Self, StructuredError> {
        if tokens.is_empty() || eos.0 as usize >= tokens.len() {
            return Err(StructuredError::Vocabulary(format!(
                "end-of-sequence id {eos} outside a vocabulary of {}",
                tokens.len()
            )));
        }
        let words: Vec<Vec<u8>> = tokens
            .iter()
            .map(|t| match t {
                TokenText::Bytes(b) => b.clone(),
                // The trie's convention: special tokens are their name after a marker byte
                // that no text contains, so no grammar over text can produce them.
                TokenText::Special(name) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                }
            })
            .collect();
        let longest_token_digits = words
            .iter()
            .map(|w| longest_digit_run(w))
            .max()
            .unwrap_or(0);
        let info = TokRxInfo::new(tokens.len() as u32, eos.0);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| StructuredError::Vocabulary(e.to_string()))?;
        // Library code never prints: llguidance's warnings come back as errors or not at all.
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            eos,
            json_whitespace: JsonWhitespace::default(),
            longest_token_digits,
        })
    }

    /// The same compiler, with JSON output (schemas, `json_object`, a Lark grammar's `%json`
    /// embeds) allowed `whitespace` between its tokens.
    #[must_use]
    pub fn with_json_whitespace(mut self, whitespace: JsonWhitespace) -> Self {
        self.json_whitespace = whitespace;
        self
    }

    /// The whitespace JSON output may have.
    pub fn json_whitespace(&self) -> JsonWhitespace {
        self.json_whitespace
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Compiles `constraint`.
    ///
    /// # Errors
    /// [`StructuredError::Invalid`]: malformed, or asks for what llguidance does not support.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<Grammar, StructuredError> {
        let grammar = constraint.grammar(self.json_whitespace)?;
        // llguidance's messages may span lines (a grammar excerpt); errors here are one line.
        let invalid = |e: &dyn fmt::Display| StructuredError::Invalid {
            kind: constraint.kind(),
            reason: reason_of(&e.to_string()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(&e))?;
        let mut matcher = Matcher::new(Ok(parser));
        // Some errors only show when the first mask is computed (an empty language).
        if let Err(e) = matcher.compute_mask() {
            return Err(invalid(&e));
        }
        if let Some(e) = matcher.get_error() {
            return Err(invalid(&e));
        }
        Ok(Grammar {
            template: Arc::new(Mutex::new(matcher)),
            kind: constraint.kind(),
            eos: self.eos,
            vocab: self.vocab(),
            digits: constraint.is_json().then(|| DigitBound {
                env: self.factory.tok_env().clone(),
                longest_token_digits: self.longest_token_digits,
            }),
        })
    }
}

/// llguidance's message as one line for a person: without the parser state it appends to
/// some errors, and an empty language (its `NoExtensionBias`: no token may come first) said
/// as such.
fn reason_of(message: &str) -> String {
    let message = message.split("<state>").next().unwrap_or(message);
    if message.contains("NoExtensionBias") {
        return "its language is empty: no output can match it".into();
    }
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A compiled constraint, ready to start any number of sequences ([`Grammar::start`]).
/// Cloning it is cheap (the clones share the compiled form).
#[derive(Clone)]
pub struct Grammar {
    /// A matcher at the start of the language (deep-cloned for each sequence).
    template: Arc<Mutex<Matcher>>,
    kind: &'static str,
    eos: TokenId,
    vocab: usize,
    /// For JSON output: the bound on digits in a row.
    digits: Option<DigitBound>,
}

/// What the digit bound needs of the vocabulary: each token's bytes, and the longest run of
/// digits in any one.
#[derive(Clone)]
struct DigitBound {
    env: TokEnv,
    longest_token_digits: usize,
}

impl DigitBound {
    /// `mask` without the tokens that would make a run of digits outside strings longer than
    /// [`MAX_JSON_DIGITS`] after `runs`; unchanged if that would leave nothing (the grammar
    /// itself asks for more digits: a schema's `minimum` of 10^20), so the bound never makes
    /// an output impossible.
    fn restrict(&self, mask: &mut SimpleVob, runs: &DigitRuns) {
        if !runs.at_risk(self.longest_token_digits) {
            return;
        }
        let trie = self.env.tok_trie();
        let mut refused = Vec::new();
        mask.iter_set_entries(|t| {
            let t = t as u32;
            if !runs.allows(trie.token(t)) {
                refused.push(t);
            }
        });
        if refused.len() < mask.num_set() {
            refused.into_iter().for_each(|t| mask.disallow_token(t));
        }
    }
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar")
            .field("kind", &self.kind)
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.template, &other.template)
    }
}

impl Grammar {
    /// [`OutputConstraint::kind`] of what it was compiled from.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The vocabulary size it was compiled for (the model's logits must match).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A matcher at the start of the output, for one sequence that ends on any of `eos` (the
    /// vocabulary's own end-of-sequence token always ends it too).
    pub fn start(&self, eos: &[TokenId]) -> GrammarMatcher {
        let matcher = lock(&self.template).deep_clone();
        let mut ends: Vec<TokenId> = eos.to_vec();
        if !ends.contains(&self.eos) {
            ends.push(self.eos);
        }
        GrammarMatcher {
            state: Arc::new(Mutex::new(MatchState {
                start: matcher.deep_clone(),
                matcher,
                consumed: Vec::new(),
                mask: None,
                runs: DigitRuns::default(),
            })),
            ends: ends.into(),
            trie_eos: self.eos,
            digits: self.digits.clone(),
        }
    }
}

/// One sequence's position in its grammar, shared by its clones (the engine keeps one, the
/// sampler another).
#[derive(Clone)]
pub struct GrammarMatcher {
    state: Arc<Mutex<MatchState>>,
    /// Tokens that end the sequence: allowed exactly when the grammar is complete.
    ends: Arc<[TokenId]>,
    /// The trie's end-of-sequence token, which carries "complete" in llguidance's mask.
    trie_eos: TokenId,
    /// For JSON output: the bound on digits in a row.
    digits: Option<DigitBound>,
}

struct MatchState {
    /// The matcher before any token, to start over from.
    start: Matcher,
    matcher: Matcher,
    /// The generated tokens the matcher has consumed.
    consumed: Vec<TokenId>,
    /// The mask for the token after `consumed`, once computed.
    mask: Option<SimpleVob>,
    /// Where `consumed`'s JSON stands, for the digit bound.
    runs: DigitRuns,
}

impl fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("ends", &self.ends)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves a matcher that is at worst behind; the next
    // prepare resynchronises it from the history.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl GrammarMatcher {
    /// Brings the matcher up to `generated` (the sequence's output so far) and computes the
    /// mask for the next token, unless it is already known. Expensive (tens to hundreds of
    /// microseconds); the engine calls it while the forward runs.
    pub fn prepare(&self, generated: &[TokenId]) {
        let mut state = lock(&self.state);
        let env = self.digits.as_ref().map(|d| &d.env);
        state.sync(generated, &self.ends, env);
        if state.mask.is_none() {
            // A stopped matcher (nothing can follow) allows only the end.
            let mut mask = state.matcher.compute_mask_or_eos().ok();
            if let (Some(mask), Some(digits)) = (mask.as_mut(), &self.digits) {
                digits.restrict(mask, &state.runs);
            }
            state.mask = mask;
        }
    }

    /// Whether `token` ends the sequence (an end-of-sequence token, allowed only when the
    /// output is complete).
    pub fn is_end(&self, token: TokenId) -> bool {
        self.ends.contains(&token)
    }

    /// Whether the output so far is a complete sentence of the language.
    pub fn is_complete(&self) -> bool {
        let mut state = lock(&self.state);
        let matcher = &mut state.matcher;
        matcher.get_error().is_none()
            && (matcher.is_stopped() || matcher.is_accepting().unwrap_or(false))
    }

    /// Why the matcher failed (a token outside the mask was forced on it), if it did.
    pub fn error(&self) -> Option<String> {
        lock(&self.state).matcher.get_error()
    }

    /// Whether the next token may be `token`, given `generated` so far.
    pub fn allows(&self, generated: &[TokenId], token: TokenId) -> bool {
        self.prepare(generated);
        let state = lock(&self.state);
        self.allowed_in(state.mask.as_ref(), token)
    }

    fn allowed_in(&self, mask: Option<&SimpleVob>, token: TokenId) -> bool {
        let Some(mask) = mask else {
            // No mask (the matcher failed): only an end is allowed.
            return self.is_end(token);
        };
        if self.is_end(token) {
            mask.is_allowed(self.trie_eos.0)
        } else {
            (token.0 as usize) < mask.len() && mask.is_allowed(token.0)
        }
    }
}

impl MatchState {
    /// Makes the matcher's consumed tokens equal `generated`: consumes what is new, or, when
    /// the history went another way (a hand-written loop that backtracked), starts over and
    /// replays it. End tokens are not fed (the sequence ends on them). With `env` (JSON
    /// output), the digit runs follow the tokens' bytes.
    fn sync(&mut self, generated: &[TokenId], ends: &[TokenId], env: Option<&TokEnv>) {
        let shared = crate::sequence::common_prefix(&self.consumed, generated);
        if shared == self.consumed.len() && shared == generated.len() {
            return;
        }
        self.mask = None;
        if shared < self.consumed.len() {
            // llguidance's rollback does not undo a stop or an error; a replay is always right
            // and never happens on the engine's path.
            self.matcher = self.start.deep_clone();
            self.consumed.clear();
            self.runs = DigitRuns::default();
        }
        for &t in &generated[self.consumed.len()..] {
            if ends.contains(&t) {
                break;
            }
            // A token the mask forbade puts the matcher in its error state, which allows only
            // an end from then on.
            let _ = self.matcher.consume_token(t.0);
            if let Some(env) = env {
                self.runs.push(env.tok_trie().token(t.0));
            }
            self.consumed.push(t);
        }
    }
}

impl LogitsProcessor for GrammarMatcher {
    fn name(&self) -> &'static str {
        "grammar"
    }

    fn process(&self, candidates: &mut Candidates, history: &TokenHistory) {
        self.prepare(history.generated());
        let state = lock(&self.state);
        let mask = state.mask.as_ref();
        candidates.keep_only(|t| self.allowed_in(mask, t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte a token, plus two special tokens: id 256 is the end of sequence.
    fn bytes_vocab() -> Vec<TokenText> {
        let mut v: Vec<TokenText> = (0..=255u8).map(|b| TokenText::Bytes(vec![b])).collect();
        v.push(TokenText::Special("<eos>".into()));
        v.push(TokenText::Special("<other>".into()));
        v.push(TokenText::Bytes(b"ab".to_vec()));
        v
    }

    const EOS: TokenId = TokenId(256);

    fn compiler() -> GrammarCompiler {
        GrammarCompiler::new(&bytes_vocab(), EOS).unwrap()
    }

    fn allowed(m: &GrammarMatcher, generated: &[TokenId]) -> Vec<u32> {
        (0..259)
            .filter(|&t| m.allows(generated, TokenId(t)))
            .collect()
    }

    fn ids(s: &[u8]) -> Vec<TokenId> {
        s.iter().map(|&b| TokenId(u32::from(b))).collect()
    }

    #[test]
    fn a_regex_allows_exactly_its_continuations_and_the_end_only_when_complete() {
        let g = compiler()
            .compile(&OutputConstraint::Regex("a[bc]d?".into()))
            .unwrap();
        let m = g.start(&[]);
        assert_eq!(allowed(&m, &[]), vec![u32::from(b'a'), 258]);
        assert_eq!(
            allowed(&m, &ids(b"a")),
            vec![u32::from(b'b'), u32::from(b'c')]
        );
        assert_eq!(allowed(&m, &ids(b"ab")), vec![u32::from(b'd'), 256]);
        assert_eq!(allowed(&m, &ids(b"abd")), vec![256]);
        // Going back re-synchronises: the mask follows the history it is given.
        assert_eq!(
            allowed(&m, &ids(b"a")),
            vec![u32::from(b'b'), u32::from(b'c')]
        );
        assert!(m.is_end(EOS));
        assert!(!m.is_end(TokenId(257)));
    }

    #[test]
    fn the_request_s_own_end_tokens_are_allowed_with_the_vocabulary_s() {
        let g = compiler()
            .compile(&OutputConstraint::Regex("x".into()))
            .unwrap();
        let m = g.start(&[TokenId(257)]);
        assert_eq!(allowed(&m, &[]), vec![u32::from(b'x')]);
        assert_eq!(allowed(&m, &ids(b"x")), vec![256, 257]);
    }

    #[test]
    fn the_processor_masks_before_anything_else_sees_the_logits() {
        let g = compiler()
            .compile(&OutputConstraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": false
            })))
            .unwrap();
        let m = g.start(&[]);
        // The forbidden token 'x' has the highest logit; the mask still removes it.
        let mut logits = vec![0.0f32; 259];
        logits[usize::from(b'x')] = 10.0;
        let mut candidates = Candidates::from_logits(&logits);
        m.process(&mut candidates, &TokenHistory::default());
        let ids: Vec<u32> = candidates.ids().iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![u32::from(b'{')]);
        let mut history = TokenHistory::default();
        for &t in &ids_of(br#"{"a": 12}"#) {
            assert!(m.allows(history.generated(), t), "{t:?}");
            history.push(t);
        }
        assert_eq!(allowed(&m, history.generated()), vec![256]);
        assert!(m.is_complete());
    }

    fn ids_of(s: &[u8]) -> Vec<TokenId> {
        ids(s)
    }

    #[test]
    fn bad_constraints_are_refused_by_kind_with_the_reason() {
        let c = compiler();
        let err = |k: OutputConstraint| c.compile(&k).unwrap_err().to_string();
        assert_eq!(
            err(OutputConstraint::Regex("a(b".into())),
            "invalid regex: unclosed group at byte 1"
        );
        let e = err(OutputConstraint::Lark("start: foo".into()));
        assert!(
            e.starts_with("invalid grammar:") && !e.contains('\n'),
            "{e}"
        );
        assert!(err(OutputConstraint::Lark("  ".into())).contains("empty"));
        // Languages with no string in them: llguidance reports them with a dump of its parser
        // state, which is not for a person.
        for empty in [
            OutputConstraint::Lark("start: a\na: a".into()),
            OutputConstraint::Lark("start: /[^\\s\\S]/".into()),
            OutputConstraint::Regex("[^\\s\\S]".into()),
        ] {
            let e = err(empty);
            assert!(
                e.ends_with("its language is empty: no output can match it"),
                "{e}"
            );
        }
        let e = err(OutputConstraint::JsonSchema(
            serde_json::json!({"type": "strng"}),
        ));
        assert!(e.starts_with("invalid json_schema:"), "{e}");
        let e = err(OutputConstraint::JsonSchema(serde_json::json!([1])));
        assert!(e.contains("is an object"), "{e}");
        // A keyword llguidance does not implement is refused, not ignored.
        let e = err(OutputConstraint::JsonSchema(serde_json::json!({
            "type": "array", "items": {"type": "string"}, "uniqueItems": true
        })));
        assert!(
            e.starts_with("invalid json_schema:") && e.contains("uniqueItems"),
            "{e}"
        );
    }

    #[test]
    fn unbounded_integers_get_the_interoperable_range_and_data_is_untouched() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": ["integer", "null"], "minimum": 3},
                "c": {"type": "integer", "exclusiveMaximum": 5},
                "d": {"const": {"type": "integer"}},
                "default": {"type": "integer", "default": {"type": "integer"}}
            },
            "$defs": {"enum": {"type": "integer"}}
        });
        let bounded = bound_integers(schema);
        let p = &bounded["properties"];
        assert_eq!(p["a"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert_eq!(p["a"]["minimum"], -MAX_UNBOUNDED_INTEGER);
        assert_eq!(p["b"]["minimum"], 3);
        assert_eq!(p["b"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert!(p["c"].get("maximum").is_none());
        assert_eq!(p["d"], serde_json::json!({"const": {"type": "integer"}}));
        // Properties and definitions named like data keywords are schemas all the same.
        assert_eq!(p["default"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert_eq!(
            p["default"]["default"],
            serde_json::json!({"type": "integer"})
        );
        assert_eq!(bounded["$defs"]["enum"]["minimum"], -MAX_UNBOUNDED_INTEGER);
        // A bound beyond the range leaves the other side open, not the schema empty.
        let beyond = bound_integers(serde_json::json!({"type": "integer", "minimum": 1e17}));
        assert!(beyond.get("maximum").is_none());
        // The matcher stops an integer at the bound's digits.
        let g = compiler()
            .compile(&OutputConstraint::JsonSchema(
                serde_json::json!({"type": "integer"}),
            ))
            .unwrap();
        let m = g.start(&[]);
        let digits = ids(b"9007199254740991");
        assert!(allowed(&m, &digits).contains(&256));
        assert!(!allowed(&m, &digits).contains(&u32::from(b'0')));
    }

    fn json(schema: Value) -> OutputConstraint {
        OutputConstraint::JsonSchema(schema)
    }

    fn start_with(whitespace: JsonWhitespace, constraint: &OutputConstraint) -> GrammarMatcher {
        compiler()
            .with_json_whitespace(whitespace)
            .compile(constraint)
            .unwrap()
            .start(&[])
    }

    const WHITESPACE: [u8; 4] = [b' ', b'\n', b'\t', b'\r'];

    /// Which JSON whitespace bytes may follow `text`.
    fn whitespace_after(m: &GrammarMatcher, text: &[u8]) -> Vec<u8> {
        let allowed = allowed(m, &ids(text));
        WHITESPACE
            .into_iter()
            .filter(|&b| allowed.contains(&u32::from(b)))
            .collect()
    }

    #[test]
    fn bounded_whitespace_is_one_space_or_newlines_and_twenty_of_indentation() {
        let schema = json(serde_json::json!({
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"type": "integer"}}}
        }));
        let m = start_with(JsonWhitespace::Bounded, &schema);
        assert_eq!(whitespace_after(&m, b"{\"a\":"), vec![b' ', b'\n']);
        // One space is all a space may be.
        assert!(whitespace_after(&m, b"{\"a\": ").is_empty());
        // Two newlines at most, then indentation up to 20 spaces or tabs.
        assert_eq!(whitespace_after(&m, b"{\"a\":[\n\n"), vec![b' ', b'\t']);
        let mut indented = b"{\"a\":[\n".to_vec();
        indented.extend([b' '; 19]);
        assert_eq!(whitespace_after(&m, &indented), vec![b' ', b'\t']);
        indented.push(b' ');
        assert!(whitespace_after(&m, &indented).is_empty());
        // The value may follow, and whitespace again after it.
        indented.push(b'1');
        assert_eq!(whitespace_after(&m, &indented), vec![b' ', b'\n']);
        // Free: llguidance's own, any run of whitespace.
        let m = start_with(JsonWhitespace::Free, &schema);
        let mut spaces = b"{\"a\":[\n".to_vec();
        spaces.extend([b' '; 200]);
        assert_eq!(whitespace_after(&m, &spaces), WHITESPACE.to_vec());
        // Compact: none anywhere.
        let m = start_with(JsonWhitespace::Compact, &schema);
        for text in [
            &b"{"[..],
            b"{\"a\"",
            b"{\"a\":",
            b"{\"a\":[1",
            b"{\"a\":[1,",
        ] {
            assert!(whitespace_after(&m, text).is_empty(), "{text:?}");
        }
    }

    #[test]
    fn json_object_and_lark_json_embeds_get_the_same_whitespace_bound() {
        let lark = OutputConstraint::Lark(
            "start: \"answer: \" obj\nobj: %json {\"type\": \"object\"}\n".into(),
        );
        for (constraint, prefix) in [
            (OutputConstraint::JsonObject, &b"{\"k\":"[..]),
            (lark, b"answer: {\"k\":"),
        ] {
            let m = start_with(JsonWhitespace::Bounded, &constraint);
            let mut text = prefix.to_vec();
            text.push(b'\n');
            text.extend([b' '; 20]);
            assert!(whitespace_after(&m, &text).is_empty(), "{constraint:?}");
            let m = start_with(JsonWhitespace::Free, &constraint);
            assert!(!whitespace_after(&m, &text).is_empty(), "{constraint:?}");
        }
    }

    fn digit_allowed(m: &GrammarMatcher, text: &[u8]) -> bool {
        let allowed = allowed(m, &ids(text));
        (b'0'..=b'9').any(|d| allowed.contains(&u32::from(d)))
    }

    #[test]
    fn a_number_s_integer_part_fraction_and_exponent_stop_at_the_digit_bound() {
        let m = start_with(
            JsonWhitespace::Bounded,
            &json(serde_json::json!({"type": "number"})),
        );
        let digits = "1234567890123456";
        assert_eq!(digits.len(), MAX_JSON_DIGITS);
        let integer = format!("-{}", &digits[..MAX_JSON_DIGITS - 1]);
        assert!(digit_allowed(&m, integer.as_bytes()));
        let integer = format!("-{digits}");
        assert!(!digit_allowed(&m, integer.as_bytes()));
        // The number can still go on (a fraction) or end.
        let after = allowed(&m, &ids(integer.as_bytes()));
        assert!(after.contains(&u32::from(b'.')) && after.contains(&256));
        // The fraction of the issue: zeros until max_tokens.
        let fraction = format!("0.{}", "0".repeat(MAX_JSON_DIGITS));
        assert!(!digit_allowed(&m, fraction.as_bytes()));
        assert!(allowed(&m, &ids(fraction.as_bytes())).contains(&256));
        let exponent = format!("1.5e+{digits}");
        assert!(!digit_allowed(&m, exponent.as_bytes()));
        assert!(allowed(&m, &ids(exponent.as_bytes())).contains(&256));
        // Bounded numbers' fractions too, and numbers anywhere in a document.
        let m = start_with(
            JsonWhitespace::Bounded,
            &json(
                serde_json::json!({"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}}),
            ),
        );
        let text = format!("[0.5, 0.{digits}");
        assert!(!digit_allowed(&m, text.as_bytes()));
        assert!(digit_allowed(&m, b"[0.5, 0.1"));
    }

    #[test]
    fn digits_in_strings_are_text_and_a_schema_that_needs_more_digits_still_gets_them() {
        let m = start_with(
            JsonWhitespace::Bounded,
            &json(serde_json::json!({"type": "string"})),
        );
        let text = format!("\"{}", "7".repeat(40));
        assert!(digit_allowed(&m, text.as_bytes()));
        // 10^17 has 18 digits: the bound gives way rather than make the schema impossible.
        let m = start_with(
            JsonWhitespace::Bounded,
            &json(serde_json::json!({"type": "integer", "minimum": 100_000_000_000_000_000_i64})),
        );
        assert!(digit_allowed(&m, "1".repeat(17).as_bytes()));
        // Not JSON output: a regex's digits are the regex's business.
        let m = start_with(
            JsonWhitespace::Bounded,
            &OutputConstraint::Regex("[0-9]{1,40}".into()),
        );
        assert!(digit_allowed(&m, "1".repeat(30).as_bytes()));
    }

    #[test]
    fn max_and_min_length_and_items_are_honoured() {
        let m = start_with(
            JsonWhitespace::Bounded,
            &json(serde_json::json!({"type": "string", "minLength": 2, "maxLength": 5})),
        );
        assert_eq!(allowed(&m, &ids(b"\"abcde")), vec![u32::from(b'"')]);
        assert!(!allowed(&m, &ids(b"\"a")).contains(&u32::from(b'"')));
        assert!(allowed(&m, &ids(b"\"ab")).contains(&u32::from(b'"')));
        let m = start_with(
            JsonWhitespace::Compact,
            &json(serde_json::json!({
                "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2, "maxItems": 3
            })),
        );
        assert_eq!(allowed(&m, &ids(b"[1")), vec![u32::from(b',')]);
        assert_eq!(
            allowed(&m, &ids(b"[1,2")),
            vec![u32::from(b','), u32::from(b']')]
        );
        assert_eq!(allowed(&m, &ids(b"[1,2,3")), vec![u32::from(b']')]);
    }

    #[test]
    fn a_vocabulary_without_its_end_token_is_refused() {
        assert!(matches!(
            GrammarCompiler::new(&bytes_vocab(), TokenId(999)),
            Err(StructuredError::Vocabulary(_))
        ));
    }
}
