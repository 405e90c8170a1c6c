//! [`TextTokenizer`]: text to token ids and back, from any of the files checkpoints ship:
//! `tokenizer.json`, GPT-2's `vocab.json` + `merges.txt`, or Llama-3's tiktoken
//! `tokenizer.model`. All become a Hugging Face `tokenizers::Tokenizer`: the latter two are
//! converted into the `tokenizer.json` document transformers' converters would write.

mod byte_level;
pub mod chat_prompt;
pub(crate) mod gguf;
mod literal;
pub mod sentencepiece;
mod tiktoken;

use std::path::Path;
use std::sync::Arc;

use kiln_core::TokenId;
use kiln_core::ids::TokenText;
use serde_json::Value;

pub use byte_level::{AddedToken, LLAMA3_PATTERN, PreTokenizer, QWEN2_PATTERN};
pub use chat_prompt::SpecialsInContent;
pub use tiktoken::llama3_special_tokens;

use crate::error::{ModelError, Result};
use crate::weights::read_text;

/// A tokenizer with kiln's id type.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    source: String,
    /// Where a text spells a special token (what a chat prompt reads literally).
    specials: Arc<literal::SpecialTexts>,
}

impl TextTokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    ///
    /// # Errors
    /// Missing or invalid file.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let text = read_text(path)?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// GPT-2's `vocab.json` + `merges.txt`: byte-level BPE with GPT-2's pre-tokenizer regex,
    /// `<|endoftext|>` special when the vocabulary has it.
    ///
    /// # Errors
    /// Missing or invalid files.
    pub fn from_vocab_merges(vocab_path: &Path, merges_path: &Path) -> Result<Self> {
        let vocab: Value = serde_json::from_str(&read_text(vocab_path)?)
            .map_err(|e| ModelError::config(vocab_path, format!("invalid JSON: {e}")))?;
        let vocab = vocab
            .as_object()
            .ok_or_else(|| ModelError::config(vocab_path, "expected a token → id object"))?;
        let merges: Vec<String> = read_text(merges_path)?
            .lines()
            .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        let added: Vec<AddedToken> = vocab
            .get("<|endoftext|>")
            .and_then(Value::as_u64)
            .map(|id| AddedToken::special("<|endoftext|>", id as u32))
            .into_iter()
            .collect();
        let document = byte_level::tokenizer_json(
            Value::Object(vocab.clone()),
            merges,
            PreTokenizer::Gpt2.json(),
            PreTokenizer::Gpt2.ignores_merges(),
            &added,
            None,
        );
        Self::from_json_str(&document.to_string(), &vocab_path.display().to_string())
    }

    /// Llama-3's tiktoken `tokenizer.model` (base64 token and rank per line) plus the 256
    /// special tokens after the base vocabulary, with `<|begin_of_text|>` added by
    /// `encode(.., true)` as transformers' Llama-3 tokenizer does.
    ///
    /// # Errors
    /// Missing or malformed file.
    pub fn from_tiktoken(path: &Path) -> Result<Self> {
        let document = tiktoken::tokenizer_json(path)?;
        Self::from_json_str(&document.to_string(), &path.display().to_string())
    }

    /// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata: byte-level BPE
    /// (`tokenizer.ggml.model` `gpt2`) with the pre-tokenizer `tokenizer.ggml.pre` names (see
    /// [`PreTokenizer`]), or a SentencePiece vocabulary (`llama`: Llama 1 and 2, Mistral,
    /// Gemma; see [`sentencepiece`]). Control tokens become special tokens, user-defined ones
    /// plain added tokens; `encode(.., true)` adds BOS and EOS as
    /// `tokenizer.ggml.add_bos_token` / `add_eos_token` say, with llama.cpp's defaults.
    ///
    /// # Errors
    /// A vocabulary kind or pre-tokenizer kiln does not implement, or malformed metadata.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        let document = gguf::tokenizer_json(file)?;
        Self::from_json_str(&document.to_string(), &file.path().display().to_string())
    }

    fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let inner: tokenizers::Tokenizer = text.parse().map_err(|e| ModelError::Tokenizer {
            source_name: source.to_string(),
            reason: format!("{e}"),
        })?;
        Ok(Self {
            specials: Arc::new(literal::SpecialTexts::new(&inner)),
            inner,
            source: source.to_string(),
        })
    }

    /// Token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor adds what
    /// it is configured to (a BOS token for Llama-3). Special tokens written in the text
    /// (`<|eot_id|>`) are recognised as such ([`Self::encode_with_literals`] reads some
    /// stretches literally).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<TokenId>> {
        let encoding =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| ModelError::Tokenizer {
                    source_name: self.source.clone(),
                    reason: format!("encoding failed: {e}"),
                })?;
        Ok(encoding.get_ids().iter().copied().map(TokenId).collect())
    }

    /// The text of `ids`.
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`].
    pub fn decode(&self, ids: &[TokenId], skip_special_tokens: bool) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|t| t.0).collect();
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer {
                source_name: self.source.clone(),
                reason: format!("decoding failed: {e}"),
            })
    }

    /// The id of a token written out (`<|eot_id|>`).
    pub fn token_id(&self, token: &str) -> Option<TokenId> {
        self.inner.token_to_id(token).map(TokenId)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// What each of the first `vocab` ids stands for (the model's logits may cover more ids
    /// than the tokenizer names): the bytes it adds to the text, or a special token's name.
    /// Byte-level BPE pieces are mapped back to their bytes; SentencePiece-style pieces
    /// (`▁`, `<0x0A>`) to theirs. Ids the tokenizer does not name are special (no text can
    /// produce them). Constrained decoding builds its token trie from this.
    pub fn token_texts(&self, vocab: usize) -> Vec<TokenText> {
        let added = self.inner.get_added_tokens_decoder();
        let byte_level = serde_json::to_value(self.inner.get_decoder())
            .ok()
            .and_then(|d| d.get("type").and_then(Value::as_str).map(str::to_string))
            .is_none_or(|kind| kind == "ByteLevel");
        let byte_of: std::collections::HashMap<char, u8> = byte_level::byte_to_char()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        (0..vocab as u32)
            .map(|id| {
                if let Some(token) = added.get(&id) {
                    return if token.special {
                        TokenText::Special(token.content.clone())
                    } else {
                        TokenText::Bytes(token.content.as_bytes().to_vec())
                    };
                }
                let Some(piece) = self.inner.id_to_token(id) else {
                    return TokenText::Special(format!("<unnamed {id}>"));
                };
                if byte_level {
                    let bytes: Option<Vec<u8>> =
                        piece.chars().map(|c| byte_of.get(&c).copied()).collect();
                    bytes.map_or(TokenText::Special(piece), TokenText::Bytes)
                } else {
                    TokenText::Bytes(sentencepiece_bytes(&piece))
                }
            })
            .collect()
    }

    /// The underlying Hugging Face tokenizer (for streaming decoders).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The `added_tokens` list of `tokenizer.json`: tokens matched whole in text, before the
/// normalizer (so a `▁` is never put inside them).
fn added_tokens_json(added: &[AddedToken]) -> Value {
    added
        .iter()
        .map(|t| {
            serde_json::json!({"id": t.id, "content": t.content, "single_word": false,
                "lstrip": false, "rstrip": t.rstrip, "normalized": false, "special": t.special})
        })
        .collect()
}

/// The `post_processor` of `tokenizer.json` that puts `bos` before and `eos` after a prompt
/// when `encode(.., true)` asks for special tokens (`null` when neither is set). A pair of
/// texts gets `bos A eos B eos`.
fn framing_json(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    use serde_json::json;
    if bos.is_none() && eos.is_none() {
        return Value::Null;
    }
    let special = |token: &str| json!({"SpecialToken": {"id": token, "type_id": 0}});
    let sequence = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    single.extend(bos.map(|(t, _)| special(t)));
    single.push(sequence("A", 0));
    single.extend(eos.map(|(t, _)| special(t)));
    let mut pair = single.clone();
    pair.push(sequence("B", 1));
    pair.extend(eos.map(|(t, _)| special(t)));
    let mut special_tokens = serde_json::Map::new();
    for (token, id) in bos.into_iter().chain(eos) {
        special_tokens.insert(
            token.to_string(),
            json!({"id": token, "ids": [id], "tokens": [token]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair,
           "special_tokens": special_tokens})
}

/// A SentencePiece piece's bytes: `<0xAB>` is the byte 0xAB, `▁` a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if let Some(hex) = piece
        .strip_prefix("<0x")
        .and_then(|p| p.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        && let Ok(byte) = u8::from_str_radix(hex, 16)
    {
        return vec![byte];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}
