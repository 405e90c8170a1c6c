//! Stop strings, matched on decoded text across token boundaries: text that could be the start
//! of a stop string is held back until it is known not to be one, so the output never contains
//! a stop string, or a piece of one that later completes.
//!
//! Each stop string is matched with Knuth–Morris–Pratt: its failure table is built once in
//! [`StopMatcher::new`], and its state is the length of the longest prefix of it that is a
//! suffix of the text since the last reset (a stop or a flush). A pushed byte costs amortised
//! O(1) per stop (a state grows by at most one per byte, and each fallback shrinks it), so a
//! piece costs O(piece × stops) however long the stop strings are, and memory is linear in the
//! stop strings' total length.

/// One stop string and where the text stands in it.
#[derive(Debug, Clone, Default)]
struct Stop {
    bytes: Box<[u8]>,
    /// `fail[i]`: the length of the longest proper prefix of `bytes[..=i]` that is also a
    /// suffix of it.
    fail: Box<[usize]>,
    /// The length of the longest prefix of `bytes` that is a suffix of the text since the last
    /// reset (`bytes.len()` right after a match).
    state: usize,
    /// Steps taken (table building and matching), to check the cost in tests.
    #[cfg(test)]
    work: u64,
}

impl Stop {
    fn new(stop: &str) -> Self {
        let bytes: Box<[u8]> = stop.as_bytes().into();
        let mut fail = vec![0; bytes.len()].into_boxed_slice();
        #[cfg(test)]
        let mut work = 0;
        let mut k = 0;
        for i in 1..bytes.len() {
            while k > 0 && bytes[i] != bytes[k] {
                k = fail[k - 1];
                #[cfg(test)]
                {
                    work += 1;
                }
            }
            if bytes[i] == bytes[k] {
                k += 1;
            }
            fail[i] = k;
            #[cfg(test)]
            {
                work += 1;
            }
        }
        Self {
            bytes,
            fail,
            state: 0,
            #[cfg(test)]
            work,
        }
    }

    /// Advances over one byte of text; true when the whole stop string now ends there.
    fn step(&mut self, byte: u8) -> bool {
        let mut s = self.state;
        loop {
            #[cfg(test)]
            {
                self.work += 1;
            }
            if s < self.bytes.len() && self.bytes[s] == byte {
                s += 1;
                break;
            }
            if s == 0 {
                break;
            }
            s = self.fail[s - 1];
        }
        self.state = s;
        s == self.bytes.len()
    }
}

