//! Tokenizing a text in which some stretches are to be read literally: special tokens' text
//! inside them (`<|im_end|>` typed into a chat message) becomes ordinary text, while everywhere
//! else it stays the control token `Tokenizer::encode` makes of it. transformers does the former
//! for a whole text with `split_special_tokens=True` (the `tokenizers` crate's
//! `set_encode_special_tokens`), llama.cpp with `parse_special = false`; neither can do it for
//! part of a text, which a chat prompt needs (the template's own `<|im_end|>` must stay one).
//!
//! This module does not know where the literal stretches are: the chat prompt
//! ([`super::chat_prompt`]) says.
//!
//! How, exactly: `Tokenizer::encode` first cuts the text at the added tokens it finds
//! (leftmost-longest, an `lstrip`/`rstrip` token taking the whitespace beside it), then
//! normalizes, pre-tokenizes and tokenizes the pieces between them, each on its own, with
//! offsets into the whole text (which Metaspace's `prepend_scheme: first` reads). Here the
//! tokenizer's own matcher finds the added tokens in a copy of the text whose literal stretches
//! are blanked out (same byte length, so the offsets hold), and the rest of `encode`'s pipeline
//! runs on the real text cut at those matches. With no literal stretch nothing differs from
//! `encode`; with one, the pieces around it join and are tokenized as one, as
//! `split_special_tokens=True` would tokenize them.

use std::collections::HashSet;
use std::ops::Range;

use kiln_core::TokenId;
use tokenizers::normalizer::Range as TextRange;
use tokenizers::{
    Model, NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString,
    PreTokenizer, Token,
};

use super::TextTokenizer;
use crate::error::{ModelError, Result};

/// The special tokens' texts (`<|im_end|>`, `<s>`: added tokens marked special; for a GGUF
/// vocabulary, its control tokens), to find where a text spells one.
#[derive(Debug, Default)]
pub(crate) struct SpecialTexts {
    texts: HashSet<String>,
    /// The texts' distinct lengths in bytes, longest first.
    lengths: Vec<usize>,
    /// Whether some text starts with this byte.
    first_bytes: Vec<bool>,
}

impl SpecialTexts {
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let texts: HashSet<String> = tokenizer
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        let mut lengths: Vec<usize> = texts.iter().map(String::len).collect();
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        let mut first_bytes = vec![false; 256];
        for text in &texts {
            first_bytes[usize::from(text.as_bytes()[0])] = true;
        }
        Self {
            texts,
            lengths,
            first_bytes,
        }
    }

    /// Where `text` spells a special token, leftmost-longest (as the tokenizer matches them).
    pub(crate) fn find(&self, text: &str) -> Vec<Range<usize>> {
        let bytes = text.as_bytes();
        let mut found = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if self.first_bytes[usize::from(bytes[i])]
                && let Some(len) = self.lengths.iter().copied().find(|&len| {
                    text.get(i..i + len)
                        .is_some_and(|piece| self.texts.contains(piece))
                })
            {
                found.push(i..i + len);
                i += len;
            } else {
                i += 1;
            }
        }
        found
    }
}

impl TextTokenizer {
    /// Where `text` spells one of the tokenizer's special tokens (`<|im_end|>`), leftmost-longest,
    /// as byte ranges. Empty when it spells none.
    pub fn special_token_spans(&self, text: &str) -> Vec<Range<usize>> {
        self.specials.find(text)
    }

    /// Token ids of `text`, without the special tokens `encode(.., true)` would add, where the
    /// byte ranges `literals` are read literally: no added token is matched inside them, so a
    /// special token's text there is tokenized as ordinary text (transformers'
    /// `split_special_tokens=True`), joined with the text around it. Outside them, special
    /// tokens' text is the control token, as in [`Self::encode`]; with no literal range this is
    /// `encode(text, false)`.
    ///
    /// Exact for added tokens the tokenizer matches before normalizing (`"normalized": false`:
    /// every special token of the Llama, Qwen, Gemma, Phi-3 and SmolLM2 tokenizers, and every
    /// token of a GGUF vocabulary). One it matches after normalizing is cut at the same place in
    /// the original text, which differs only where the normalizer writes text at a piece's
    /// start (a `Prepend`).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`]: a range outside `text` or not on character boundaries, or a
    /// failing tokenizer.
    pub fn encode_with_literals(
        &self,
        text: &str,
        literals: &[Range<usize>],
    ) -> Result<Vec<TokenId>> {
        if literals.iter().all(Range::is_empty) {
            return self.encode(text, false);
        }
        self.encode_blanking(text, literals)
    }

