//! kiln-models' error type: every loading failure names the file and, where there is one, the
//! tensor.

use std::path::PathBuf;

/// What can go wrong loading a model or a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file the format requires is not there.
    #[error("{path}: missing ({what})")]
    MissingFile {
        /// The file looked for.
        path: PathBuf,
        /// What it would have provided.
        what: &'static str,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not what its format says.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A JSON file that does not parse or lacks a required key.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint lacks a tensor the model needs.
    #[error("{file}: no tensor `{tensor}`")]
    MissingTensor {
        /// The file or files searched.
        file: String,
        /// The tensor's name in the file.
        tensor: String,
    },
    /// A tensor whose shape disagrees with the configuration.
    #[error("{file}: tensor `{tensor}` has shape {got:?}, the configuration implies {expected:?}")]
    ShapeMismatch {
        /// The file holding it.
        file: String,
        /// The tensor's name in the file.
        tensor: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor stored in a dtype kiln cannot read.
    #[error("{file}: tensor `{tensor}` has unsupported dtype {dtype}")]
    UnsupportedTensorDtype {
        /// The file holding it.
        file: String,
        /// The tensor's name in the file.
        tensor: String,
        /// The dtype found.
        dtype: String,
    },
    /// A model architecture kiln does not implement.
    #[error("{path}: unsupported architecture `{architecture}` (kiln reads {supported})")]
    UnsupportedArchitecture {
        /// The file that named it.
        path: PathBuf,
        /// The name found.
        architecture: String,
        /// The names kiln reads in that place.
        supported: String,
    },
    /// A path that is none of the formats kiln reads.
    #[error("{path}: not a model kiln can read ({reason})")]
    UnknownFormat {
        /// The path given.
        path: PathBuf,
        /// What was expected there.
        reason: String,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer ({source_name}): {reason}")]
    Tokenizer {
        /// Where the tokenizer came from.
        source_name: String,
        /// What failed.
        reason: String,
    },
    /// A chat template that does not parse or fails to render.
    #[error("chat template: {reason}")]
    ChatTemplate {
        /// What failed, with the template line where known.
        reason: String,
    },
    /// The default model is not cached and could not be fetched.
    #[error("cannot get the default model {model}: {reason}. {manual}")]
    Fetch {
        /// The model's name.
        model: String,
        /// What failed.
        reason: String,
        /// How to get the file by hand.
        manual: String,
    },
    /// The backend refused the request (for example a dtype it lacks).
    #[error(transparent)]
    Core(#[from] kiln_core::CoreError),
}

impl ModelError {
    /// A `Corrupt` error for `path`.
    pub fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Corrupt {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// A `Config` error for `path`.
    pub fn config(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// kiln-models' result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
