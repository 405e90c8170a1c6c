//! The OpenAI request bodies kiln reads, and their validation into what the engine runs.
//!
//! Unknown fields are ignored (clients send many: `user`, `store`, `metadata`, ...), `null`
//! means "not given", and every value out of range is a 400 naming its field.
//!
//! Parsing takes memory in proportion to the body: unknown fields are skipped without being
//! kept (no `#[serde(flatten)]`, which buffers every field it does not know; the common fields
//! are a second pass over the same bytes), the fields that take several forms are read by
//! visitors of their own (serde's untagged enums buffer the value first), lists stop at their
//! limit, and free-form JSON (a schema, template variables) is kept as text up to
//! [`MAX_JSON_FIELD_BYTES`] before it is parsed.

use kiln_core::TokenId;
use kiln_core::sampling::{SamplingError, SamplingParams};
use kiln_engine::{BeamSearch, EarlyStopping, MAX_BEAMS, MAX_TOP_LOGPROBS, OutputConstraint};
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::error::ApiError;

/// Most choices one request may ask for (`n`, times the prompts of a completions request).
pub const MAX_CHOICES: usize = 16;
/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most bytes of stop strings one request may give, all together.
pub const MAX_STOP_BYTES: usize = 4096;
/// Largest free-form JSON field (`response_format`, `chat_template_kwargs`), in bytes of its
/// text.
pub const MAX_JSON_FIELD_BYTES: usize = 1 << 20;
/// Most alternatives `/v1/completions`' integer `logprobs` may ask for (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// Fields both completion endpoints share.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CommonFields {
    /// The model's name; any name is served by the one model loaded.
    pub model: Option<String>,
    /// Most new tokens per choice (the old name).
    pub max_tokens: Option<u64>,
    /// Most new tokens per choice (the new name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Keep the K most likely tokens; 0 or -1 is off.
    pub top_k: Option<i64>,
    /// Drop tokens less likely than this times the best.
    pub min_p: Option<f32>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Hugging Face repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Sampling seed; choice `i` of `n` uses `seed + i`.
    pub seed: Option<i64>,
    /// Strings that end a choice.
    pub stop: Option<Stop>,
    /// Choices per prompt.
    pub n: Option<u64>,
    /// Server-sent events instead of one body.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Generate past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, as text
    /// ([`json_field`] parses it).
    pub response_format: Option<Box<RawValue>>,
    /// Structured output (a kiln extension, vLLM's older name accepted): the output matches
    /// this regular expression.
    #[serde(alias = "guided_regex")]
    pub regex: Option<String>,
    /// Structured output (a kiln extension, vLLM's older name accepted): the output is in the
    /// language of this Lark grammar (llguidance's dialect).
    #[serde(alias = "guided_grammar")]
    pub grammar: Option<String>,
}

/// `stop`: one string or several.
#[derive(Debug)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with the usage (and `choices: []`).
    pub include_usage: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Report the log-probability of each token.
    pub logprobs: Option<bool>,
    /// And this many alternatives with it (0-20).
    pub top_logprobs: Option<u64>,
    /// More variables for the chat template (vLLM's field): `{"enable_thinking": false}`
    /// turns Qwen3's thinking off. As text; [`ChatRequest::template_variables`] parses it.
    pub chat_template_kwargs: Option<Box<RawValue>>,
    /// The fields both endpoints share (read from the same body by [`RequestBody::parse`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// A string, an array of text parts, or null (an assistant turn with no text).
    #[serde(default)]
    pub content: Option<Content>,
}

/// A message's content.
#[derive(Debug)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Parts; only `{"type": "text", "text": ...}` is supported.
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub struct Part {
    /// The part's kind.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its text, for a text part.
    #[serde(default)]
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    /// What to continue.
    pub prompt: Option<Prompt>,
    /// Report each token's log-probability and this many alternatives (0-5).
    pub logprobs: Option<u64>,
    /// Echo the prompt before the completion (not supported; refused when true).
    pub echo: Option<bool>,
    /// Text appended after the completion (not supported; refused when given).
    pub suffix: Option<String>,
    /// Beam search (a kiln extension): beams kept per step, as transformers'
    /// `generate(num_beams=N, do_sample=False)`; `n` hypotheses come back as the choices, best
    /// first.
    pub num_beams: Option<u64>,
    /// Beam search: a finished hypothesis's score is divided by its length to this power
    /// (default 1).
    pub length_penalty: Option<f32>,
    /// Beam search: `false` (default), `true` or `"never"`, as transformers.
    pub early_stopping: Option<EarlyStoppingField>,
    /// The fields both endpoints share (read from the same body by [`RequestBody::parse`]).
    #[serde(skip)]
    pub common: CommonFields,
}

