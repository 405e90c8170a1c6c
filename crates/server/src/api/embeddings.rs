//! `POST /v1/embeddings`' body: [`EmbeddingRequest`], whose `input` takes OpenAI's four forms
//! (a string, a list of strings, a list of token ids, a list of id lists), read in one pass and
//! refused past [`MAX_EMBEDDING_INPUTS`] entries before more are read.

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};

use super::{RequestBody, parse};
use crate::error::ApiError;

/// Most inputs one embeddings request may give (a list of strings or of id lists).
pub const MAX_EMBEDDING_INPUTS: usize = 256;

/// `POST /v1/embeddings`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct EmbeddingRequest {
    /// What to embed.
    pub input: Option<EmbeddingInput>,
    /// The model to run: one of the served models' names (any name, when one model is
    /// served; none: the first).
    pub model: Option<String>,
    /// `"float"` (the default) or `"base64"` (little-endian f32, base64).
    pub encoding_format: Option<String>,
    /// Keep the first this many values of each embedding, normalised again.
    pub dimensions: Option<i64>,
    /// The end user (accepted, not used).
    pub user: Option<String>,
}

impl RequestBody for EmbeddingRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse(body)
    }
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// `input`'s forms.
#[derive(Debug, PartialEq, Eq)]
pub enum EmbeddingInput {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One list of token ids.
    Tokens(Vec<u32>),
    /// Several lists of token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// One entry of an `input` list.
enum Item {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

/// A token id from a JSON number: not negative, within `u32`.
fn token_id<E: de::Error>(v: u64) -> Result<u32, E> {
    u32::try_from(v).map_err(|_| E::custom(format!("token id {v} is out of range")))
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> Visitor<'de> for ItemVisitor {
            type Value = Item;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, a token id, or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Item, E> {
                Ok(Item::Text(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
                token_id(v).map(Item::Token)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("token id {v} is negative")))
                    .and_then(token_id)
                    .map(Item::Token)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(Item::Tokens(ids))
            }
        }
        deserializer.deserialize_any(ItemVisitor)
    }
}

/// Why an `input` list whose entries are not all of its first entry's kind is refused.
const MIXED: &str = "an input list mixes strings, ids and id lists";

