//! Bad input gives an error that names the file and the tensor; never a panic.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use std::path::Path;

use crate::common::fixture;
use kiln_core::{Dtype, InferenceBackend};
use kiln_models::{LoadOptions, ModelError};
use serde_json::Value;

type B = burn::backend::Flex;

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn load_err(path: &Path) -> ModelError {
    kiln_models::load::<B>(path, &LoadOptions::default(), &B::inference_device()).unwrap_err()
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// A config.json claiming 2^62 layers (once a "capacity overflow" panic) is refused naming
/// the count, also by the families that list a window per layer before validating (2^36
/// layers of Mistral once asked for 1 TiB there; found by `fuzz::config_json`).
#[test]
fn absurd_layer_counts_are_refused() {
    for (fixture, layers) in [
        ("llama-tiny", 1u64 << 62),
        ("mistral-tiny", 1 << 62),
        ("mistral-tiny", 1 << 36),
        ("gemma2-tiny", 1 << 36),
        ("gemma3-tiny", 1 << 36),
    ] {
        let dir = copy_fixture(fixture);
        edit_json(&dir.path().join("config.json"), |c| {
            c["num_hidden_layers"] = layers.into();
        });
        let err = load_err(dir.path()).to_string();
        assert!(
            err.contains(&format!("n_layers is {layers}, more than kiln accepts")),
            "{fixture}: {err}"
        );
    }
}

#[test]
fn missing_path_and_unknown_folder() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(err.to_string().contains("/nonexistent/model"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        load_err(empty.path()),
        ModelError::UnknownFormat { .. }
    ));
}

#[test]
fn missing_weights_file_is_named() {
    let dir = copy_fixture("gpt2-tiny");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert!(matches!(err, ModelError::MissingFile { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn missing_shard_is_named() {
    let dir = copy_fixture("llama-tiny");
    std::fs::remove_file(dir.path().join("model-00002-of-00004.safetensors")).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.to_string().contains("model-00002-of-00004.safetensors"),
        "{err}"
    );
}

#[test]
fn config_that_disagrees_with_the_weights_names_file_and_tensor() {
    let dir = copy_fixture("llama-tiny");
    edit_json(&dir.path().join("config.json"), |c| {
        c["intermediate_size"] = 96.into()
    });
    let err = load_err(dir.path());
    let ModelError::ShapeMismatch {
        file,
        tensor,
        expected,
        got,
    } = &err
    else {
        panic!("expected a shape mismatch, got {err}");
    };
    assert!(file.contains(".safetensors"), "{err}");
    assert!(tensor.contains("mlp."), "{err}");
    assert_ne!(expected, got);
}

#[test]
fn unknown_architecture_is_named() {
    let dir = copy_fixture("gpt2-tiny");
    edit_json(&dir.path().join("config.json"), |c| {
        c["model_type"] = "mamba".into();
        c["architectures"] = serde_json::json!(["MambaForCausalLM"]);
    });
    let err = load_err(dir.path());
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("MambaForCausalLM"), "{err}");
}

#[test]
fn corrupt_safetensors_is_an_error() {
    let dir = copy_fixture("gpt2-tiny");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage",
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(matches!(err, ModelError::Corrupt { .. }), "{err}");
}

/// Reading each tensor of a safetensors file does not parse its header again: a 54 MiB header
/// parsed once per tensor took 7 s to load. Counted in bytes allocated, which does not depend
/// on timing: a parse of this 300 KB header allocates more than the header's size, reading one
/// tiny tensor a few hundred bytes.
#[test]
fn safetensors_headers_are_parsed_once() {
    use crate::fuzz::harness::allocated_during;
    use kiln_models::weights::{SafetensorsSource, TensorSource};

    let n = 4000;
    let entries: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#""layer.{i}.weight":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}"#,
                4 * i,
                4 * i + 4
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(vec![0u8; 4 * n]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, bytes).unwrap();

    let source = SafetensorsSource::open(&path).unwrap();
    let names = source.names();
    assert_eq!(names.len(), n);
    let ((), allocated) = allocated_during(|| {
        for name in &names {
            assert_eq!(source.read(name).unwrap().data, [0.0]);
        }
    });
    let per_tensor = allocated / n;
    assert!(
        per_tensor < 1024,
        "reading a one-value tensor allocated {per_tensor} bytes (the header is {} bytes)",
        header.len()
    );
}

/// A header length past the end of the file (or past any file) is refused before anything
/// is allocated for it, naming the file.
#[test]
fn safetensors_header_lengths_past_the_file_are_refused() {
    use kiln_models::weights::SafetensorsSource;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    for len in [64u64, 1 << 40, u64::MAX] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend(b"{}");
        std::fs::write(&path, bytes).unwrap();
        let err = SafetensorsSource::open(&path).err().unwrap().to_string();
        assert!(
            err.contains("model.safetensors") && err.contains("not a valid safetensors file"),
            "{len}: {err}"
        );
    }
}

#[test]
fn untied_config_without_head_names_the_tensor() {
    let dir = copy_fixture("llama-tiny-tied");
    edit_json(&dir.path().join("config.json"), |c| {
        c["tie_word_embeddings"] = false.into()
    });
    let err = load_err(dir.path());
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

#[test]
fn unsupported_rope_type_is_named() {
    let dir = copy_fixture("llama-tiny-tied");
    edit_json(&dir.path().join("config.json"), |c| {
        c["rope_scaling"]["rope_type"] = "mrope".into()
    });
    let err = load_err(dir.path());
    assert!(
        err.to_string().contains("`mrope`") && err.to_string().contains("config.json"),
        "{err}"
    );
    // LongRoPE without its lists of factors is named by key.
    let dir = copy_fixture("llama-tiny-tied");
    edit_json(&dir.path().join("config.json"), |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "longrope",
            "original_max_position_embeddings": 32, "short_factor": [1.0]})
    });
    let err = load_err(dir.path()).to_string();
    assert!(err.contains("`long_factor`"), "{err}");
    // YaRN without the original context it scales is named by key.
    let dir = copy_fixture("llama-tiny-tied");
    edit_json(&dir.path().join("config.json"), |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
    });
    let err = load_err(dir.path()).to_string();
    assert!(err.contains("original_max_position_embeddings"), "{err}");
}

