//! Reasoning output: a thinking model's `<think>…</think>` text kept apart from its answer, as
//! `message.reasoning_content` (and `delta.reasoning_content` when streaming) beside
//! `content`, the field llama-server, vLLM and DeepSeek's API use.
//!
//! [`ReasoningSplitter`] reads the generated text piece by piece, as the stream sends it, and
//! says which part of each piece is reasoning and which is answer. A non-streamed answer runs
//! the same splitter over its whole text ([`split`]), so both give the same two texts.
//!
//! The rules (vLLM's Qwen3 and DeepSeek-R1 parsers and llama.cpp's `try_parse_reasoning`
//! agree on them):
//! - the reasoning is the text between `<think>` and `</think>`; the output may open with
//!   `<think>` (Qwen3), or the prompt may already have opened it (DeepSeek-R1 distills' and
//!   QwQ's templates end the generation prompt with `<think>\n`), in which case the output
//!   starts inside it;
//! - an output that does not open with `<think>` is all answer;
//! - whitespace around the reasoning and before the answer is dropped (templates put newlines
//!   there);
//! - an output that ends inside the reasoning (`max_tokens`) is all reasoning, no answer.
//!
//! Text that might be the start of a tag is held back until the next piece says whether it
//! is one, so a tag split over two tokens never leaks into either field.

/// The tag that opens the reasoning.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes it.
pub const THINK_CLOSE: &str = "</think>";

/// What `--reasoning-format` chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// Split when the model's chat template speaks of `<think>` (Qwen3, QwQ, DeepSeek-R1
    /// distills); leave the text alone otherwise.
    #[default]
    Auto,
    /// Never split: the tags stay in `content`.
    None,
    /// Always split `<think>…</think>` into `reasoning_content`.
    Separate,
}

impl ReasoningFormat {
    /// The names the flag takes (`deepseek` is llama-server's name for `separate`).
    ///
    /// # Errors
    /// A message listing the names, for anything else.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "separate" | "deepseek" => Ok(Self::Separate),
            other => Err(format!(
                "unknown reasoning format `{other}` (expected auto, none or separate)"
            )),
        }
    }

    /// Whether answers from a model with this chat template are split.
    pub fn splits(self, chat_template: Option<&str>) -> bool {
        match self {
            Self::Auto => chat_template.is_some_and(|t| t.contains(THINK_OPEN)),
            Self::None => false,
            Self::Separate => true,
        }
    }
}

impl std::str::FromStr for ReasoningFormat {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Self::parse(name)
    }
}

/// Whether a rendered prompt leaves the model inside an open `<think>` (its last tag is an
/// opening one): then the output starts as reasoning.
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// One piece of output, split.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    /// The part that is reasoning.
    pub reasoning: String,
    /// The part that is answer.
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the output may still open with `<think>`.
    Start,
    /// Inside the reasoning, nothing but whitespace in it yet.
    ThinkingStart,
    /// Inside the reasoning.
    Thinking,
    /// After the reasoning, nothing but whitespace yet.
    AnswerStart,
    /// In the answer: everything else is content.
    Answer,
}

/// Splits one choice's output as it is generated.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    /// Text not yet given out: a possible tag's beginning, or whitespace inside the reasoning
    /// that is dropped if `</think>` follows.
    held: String,
    /// Whether any reasoning was seen (an opened `<think>`).
    thought: bool,
}

impl ReasoningSplitter {
    /// A splitter for an output that starts inside the reasoning when `starts_thinking`
    /// ([`prompt_opens_thinking`]).
    pub fn new(starts_thinking: bool) -> Self {
        Self {
            state: if starts_thinking {
                State::ThinkingStart
            } else {
                State::Start
            },
            held: String::new(),
            thought: starts_thinking,
        }
    }

    /// Whether the output had a reasoning part (so far).
    pub fn thought(&self) -> bool {
        self.thought
    }

