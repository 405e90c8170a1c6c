//! `torch.distributed.checkpoint` folders (torchtitan's checkpoints): `llama-tiny-dcp` holds
//! `llama-tiny-meta`'s weights (`scripts/reference/make_model_fixtures.py --only dcp`), so it
//! must load to the same model, and so match transformers' reference in `llama-tiny-meta`;
//! `dcp-chunks` holds tensors split into chunks as a sharded save writes them.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use crate::common::*;
use kiln_core::Dtype;
use kiln_models::weights::{DcpSource, TensorSource};
use kiln_models::{LoadOptions, ModelFormat};

type B = burn::backend::Flex;

/// The same logits as the `.pth` folder, bit for bit (same f32 weights, same path), hence
/// transformers' within 1e-4, and its greedy tokens.
#[test]
fn dcp_folder_loads_the_meta_model() {
    let dcp = load::<B>("llama-tiny-dcp", Dtype::F32);
    let meta = load::<B>("llama-tiny-meta", Dtype::F32);
    assert_eq!(dcp.format, ModelFormat::TorchDistributed);
    assert_eq!(dcp.format.name(), "torch-dcp");
    assert_eq!(dcp.model.config(), meta.model.config());
    assert_eq!(dcp.generation, meta.generation);
    assert_eq!(dcp.chat_template, meta.chat_template);
    let (dcp_tok, meta_tok) = (dcp.tokenizer.unwrap(), meta.tokenizer.unwrap());
    assert_eq!(
        dcp_tok.encode("The quick brown fox", true).unwrap(),
        meta_tok.encode("The quick brown fox", true).unwrap()
    );
    let (_, cases) = reference("llama-tiny-meta");
    for (i, case) in cases.iter().enumerate() {
        let ours = all_logits(&dcp.model, &case.prompt);
        assert_eq!(ours, all_logits(&meta.model, &case.prompt), "prompt {i}");
        let diff = max_abs_diff(&ours, &case.logits);
        assert!(
            diff <= 1e-4,
            "prompt {i}: max |diff| {diff} from transformers"
        );
        let greedy = greedy_cached(&dcp.model, &case.prompt, case.greedy.len());
        assert_eq!(greedy, case.greedy, "prompt {i}: greedy");
    }
}

/// `kiln info`'s view: the Meta folder's configuration, types and tokenizer, this folder's
/// format and bytes.
#[test]
fn inspect_reads_the_folder_without_its_weights() {
    let options = LoadOptions::default();
    let path = fixture("llama-tiny-dcp");
    let info = kiln_models::inspect(&path, &options).unwrap();
    let meta = kiln_models::inspect(&fixture("llama-tiny-meta"), &options).unwrap();
    assert_eq!(info.format, ModelFormat::TorchDistributed);
    assert_eq!(info.config, meta.config);
    assert_eq!(info.stored_types, meta.stored_types);
    assert_eq!(info.tokenizer, meta.tokenizer);
    assert!(info.chat_template);
    let bytes: u64 = [".metadata", "__0_0.distcp"]
        .iter()
        .map(|f| std::fs::metadata(path.join(f)).unwrap().len())
        .sum();
    assert_eq!(info.file_bytes, bytes);
    assert_eq!(
        kiln_models::loaders::read_config(&path, &options).unwrap(),
        meta.config
    );
}

/// Chunks split along rows (bf16), along columns with one chunk stored column-major (f16),
/// in a 2x2 grid over two data files (f32), and a 0-d tensor come back whole; the bytes entry
/// is skipped and `model.` is dropped from names. Element `k` of each tensor is `k / 4 - 1`.
#[test]
fn chunks_are_reassembled_into_tensors() {
    let source = DcpSource::open(&fixture("dcp-chunks")).unwrap();
    let mut names = source.names();
    names.sort();
    assert_eq!(names, ["cols", "grid", "rows", "scalar"]);
    for (name, shape) in [
        ("rows", vec![6, 4]),
        ("cols", vec![3, 5]),
        ("grid", vec![4, 6]),
        ("scalar", vec![]),
    ] {
        let tensor = source.read(name).unwrap();
        assert_eq!(tensor.shape, shape, "{name}");
        let n: usize = shape.iter().product();
        let expected: Vec<f32> = (0..n).map(|k| k as f32 / 4.0 - 1.0).collect();
        assert_eq!(tensor.data, expected, "{name}");
    }
    assert_eq!(
        source.stored_types(),
        [
            ("F32".to_string(), 25),
            ("BF16".to_string(), 24),
            ("F16".to_string(), 15)
        ]
    );
    assert!(!source.contains("train_state"));
}
