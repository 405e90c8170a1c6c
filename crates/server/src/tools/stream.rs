//! A streamed choice's text split as it comes into content sent at once and text held back for
//! the calls ([`StreamSplitter`]): text before a call marker streams as content; text that may
//! be the start of a marker (`<tool_`) waits until the next piece says; from a marker on (or,
//! in the formats whose calls are the whole reply, from a first `{` or `[`), everything is held
//! and parsed when the choice ends.

use super::{Parsed, ToolFormat, ToolPlan, parse};

/// Where a streamed choice is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet (whole-reply formats): held.
    Undecided,
    /// Text: sent as it comes, less a possible marker's start.
    Content,
    /// Calls: held to the end.
    Calls,
}

/// One streamed choice's splitter.
#[derive(Debug)]
pub struct StreamSplitter {
    plan: ToolPlan,
    phase: Phase,
    /// Text not sent yet.
    held: String,
}

const HERMES_OPEN: &str = "<tool_call>";

impl StreamSplitter {
    /// A splitter reading as `plan` says.
    pub fn new(plan: &ToolPlan) -> Self {
        let phase = match plan.format {
            _ if plan.generic_output => Phase::Calls,
            None => Phase::Content,
            Some(ToolFormat::Hermes) => Phase::Content,
            Some(_) => Phase::Undecided,
        };
        Self {
            plan: plan.clone(),
            phase,
            held: String::new(),
        }
    }

    /// Takes the next piece of text; returns the content that may be sent now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.phase == Phase::Undecided {
            let Some(first) = self.held.trim_start().chars().next() else {
                return String::new();
            };
            self.phase = if first == '{' || first == '[' || first == '<' {
                Phase::Calls
            } else {
                Phase::Content
            };
        }
        match self.phase {
            Phase::Content => {
                if self.plan.format == Some(ToolFormat::Hermes) {
                    if let Some(at) = self.held.find(HERMES_OPEN) {
                        let before = self.held[..at].to_string();
                        self.held.drain(..at);
                        self.phase = Phase::Calls;
                        return before;
                    }
                    let keep = marker_start(&self.held, HERMES_OPEN);
                    let send = self.held[..keep].to_string();
                    self.held.drain(..keep);
                    return send;
                }
                std::mem::take(&mut self.held)
            }
            Phase::Undecided | Phase::Calls => String::new(),
        }
    }

    /// The choice ended: the content not sent yet and the calls.
    pub fn finish(self) -> Parsed {
        if self.held.is_empty() {
            return Parsed::default();
        }
        match self.phase {
            Phase::Content | Phase::Undecided => Parsed {
                content: Some(self.held),
                calls: Vec::new(),
            },
            Phase::Calls => {
                let mut parsed = parse(&self.plan, &self.held);
                if self.plan.format == Some(ToolFormat::Hermes) && !self.plan.generic_output {
                    // The text before the marker went out already.
                    if !parsed.calls.is_empty() {
                        parsed.content = None;
                    }
                }
                parsed
            }
        }
    }
}

/// Where the longest end of `text` that begins `marker` starts (`text.len()` when none does).
fn marker_start(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .map(|n| text.len() - n)
        .find(|&at| text.is_char_boundary(at) && marker.starts_with(&text[at..]))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(format: ToolFormat) -> ToolPlan {
        ToolPlan {
            format: Some(format),
            generic_output: false,
            single: false,
        }
    }

    #[test]
    fn hermes_streams_text_and_holds_a_split_marker() {
        let mut s = StreamSplitter::new(&plan(ToolFormat::Hermes));
        assert_eq!(s.push("Let me "), "Let me ");
        assert_eq!(s.push("check.\n<tool"), "check.\n");
        assert_eq!(s.push("_call>\n{\"name\": \"f\", "), "");
        assert_eq!(s.push("\"arguments\": {}}\n</tool_call>"), "");
        let parsed = s.finish();
        assert_eq!(parsed.content, None);
        assert_eq!(parsed.calls.len(), 1);
        assert_eq!(parsed.calls[0].name, "f");
    }

    #[test]
    fn a_held_start_that_is_not_a_marker_is_sent_later() {
        let mut s = StreamSplitter::new(&plan(ToolFormat::Hermes));
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("p>"), "<top>");
        assert_eq!(s.finish(), Parsed::default());
    }

    #[test]
    fn whole_reply_formats_decide_on_the_first_character() {
        let mut s = StreamSplitter::new(&plan(ToolFormat::Llama3));
        assert_eq!(s.push("  "), "");
        assert_eq!(s.push("Hello"), "  Hello");
        let mut s = StreamSplitter::new(&plan(ToolFormat::Llama3));
        assert_eq!(s.push("{\"name\": \"f\", \"parameters\": {}}"), "");
        assert_eq!(s.finish().calls.len(), 1);
        // JSON that is no call comes back as content at the end.
        let mut s = StreamSplitter::new(&plan(ToolFormat::Mistral));
        assert_eq!(s.push("[1, 2]"), "");
        assert_eq!(s.finish().content.as_deref(), Some("[1, 2]"));
    }
}