/// `early_stopping` as transformers spells it: a boolean or `"never"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EarlyStoppingField {
    /// `true` or `false`.
    Bool(bool),
    /// `"never"` (or `"true"` / `"false"` as text).
    Text(String),
}

/// A completions prompt: text or token ids, one or several.
#[derive(Debug)]
pub enum Prompt {
    /// One text.
    Text(String),
    /// One list of token ids.
    Tokens(Vec<u32>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several lists of token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /tokenize`: llama.cpp's `content` or vLLM's `prompt`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct TokenizeRequest {
    /// The text (llama.cpp's name).
    pub content: Option<String>,
    /// The text (vLLM's name).
    pub prompt: Option<String>,
    /// Add the tokenizer's special tokens (BOS); llama.cpp's name.
    pub add_special: Option<bool>,
    /// The same, vLLM's name.
    pub add_special_tokens: Option<bool>,
}

/// `POST /detokenize`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct DetokenizeRequest {
    /// The ids.
    pub tokens: Vec<u32>,
}

/// What a request asks the engine for, per choice, once validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Most new tokens (`None`: up to the end of the context).
    pub max_tokens: Option<usize>,
    /// Sampling of choice 0 (choice `i` adds `i` to the seed).
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Choices per prompt.
    pub n: usize,
    /// Log-probabilities and how many alternatives.
    pub logprobs: Option<usize>,
    /// Server-sent events.
    pub stream: bool,
    /// A usage chunk at the end of the stream.
    pub include_usage: bool,
    /// No end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Beam search, one engine request per prompt whose `n` best hypotheses are the choices.
    pub beam: Option<BeamSearch>,
    /// Structured output, and the field that asked for it (what a 400 names).
    pub constraint: Option<(&'static str, OutputConstraint)>,
}

impl Generation {
    /// Choice `index`'s sampling: its own seed, so `n` choices differ and each is reproducible.
    pub fn sampling_for(&self, index: usize) -> SamplingParams {
        SamplingParams {
            seed: self.sampling.seed.map(|s| s.wrapping_add(index as u64)),
            ..self.sampling.clone()
        }
    }
}

impl CommonFields {
    /// Validates the fields, with `logprobs` already read from the endpoint's own spelling.
    ///
    /// # Errors
    /// A 400 naming the first field out of range.
    pub fn generation(&self, logprobs: Option<usize>) -> Result<Generation, ApiError> {
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => {
                let field = if self.max_completion_tokens.is_some() {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                };
                return Err(ApiError::invalid_field(
                    field,
                    format!("{field} must be at least 1"),
                ));
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let top_k = match self.top_k {
            None | Some(-1 | 0) => 0,
            Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => {
                return Err(ApiError::invalid_field(
                    "top_k",
                    format!("top_k = {k}: expected a positive integer, or 0 or -1 for off"),
                ));
            }
        };
        let defaults = SamplingParams::default();
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            seed: self.seed.map(|s| s as u64),
        };
        sampling.validate().map_err(|e| match &e {
            SamplingError::Invalid { field, .. } => ApiError::invalid_field(field, e.to_string()),
            SamplingError::VocabMismatch { .. } => ApiError::invalid(e.to_string()),
        })?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid_field(
                "stop",
                format!(
                    "{} stop strings given; at most {MAX_STOP_STRINGS}",
                    stop.len()
                ),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid_field(
                "stop",
                "stop strings must not be empty",
            ));
        }
        let stop_bytes: usize = stop.iter().map(String::len).sum();
        if stop_bytes > MAX_STOP_BYTES {
            return Err(ApiError::invalid_field(
                "stop",
                format!("the stop strings are {stop_bytes} bytes in all; at most {MAX_STOP_BYTES}"),
            ));
        }
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid_field(
                    "n",
                    format!("n = {n}: expected 1 to {MAX_CHOICES}"),
                ));
            }
        };
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        Ok(Generation {
            max_tokens,
            sampling,
            stop,
            n,
            logprobs,
            stream,
            include_usage,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            beam: None,
            constraint: self.constraint()?,
        })
    }

    /// What `response_format`, `regex` and `grammar` ask for (at most one of them).
    fn constraint(&self) -> Result<Option<(&'static str, OutputConstraint)>, ApiError> {
        let format = match &self.response_format {
            None => None,
            Some(raw) => {
                let value = json_field("response_format", raw)?;
                response_format(&value)?.map(|c| ("response_format", c))
            }
        };
        let given = [
            format,
            self.regex
                .clone()
                .map(|rx| ("regex", OutputConstraint::Regex(rx))),
            self.grammar
                .clone()
                .map(|g| ("grammar", OutputConstraint::Lark(g))),
        ];
        let mut given = given.into_iter().flatten();
        let first = given.next();
        if let (Some((a, _)), Some((b, _))) = (&first, given.next()) {
            return Err(ApiError::invalid_field(
                b,
                format!("{a} and {b} both constrain the output; give one"),
            ));
        }
        Ok(first)
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with its
/// schema under `json_schema.schema` (`name`, `description` and `strict` are accepted; the
/// schema is always enforced).
fn response_format(value: &Value) -> Result<Option<OutputConstraint>, ApiError> {
    let bad = |why: &str| Err(ApiError::invalid_field("response_format", why));
    let Some(kind) = value.get("type").and_then(Value::as_str) else {
        return bad(
            "response_format needs a \"type\": \"text\", \"json_object\" or \"json_schema\"",
        );
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(OutputConstraint::JsonObject)),
        "json_schema" => {
            let Some(spec) = value.get("json_schema").filter(|v| v.is_object()) else {
                return bad("response_format of type json_schema needs a \"json_schema\" object");
            };
            match spec.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(OutputConstraint::JsonSchema(schema.clone())))
                }
                Some(_) => bad("response_format.json_schema.schema must be a JSON schema object"),
                // OpenAI's default: no schema means any JSON object.
                None => Ok(Some(OutputConstraint::JsonObject)),
            }
        }
        other => Err(ApiError::invalid_field(
            "response_format",
            format!(
                "response_format type {other:?}: expected \"text\", \"json_object\" or \"json_schema\""
            ),
        )),
    }
}

/// A free-form JSON field's value, parsed from its text once it is known not to be huge.
///
/// # Errors
/// A 400 naming `field` when its text is over [`MAX_JSON_FIELD_BYTES`].
pub fn json_field(field: &str, raw: &RawValue) -> Result<Value, ApiError> {
    let text = raw.get();
    if text.len() > MAX_JSON_FIELD_BYTES {
        return Err(ApiError::invalid_field(
            field,
            format!(
                "{field} is {} bytes of JSON; at most {MAX_JSON_FIELD_BYTES}",
                text.len()
            ),
        ));
    }
    serde_json::from_str(text).map_err(|e| ApiError::invalid_field(field, format!("{field}: {e}")))
}

impl ChatRequest {
    /// `chat_template_kwargs`: an object of variables for the template (empty when not
    /// given).
    ///
    /// # Errors
    /// A 400 when it is not an object, or too large.
    pub fn template_variables(&self) -> Result<serde_json::Map<String, Value>, ApiError> {
        const FIELD: &str = "chat_template_kwargs";
        match &self.chat_template_kwargs {
            None => Ok(serde_json::Map::new()),
            Some(raw) => match json_field(FIELD, raw)? {
                Value::Object(map) => Ok(map),
                Value::Null => Ok(serde_json::Map::new()),
                other => Err(ApiError::invalid_field(
                    FIELD,
                    format!("{FIELD} must be an object of template variables, not {other}"),
                )),
            },
        }
    }

    /// The validated generation settings.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn generation(&self) -> Result<Generation, ApiError> {
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(ApiError::invalid_field(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ));
            }
            (true, top) => {
                let top = top.unwrap_or(0);
                if top > MAX_TOP_LOGPROBS as u64 {
                    return Err(ApiError::invalid_field(
                        "top_logprobs",
                        format!("top_logprobs = {top}: expected 0 to {MAX_TOP_LOGPROBS}"),
                    ));
                }
                Some(top as usize)
            }
        };
        self.common.generation(logprobs)
    }
}

impl CompletionRequest {
    /// The validated generation settings.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    pub fn generation(&self) -> Result<Generation, ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::invalid_field("echo", "echo is not supported"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_field("suffix", "suffix is not supported"));
        }
        let logprobs = match self.logprobs {
            None => None,
            Some(n) if n <= MAX_COMPLETION_LOGPROBS as u64 => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid_field(
                    "logprobs",
                    format!("logprobs = {n}: expected 0 to {MAX_COMPLETION_LOGPROBS}"),
                ));
            }
        };
        let mut generation = self.common.generation(logprobs)?;
        generation.beam = self.beam(&generation)?;
        Ok(generation)
    }

    /// The beam search the extension fields ask for, checked against the rest of the request.
    fn beam(&self, generation: &Generation) -> Result<Option<BeamSearch>, ApiError> {
        let Some(num_beams) = self.num_beams else {
            for (field, given) in [
                ("length_penalty", self.length_penalty.is_some()),
                ("early_stopping", self.early_stopping.is_some()),
            ] {
                if given {
                    return Err(ApiError::invalid_field(
                        field,
                        format!("{field} is a beam search setting: it needs num_beams"),
                    ));
                }
            }
            return Ok(None);
        };
        if !(1..=MAX_BEAMS as u64).contains(&num_beams) {
            return Err(ApiError::invalid_field(
                "num_beams",
                format!("num_beams = {num_beams}: expected 1 to {MAX_BEAMS}"),
            ));
        }
        let num_beams = num_beams as usize;
        if generation.n > num_beams {
            return Err(ApiError::invalid_field(
                "n",
                format!(
                    "n = {}: beam search returns at most num_beams ({num_beams}) choices",
                    generation.n
                ),
            ));
        }
        let common = &self.common;
        let refused = [
            ("stream", generation.stream, "streaming"),
            ("logprobs", generation.logprobs.is_some(), "logprobs"),
            ("stop", !generation.stop.is_empty(), "stop strings"),
            (
                "presence_penalty",
                common.presence_penalty.is_some_and(|p| p != 0.0),
                "a presence penalty",
            ),
            (
                "frequency_penalty",
                common.frequency_penalty.is_some_and(|p| p != 0.0),
                "a frequency penalty",
            ),
            (
                "repetition_penalty",
                common.repetition_penalty.is_some_and(|p| p != 1.0),
                "a repetition penalty",
            ),
            (
                generation.constraint.as_ref().map_or("", |c| c.0),
                generation.constraint.is_some(),
                "structured output",
            ),
        ];
        if let Some((field, _, what)) = refused.iter().find(|r| r.1) {
            return Err(ApiError::invalid_field(
                field,
                format!("beam search does not take {what}"),
            ));
        }
        let early_stopping = match &self.early_stopping {
            None => EarlyStopping::default(),
            Some(EarlyStoppingField::Bool(true)) => EarlyStopping::Immediate,
            Some(EarlyStoppingField::Bool(false)) => EarlyStopping::Heuristic,
            Some(EarlyStoppingField::Text(text)) => text
                .parse()
                .map_err(|why: String| ApiError::invalid_field("early_stopping", why))?,
        };
        let beam = BeamSearch {
            num_beams,
            length_penalty: self.length_penalty.unwrap_or(1.0),
            early_stopping,
            num_return_sequences: generation.n,
        };
        match beam.problem() {
            Some(why) => Err(ApiError::invalid_field("length_penalty", why)),
            None => Ok(Some(beam)),
        }
    }
}

/// The prompts of a completions request: each a text or token ids.
pub enum PromptInput {
    /// Text, tokenized with the tokenizer's special tokens (BOS).
    Text(String),
    /// Ids, fed as they are.
    Tokens(Vec<TokenId>),
}

impl Prompt {
    /// The prompts, one per list entry.
    ///
    /// # Errors
    /// A 400 for an empty list.
    pub fn inputs(&self) -> Result<Vec<PromptInput>, ApiError> {
        let ids = |v: &[u32]| PromptInput::Tokens(v.iter().copied().map(TokenId).collect());
        let inputs: Vec<PromptInput> = match self {
            Prompt::Text(t) => vec![PromptInput::Text(t.clone())],
            Prompt::Texts(v) => v.iter().cloned().map(PromptInput::Text).collect(),
            // `[]` parses as an empty list of ids.
            Prompt::Tokens(v) if v.is_empty() => Vec::new(),
            Prompt::Tokens(v) => vec![ids(v)],
            Prompt::TokenLists(v) => v.iter().map(|v| ids(v)).collect(),
        };
        if inputs.is_empty() {
            return Err(ApiError::invalid_field(
                "prompt",
                "the prompt list is empty",
            ));
        }
        Ok(inputs)
    }
}

impl Message {
    /// Bytes of its text (the text parts' together), before any template.
    pub fn text_bytes(&self) -> usize {
        match &self.content {
            None => 0,
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .map(|p| p.text.as_ref().map_or(0, String::len))
                .sum(),
        }
    }
}

impl Content {
    /// The text: the string, or the text parts joined.
    ///
    /// # Errors
    /// A 400 for a part that is not text.
    pub fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid_field(
                                "messages",
                                format!(
                                    "content parts of type {kind:?} are not supported; only text parts are"
                                ),
                            ));
                        }
                    }
                }
                Ok(text)
            }
        }
    }
}

/// Parses a JSON body into `T`, naming the field at fault when a value has the wrong type.
///
/// # Errors
/// A 400 with serde's message and the field's path.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid(format!("the body is not valid JSON: {inner}"))
        } else if path == "." {
            ApiError::invalid(format!("unexpected request body: {inner}"))
        } else {
            ApiError::invalid_field(&path, format!("{path}: {inner}"))
        }
    })
}

/// A request body the handlers read: parsed from the body's bytes.
pub trait RequestBody: Sized {
    /// The request in `body`.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    fn parse(body: &[u8]) -> Result<Self, ApiError>;
}

impl RequestBody for ChatRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut request: Self = parse(body)?;
        request.common = parse(body)?;
        Ok(request)
    }
}

impl RequestBody for CompletionRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut request: Self = parse(body)?;
        request.common = parse(body)?;
        Ok(request)
    }
}

impl RequestBody for TokenizeRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
}

impl RequestBody for DetokenizeRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StopVisitor;
        impl<'de> Visitor<'de> for StopVisitor {
            type Value = Stop;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(
                    f,
                    "a string or a list of at most {MAX_STOP_STRINGS} strings"
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Stop, E> {
                Ok(Stop::One(v.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Stop, A::Error> {
                bounded_list(seq, MAX_STOP_STRINGS, "stop strings").map(Stop::Many)
            }
        }
        deserializer.deserialize_any(StopVisitor)
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ContentVisitor;
        impl<'de> Visitor<'de> for ContentVisitor {
            type Value = Content;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
                Ok(Content::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
                Ok(Content::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }
        deserializer.deserialize_any(ContentVisitor)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

/// Reads `prompt` in one pass: a string, a list of ids, a list of strings, or a list of id
/// lists; at most [`MAX_CHOICES`] prompts.
struct PromptVisitor;

/// One entry of a `prompt` list.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = PromptItem;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, a token id, or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token id {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("token id {v} is negative")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        deserializer.deserialize_any(ItemVisitor)
    }
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a list of token ids, a list of strings or a list of id lists")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mixed = || de::Error::custom("a prompt list mixes strings, ids and id lists");
        let too_many =
            || de::Error::custom(format!("more than {MAX_CHOICES} prompts in one request"));
        let Some(first) = seq.next_element::<PromptItem>()? else {
            return Ok(Prompt::Tokens(Vec::new()));
        };
        match first {
            PromptItem::Token(id) => {
                let mut ids = vec![id];
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(Prompt::Tokens(ids))
            }
            PromptItem::Text(text) => {
                let mut texts = vec![text];
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    let PromptItem::Text(text) = item else {
                        return Err(mixed());
                    };
                    if texts.len() == MAX_CHOICES {
                        return Err(too_many());
                    }
                    texts.push(text);
                }
                Ok(Prompt::Texts(texts))
            }
            PromptItem::Tokens(ids) => {
                let mut lists = vec![ids];
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    let PromptItem::Tokens(ids) = item else {
                        return Err(mixed());
                    };
                    if lists.len() == MAX_CHOICES {
                        return Err(too_many());
                    }
                    lists.push(ids);
                }
                Ok(Prompt::TokenLists(lists))
            }
        }
    }
}

/// The strings of a JSON list, refusing it past `most` entries (before reading more).
fn bounded_list<'de, A: SeqAccess<'de>>(
    mut seq: A,
    most: usize,
    what: &str,
) -> Result<Vec<String>, A::Error> {
    let mut items = Vec::new();
    while let Some(item) = seq.next_element::<String>()? {
        if items.len() == most {
            return Err(de::Error::custom(format!("more than {most} {what}")));
        }
        items.push(item);
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
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
        let err = CompletionRequest::parse(format!(r#"{{"prompt": [{prompts}]}}"#).as_bytes())
            .unwrap_err();
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
}
