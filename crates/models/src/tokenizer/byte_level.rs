//! Byte-level BPE pieces: GPT-2's byte ↔ printable-character map and the `tokenizer.json`
//! document for a byte-level BPE.

use serde_json::{Value, json};

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the others to code points
/// from 256 on, so every byte sequence is a printable string.
pub fn byte_to_char() -> [char; 256] {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = [char::from(0u8); 256];
    for b in &printable {
        chars[*b as usize] = char::from_u32(*b).expect("latin-1 code point");
    }
    let mut next = 256u32;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            chars[b as usize] = char::from_u32(next).expect("valid code point");
            next += 1;
            printable.push(b);
        }
    }
    chars
}

/// A byte string as byte-level characters.
pub fn encode_bytes(bytes: &[u8], map: &[char; 256]) -> String {
    bytes.iter().map(|&b| map[b as usize]).collect()
}

/// The `tokenizer.json` of a byte-level BPE.
pub fn tokenizer_json(
    vocab: Value,
    merges: Vec<String>,
    pre_tokenizer: Value,
    ignore_merges: bool,
    added: &[(String, u32)],
    bos: Option<(&str, u32)>,
) -> Value {
    let added_tokens: Vec<Value> = added
        .iter()
        .map(|(content, id)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let post_processor = match bos {
        Some((token, id)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {token: {"id": token, "ids": [id], "tokens": [token]}}
        }),
        None => Value::Null,
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2s() {
        let map = byte_to_char();
        assert_eq!(map[b'a' as usize], 'a');
        assert_eq!(map[b' ' as usize], 'Ġ');
        assert_eq!(map[b'\n' as usize], 'Ċ');
        let mut seen: Vec<char> = map.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }
}