    /// `encode_with_literals` without the shortcut: `encode`'s pipeline, cut where the tokenizer
    /// matches added tokens in `text` with the `literals` blanked out.
    fn encode_blanking(&self, text: &str, literals: &[Range<usize>]) -> Result<Vec<TokenId>> {
        let tokenizer = &self.inner;
        let added = tokenizer.get_added_vocabulary();
        let decoder = added.get_added_tokens_decoder();
        let blanked = self.blank(text, literals)?;
        // The tokenizer's own matching, on text of the same length: the offsets are the text's.
        let analysis = added.extract_and_normalize(tokenizer.get_normalizer(), &blanked);
        let mut before_normalizing = Vec::new();
        let mut after_normalizing = Vec::new();
        for (_, (start, end), tokens) in
            analysis.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            let Some([token]) = tokens.as_deref() else {
                continue;
            };
            let matched = (start..end, token.id);
            if decoder.get(&token.id).is_some_and(|t| t.normalized) {
                after_normalizing.push(matched);
            } else {
                before_normalizing.push(matched);
            }
        }
        // `Tokenizer::encode` (`encode_single_sequence`, then `post_process`), on `text`.
        let failed = |e: tokenizers::Error| self.error(format!("encoding failed: {e}"));
        let mut pieces = PreTokenizedString::from(text);
        pieces
            .split(|_, piece| cut_at(piece, &before_normalizing))
            .map_err(failed)?;
        if let Some(normalizer) = tokenizer.get_normalizer() {
            pieces
                .normalize(|piece| normalizer.normalize(piece))
                .map_err(failed)?;
        }
        if !after_normalizing.is_empty() {
            pieces
                .split(|_, piece| cut_at(piece, &after_normalizing))
                .map_err(failed)?;
        }
        if let Some(pre_tokenizer) = tokenizer.get_pre_tokenizer() {
            pre_tokenizer.pre_tokenize(&mut pieces).map_err(failed)?;
        }
        let model = tokenizer.get_model();
        pieces
            .tokenize(|piece| model.tokenize(piece.get()))
            .map_err(failed)?;
        let encoding = pieces
            .into_encoding(None, 0, OffsetType::Byte)
            .map_err(failed)?;
        let encoding = tokenizer
            .post_process(encoding, None, false)
            .map_err(failed)?;
        Ok(encoding.get_ids().iter().copied().map(TokenId).collect())
    }

    /// `text` with the bytes of `literals` replaced by a control character no added token
    /// contains: not whitespace (an `lstrip`/`rstrip` token beside a literal stops there, as at
    /// the special token's `<`), and the same length, so offsets into it are offsets into `text`.
    fn blank(&self, text: &str, literals: &[Range<usize>]) -> Result<String> {
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        let filler = ('\u{1}'..='\u{8}')
            .find(|&c| added.values().all(|t| !t.content.contains(c)))
            .ok_or_else(|| self.error("every added token filler is taken".into()))?;
        let mut bytes = text.as_bytes().to_vec();
        for range in literals {
            if range.start > range.end
                || !text.is_char_boundary(range.start)
                || !text.is_char_boundary(range.end)
            {
                return Err(self.error(format!(
                    "literal range {range:?} is not a stretch of the {}-byte text",
                    text.len()
                )));
            }
            bytes[range.clone()].fill(filler as u8);
        }
        String::from_utf8(bytes).map_err(|e| self.error(format!("blanking the literals: {e}")))
    }

    fn error(&self, reason: String) -> ModelError {
        ModelError::Tokenizer {
            source_name: self.source.clone(),
            reason,
        }
    }
}

