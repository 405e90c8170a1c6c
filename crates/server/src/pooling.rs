//! Which pooling `/v1/embeddings` uses: what a sentence-transformers model folder says
//! (`modules.json` names the `Pooling` module's folder, usually `1_Pooling/`, whose
//! `config.json` sets one `pooling_mode_*`), else `--embedding-pooling`, else the last token
//! (what decoder embedders such as Qwen3-Embedding use).

use std::path::Path;

use kiln_engine::Pooling;
use serde::Deserialize;

/// Where the pooling came from, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolingSource {
    /// The model folder's sentence-transformers configuration.
    ModelFiles,
    /// `--embedding-pooling`.
    Flag,
    /// Neither: the last token.
    Default,
}

impl PoolingSource {
    /// Where the pooling came from, for a person.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::ModelFiles => "as the model's sentence-transformers files say",
            Self::Flag => "--embedding-pooling",
            Self::Default => "the default for a decoder model; --embedding-pooling mean to change",
        }
    }
}

/// One entry of sentence-transformers' `modules.json`.
#[derive(Debug, Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type", default)]
    kind: String,
}

/// The `pooling_mode_*` keys of a `Pooling` module's `config.json`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PoolingConfig {
    pooling_mode_lasttoken: bool,
    pooling_mode_mean_tokens: bool,
    pooling_mode_cls_token: bool,
    pooling_mode_max_tokens: bool,
    pooling_mode_mean_sqrt_len_tokens: bool,
    pooling_mode_weightedmean_tokens: bool,
}

/// The pooling of the model at `model` (`flag`: `--embedding-pooling`), where it came from,
/// and a warning when the model's files name a pooling kiln does not have or cannot be read
/// (the flag or the default is used then).
pub(crate) fn resolve(
    model: &Path,
    flag: Option<Pooling>,
) -> (Pooling, PoolingSource, Option<String>) {
    let fallback = match flag {
        Some(p) => (p, PoolingSource::Flag),
        None => (Pooling::Last, PoolingSource::Default),
    };
    match from_model_files(model) {
        Ok(Some(pooling)) => (pooling, PoolingSource::ModelFiles, None),
        Ok(None) => (fallback.0, fallback.1, None),
        Err(why) => (fallback.0, fallback.1, Some(why)),
    }
}

/// The pooling a sentence-transformers folder sets; `None` when `model` is not a folder or
/// has no `Pooling` module.
///
/// # Errors
/// A file that is not what sentence-transformers writes, or a pooling kiln does not have
/// (CLS, max, weighted mean), described.
fn from_model_files(model: &Path) -> Result<Option<Pooling>, String> {
    if !model.is_dir() {
        return Ok(None);
    }
    let modules = model.join("modules.json");
    let folder = if modules.is_file() {
        let text =
            std::fs::read_to_string(&modules).map_err(|e| format!("{}: {e}", modules.display()))?;
        let modules: Vec<Module> =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", modules.display()))?;
        match modules.iter().find(|m| m.kind.ends_with(".Pooling")) {
            Some(m) => m.path.clone(),
            None => return Ok(None),
        }
    } else {
        "1_Pooling".to_string()
    };
    let config = model.join(folder).join("config.json");
    if !config.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&config).map_err(|e| format!("{}: {e}", config.display()))?;
    let modes: PoolingConfig =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", config.display()))?;
    let others = modes.pooling_mode_cls_token
        || modes.pooling_mode_max_tokens
        || modes.pooling_mode_mean_sqrt_len_tokens
        || modes.pooling_mode_weightedmean_tokens;
    match (
        modes.pooling_mode_lasttoken,
        modes.pooling_mode_mean_tokens,
        others,
    ) {
        (true, false, false) => Ok(Some(Pooling::Last)),
        (false, true, false) => Ok(Some(Pooling::Mean)),
        _ => Err(format!(
            "{}: a pooling kiln does not have ({modes:?}); kiln pools by the last token or \
             the mean",
            config.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(files: &[(&str, &str)]) -> std::path::PathBuf {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kiln-pooling-{}-{n}", std::process::id()));
        for (path, text) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap_or(&dir)).expect("mkdir");
            std::fs::write(path, text).expect("write");
        }
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }

    #[test]
    fn the_model_files_win_then_the_flag_then_the_last_token() {
        let qwen = folder(&[
            (
                "modules.json",
                r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                    {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                    {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
            ),
            (
                "1_Pooling/config.json",
                r#"{"word_embedding_dimension":1024,"pooling_mode_cls_token":false,
                    "pooling_mode_mean_tokens":false,"pooling_mode_lasttoken":true}"#,
            ),
        ]);
        assert_eq!(
            resolve(&qwen, Some(Pooling::Mean)),
            (Pooling::Last, PoolingSource::ModelFiles, None)
        );
        let mean = folder(&[(
            "1_Pooling/config.json",
            r#"{"pooling_mode_mean_tokens":true}"#,
        )]);
        assert_eq!(resolve(&mean, None).0, Pooling::Mean);
        let plain = folder(&[("config.json", "{}")]);
        assert_eq!(
            resolve(&plain, Some(Pooling::Mean)),
            (Pooling::Mean, PoolingSource::Flag, None)
        );
        assert_eq!(
            resolve(&plain, None),
            (Pooling::Last, PoolingSource::Default, None)
        );
        let cls = folder(&[(
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token":true}"#,
        )]);
        let (pooling, source, warning) = resolve(&cls, None);
        assert_eq!((pooling, source), (Pooling::Last, PoolingSource::Default));
        assert!(warning.is_some());
        for dir in [qwen, mean, plain, cls] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
