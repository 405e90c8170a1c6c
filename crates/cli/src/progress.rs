//! Progress bars for long work (fetching the default model, loading weights): drawn on stderr
//! when it is a terminal, nothing at all on a pipe or a file.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether bars are drawn (stderr is a terminal).
pub fn on_terminal() -> bool {
    std::io::stderr().is_terminal()
}

fn target() -> ProgressDrawTarget {
    if on_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

/// A bar of `len` steps: `message [=====>    ] pos/len unit (eta)`.
pub fn bar(len: u64, message: String, unit: &str) -> ProgressBar {
    let template =
        format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} ({{elapsed}}, eta {{eta}})");
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::with_draw_target(Some(len), target())
        .with_style(style)
        .with_message(message)
}

/// A spinner for work of unknown length.
pub fn spinner(message: String) -> ProgressBar {
    let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let spinner = ProgressBar::with_draw_target(None, target())
        .with_style(style)
        .with_message(message);
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner
}
