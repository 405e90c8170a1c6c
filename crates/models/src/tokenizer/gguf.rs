//! The tokenizer a GGUF file describes in `tokenizer.ggml.*`, as a `tokenizer.json` document.
//! Only byte-level BPE (`tokenizer.ggml.model = gpt2`) is read; the pre-tokenizer follows
//! `tokenizer.ggml.pre` as llama.cpp's `llama-vocab.cpp` maps it, and a name kiln does not know
//! is an error rather than a guess (a wrong split silently changes every prompt's tokens).

use serde_json::{Map, Value, json};

use super::byte_level::{self, AddedToken, PreTokenizer, byte_to_char, encode_bytes};
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
    let path = file.path();
    let model = file.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(ModelError::Tokenizer {
            source_name: path.display().to_string(),
            reason: format!(
                "tokenizer.ggml.model `{model}` is not supported (kiln reads byte-level BPE, `gpt2`; \
                 `llama` is SentencePiece, used by Llama 1 and 2)"
            ),
        });
    }
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
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
        Some(_) => file
            .array("tokenizer.ggml.token_type")?
            .iter()
            .map(|v| v.as_i64().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(ModelError::config(
            path,
            format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                types.len(),
                tokens.len()
            ),
        ));
    }
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
            });
        }
    }
    let vocab_size = tokens.len();
    let bos = token_id(file, "tokenizer.ggml.bos_token_id", vocab_size)?;
    let add_bos = file
        .bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let bos = match (add_bos, bos) {
        (true, Some(id)) => Some((tokens[id as usize], id)),
        (true, None) => {
            return Err(ModelError::config(
                path,
                "tokenizer.ggml.add_bos_token is true but there is no tokenizer.ggml.bos_token_id",
            ));
        }
        (false, _) => None,
    };
    Ok(byte_level::tokenizer_json(
        Value::Object(vocab),
        merges,
        pre.json(),
        pre.ignores_merges(),
        &added,
        bos,
    ))
}

/// BOS, the ids that end a sequence (EOS, end-of-turn, end-of-message), and whether prompts
/// start with BOS.
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
    let add_bos = file
        .bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
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