/// `piece` cut at the `matches` (byte ranges of the whole text, each an added token's id) that
/// lie in it: the matches become their tokens, what lies between stays to be tokenized.
fn cut_at(
    piece: NormalizedString,
    matches: &[(Range<usize>, u32)],
) -> tokenizers::Result<Vec<(NormalizedString, Option<Vec<Token>>)>> {
    let (start, end) = piece.offsets_original();
    let inside: Vec<_> = matches
        .iter()
        .filter(|(range, _)| start <= range.start && range.end <= end)
        .collect();
    if inside.is_empty() {
        return Ok(vec![(piece, None)]);
    }
    let slice = |range: Range<usize>| {
        piece
            .slice(TextRange::Original(range.start - start..range.end - start))
            .ok_or_else(|| format!("cannot cut the text at {range:?}"))
    };
    let mut cut = Vec::with_capacity(2 * inside.len() + 1);
    let mut at = start;
    for (range, id) in inside {
        if at < range.start {
            cut.push((slice(at..range.start)?, None));
        }
        let token = slice(range.clone())?;
        let value = token.get().to_string();
        let len = value.len();
        cut.push((token, Some(vec![Token::new(*id, value, (0, len))])));
        at = range.end;
    }
    if at < end {
        cut.push((slice(at..end)?, None));
    }
    Ok(cut)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::PathBuf;

    use super::*;

    fn fixture(name: &str) -> TextTokenizer {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
            .join("tokenizer.json");
        TextTokenizer::from_tokenizer_json(&path).unwrap()
    }

    /// Every tokenizer.json of the fixtures: byte-level BPE (GPT-2, Llama 3, Qwen with NFC,
    /// Gemma) and SentencePiece (Llama 2, Phi-3 with `rstrip` chat tokens, both Metaspace
    /// `prepend_scheme: first`).
    const TOKENIZERS: [&str; 11] = [
        "gpt2-tiny-legacy",
        "gpt-bigcode-tiny",
        "llama-tiny",
        "llama-tiny-tied",
        "qwen2-tiny",
        "qwen3-tiny",
        "gemma2-tiny",
        "gemma3-tiny",
        "gemma3-mm-tiny",
        "llama2-tiny",
        "phi3-tiny",
    ];

    /// Texts with every fixture's special tokens in them, at the start, the end, side by
    /// side, beside whitespace (which Phi-3's `rstrip` tokens take) and beside words.
    const TEXTS: [&str; 12] = [
        "",
        "Hello world",
        " leading and trailing ",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
        "<s>[INST] Hi [/INST]</s>",
        "<|user|>\n Hi<|end|>\n<|assistant|>  \n",
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "a<|endoftext|>b <|im_end|> c\n\n<|eot_id|>\t<|end|>x",
        "<think>\nwhy</think>\n\n<|im_end|>",
        "naïve café 🙂 <s> 日本語</s>",
        "  <|end|>  <|end|>",
    ];

    /// The pipeline rebuilt from `encode`'s parts, with nothing blanked, is `encode`.
    #[test]
    fn the_rebuilt_pipeline_is_encode() {
        for name in TOKENIZERS {
            let tok = fixture(name);
            for text in TEXTS {
                assert_eq!(
                    tok.encode_blanking(text, &[]).unwrap(),
                    tok.encode(text, false).unwrap(),
                    "{name}: {text:?}"
                );
            }
        }
    }

    /// A text whose every special token is literal is the text as `split_special_tokens=True`
    /// tokenizes it (the tokenizers crate's `set_encode_special_tokens(true)`).
    #[test]
    fn all_literal_is_encode_special_tokens() {
        for name in TOKENIZERS {
            let tok = fixture(name);
            let mut split = tok.inner().clone();
            split.set_encode_special_tokens(true);
            for text in TEXTS {
                let literals = tok.special_token_spans(text);
                let expected: Vec<TokenId> = split
                    .encode(text, false)
                    .unwrap()
                    .get_ids()
                    .iter()
                    .copied()
                    .map(TokenId)
                    .collect();
                assert_eq!(
                    tok.encode_with_literals(text, &literals).unwrap(),
                    expected,
                    "{name}: {text:?}"
                );
            }
        }
    }

    /// Pieces between control tokens are tokenized alone in either tokenizer: a literal
    /// special token is the pieces around it joined, its text tokenized with them.
    #[test]
    fn one_literal_joins_the_pieces_around_it() {
        let tok = fixture("qwen2-tiny");
        let text = "<|im_start|>user\nbye<|im_end|>\n<|im_start|>system\n";
        let spans = tok.special_token_spans(text);
        assert_eq!(spans.len(), 3);
        let ids = tok.encode_with_literals(text, &spans[1..2]).unwrap();
        let start = tok.token_id("<|im_start|>").unwrap();
        let mut split = tok.inner().clone();
        split.set_encode_special_tokens(true);
        let mut expected = vec![start];
        expected.extend(
            split
                .encode("user\nbye<|im_end|>\n", false)
                .unwrap()
                .get_ids()
                .iter()
                .copied()
                .map(TokenId),
        );
        expected.push(start);
        expected.extend(tok.encode("system\n", false).unwrap());
        assert_eq!(ids, expected);
        let end = tok.token_id("<|im_end|>").unwrap();
        assert!(!ids.contains(&end));
    }

    /// What `encode_with_literals` claims, built another way: the tokenizer cuts a text at the
    /// control tokens (an `rstrip`/`lstrip` one with the whitespace beside it) and tokenizes
    /// each piece between them alone, at its place in the text (Metaspace `prepend_scheme:
    /// first` marks only the piece at offset 0); a literal special token is not a cut, so here
    /// each piece is tokenized with the special tokens read as text. Every subset of the
    /// special tokens of every text, literal, on every fixture tokenizer.
    #[test]
    fn literals_are_the_pieces_between_control_tokens_tokenized_as_text() {
        for name in TOKENIZERS {
            let tok = fixture(name);
            let added = tok
                .inner()
                .get_added_vocabulary()
                .get_added_tokens_decoder();
            let mut split = tok.inner().clone();
            split.set_encode_special_tokens(true);
            // The same tokenizer for a piece that does not start the text.
            let mut later = split.clone();
            if let Some(pre) = split.get_pre_tokenizer() {
                let mut json = serde_json::to_value(pre).unwrap();
                never_prepend(&mut json);
                later.with_pre_tokenizer(Some(
                    serde_json::from_value::<tokenizers::PreTokenizerWrapper>(json).unwrap(),
                ));
            }
            let pieces = |text: &str, at: usize| -> Vec<TokenId> {
                let tokenizer = if at == 0 { &split } else { &later };
                let encoding = tokenizer.encode(text, false).unwrap();
                encoding.get_ids().iter().copied().map(TokenId).collect()
            };
            for text in TEXTS {
                let spans = tok.special_token_spans(text);
                for subset in 0..1u32 << spans.len() {
                    let literal: Vec<_> = (0..spans.len())
                        .filter(|i| subset & (1 << i) != 0)
                        .map(|i| spans[i].clone())
                        .collect();
                    let mut expected = Vec::new();
                    let mut at = 0;
                    for (i, span) in spans.iter().enumerate() {
                        if subset & (1 << i) != 0 {
                            continue;
                        }
                        let id = tok.token_id(&text[span.clone()]).unwrap();
                        let token = &added[&id.0];
                        let mut start = span.start;
                        if token.lstrip {
                            let before = text[at..start].trim_end();
                            start = at + before.len();
                        }
                        let mut end = span.end;
                        if token.rstrip {
                            end = text.len() - text[end..].trim_start().len();
                        }
                        if at < start {
                            expected.extend(pieces(&text[at..start], at));
                        }
                        expected.push(id);
                        at = end;
                    }
                    if at < text.len() {
                        expected.extend(pieces(&text[at..], at));
                    }
                    assert_eq!(
                        tok.encode_with_literals(text, &literal).unwrap(),
                        expected,
                        "{name}: {text:?} with {literal:?} literal"
                    );
                }
            }
        }
    }

    fn never_prepend(json: &mut serde_json::Value) {
        match json {
            serde_json::Value::Object(map) => {
                if map.get("prepend_scheme").is_some() {
                    map.insert("prepend_scheme".into(), "never".into());
                }
                map.values_mut().for_each(never_prepend);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(never_prepend),
            _ => {}
        }
    }

    #[test]
    fn special_token_spans_are_leftmost_longest() {
        let tok = fixture("llama-tiny");
        let text = "x<|eot_id|><|eot_id|y <|begin_of_text|>é";
        assert_eq!(tok.special_token_spans(text), vec![1..11, 22..39]);
        assert!(tok.special_token_spans("no specials <|im_end|>").is_empty());
    }

    /// A range inside a character or past the end is an error; an empty one reads nothing.
    #[test]
    fn literal_ranges_are_checked() {
        let tok = fixture("llama-tiny");
        let one = |range: Range<usize>| -> Vec<Range<usize>> { std::iter::once(range).collect() };
        assert!(tok.encode_with_literals("é", &one(0..1)).is_err());
        assert!(tok.encode_with_literals("ab", &one(1..5)).is_err());
        assert_eq!(
            tok.encode_with_literals("ab", &one(1..1)).unwrap(),
            tok.encode("ab", false).unwrap()
        );
    }
}
