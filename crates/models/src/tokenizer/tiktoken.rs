//! Llama-3's tiktoken `tokenizer.model` as a Hugging Face tokenizer, the way transformers'
//! `TikTokenConverter` does it: every token of two or more bytes yields the merges of its
//! splits whose halves are both tokens, ordered by the token's rank.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use serde_json::{Map, Value, json};

use super::byte_level::{self, AddedToken, PreTokenizer, byte_to_char, encode_bytes};
use crate::error::{ModelError, Result};
use crate::weights::read_text;

/// Meta's 256 special tokens (Llama 3.1 / 3.2 names), in id order after the base vocabulary.
pub fn llama3_special_tokens() -> Vec<String> {
    let named: HashMap<usize, &str> = [
        (0, "<|begin_of_text|>"),
        (1, "<|end_of_text|>"),
        (4, "<|finetune_right_pad_id|>"),
        (5, "<|step_id|>"),
        (6, "<|start_header_id|>"),
        (7, "<|end_header_id|>"),
        (8, "<|eom_id|>"),
        (9, "<|eot_id|>"),
        (10, "<|python_tag|>"),
    ]
    .into_iter()
    .collect();
    let mut reserved = 0;
    (0..256)
        .map(|i| match named.get(&i) {
            Some(name) => (*name).to_string(),
            None => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

/// Parses `tokenizer.model` and builds the `tokenizer.json` document.
pub fn tokenizer_json(path: &Path) -> Result<Value> {
    let text = read_text(path)?;
    let mut ranks: HashMap<Vec<u8>, u32> = HashMap::new();
    for (line_no, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| ModelError::corrupt(path, format!("line {}: {what}", line_no + 1));
        let (token, rank) = line
            .split_once(' ')
            .ok_or_else(|| bad("expected `<base64> <rank>`"))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|_| bad("invalid base64"))?;
        let rank: u32 = rank.trim().parse().map_err(|_| bad("invalid rank"))?;
        ranks.insert(bytes, rank);
    }
    if ranks.is_empty() {
        return Err(ModelError::corrupt(path, "no tokens"));
    }
    let base = ranks.len() as u32;
    if ranks.values().any(|&r| r >= base) {
        return Err(ModelError::corrupt(path, "ranks are not 0..n"));
    }
    let map = byte_to_char();
    let mut vocab = Map::new();
    let mut merges: Vec<(u32, u32, u32, String)> = Vec::new();
    for (bytes, &rank) in &ranks {
        vocab.insert(encode_bytes(bytes, &map), json!(rank));
        if bytes.len() < 2 {
            continue;
        }
        for split in 1..bytes.len() {
            let (left, right) = bytes.split_at(split);
            if let (Some(&l), Some(&r)) = (ranks.get(left), ranks.get(right)) {
                let merge = format!("{} {}", encode_bytes(left, &map), encode_bytes(right, &map));
                merges.push((rank, l, r, merge));
            }
        }
    }
    merges.sort();
    let specials: Vec<AddedToken> = llama3_special_tokens()
        .into_iter()
        .enumerate()
        .map(|(i, name)| AddedToken::special(name, base + i as u32))
        .collect();
    Ok(byte_level::tokenizer_json(
        Value::Object(vocab),
        merges.into_iter().map(|m| m.3).collect(),
        PreTokenizer::Llama3.json(),
        PreTokenizer::Llama3.ignores_merges(),
        &specials,
        Some(("<|begin_of_text|>", base)),
    ))
}
