//! The tokenizer a GGUF file describes in `tokenizer.ggml.*`, as a `tokenizer.json` document.
//! Two vocabulary kinds (`tokenizer.ggml.model`) are read: byte-level BPE (`gpt2`), whose
//! pre-tokenizer follows `tokenizer.ggml.pre` as llama.cpp's `llama-vocab.cpp` maps it (a name
//! kiln does not know is an error rather than a guess: a wrong split silently changes every
//! prompt's tokens), and SentencePiece (`llama`), from the pieces' scores and types.

use serde_json::{Map, Value, json};

use super::byte_level::{self, AddedToken, PreTokenizer, byte_to_char, encode_bytes};
use super::sentencepiece::{self, Piece, PieceKind};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// llama.cpp's `llama_token_type`: tokens matched whole in text.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizer for a `tokenizer.ggml.pre` name.
///
/// # Errors
/// A message listing the names kiln knows.
pub fn pre_tokenizer(name: &str) -> std::result::Result<PreTokenizer, String> {
    match name {
        "gpt-2" | "gpt2" => Ok(PreTokenizer::Gpt2),
        // llama.cpp gives these one regex list: {"\p{N}", GPT-2's regex}.
        "smollm" | "starcoder" | "refact" | "codeshell" => Ok(PreTokenizer::Gpt2IndividualDigits),
        "llama-bpe" | "llama3" | "llama-v3" => Ok(PreTokenizer::Llama3),
        "qwen2" | "deepseek-r1-qwen" => Ok(PreTokenizer::Qwen2),
        other => Err(format!(
            "tokenizer.ggml.pre `{other}` is not supported (kiln knows gpt-2, smollm, starcoder, \
             refact, codeshell, llama-bpe, qwen2)"
        )),
    }
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    file.array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().ok_or_else(|| {
                ModelError::config(file.path(), format!("`{key}`[{i}] is not a string"))
            })
        })
        .collect()
}

fn token_id(file: &GgufFile, key: &str, vocab: usize) -> Result<Option<u32>> {
    match file.unsigned_opt(key)? {
        Some(id) if id as usize >= vocab => Err(ModelError::config(
            file.path(),
            format!("`{key}` is {id}, past the vocabulary of {vocab}"),
        )),
        other => Ok(other.map(|id| id as u32)),
    }
}

/// Builds the `tokenizer.json` document.
pub fn tokenizer_json(file: &GgufFile) -> Result<Value> {
    match file.string("tokenizer.ggml.model")? {
        "gpt2" => byte_level_json(file),
        "llama" => sentencepiece_json(file),
        model => Err(ModelError::Tokenizer {
            source_name: file.path().display().to_string(),
            reason: format!(
                "tokenizer.ggml.model `{model}` is not supported (kiln reads byte-level BPE, \
                 `gpt2`, and SentencePiece, `llama`)"
            ),
        }),
    }
}

