//! `kiln chat` driven as a person drives it: in a terminal (tmux), typing lines, reading the
//! screen, pressing Ctrl-C in the middle of a reply. Needs `tmux` (CI installs it).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A tmux server of its own (`-L`), killed when the test ends, pass or fail.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn start(command: &str) -> Self {
        let tmux = Self {
            socket: format!("kiln-chat-test-{}", std::process::id()),
        };
        let out = tmux.run(&[
            "new-session",
            "-d",
            "-s",
            "chat",
            "-x",
            "160",
            "-y",
            "50",
            command,
        ]);
        assert!(out.status.success(), "tmux new-session: {:?}", out);
        tmux
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux is installed (apt-get install tmux)")
    }

    /// Types `text` and presses Enter.
    fn type_line(&self, text: &str) {
        assert!(
            self.run(&["send-keys", "-t", "chat", "-l", text])
                .status
                .success()
        );
        assert!(
            self.run(&["send-keys", "-t", "chat", "Enter"])
                .status
                .success()
        );
    }

    fn ctrl_c(&self) {
        assert!(
            self.run(&["send-keys", "-t", "chat", "C-c"])
                .status
                .success()
        );
    }

    /// The whole screen and scrollback, wrapped lines joined.
    fn screen(&self) -> String {
        let out = self.run(&["capture-pane", "-p", "-J", "-S", "-", "-t", "chat"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn alive(&self) -> bool {
        self.run(&["has-session", "-t", "chat"]).status.success()
    }

    /// Waits until `done(screen)` holds; fails with the screen after `timeout`.
    fn wait_for(&self, what: &str, timeout: Duration, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if done(&screen) {
                return screen;
            }
            assert!(
                start.elapsed() < timeout && self.alive(),
                "waited {:?} for {what}; the screen:\n{screen}",
                start.elapsed()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the `> ` prompt to appear for the `n`-th time.
    fn wait_for_prompt(&self, n: usize, timeout: Duration) -> String {
        self.wait_for(&format!("prompt #{n}"), timeout, |s| prompts(s) >= n)
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// How many times the input prompt has been shown.
fn prompts(screen: &str) -> usize {
    screen.lines().filter(|l| l.starts_with("> ")).count()
        + usize::from(screen.trim_end().ends_with('>'))
}

fn greedy_reply_to_two_plus_two() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/tests/fixtures/smollm2/reference.json"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = &json["greedy_cases"][3];
    assert!(case["prompt"].as_str().unwrap().contains("What is 2+2?"));
    let text = case["greedy_text"].as_str().unwrap();
    text[..text.find("<|im_end|>").unwrap()].to_string()
}

/// A chat session at a terminal: the first reply is transformers' greedy reply, the second
/// turn reuses the cached conversation (`/stats` says how much), `/temperature` is taken,
/// Ctrl-C stops a long reply and the chat goes on, `/exit` ends the program.
#[test]
fn chat_in_a_terminal() {
    // `exec`: Ctrl-C must reach kiln alone, not a shell that would die of it and close the
    // pane.
    let command = format!(
        "exec {} chat --dtype f32 --temperature 0 --max-tokens 64",
        env!("CARGO_BIN_EXE_kiln")
    );
    let tmux = Tmux::start(&command);
    let minute = Duration::from_secs(60);
    tmux.wait_for_prompt(1, 3 * minute);

    tmux.type_line("What is 2+2?");
    let expected = greedy_reply_to_two_plus_two();
    let screen = tmux.wait_for_prompt(2, minute);
    let first_line = expected.lines().next().unwrap();
    assert!(
        screen.contains(first_line),
        "expected {expected:?}:\n{screen}"
    );

    tmux.type_line("And 3+3?");
    tmux.wait_for_prompt(3, minute);
    tmux.type_line("/stats");
    let screen = tmux.wait_for("/stats", minute, |s| s.contains("conversation:"));
    let stats = screen
        .lines()
        .find(|l| l.starts_with("last reply:"))
        .unwrap();
    let reused: usize = stats
        .split(": ")
        .nth(2)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no reused count in {stats:?}"));
    assert!(reused > 20, "turn 2 should reuse turn 1's tokens: {stats}");
    assert!(screen.contains("conversation: 2 turns"), "{screen}");

    tmux.type_line("/temperature 0.5");
    tmux.wait_for("the new temperature", minute, |s| {
        s.contains("temperature 0.5, top-k")
    });
    tmux.type_line("/seed 7");
    tmux.wait_for("the seed", minute, |s| s.contains("seed 7, max-tokens"));
    tmux.type_line("/max-tokens 2000");
    tmux.wait_for("the new max-tokens", minute, |s| {
        s.contains("max-tokens 2000")
    });
    let before = tmux.screen();
    tmux.type_line("Write a very long story about a dragon who learns to bake bread.");
    // Let a few words stream, then interrupt.
    tmux.wait_for("the story to start", minute, |s| {
        s.len() > before.len() + 120
    });
    tmux.ctrl_c();
    let screen = tmux.wait_for("the reply to stop", minute, |s| s.contains("(stopped)"));
    assert!(tmux.alive(), "Ctrl-C must not end the chat:\n{screen}");
    tmux.type_line("/stats");
    let screen = tmux.wait_for("/stats after Ctrl-C", minute, |s| {
        s.matches("conversation:").count() == 2
    });
    assert!(screen.contains("conversation: 3 turns"), "{screen}");
    let stopped = screen
        .lines()
        .rfind(|l| l.starts_with("last reply:"))
        .unwrap();
    assert!(stopped.contains("(stop)"), "{stopped}");

    tmux.type_line("/exit");
    let start = Instant::now();
    while tmux.alive() {
        assert!(
            start.elapsed() < minute,
            "/exit did not end the chat:\n{}",
            tmux.screen()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
