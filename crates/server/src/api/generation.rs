//! Validation: a parsed body becomes a [`Generation`] (what each choice asks of the engine),
//! its prompts [`PromptInput`]s, or a 400 naming the first field out of range.

use kiln_core::TokenId;
use kiln_core::sampling::{SamplingError, SamplingParams};
use kiln_engine::{BeamSearch, EarlyStopping, MAX_BEAMS, MAX_TOP_LOGPROBS, OutputConstraint};
use serde_json::Value;
use serde_json::value::RawValue;

use super::{
    ChatRequest, CommonFields, CompletionRequest, Content, EarlyStoppingField, MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS, MAX_JSON_FIELD_BYTES, MAX_STOP_BYTES, MAX_STOP_STRINGS, Message,
    Prompt, Stop,
};
use crate::error::ApiError;

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
            logit_bias: self
                .logit_bias
                .as_ref()
                .map(|m| m.0.clone())
                .unwrap_or_default(),
        };
        sampling.validate().map_err(|e| match &e {
            SamplingError::Invalid { field, .. }
            | SamplingError::TokenOutsideVocab { field, .. } => {
                ApiError::invalid_field(field, e.to_string())
            }
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
                "logit_bias",
                !generation.sampling.logit_bias.is_empty(),
                "a logit bias",
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