/// One sequence's stop-string state.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Stop>,
    /// Everything decoded so far.
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    /// The stop string that ended the text, once one has.
    matched: Option<usize>,
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
            stops: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Stop::new(s))
                .collect(),
            ..Self::default()
        }
    }

    /// Adds decoded text.
    pub fn push(&mut self, piece: &str) -> StopCheck {
        let base = self.text.len();
        self.text.push_str(piece);
        // The states only look at text since the last reset, where `emitted` was then, and a
        // state is never longer than the unemitted text: it was at most the held-back length
        // (their maximum) before the piece, and grows by at most one per byte. So a match found
        // here starts at or after `emitted`. The earliest-starting match wins, even when another
        // stop completes first: once one is found, keep going while some stop's partial match
        // started before it (a later match starts no earlier than its partial match).
        let mut found: Option<usize> = None;
        for (i, &byte) in piece.as_bytes().iter().enumerate() {
            let end = base + i + 1;
            for (k, stop) in self.stops.iter_mut().enumerate() {
                if stop.step(byte) {
                    let start = end - stop.bytes.len();
                    if found.is_none_or(|at| start < at) {
                        found = Some(start);
                        self.matched = Some(k);
                    }
                }
            }
            if let Some(at) = found
                && self.stops.iter().all(|s| end - s.state >= at)
            {
                break;
            }
        }
        if let Some(at) = found {
            // `at` is where a stop string's first byte sits in the text: not a continuation
            // byte, so a char boundary.
            let emit = self.text[self.emitted..at].to_string();
            self.text.truncate(at);
            self.emitted = at;
            self.reset();
            return StopCheck {
                emit,
                stopped: true,
            };
        }
        // Held back: the longest proper prefix of a stop string that ends the text. It starts
        // on a char boundary: it begins with a stop string's first byte, which starts a char;
        // and it ends where the text (valid UTF-8) does, so it also ends on one of the stop
        // string's char boundaries, as the old prefix-by-prefix check required.
        let held = self.stops.iter().map(|s| s.state).max().unwrap_or(0);
        let safe = self.text.len() - held;
        debug_assert!(safe >= self.emitted && self.text.is_char_boundary(safe));
        let emit = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        StopCheck {
            emit,
            stopped: false,
        }
    }

    /// Forgets partial matches: text already emitted (or cut) is never part of a later match.
    fn reset(&mut self) {
        for stop in &mut self.stops {
            stop.state = 0;
        }
    }

    /// The held-back text, when the sequence ends for another reason.
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        self.reset();
        rest
    }

    /// All text so far, without any stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The stop string that ended the text (the one that starts first), if one did.
    pub fn matched(&self) -> Option<&str> {
        let stop = self.stops.get(self.matched?)?;
        // Made from a `&str`: valid UTF-8.
        std::str::from_utf8(&stop.bytes).ok()
    }

    /// Steps taken by the stop strings' automata so far, table building included.
    #[cfg(test)]
    fn work(&self) -> u64 {
        self.stops.iter().map(|s| s.work).sum()
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
    fn the_stop_string_that_starts_first_is_the_one_named() {
        let stops = ["", "world", "lo wor", "x"].map(String::from);
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.matched(), None);
        // "world" completes in the same piece, but "lo wor" started first.
        let check = m.push("Hello world");
        assert!(check.stopped);
        assert_eq!(check.emit, "Hel");
        assert_eq!(m.matched(), Some("lo wor"));
        let mut m = StopMatcher::new(&stops[1..2]);
        m.push("Hello ");
        assert!(m.push("wor").emit.is_empty());
        assert!(m.push("ld").stopped);
        assert_eq!(m.matched(), Some("world"));
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

    #[test]
    fn an_earlier_starting_stop_wins_though_another_completes_first() {
        // "bc" completes before "abcd" does, but "abcd" starts earlier.
        let (out, stopped, text) = run(&["abcd", "bc"], &["xabcd"]);
        assert!(stopped);
        assert_eq!((out, text), (vec!["x".to_string()], "x".to_string()));
        // Unless the earlier one only completes in a later piece: then the piece that
        // completes "bc" ends the sequence.
        let (_, stopped, text) = run(&["abcd", "bc"], &["xabc", "d"]);
        assert!(stopped);
        assert_eq!(text, "xa");
        // Or never completes in this piece.
        let (_, stopped, text) = run(&["abcx", "bc"], &["abcd"]);
        assert!(stopped);
        assert_eq!(text, "a");
    }

    /// The matcher as it was before KMP: searches every stop in the unemitted text and tries
    /// every prefix length of every stop for the held-back part. The reference semantics.
    #[derive(Default)]
    struct Reference {
        stops: Vec<String>,
        text: String,
        emitted: usize,
    }

    impl Reference {
        fn new(stops: &[String]) -> Self {
            Self {
                stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
                ..Self::default()
            }
        }

        fn push(&mut self, piece: &str) -> StopCheck {
            self.text.push_str(piece);
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

        fn flush(&mut self) -> String {
            let rest = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            rest
        }
    }

    /// xorshift64*: a small seeded generator, so failures reproduce.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn string(&mut self, alphabet: &[char], max_chars: usize) -> String {
            let n = self.below(max_chars + 1);
            (0..n)
                .map(|_| alphabet[self.below(alphabet.len())])
                .collect()
        }
    }

    #[test]
    fn matches_the_reference_matcher_on_random_cases() {
        const ALPHABETS: &[&[char]] = &[
            &['a', 'b'],
            &['a', 'b', 'c'],
            &['a', 'b', '\n', '#'],
            &['a', 'é', '€'],
            &['é', 'è', '😀', 'x'],
            // Chars sharing bytes: é = C3 A9, è = C3 A8, Ã = C3 83, © = C2 A9.
            &['é', 'è', 'Ã', '©'],
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut stops_seen = 0;
        for case in 0..20_000 {
            let alphabet = ALPHABETS[rng.below(ALPHABETS.len())];
            let stops: Vec<String> = (0..rng.below(5)).map(|_| rng.string(alphabet, 5)).collect();
            let mut new = StopMatcher::new(&stops);
            let mut old = Reference::new(&stops);
            for step in 0..rng.below(12) {
                let what = format!("case {case} step {step}: stops {stops:?}");
                match rng.below(10) {
                    0 => assert_eq!(new.flush(), old.flush(), "{what}: flush"),
                    _ => {
                        let piece = rng.string(alphabet, 6);
                        let check = new.push(&piece);
                        stops_seen += usize::from(check.stopped);
                        // After a stop, pushing more goes on from the cut text (like today).
                        assert_eq!(check, old.push(&piece), "{what}: push {piece:?}");
                    }
                }
                assert_eq!(new.text(), old.text, "{what}: text");
            }
            assert_eq!(new.flush(), old.flush(), "case {case}: final flush");
        }
        assert!(stops_seen > 1000, "only {stops_seen} stops hit");
    }

    #[test]
    fn the_cost_is_linear_in_the_text_and_the_stop_strings() {
        // 16 stop strings of 500 KB: half a long run of 'a' and a final byte, half periodic
        // ("a" * k + "b", repeated); the text follows them closely, so that partial matches
        // grow long and fall back often. The previous matcher did O(L^2) work per token here.
        const LEN: usize = 500_000;
        let stops: Vec<String> = (0..16)
            .map(|i| {
                let mut s = if i % 2 == 0 {
                    "a".repeat(LEN - 1)
                } else {
                    let unit = format!("{}b", "a".repeat(i));
                    unit.repeat(LEN / unit.len())
                };
                s.truncate(LEN - 1);
                s.push(char::from(b'A' + i as u8));
                s
            })
            .collect();
        let mut m = StopMatcher::new(&stops);
        let mut rng = Rng(7);
        let mut pushed = String::new();
        let mut out = String::new();
        let mut most_held = 0;
        for i in 0..2_000 {
            let piece = if i < 1_000 {
                "a".repeat(250)
            } else {
                (0..250)
                    .map(|_| if rng.below(8) == 0 { 'b' } else { 'a' })
                    .collect()
            };
            pushed.push_str(&piece);
            let check = m.push(&piece);
            assert!(!check.stopped);
            out.push_str(&check.emit);
            most_held = most_held.max(pushed.len() - out.len());
        }
        out.push_str(&m.flush());
        assert_eq!(out, pushed);
        assert_eq!(m.text(), pushed);
        // Partial matches got long: the old matcher would have redone them every token.
        assert!(most_held >= 250_000, "held back at most {most_held} bytes");
        // KMP: per stop, at most 2 steps per text byte and 2 per stop byte for its table.
        let bound = 2 * 16 * (pushed.len() + LEN) as u64;
        assert!(m.work() <= bound, "{} steps, bound {bound}", m.work());
    }
}