/// Whether `encode(.., true)` adds BOS and EOS: the file's `add_bos_token` / `add_eos_token`,
/// else llama.cpp's defaults (SentencePiece adds BOS; byte-level BPE adds nothing).
fn framing(file: &GgufFile) -> Result<(bool, bool)> {
    let sentencepiece = file.string("tokenizer.ggml.model")? == "llama";
    let add_bos = file
        .bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(sentencepiece);
    let add_eos = file
        .bool_opt("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    Ok((add_bos, add_eos))
}

/// BOS or EOS (`which`), when the file asks `encode` to add it: the token
/// `tokenizer.ggml.{which}_token_id` names, which must then exist.
fn framing_token(file: &GgufFile, which: &str, added: bool, vocab: usize) -> Result<Option<u32>> {
    if !added {
        return Ok(None);
    }
    let key = format!("tokenizer.ggml.{which}_token_id");
    token_id(file, &key, vocab)?.map(Some).ok_or_else(|| {
        ModelError::config(
            file.path(),
            format!(
                "prompts are to start or end with {} (`tokenizer.ggml.add_{which}_token` or \
                 llama.cpp's default), but there is no `{key}`",
                which.to_uppercase()
            ),
        )
    })
}

/// Per-token types (`tokenizer.ggml.token_type`), all normal when absent.
fn token_types(file: &GgufFile, tokens: usize) -> Result<Vec<i64>> {
    if file.get("tokenizer.ggml.token_type").is_none() {
        return Ok(vec![1; tokens]);
    }
    let types: Vec<i64> = file
        .array("tokenizer.ggml.token_type")?
        .iter()
        .map(|v| v.as_i64().unwrap_or(-1))
        .collect();
    one_per_token(file, "tokenizer.ggml.token_type", types.len(), tokens)?;
    Ok(types)
}

/// An error unless the per-token array `key` has one entry per token.
fn one_per_token(file: &GgufFile, key: &str, entries: usize, tokens: usize) -> Result<()> {
    if entries == tokens {
        return Ok(());
    }
    Err(ModelError::config(
        file.path(),
        format!("{key} has {entries} entries for {tokens} tokens"),
    ))
}

/// A SentencePiece vocabulary: `tokenizer.ggml.tokens`, `.scores` and `.token_type`, with
/// `add_space_prefix` (default true, as llama.cpp reads it).
fn sentencepiece_json(file: &GgufFile) -> Result<Value> {
    let path = file.path();
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let scores: Vec<f32> = file
        .array("tokenizer.ggml.scores")?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_f64()
                .filter(|s| !s.is_nan())
                .map(|s| s as f32)
                .ok_or_else(|| {
                    ModelError::config(
                        path,
                        format!("`tokenizer.ggml.scores`[{i}] is not a number"),
                    )
                })
        })
        .collect::<Result<_>>()?;
    one_per_token(file, "tokenizer.ggml.scores", scores.len(), tokens.len())?;
    let types = token_types(file, tokens.len())?;
    let pieces: Vec<Piece<'_>> = tokens
        .iter()
        .zip(&scores)
        .zip(&types)
        .enumerate()
        .map(|(id, ((&text, &score), &kind))| {
            let kind = PieceKind::from_gguf(kind).ok_or_else(|| {
                ModelError::config(
                    path,
                    format!("`tokenizer.ggml.token_type`[{id}] is {kind}, not a token type (0-6)"),
                )
            })?;
            Ok(Piece { text, score, kind })
        })
        .collect::<Result<_>>()?;
    let vocab = tokens.len();
    let unknown = match token_id(file, "tokenizer.ggml.unknown_token_id", vocab)? {
        Some(id) => Some(id),
        None => pieces
            .iter()
            .position(|p| p.kind == PieceKind::Unknown)
            .map(|id| id as u32),
    };
    let (add_bos, add_eos) = framing(file)?;
    Ok(sentencepiece::tokenizer_json(&sentencepiece::Vocabulary {
        add_space_prefix: file
            .bool_opt("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true),
        strip_after_specials: is_phi3(file),
        unknown,
        bos: framing_token(file, "bos", add_bos, vocab)?,
        eos: framing_token(file, "eos", add_eos, vocab)?,
        pieces,
    }))
}

/// Whether the file holds a Phi-3, whose chat tokens drop the whitespace after them
/// ([`sentencepiece::Vocabulary::strip_after_specials`]): llama.cpp decides by `general.name`
/// (containing `phi-3` or `phi3`), kiln also by the architecture.
fn is_phi3(file: &GgufFile) -> bool {
    let text = |key: &str| {
        file.get(key)
            .and_then(|v| v.as_str())
            .map(str::to_lowercase)
            .unwrap_or_default()
    };
    let name = text("general.name");
    text("general.architecture") == "phi3" || name.contains("phi-3") || name.contains("phi3")
}

