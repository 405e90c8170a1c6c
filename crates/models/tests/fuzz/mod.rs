//! The file readers under the mutation fuzzer ([`harness`]): GGUF files (the container, every
//! tensor read, `inspect` and a whole load), safetensors files (the header, every tensor, a
//! whole Hugging Face load) and `config.json` (every family's, then `inspect` and a load when
//! it validates). Each runs ~10 s (`KILN_FUZZ_SECONDS`): on a 2-core machine some 20,000
//! GGUF inputs, of which one in ten parses and most of those load, and as many `config.json`
//! inputs, of which one in twelve validates. A longer run:
//!
//! ```text
//! KILN_FUZZ_SECONDS=600 cargo test --profile ci --locked -p kiln-models --no-default-features \
//!     --features kiln-core/cpu,kiln-core/ndarray --test integration -- fuzz
//! ```

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

pub mod harness;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use harness::{Fields, Guard, Seed, Target, fuzz, peak_of};
use kiln_models::LoadOptions;
use kiln_models::gguf::{self, GgufFile, HEADER_MEMORY_FACTOR, HEADER_MEMORY_SLACK};
use kiln_models::weights::{SafetensorsSource, TensorSource};

use crate::common::fixture;

#[global_allocator]
static GUARD: Guard = Guard;

type B = burn::backend::Flex;

/// No input of these few hundred kilobytes needs more in one piece; a lying size asks for far
/// more.
const MAX_ALLOC: usize = 256 << 20;

/// Loads the model at `path` on the cpu; any error is fine.
fn try_load(path: &Path) {
    let options = LoadOptions::default();
    let _ = kiln_models::inspect(path, &options);
    let _ = kiln_models::load::<B>(path, &options, &Default::default());
}

/// A copy of a fixture folder without its reference outputs, to overwrite one file in.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        let file = entry.file_name().to_string_lossy().into_owned();
        if !(file.contains("reference") || file.starts_with("logits")) {
            std::fs::copy(entry.path(), dir.path().join(&file)).unwrap();
        }
    }
    dir
}

/// Where a GGUF file's fields are: counts, key and string lengths, value types, 32- and
/// 64-bit values, array counts (of the first items of each array), and every tensor info's
/// name length, rank, dimensions, type and data offset.
fn gguf_fields(b: &[u8]) -> Fields {
    let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let mut f = Fields {
        u64s: vec![8, 16],
        ..Fields::default()
    };
    fn value(b: &[u8], f: &mut Fields, at: &mut usize, ty: u32, record: bool) {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => *at += 1,
            2 | 3 => *at += 2,
            4..=6 => {
                if record {
                    f.u32s.push(*at);
                }
                *at += 4;
            }
            10..=12 => {
                if record {
                    f.u64s.push(*at);
                }
                *at += 8;
            }
            8 => {
                if record {
                    f.u64s.push(*at);
                }
                *at += 8 + u64_at(*at);
            }
            _ => {
                if record {
                    f.u32s.push(*at);
                    f.u64s.push(*at + 4);
                }
                let (item, n) = (u32_at(*at), u64_at(*at + 4));
                *at += 12;
                for i in 0..n {
                    value(b, f, at, item, record && i < 4);
                }
            }
        }
    }
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut at = 24;
    for _ in 0..n_kv {
        f.u64s.push(at);
        at += 8 + u64_at(at);
        f.u32s.push(at);
        let ty = u32_at(at);
        at += 4;
        value(b, &mut f, &mut at, ty, true);
    }
    for _ in 0..n_tensors {
        f.u64s.push(at);
        at += 8 + u64_at(at);
        f.u32s.push(at);
        let rank = u32_at(at) as usize;
        at += 4;
        for _ in 0..rank {
            f.u64s.push(at);
            at += 8;
        }
        f.u32s.push(at);
        f.u64s.push(at + 4);
        at += 12;
    }
    f.header_end = at;
    f
}

fn gguf_seed(name: &str) -> Seed {
    let bytes = std::fs::read(fixture(&format!("gguf/{name}"))).unwrap();
    Seed {
        name: name.to_string(),
        fields: gguf_fields(&bytes),
        bytes,
    }
}

