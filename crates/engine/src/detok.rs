//! Token ids to text, one token at a time, without ever emitting half a character: a token may
//! end in the middle of a multi-byte UTF-8 sequence (emoji, CJK), which decodes to U+FFFD until
//! the next token completes it.

use kiln_core::TokenId;

/// Turns ids into text. The engine knows tokenizers only through this.
pub trait Detokenizer {
    /// The text of `ids` (special tokens included), or `None` if it cannot be decoded.
    fn decode(&self, ids: &[TokenId]) -> Option<String>;
}

impl<F: Fn(&[TokenId]) -> Option<String>> Detokenizer for F {
    fn decode(&self, ids: &[TokenId]) -> Option<String> {
        self(ids)
    }
}

/// One sequence's incremental decoder: decodes a short window of recent tokens and emits what
/// the newest ones added, as Hugging Face's `DecodeStream` does, but over any [`Detokenizer`].
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<TokenId>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// Tokens before this are emitted.
    read: usize,
}

impl IncrementalDecoder {
    /// Adds `token`; returns the new text, or an empty string while a character is incomplete.
    pub fn push(&mut self, token: TokenId, detok: &dyn Detokenizer) -> String {
        self.ids.push(token);
        let before = detok
            .decode(&self.ids[self.prefix..self.read])
            .unwrap_or_default();
        let after = detok.decode(&self.ids[self.prefix..]).unwrap_or_default();
        if after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && after.is_char_boundary(before.len())
        {
            let piece = after[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            piece
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level "tokenizer": each id is one byte.
    fn bytes(ids: &[TokenId]) -> Option<String> {
        let raw: Vec<u8> = ids.iter().map(|t| t.0 as u8).collect();
        Some(String::from_utf8_lossy(&raw).into_owned())
    }

    #[test]
    fn split_characters_are_emitted_whole() {
        let mut decoder = IncrementalDecoder::default();
        let text = "a€😀b";
        let mut out = Vec::new();
        for b in text.bytes() {
            out.push(decoder.push(TokenId(u32::from(b)), &bytes));
        }
        assert_eq!(out.concat(), text);
        // '€' is 3 bytes: nothing for the first two, the whole character with the third.
        assert_eq!(&out[1..4], &["", "", "€"]);
    }
}