    /// The reasoning and answer parts of the next piece of output (either may be empty while
    /// text is held back).
    pub fn push(&mut self, piece: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(piece);
        let mut text = std::mem::take(&mut self.held);
        loop {
            match self.state {
                State::Start => {
                    let rest = text.trim_start();
                    if rest.is_empty() {
                        // Only whitespace so far: keep it, it is answer if no tag comes.
                        self.held = text;
                        return out;
                    }
                    if let Some(after) = rest.strip_prefix(THINK_OPEN) {
                        self.thought = true;
                        self.state = State::ThinkingStart;
                        text = after.to_string();
                    } else if THINK_OPEN.starts_with(rest) {
                        self.held = text;
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::ThinkingStart | State::AnswerStart => {
                    let rest = text.trim_start();
                    if rest.is_empty() {
                        return out;
                    }
                    text = rest.to_string();
                    self.state = if self.state == State::ThinkingStart {
                        State::Thinking
                    } else {
                        State::Answer
                    };
                }
                State::Thinking => {
                    if let Some(at) = text.find(THINK_CLOSE) {
                        out.reasoning.push_str(text[..at].trim_end());
                        text = text[at + THINK_CLOSE.len()..].to_string();
                        self.state = State::AnswerStart;
                        continue;
                    }
                    // Give out all but a possible tag start and the whitespace before it
                    // (dropped if the tag follows).
                    let keep = held_suffix(&text, THINK_CLOSE);
                    let body = &text[..text.len() - keep];
                    let trimmed = body.trim_end();
                    out.reasoning.push_str(trimmed);
                    self.held = text[trimmed.len()..].to_string();
                    return out;
                }
                State::Answer => {
                    out.content.push_str(&text);
                    return out;
                }
            }
        }
    }

    /// What was held back, once the output has ended: a possible tag that was not one, or
    /// whitespace.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        let mut out = Split::default();
        match self.state {
            State::Start => out.content = held,
            State::Thinking => out.reasoning = held.trim_end().to_string(),
            State::ThinkingStart | State::AnswerStart => {}
            State::Answer => out.content = held,
        }
        out
    }
}

/// The reasoning and answer of a whole output: `(reasoning, content)`, the reasoning `None`
/// when the output had none and the content `None` when it ended inside the reasoning.
pub fn split(output: &str, starts_thinking: bool) -> (Option<String>, Option<String>) {
    let mut splitter = ReasoningSplitter::new(starts_thinking);
    let head = splitter.push(output);
    let whole = head.then(splitter.finish());
    if !splitter.thought() {
        return (None, Some(whole.content));
    }
    let ended_inside = matches!(splitter.state, State::ThinkingStart | State::Thinking);
    let content = (!ended_inside || !whole.content.is_empty()).then_some(whole.content);
    (Some(whole.reasoning), content)
}

/// Bytes at the end of `text` to hold back: whitespace and a proper prefix of `tag` that the
/// next piece may complete.
fn held_suffix(text: &str, tag: &str) -> usize {
    let longest = (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0);
    let before = &text[..text.len() - longest];
    longest + (before.len() - before.trim_end().len())
}

impl Split {
    /// This split followed by `other`.
    pub fn then(mut self, other: Split) -> Split {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(pieces: &[&str], starts_thinking: bool) -> Split {
        let mut s = ReasoningSplitter::new(starts_thinking);
        let mut all = Split::default();
        for p in pieces {
            all = all.then(s.push(p));
        }
        all.then(s.finish())
    }

    #[test]
    fn qwen3_output_splits_into_reasoning_and_answer() {
        let out = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?";
        assert_eq!(
            split(out, false),
            (
                Some("The user greets me.".into()),
                Some("Hello! How can I help?".into())
            )
        );
    }

    #[test]
    fn an_output_without_the_tag_is_all_answer() {
        assert_eq!(
            split("Hello <think> there", false),
            (None, Some("Hello <think> there".into()))
        );
        assert_eq!(split("  hi", false), (None, Some("  hi".into())));
        assert_eq!(split("<thi", false), (None, Some("<thi".into())));
    }

    #[test]
    fn a_prompt_that_opened_thinking_starts_inside_it() {
        assert!(prompt_opens_thinking("<|Assistant|><think>\n"));
        assert!(!prompt_opens_thinking("<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
        assert_eq!(
            split("Let me see.</think>The answer is 4.", true),
            (Some("Let me see.".into()), Some("The answer is 4.".into()))
        );
    }

    #[test]
    fn an_output_cut_inside_the_reasoning_has_no_answer() {
        assert_eq!(
            split("<think>still going ", false),
            (Some("still going".into()), None)
        );
        assert_eq!(
            split("<think>\n\n</think>\n\n", false),
            (Some(String::new()), Some(String::new()))
        );
    }

    #[test]
    fn every_way_of_cutting_the_text_gives_the_same_split() {
        let texts = [
            "<think>\nstep one\n\nstep two </think>\n\nAnswer: <b>yes</b> <think>",
            "  <think>a</think>b",
            "reason </th>ink</think> answer",
            "<thinking>not a tag</thinking>",
        ];
        for text in texts {
            for starts in [false, true] {
                let (reasoning, content) = split(text, starts);
                let whole = Split {
                    reasoning: reasoning.unwrap_or_default(),
                    content: content.unwrap_or_default(),
                };
                // Every cut into two and three pieces on char boundaries.
                let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
                for &a in &cuts {
                    assert_eq!(
                        streamed(&[&text[..a], &text[a..]], starts),
                        whole,
                        "{text:?} at {a}"
                    );
                    for &b in cuts.iter().filter(|&&b| b > a) {
                        let pieces = [&text[..a], &text[a..b], &text[b..]];
                        assert_eq!(streamed(&pieces, starts), whole, "{text:?} at {a},{b}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_flag_chooses() {
        let qwen3 = "{%- if enable_thinking %}<think>{% endif %}";
        assert!(ReasoningFormat::Auto.splits(Some(qwen3)));
        assert!(!ReasoningFormat::Auto.splits(Some("<|im_start|>")));
        assert!(!ReasoningFormat::None.splits(Some(qwen3)));
        assert!(ReasoningFormat::Separate.splits(None));
        assert_eq!(
            ReasoningFormat::parse("deepseek"),
            Ok(ReasoningFormat::Separate)
        );
        assert!(ReasoningFormat::parse("yes").is_err());
    }
}
