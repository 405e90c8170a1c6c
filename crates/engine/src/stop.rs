//! Stop strings, matched on decoded text across token boundaries: text that could be the start
//! of a stop string is held back until it is known not to be one, so the output never contains
//! a stop string, or a piece of one that later completes.

/// One sequence's stop-string state.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Everything decoded so far.
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

/// What a new piece of text did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCheck {
    /// Text safe to emit now.
    pub emit: String,
    /// Whether a stop string was found (the sequence ends; `emit` ends before it).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Self::default()
        }
    }

    /// Adds decoded text.
    pub fn push(&mut self, piece: &str) -> StopCheck {
        self.text.push_str(piece);
        // A new match must end in the new text, so it starts at most (longest - 1) bytes
        // before it; searching from the first unemitted byte covers that, since held-back text
        // is never longer than a stop string.
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[self.emitted..]
                    .find(s.as_str())
                    .map(|i| self.emitted + i)
            })
            .min();
        if let Some(at) = found {
            let emit = self.text[self.emitted..at].to_string();
            self.text.truncate(at);
            self.emitted = at;
            return StopCheck {
                emit,
                stopped: true,
            };
        }
        let safe = self.text.len() - self.held_back();
        let emit = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        StopCheck {
            emit,
            stopped: false,
        }
    }

    /// Bytes at the end of the text that are a proper prefix of some stop string.
    fn held_back(&self) -> usize {
        let pending = &self.text[self.emitted..];
        self.stops
            .iter()
            .flat_map(|stop| {
                (1..stop.len().min(pending.len() + 1))
                    .rev()
                    .filter(|&n| stop.is_char_boundary(n))
                    .find(|&n| pending.ends_with(&stop[..n]))
            })
            .max()
            .unwrap_or(0)
    }

    /// The held-back text, when the sequence ends for another reason.
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        rest
    }

    /// All text so far, without any stop string.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            let check = m.push(p);
            out.push(check.emit);
            if check.stopped {
                return (out, true, m.text().to_string());
            }
        }
        out.push(m.flush());
        (out, false, m.text().to_string())
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_caught_and_never_emitted() {
        let (out, stopped, text) = run(&["###"], &["Hello #", "#", "# world"]);
        assert!(stopped);
        assert_eq!(out, ["Hello ", "", ""]);
        assert_eq!(text, "Hello ");
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (out, stopped, text) = run(&["###"], &["a #", "# b"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "a ## b");
        assert_eq!(out[0], "a ");
        assert_eq!(text, "a ## b");
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let (_, stopped, text) = run(&["END", "\n\n"], &["one\n\nEND"]);
        assert!(stopped);
        assert_eq!(text, "one");
    }

    #[test]
    fn multibyte_stop_strings_hold_back_on_char_boundaries() {
        let (out, stopped, _) = run(&["é!"], &["caf", "é", "?"]);
        assert!(!stopped);
        assert_eq!(out, ["caf", "", "é?", ""]);
    }
}