#[test]
fn truncated_meta_checkpoint_is_an_error() {
    let dir = copy_fixture("llama-tiny-meta");
    let path = dir.path().join("consolidated.00.pth");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let err = load_err(dir.path());
    assert!(err.to_string().contains("consolidated.00.pth"), "{err}");
}

/// A `torch.distributed.checkpoint` folder cut short or edited: each error names the file
/// and, where there is one, the tensor.
#[test]
fn broken_dcp_folders_are_named() {
    use kiln_models::weights::{DcpSource, TensorSource};
    let open_err = |dir: &Path| DcpSource::open(dir).err().unwrap().to_string();

    // `.metadata` truncated: the pickle ends early.
    let dir = copy_fixture("llama-tiny-dcp");
    let path = dir.path().join(".metadata");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir.path()).to_string();
    assert!(
        err.contains(".metadata") && err.contains("truncated"),
        "{err}"
    );

    // The data file cut short: a storage range runs past its end.
    let dir = copy_fixture("llama-tiny-dcp");
    let path = dir.path().join("__0_0.distcp");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(dir.path()).to_string();
    assert!(
        err.contains("__0_0.distcp") && err.contains("past the end") && err.contains("tensor `"),
        "{err}"
    );

    // A data file `.metadata` names is gone.
    let dir = copy_fixture("dcp-chunks");
    std::fs::remove_file(dir.path().join("__1_0.distcp")).unwrap();
    let err = DcpSource::open(dir.path()).err().unwrap();
    assert!(matches!(err, ModelError::MissingFile { .. }), "{err}");
    assert!(err.to_string().contains("__1_0.distcp"), "{err}");

    // A chunk left out of its tensor's chunk list: the others do not cover it.
    let dir = copy_fixture("dcp-chunks");
    std::fs::rename(
        dir.path().join("missing-chunk.metadata"),
        dir.path().join(".metadata"),
    )
    .unwrap();
    let err = open_err(dir.path());
    assert!(
        err.contains(".metadata") && err.contains("`grid`") && err.contains("18 of its 24"),
        "{err}"
    );

    // A chunk listed without a storage entry.
    let dir = copy_fixture("dcp-chunks");
    std::fs::rename(
        dir.path().join("missing-storage.metadata"),
        dir.path().join(".metadata"),
    )
    .unwrap();
    let err = open_err(dir.path());
    assert!(
        err.contains("`grid`") && err.contains("no storage entry") && err.contains("[2, 3]"),
        "{err}"
    );

    // A chunk's bytes overwritten: its archive does not read, named with file and tensor.
    let dir = copy_fixture("dcp-chunks");
    let path = dir.path().join("__1_0.distcp");
    let mut bytes = std::fs::read(&path).unwrap();
    let end = bytes.len();
    bytes[end - 200..].fill(0);
    std::fs::write(&path, &bytes).unwrap();
    let source = DcpSource::open(dir.path()).unwrap();
    let err = source.read("grid").err().unwrap().to_string();
    assert!(
        err.contains("__1_0.distcp") && err.contains("`grid`"),
        "{err}"
    );
    assert!(source.read("rows").is_ok());
}

#[test]
fn out_of_range_input_is_an_error_not_a_panic() {
    use kiln_core::kv_cache::DynamicKvCache;
    use kiln_core::{Batch, CausalLm, LogitsFor, Position, SeqId, TokenId};
    let loaded = crate::common::load::<B>("gpt2-tiny", Dtype::F32);
    let shape = loaded.model.shape();
    let mut cache = DynamicKvCache::<B>::new(shape.kv_layout(), Dtype::F32, &B::inference_device());
    let bad_token = Batch::single(SeqId(0), &[TokenId(shape.vocab as u32)], Position(0)).unwrap();
    let err = loaded
        .model
        .forward(&bad_token, &mut cache, LogitsFor::All)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let too_far = Batch::single(
        SeqId(1),
        &[TokenId(1)],
        Position(shape.max_positions as u32),
    )
    .unwrap();
    let err = loaded
        .model
        .forward(&too_far, &mut cache, LogitsFor::All)
        .unwrap_err();
    assert!(err.to_string().contains("context"), "{err}");
}