/// A byte-level BPE vocabulary: `tokenizer.ggml.tokens`, `.merges`, `.token_type` and the
/// pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_json(file: &GgufFile) -> Result<Value> {
    let path = file.path();
    let pre_name = file
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ModelError::Tokenizer {
            source_name: path.display().to_string(),
            reason:
                "no tokenizer.ggml.pre: the file does not say how to split text (re-convert it \
                     with a llama.cpp from 2024-05 or later)"
                    .into(),
        })?;
    let pre = pre_tokenizer(pre_name).map_err(|reason| ModelError::Tokenizer {
        source_name: path.display().to_string(),
        reason,
    })?;

    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types = token_types(file, tokens.len())?;
    let merges: Vec<String> = strings(file, "tokenizer.ggml.merges")?
        .into_iter()
        .map(str::to_string)
        .collect();

    // Tokens are written in GPT-2's byte alphabet; a control token spelled outside it (a
    // llama.cpp mislabel) is respelled byte by byte, as transformers does.
    let map = byte_to_char();
    let alphabet: std::collections::HashSet<char> = map.iter().copied().collect();
    let spell = |t: &str| -> String {
        if t.chars().all(|c| alphabet.contains(&c)) {
            t.to_string()
        } else {
            encode_bytes(t.as_bytes(), &map)
        }
    };
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&token, &kind)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(spell(token), json!(id));
        if kind == CONTROL || kind == USER_DEFINED {
            added.push(AddedToken {
                content: token.to_string(),
                id: id as u32,
                special: kind == CONTROL,
                rstrip: false,
            });
        }
    }
    let vocab_size = tokens.len();
    let (add_bos, _) = framing(file)?;
    let bos = framing_token(file, "bos", add_bos, vocab_size)?.map(|id| (tokens[id as usize], id));
    Ok(byte_level::tokenizer_json(
        Value::Object(vocab),
        merges,
        pre.json(),
        pre.ignores_merges(),
        &added,
        bos,
    ))
}

/// Token texts that end generation whatever the metadata says (llama.cpp's `llama-vocab.cpp`,
/// "maintain a list of tokens that cause end-of-generation"): converters name one EOS, while a
/// chat model's turns end with another token (Phi-3's `<|end|>`, Gemma's `<end_of_turn>`).
const END_OF_GENERATION_TEXTS: [&str; 22] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// BOS, the ids that end a sequence (EOS, end-of-turn, end-of-message, then every token
/// whose text llama.cpp treats as ending generation, in id order), and whether prompts start
/// with BOS.
pub fn special_ids(file: &GgufFile) -> Result<(Option<u32>, Vec<u32>, bool)> {
    let vocab = file.array("tokenizer.ggml.tokens")?.len();
    let bos = token_id(file, "tokenizer.ggml.bos_token_id", vocab)?;
    let mut eos = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = token_id(file, key, vocab)?
            && !eos.contains(&id)
        {
            eos.push(id);
        }
    }
    for (id, token) in file.array("tokenizer.ggml.tokens")?.iter().enumerate() {
        let id = id as u32;
        if token
            .as_str()
            .is_some_and(|t| END_OF_GENERATION_TEXTS.contains(&t))
            && !eos.contains(&id)
        {
            eos.push(id);
        }
    }
    let (add_bos, _) = framing(file)?;
    Ok((bos, eos, add_bos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_pre_tokenizers_are_named_in_the_error() {
        assert_eq!(
            pre_tokenizer("smollm"),
            Ok(PreTokenizer::Gpt2IndividualDigits)
        );
        assert_eq!(pre_tokenizer("llama-bpe"), Ok(PreTokenizer::Llama3));
        assert_eq!(pre_tokenizer("qwen2"), Ok(PreTokenizer::Qwen2));
        let err = pre_tokenizer("chatglm-bpe").unwrap_err();
        assert!(err.contains("`chatglm-bpe`"), "{err}");
    }
}