/// Where a safetensors file's fields are: the header's length and its JSON.
fn safetensors_seed(path: &str) -> Seed {
    let bytes = std::fs::read(fixture(path)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    Seed {
        name: path.to_string(),
        fields: Fields {
            u64s: vec![0],
            json: Some(8..8 + n),
            json_len_at: Some(0),
            header_end: 8 + n,
            ..Fields::default()
        },
        bytes,
    }
}

/// GGUF files: the container parses in memory in proportion to its header (the documented
/// bound), then every tensor is read, the file inspected and loaded.
#[test]
fn gguf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    let run = |_: &Seed, input: &[u8]| {
        let (parsed, peak) = peak_of(|| gguf::parse::parse(input));
        let bound = HEADER_MEMORY_FACTOR * input.len() + HEADER_MEMORY_SLACK;
        assert!(
            peak <= bound,
            "parsing held {peak} bytes for a file of {}",
            input.len()
        );
        if parsed.is_err() {
            return;
        }
        std::fs::write(&path, input).unwrap();
        if let Ok(file) = GgufFile::open(&path) {
            for info in file.tensors() {
                let _ = file.read(&info.name);
                let _ = file.read_quantized(&info.name);
            }
            let _ = file.stored_types();
        }
        try_load(&path);
    };
    fuzz(&Target {
        name: "gguf",
        seeds: [
            "tiny-llama.gguf",
            "qwen2-tiny.q8_0.gguf",
            "gpt2-tiny.q8_0.gguf",
            "gemma2-tiny.q8_0.gguf",
            "phi3-tiny.q8_0.gguf",
            "llama2-tiny.f32.gguf",
        ]
        .into_iter()
        .map(gguf_seed)
        .collect(),
        max_alloc: MAX_ALLOC,
        run: &run,
    });
}

/// safetensors files: the header, every tensor, and a whole GPT-2 load around the file.
#[test]
fn safetensors() {
    let dir = copy_fixture("gpt2-tiny");
    let path = dir.path().join("model.safetensors");
    let run = |_: &Seed, input: &[u8]| {
        std::fs::write(&path, input).unwrap();
        let (source, peak) = peak_of(|| SafetensorsSource::open(&path));
        assert!(
            peak <= 16 * input.len() + (1 << 20),
            "opening held {peak} bytes for a file of {}",
            input.len()
        );
        if let Ok(source) = source {
            for name in source.names() {
                let _ = source.read(&name);
            }
            let _ = source.stored_types();
        }
        try_load(dir.path());
    };
    fuzz(&Target {
        name: "safetensors",
        seeds: [
            "gpt2-tiny/model.safetensors",
            "llama-tiny-tied/model.safetensors",
            "llama-tiny/model-00003-of-00004.safetensors",
        ]
        .into_iter()
        .map(safetensors_seed)
        .collect(),
        max_alloc: MAX_ALLOC,
        run: &run,
    });
}

/// Every family's `config.json`: read and validated, and where it validates, the folder
/// inspected and loaded against the fixture's weights.
#[test]
fn config_json() {
    let folders: Vec<&str> = crate::common::FIXTURES
        .into_iter()
        .filter(|name| fixture(name).join("config.json").exists())
        .collect();
    let dirs: HashMap<String, tempfile::TempDir> = folders
        .iter()
        .map(|name| (name.to_string(), copy_fixture(name)))
        .collect();
    let run = |seed: &Seed, input: &[u8]| {
        let dir: PathBuf = dirs[&seed.name].path().to_path_buf();
        std::fs::write(dir.join("config.json"), input).unwrap();
        if let Ok(config) = kiln_models::loaders::read_config(&dir, &LoadOptions::default()) {
            let _ = config.parameters();
            try_load(&dir);
        }
    };
    fuzz(&Target {
        name: "config_json",
        seeds: folders
            .iter()
            .map(|name| {
                let bytes = std::fs::read(fixture(name).join("config.json")).unwrap();
                Seed {
                    name: name.to_string(),
                    fields: Fields {
                        json: Some(0..bytes.len()),
                        header_end: bytes.len(),
                        ..Fields::default()
                    },
                    bytes,
                }
            })
            .collect(),
        max_alloc: MAX_ALLOC,
        run: &run,
    });
}