impl<'de> Deserialize<'de> for EmbeddingInput {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InputVisitor;
        impl<'de> Visitor<'de> for InputVisitor {
            type Value = EmbeddingInput;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(
                    f,
                    "a string, a list of token ids, or a list of at most \
                     {MAX_EMBEDDING_INPUTS} strings or id lists"
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<EmbeddingInput, E> {
                Ok(EmbeddingInput::Text(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<EmbeddingInput, E> {
                Ok(EmbeddingInput::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EmbeddingInput, A::Error> {
                let Some(first) = seq.next_element::<Item>()? else {
                    return Ok(EmbeddingInput::Texts(Vec::new()));
                };
                let too_many = || {
                    de::Error::custom(format!(
                        "more than {MAX_EMBEDDING_INPUTS} inputs in one request"
                    ))
                };
                match first {
                    Item::Token(id) => {
                        // One input's ids: bounded by the body's size, and by the context later.
                        let mut ids = vec![id];
                        while let Some(id) = seq.next_element::<u32>()? {
                            ids.push(id);
                        }
                        Ok(EmbeddingInput::Tokens(ids))
                    }
                    Item::Text(text) => {
                        let mut texts = vec![text];
                        while let Some(item) = seq.next_element::<Item>()? {
                            let Item::Text(text) = item else {
                                return Err(de::Error::custom(MIXED));
                            };
                            if texts.len() == MAX_EMBEDDING_INPUTS {
                                return Err(too_many());
                            }
                            texts.push(text);
                        }
                        Ok(EmbeddingInput::Texts(texts))
                    }
                    Item::Tokens(ids) => {
                        let mut lists = vec![ids];
                        while let Some(item) = seq.next_element::<Item>()? {
                            let Item::Tokens(ids) = item else {
                                return Err(de::Error::custom(MIXED));
                            };
                            if lists.len() == MAX_EMBEDDING_INPUTS {
                                return Err(too_many());
                            }
                            lists.push(ids);
                        }
                        Ok(EmbeddingInput::TokenLists(lists))
                    }
                }
            }
        }
        deserializer.deserialize_any(InputVisitor)
    }
}

/// How the vectors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodingFormat {
    /// A JSON list of numbers.
    Float,
    /// The little-endian f32 bytes, base64 (OpenAI's `base64`).
    Base64,
}

impl EmbeddingRequest {
    /// `encoding_format`, `"float"` when not given.
    ///
    /// # Errors
    /// A 400 naming `encoding_format` for another value.
    pub fn encoding_format(&self) -> Result<EncodingFormat, ApiError> {
        match self.encoding_format.as_deref() {
            None | Some("float") => Ok(EncodingFormat::Float),
            Some("base64") => Ok(EncodingFormat::Base64),
            Some(other) => Err(ApiError::invalid_field(
                "encoding_format",
                format!("encoding_format is `{other}`; expected `float` or `base64`"),
            )),
        }
    }

    /// `dimensions` checked against the model's width `d_model` (`None`: the whole vector).
    ///
    /// # Errors
    /// A 400 naming `dimensions` below 1 or above `d_model`.
    pub fn dimensions(&self, d_model: usize) -> Result<Option<usize>, ApiError> {
        let Some(n) = self.dimensions else {
            return Ok(None);
        };
        match usize::try_from(n) {
            Ok(n) if (1..=d_model).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::invalid_field(
                "dimensions",
                format!("dimensions is {n}; this model's embeddings have 1 to {d_model}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(json: &str) -> Result<Option<EmbeddingInput>, ApiError> {
        EmbeddingRequest::parse(json.as_bytes()).map(|r| r.input)
    }

    #[test]
    fn every_form_of_input_is_read() {
        assert_eq!(
            input(r#"{"input": "hi"}"#).unwrap(),
            Some(EmbeddingInput::Text("hi".into()))
        );
        assert_eq!(
            input(r#"{"input": ["a", "b"]}"#).unwrap(),
            Some(EmbeddingInput::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            input(r#"{"input": [1, 2]}"#).unwrap(),
            Some(EmbeddingInput::Tokens(vec![1, 2]))
        );
        assert_eq!(
            input(r#"{"input": [[1], [2, 3]]}"#).unwrap(),
            Some(EmbeddingInput::TokenLists(vec![vec![1], vec![2, 3]]))
        );
    }

    #[test]
    fn bad_inputs_name_the_field() {
        for body in [
            r#"{"input": ["a", 1]}"#,
            r#"{"input": [-1]}"#,
            r#"{"input": 3}"#,
            r#"{"input": [[1], "a"]}"#,
        ] {
            let e = input(body).unwrap_err();
            let param = e.param.clone().unwrap_or_default();
            assert!(param.starts_with("input"), "{body}: {e:?}");
        }
        let many = format!(r#"{{"input": [{}]}}"#, vec!["\"x\""; 257].join(","));
        let e = input(&many).unwrap_err();
        assert!(e.message.contains("more than 256"), "{e:?}");
    }

    #[test]
    fn format_and_dimensions_are_checked() {
        let r =
            EmbeddingRequest::parse(br#"{"encoding_format": "int8", "dimensions": 0}"#).unwrap();
        assert_eq!(
            r.encoding_format().unwrap_err().param.as_deref(),
            Some("encoding_format")
        );
        assert_eq!(
            r.dimensions(64).unwrap_err().param.as_deref(),
            Some("dimensions")
        );
        let r = EmbeddingRequest::parse(br#"{"dimensions": 65}"#).unwrap();
        assert!(r.dimensions(64).is_err());
        assert_eq!(r.dimensions(65).unwrap(), Some(65));
    }
}
