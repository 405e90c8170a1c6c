//! A streamed chat choice read as it comes, in no API's shape: [`ChoiceReader`] splits each
//! piece of text into reasoning and content and holds back what may be a tool call, and
//! [`ChatStream`] turns a one-choice job's engine updates into [`Piece`]s and an [`Ending`].
//! Each API's stream writer (OpenAI's chunks, Anthropic's and the Responses API's typed
//! events, Ollama's lines) puts these into its own shape.

use kiln_engine::{FinishReason, Timings};
use tokio::sync::mpsc::UnboundedReceiver;

use super::collect::{CallOut, call_outs};
use super::job::Job;
use crate::error::ApiError;
use crate::reasoning::{ReasoningSplitter, Split};
use crate::tools::{Parsed, StreamSplitter};
use crate::worker::Update;

/// One streamed choice's readers: the reasoning splitter (when the model's reasoning is split)
/// and the tool-call splitter (when the request offers tools).
pub(super) struct ChoiceReader {
    reasoner: Option<ReasoningSplitter>,
    calls: Option<StreamSplitter>,
}

impl ChoiceReader {
    /// A reader of one of `job`'s choices.
    pub fn new(job: &Job) -> Self {
        Self {
            reasoner: job.thinking.map(ReasoningSplitter::new),
            calls: job.tools.format.map(|_| StreamSplitter::new(&job.tools)),
        }
    }

    /// The next piece of text: its reasoning, and the content that is surely not a call.
    pub fn push(&mut self, text: &str) -> Split {
        let split = match &mut self.reasoner {
            Some(reasoner) => reasoner.push(text),
            None => Split {
                reasoning: String::new(),
                content: text.to_string(),
            },
        };
        self.content(split)
    }

    /// The choice ended: what the reasoning splitter held back (its content through the call
    /// splitter), and what the call splitter held (content not sent yet, and the calls).
    pub fn finish(&mut self) -> (Split, Parsed) {
        let tail = match &mut self.reasoner {
            Some(reasoner) => reasoner.finish(),
            None => Split::default(),
        };
        let tail = self.content(tail);
        let held = self
            .calls
            .take()
            .map(StreamSplitter::finish)
            .unwrap_or_default();
        (tail, held)
    }

    fn content(&mut self, split: Split) -> Split {
        match &mut self.calls {
            Some(calls) => Split {
                content: calls.push(&split.content),
                reasoning: split.reasoning,
            },
            None => split,
        }
    }
}

/// A piece of a streamed chat answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Piece {
    Reasoning(String),
    Content(String),
    /// A whole call: calls are parsed once the output has ended.
    Call(CallOut),
}

/// How a streamed answer ended.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Ending {
    pub finish: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// Tokens generated.
    pub tokens: usize,
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
    /// Calls it made.
    pub calls: usize,
    /// Its time to first token and decode time.
    pub timings: Timings,
}

/// What the next update brought.
pub(super) enum Step {
    /// Pieces (possibly none: an update with no text).
    Pieces(Vec<Piece>),
    /// The last pieces, and how it ended.
    Ended(Vec<Piece>, Ending),
    /// The engine failed it, or the server stopped.
    Failed(ApiError),
}

/// A one-choice job's answer as [`Piece`]s.
pub(super) struct ChatStream {
    pub job: Job,
    updates: UnboundedReceiver<Update>,
    reader: ChoiceReader,
}

impl ChatStream {
    /// The stream of `job`'s one choice.
    pub fn new(job: Job, updates: UnboundedReceiver<Update>) -> Self {
        debug_assert_eq!(job.choices(), 1, "a chat stream reads one choice");
        Self {
            reader: ChoiceReader::new(&job),
            job,
            updates,
        }
    }

    /// What the next update brings.
    pub async fn next(&mut self) -> Step {
        match self.updates.recv().await {
            Some(Update::Token { text, .. } | Update::Text { text, .. }) => {
                Step::Pieces(pieces(self.reader.push(&text)))
            }
            Some(Update::Finished { completion, .. }) => {
                let (tail, held) = self.reader.finish();
                let mut out = pieces(tail);
                out.extend(held.content.filter(|c| !c.is_empty()).map(Piece::Content));
                let calls = call_outs(&self.job, 0, &held.calls);
                let ending = Ending {
                    finish: completion.finish_reason,
                    stop_string: completion.stop_string,
                    tokens: completion.tokens.len(),
                    cached_tokens: completion.cached_tokens,
                    calls: calls.len(),
                    timings: completion.timings,
                };
                out.extend(calls.into_iter().map(Piece::Call));
                Step::Ended(out, ending)
            }
            Some(Update::Accepted) => Step::Pieces(Vec::new()),
            Some(Update::Failed(e) | Update::Rejected(e)) => Step::Failed(e),
            None => Step::Failed(ApiError::shutting_down()),
        }
    }
}

/// A split's non-empty parts, reasoning first.
fn pieces(split: Split) -> Vec<Piece> {
    let mut out = Vec::new();
    if !split.reasoning.is_empty() {
        out.push(Piece::Reasoning(split.reasoning));
    }
    if !split.content.is_empty() {
        out.push(Piece::Content(split.content));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{ToolFormat, ToolPlan};

    fn reader(thinking: Option<bool>, tools: Option<ToolPlan>) -> ChoiceReader {
        ChoiceReader {
            reasoner: thinking.map(ReasoningSplitter::new),
            calls: tools.as_ref().map(StreamSplitter::new),
        }
    }

    #[test]
    fn reasoning_then_content_then_a_held_call() {
        let plan = ToolPlan {
            format: Some(ToolFormat::Hermes),
            generic_output: false,
            single: false,
        };
        let mut r = reader(Some(false), Some(plan));
        let mut all = Split::default();
        for piece in [
            "<think>\nhm",
            "m\n</think>\n\nSure. <tool",
            "_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        ] {
            all = all.then(r.push(piece));
        }
        let (tail, held) = r.finish();
        let all = all.then(tail);
        assert_eq!(all.reasoning, "hmm");
        assert_eq!(all.content, "Sure. ");
        assert_eq!(held.calls.len(), 1);
        assert_eq!(held.calls[0].name, "f");
    }

    #[test]
    fn without_reasoning_or_tools_everything_is_content_at_once() {
        let mut r = reader(None, None);
        assert_eq!(r.push("<think>a").content, "<think>a");
        let (tail, held) = r.finish();
        assert_eq!(tail, Split::default());
        assert_eq!(held, Parsed::default());
    }
}
