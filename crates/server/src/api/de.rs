//! The visitors of the fields that take several forms (`stop`, a message's `content`, a
//! completions `prompt`), each read in one pass without buffering the value,
//! [`bounded_list`], which reads a list of one kind up to a limit, and `logit_bias`'s map,
//! read up to its limit the same way.

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

use super::{
    Content, LogitBiasMap, MAX_CHOICES, MAX_LOGIT_BIAS_TOKENS, MAX_STOP_STRINGS, Prompt, Stop,
    TokenId,
};

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
                bounded_list(seq, None, MAX_STOP_STRINGS, "stop strings", Ok::<String, _>)
                    .map(Stop::Many)
            }
        }
        deserializer.deserialize_any(StopVisitor)
    }
}

impl<'de> Deserialize<'de> for LogitBiasMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BiasVisitor;
        impl<'de> Visitor<'de> for BiasVisitor {
            type Value = LogitBiasMap;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(
                    f,
                    "an object of at most {MAX_LOGIT_BIAS_TOKENS} token ids (as strings) to \
                     biases"
                )
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<LogitBiasMap, A::Error> {
                let mut biases = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if biases.len() == MAX_LOGIT_BIAS_TOKENS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_LOGIT_BIAS_TOKENS} tokens"
                        )));
                    }
                    // Digits only: "+5", " 5" or "5.0" name no token id either.
                    let token = Some(&*key)
                        .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
                        .and_then(|k| k.parse::<u32>().ok())
                        .ok_or_else(|| {
                            de::Error::custom(format!(
                                "key {key:?} is not a token id (a non-negative integer, as a \
                                 string)"
                            ))
                        })?;
                    let bias: f64 = map.next_value()?;
                    biases.push((TokenId(token), bias as f32));
                }
                Ok(LogitBiasMap(biases))
            }
        }
        deserializer.deserialize_map(BiasVisitor)
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
        const WHAT: &str = "prompts in one request";
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
                bounded_list(seq, Some(text), MAX_CHOICES, WHAT, |item| match item {
                    PromptItem::Text(text) => Ok(text),
                    _ => Err(MIXED_PROMPTS),
                })
                .map(Prompt::Texts)
            }
            PromptItem::Tokens(ids) => {
                bounded_list(seq, Some(ids), MAX_CHOICES, WHAT, |item| match item {
                    PromptItem::Tokens(ids) => Ok(ids),
                    _ => Err(MIXED_PROMPTS),
                })
                .map(Prompt::TokenLists)
            }
        }
    }
}

/// Why a `prompt` list whose entries are not all of its first entry's kind is refused.
const MIXED_PROMPTS: &str = "a prompt list mixes strings, ids and id lists";

/// The entries of a JSON list, `first` (read already, when given) then the rest: each entry is
/// read as `T` and kept as `keep` makes it, which refuses an entry of another kind (`Err`: why);
/// past `most` entries the list is refused before more are read, so a long list costs no
/// memory.
///
/// # Errors
/// An entry that is not a `T`, or that `keep` refuses; more than `most` entries ("more than
/// {most} {what}").
fn bounded_list<'de, A, T, U>(
    mut seq: A,
    first: Option<U>,
    most: usize,
    what: &str,
    keep: impl Fn(T) -> Result<U, &'static str>,
) -> Result<Vec<U>, A::Error>
where
    A: SeqAccess<'de>,
    T: Deserialize<'de>,
{
    let mut items: Vec<U> = first.into_iter().collect();
    while let Some(entry) = seq.next_element::<T>()? {
        let item = keep(entry).map_err(de::Error::custom)?;
        if items.len() == most {
            return Err(de::Error::custom(format!("more than {most} {what}")));
        }
        items.push(item);
    }
    Ok(items)
}
