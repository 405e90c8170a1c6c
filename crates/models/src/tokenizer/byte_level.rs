//! Byte-level BPE pieces: GPT-2's byte ↔ printable-character map and the `tokenizer.json`
//! document for a byte-level BPE.

use serde_json::{Value, json};

/// Llama-3's pre-tokenizer regex.
pub const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split regex (its `tokenizer.json`; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`):
/// Llama-3's with every digit a word of its own.
pub const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How text is split into words before byte-level BPE, one per regex family llama.cpp and
/// Hugging Face use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex (`'s|'t|...| ?\p{L}+| ?\p{N}+|...`).
    Gpt2,
    /// GPT-2's regex after isolating every digit (SmolLM, StarCoder): `"2024"` is four words.
    Gpt2IndividualDigits,
    /// Llama-3's regex (numbers in groups of up to three), with whole-word vocabulary hits
    /// taking precedence over merges (`ignore_merges`), as in Llama-3's `tokenizer.json`.
    Llama3,
    /// Qwen2's regex ([`QWEN2_PATTERN`]), merges always applied (Qwen2 and Qwen3 GGUFs).
    Qwen2,
}

impl PreTokenizer {
    /// The `pre_tokenizer` object of `tokenizer.json`.
    pub fn json(self) -> Value {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        match self {
            Self::Gpt2 => byte_level(true),
            Self::Gpt2IndividualDigits => json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
            }),
            Self::Llama3 | Self::Qwen2 => json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": self.split_pattern()}, "behavior": "Isolated", "invert": false},
                    byte_level(false)
                ]
            }),
        }
    }

    fn split_pattern(self) -> &'static str {
        match self {
            Self::Qwen2 => QWEN2_PATTERN,
            _ => LLAMA3_PATTERN,
        }
    }

    /// Whether a word found whole in the vocabulary skips the merges.
    pub fn ignores_merges(self) -> bool {
        self == Self::Llama3
    }
}

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

/// A token matched whole in the text before the BPE runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedToken {
    /// Its text (`<|im_start|>`).
    pub content: String,
    /// Its id.
    pub id: u32,
    /// Special tokens are dropped by `decode(.., skip_special_tokens = true)`.
    pub special: bool,
    /// Whether the whitespace after it in the text is dropped with it (`rstrip`).
    pub rstrip: bool,
}

impl AddedToken {
    /// A special token.
    pub fn special(content: impl Into<String>, id: u32) -> Self {
        Self {
            content: content.into(),
            id,
            special: true,
            rstrip: false,
        }
    }
}

/// The `tokenizer.json` of a byte-level BPE.
pub fn tokenizer_json(
    vocab: Value,
    merges: Vec<String>,
    pre_tokenizer: Value,
    ignore_merges: bool,
    added: &[AddedToken],
    bos: Option<(&str, u32)>,
) -> Value {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": super::added_tokens_json(added),
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": super::framing_json(bos, None),
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
