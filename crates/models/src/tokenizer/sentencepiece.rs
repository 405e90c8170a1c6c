//! SentencePiece vocabularies (Llama 1 and 2, Mistral, TinyLlama, Gemma) as a Hugging Face
//! `tokenizer.json`: BPE over text whose spaces are `▁`, with a `▁` put before each run of
//! text (when the vocabulary says so), characters outside the vocabulary spelled as
//! `<0xAB>` byte pieces, and merges ordered by the score of the piece they make.
//!
//! This is the document transformers' `LlamaConverter` writes (its legacy form, which is also
//! what its GGUF converter builds), and it tokenizes as llama.cpp's SPM tokenizer does:
//! llama.cpp merges, again and again, the adjacent pair whose joined text is the
//! highest-scoring piece; ranking every such pair by that score makes Hugging Face's BPE take
//! the same merges in the same order. llama.cpp puts a space before the first run of text and
//! before every run that follows a special token; the `Prepend` normalizer does the same, since
//! Hugging Face normalizes each run between added tokens on its own.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::byte_level::AddedToken;

/// What a piece is, as SentencePiece's model proto and llama.cpp's `llama_token_type` say
/// (GGUF `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined,
/// 5 unused, 6 byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceKind {
    /// Text that merges produce.
    Normal,
    /// `<unk>`: what a character without a piece or byte piece becomes.
    Unknown,
    /// `<s>`, `</s>`, `[INST]`: never produced from text by the merges; special.
    Control,
    /// Matched whole in text, kept when decoding.
    UserDefined,
    /// Reserved, never produced.
    Unused,
    /// `<0xAB>`: one byte, for characters no piece spells.
    Byte,
}

impl PieceKind {
    /// The kind of a GGUF `tokenizer.ggml.token_type` value (0, "undefined", reads as normal,
    /// as llama.cpp reads it).
    pub fn from_gguf(value: i64) -> Option<Self> {
        Some(match value {
            0 | 1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Whether BPE merges may produce this piece.
    fn merges_to(self) -> bool {
        matches!(self, Self::Normal | Self::UserDefined)
    }
}

/// One vocabulary entry; its id is its index.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// Its text, spaces as `▁`.
    pub text: &'a str,
    /// Its score: a higher score merges first.
    pub score: f32,
    /// Its kind.
    pub kind: PieceKind,
}

/// A SentencePiece vocabulary and how prompts are framed.
#[derive(Debug, Clone)]
pub struct Vocabulary<'a> {
    /// The pieces in id order.
    pub pieces: Vec<Piece<'a>>,
    /// Whether a `▁` goes before each run of text (SentencePiece's `add_dummy_prefix`;
    /// Llama and Mistral: yes, Gemma: no). Decoding then drops the first space.
    pub add_space_prefix: bool,
    /// Whether control, user-defined and unknown pieces written in the text take the
    /// whitespace after them along (`rstrip`), except `<unk>`, `<s>` and `<|endoftext|>`: what
    /// llama.cpp does for Phi-3's vocabularies, as Phi-3's own `tokenizer.json` marks its
    /// chat tokens.
    pub strip_after_specials: bool,
    /// The piece characters without a piece become when no byte piece spells them.
    pub unknown: Option<u32>,
    /// The token `encode(.., true)` puts first.
    pub bos: Option<u32>,
    /// The token `encode(.., true)` puts last.
    pub eos: Option<u32>,
}

/// The merges BPE needs to rebuild every mergeable piece: each split of a normal piece into
/// two pieces, ranked by the joined piece's score (highest first; ties by id, then by the
/// length of the left half).
///
/// # Shapes
/// One `[left, right]` pair per split; their number grows with the vocabulary times the
/// pieces' length in characters.
pub fn merges(pieces: &[Piece<'_>]) -> Vec<[String; 2]> {
    let ids: HashMap<&str, usize> = pieces
        .iter()
        .enumerate()
        .filter(|(_, p)| p.kind.merges_to())
        .map(|(id, p)| (p.text, id))
        .collect();
    let mut ranked: Vec<(f32, usize, usize)> = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        if !piece.kind.merges_to() || ids.get(piece.text) != Some(&id) {
            continue;
        }
        for (split, _) in piece.text.char_indices().skip(1) {
            let (left, right) = piece.text.split_at(split);
            if ids.contains_key(left) && ids.contains_key(right) {
                ranked.push((piece.score, id, split));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked
        .into_iter()
        .map(|(_, id, split)| {
            let (left, right) = pieces[id].text.split_at(split);
            [left.to_string(), right.to_string()]
        })
        .collect()
}

/// The `tokenizer.json` document.
pub fn tokenizer_json(vocabulary: &Vocabulary<'_>) -> Value {
    let pieces = &vocabulary.pieces;
    let mut vocab = serde_json::Map::new();
    for (id, piece) in pieces.iter().enumerate() {
        // A piece spelled twice keeps its first id, as SentencePiece does.
        vocab.entry(piece.text).or_insert_with(|| json!(id));
    }
    let added: Vec<AddedToken> = pieces
        .iter()
        .enumerate()
        .filter_map(|(id, piece)| {
            let special = match piece.kind {
                PieceKind::Control | PieceKind::Unknown => true,
                PieceKind::UserDefined => false,
                _ => return None,
            };
            let keeps_whitespace = ["<unk>", "<s>", "<|endoftext|>"].contains(&piece.text);
            Some(AddedToken {
                content: piece.text.to_string(),
                id: id as u32,
                special,
                rstrip: vocabulary.strip_after_specials && !keeps_whitespace,
            })
        })
        .collect();
    let name = |id: Option<u32>| id.map(|id| (pieces[id as usize].text, id));
    let normalizer = if vocabulary.add_space_prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]})
    } else {
        json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"})
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if vocabulary.add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": super::added_tokens_json(&added),
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": super::framing_json(name(vocabulary.bos), name(vocabulary.eos)),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": null,
            "unk_token": vocabulary.unknown.map(|id| pieces[id as usize].text),
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
            "merges": merges(pieces)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(text: &str, score: f32) -> Piece<'_> {
        Piece {
            text,
            score,
            kind: PieceKind::Normal,
        }
    }

    #[test]
    fn merges_follow_the_joined_pieces_scores() {
        let pieces = [
            Piece {
                text: "<unk>",
                score: 0.0,
                kind: PieceKind::Unknown,
            },
            piece("a", -10.0),
            piece("b", -11.0),
            piece("c", -12.0),
            piece("bc", -2.0),
            piece("ab", -1.0),
            piece("abc", -3.0),
        ];
        let merges = merges(&pieces);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|[l, r]| (l.as_str(), r.as_str()))
            .collect();
        // "ab" (-1) before "bc" (-2) before both ways of making "abc" (-3).
        assert_eq!(
            pairs,
            [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")],
            "{pairs:?}"
        );
    }

    #[test]
    fn control_and_byte_pieces_are_never_merge_results() {
        let pieces = [
            piece("<", -1.0),
            piece("s>", -1.0),
            Piece {
                text: "<s>",
                score: 0.0,
                kind: PieceKind::Control,
            },
            piece("s", -1.0),
            piece(">", -1.0),
        ];
        let merges = merges(&pieces);
        assert_eq!(merges, vec![["s".to_string(), ">".to_string()]]);
    }
}
