//! GGUF: dequantization against the python `gguf` package, the container's handling of
//! corrupt and truncated files, and a tiny Llama GGUF against transformers loading the same
//! file (`scripts/reference/make_gguf_fixtures.py`).

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use crate::common::*;
use kiln_core::{Dtype, InferenceBackend, TokenId};
use kiln_models::gguf::{GgmlType, GgufFile, dequantize, parse};
use kiln_models::{ModelError, ModelFormat, TextTokenizer};
use proptest::prelude::*;
use serde_json::Value;

fn tiny_path() -> std::path::PathBuf {
    fixture("gguf/tiny-llama.gguf")
}

fn tiny_bytes() -> Vec<u8> {
    std::fs::read(tiny_path()).unwrap()
}

fn json(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(path)).unwrap()).unwrap()
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Every type's sample blocks dequantize to `gguf.quants.dequantize`'s values. The tolerance is
/// one part in 10^6: gguf-py multiplies in numpy's order and a compiler may fuse a multiply-add.
#[test]
fn dequantization_matches_gguf_py() {
    let samples = json("gguf/quants.json");
    let samples = samples["samples"].as_array().unwrap();
    assert_eq!(samples.len(), GgmlType::ALL.len());
    for sample in samples {
        let name = sample["type"].as_str().unwrap();
        let ty = GgmlType::from_id(sample["ggml_type"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(ty.name(), name);
        assert_eq!(
            ty.block_size() as u64,
            sample["block_size"].as_u64().unwrap()
        );
        assert_eq!(ty.type_size() as u64, sample["type_size"].as_u64().unwrap());
        let bytes = hex(sample["hex"].as_str().unwrap());
        let expected: Vec<f32> = sample["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut ours = vec![0f32; expected.len()];
        dequantize(ty, &bytes, &mut ours);
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{name} value {i}: kiln {a}, gguf-py {b}"
            );
        }
    }
}

#[test]
fn the_tiny_file_parses_as_v3_and_v2() {
    let bytes = tiny_bytes();
    let v3 = parse::parse(&bytes).unwrap();
    assert_eq!(v3.version, 3);
    let reference = json("gguf/tiny-llama.reference.json");
    let types = reference["tensor_types"].as_object().unwrap();
    assert_eq!(v3.tensors.len(), types.len());
    for tensor in &v3.tensors {
        assert_eq!(
            tensor.ggml_type.name(),
            types[&tensor.name].as_str().unwrap(),
            "{}",
            tensor.name
        );
    }
    // v2 differs from v3 only in allowing big-endian files; the layout is the same.
    let mut v2 = bytes.clone();
    v2[4..8].copy_from_slice(&2u32.to_le_bytes());
    let parsed = parse::parse(&v2).unwrap();
    assert_eq!((parsed.version, parsed.tensors), (2, v3.tensors));
}

fn parse_error(bytes: &[u8]) -> String {
    parse::parse(bytes).unwrap_err().to_string()
}

#[test]
fn unsupported_versions_and_byte_orders_are_named() {
    let bytes = tiny_bytes();
    let mut v1 = bytes.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(parse_error(&v1).contains("version 1 is not supported"));
    let mut big = bytes.clone();
    big[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(parse_error(&big).contains("big-endian"));
    assert!(parse_error(b"PK\x03\x04 not gguf").contains("not a GGUF file"));
}

/// A file cut anywhere before the end of its last tensor is an error naming a byte offset.
#[test]
fn every_truncation_is_an_error_with_an_offset() {
    let bytes = tiny_bytes();
    let header = parse::parse(&bytes).unwrap();
    let data_end = header.tensors.iter().map(|t| t.data.end).max().unwrap();
    let cuts = (0..header.data_offset + 64).chain((header.data_offset..data_end).step_by(997));
    for len in cuts {
        let err = parse::parse(&bytes[..len]).unwrap_err();
        assert!(
            err.offset <= len,
            "cut at {len}: offset {} past the end",
            err.offset
        );
        assert!(!err.reason.is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random bytes overwritten anywhere in the header never panic or read out of bounds;
    /// what parses has every tensor inside the file.
    #[test]
    fn mutated_headers_never_panic(edits in prop::collection::vec((0usize..4096, any::<u8>()), 1..8)) {
        let mut bytes = tiny_bytes();
        let header_len = parse::parse(&bytes).unwrap().data_offset;
        for (at, value) in edits {
            let at = at % header_len;
            bytes[at] = value;
        }
        if let Ok(header) = parse::parse(&bytes) {
            for t in &header.tensors {
                prop_assert!(t.data.end <= bytes.len());
                prop_assert_eq!(t.ggml_type.bytes_for(t.len()), Some(t.data.len()));
            }
        }
    }
}

/// Writes `bytes` to a temporary `.gguf` and loads it on cpu.
fn load_bytes(bytes: &[u8]) -> Result<(), ModelError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    kiln_models::load::<burn::backend::Flex>(&path, &Default::default(), &Default::default())
        .map(|_| ())
}

fn replace(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
    let mut out = bytes.to_vec();
    out[at..at + to.len()].copy_from_slice(to);
    out
}

#[test]
fn unsupported_architectures_pre_tokenizers_and_types_are_named() {
    let bytes = tiny_bytes();
    let arch = load_bytes(&replace(
        &bytes,
        b"\x05\0\0\0\0\0\0\0llama",
        b"\x05\0\0\0\0\0\0\0mamba",
    ))
    .unwrap_err();
    assert!(
        matches!(arch, ModelError::UnsupportedArchitecture { .. }),
        "{arch}"
    );
    assert!(arch.to_string().contains("`mamba`"), "{arch}");

    let pre = load_bytes(&replace(&bytes, b"llama-bpe", b"llama-xyz")).unwrap_err();
    assert!(
        pre.to_string().contains("`llama-xyz` is not supported"),
        "{pre}"
    );

    // The type field follows the name, the rank and two dimensions; 16 is IQ2_XXS.
    let name = b"blk.0.attn_v.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 16;
    let mut iq2 = bytes.clone();
    iq2[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
    let err = load_bytes(&iq2).unwrap_err();
    assert!(
        err.to_string()
            .contains("`blk.0.attn_v.weight` is stored as IQ2_XXS"),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let bytes = tiny_bytes();
    let err = load_bytes(&replace(
        &bytes,
        b"blk.1.ffn_up.weight",
        b"blk.1.ffn_UP.weight",
    ))
    .unwrap_err();
    assert!(
        err.to_string().contains("no tensor `blk.1.ffn_up.weight`"),
        "{err}"
    );
}

/// The tiny GGUF's tokenizer gives the prompt ids transformers gives.
#[test]
fn tiny_tokenizer_matches_transformers() {
    let file = GgufFile::open(&tiny_path()).unwrap();
    let tokenizer = TextTokenizer::from_gguf(&file).unwrap();
    for case in json("gguf/tiny-llama.reference.json")["cases"]
        .as_array()
        .unwrap()
    {
        let text = case["prompt_text"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            ids(&case["prompt_ids"]),
            "{text:?}"
        );
    }
}

/// kiln on the tiny GGUF equals transformers on the same file: last-position logits within
/// 1e-4 and 20 greedy tokens, which also checks the Q/K permutation and `rope_freqs`.
fn tiny_llama_matches_transformers<B: InferenceBackend>(loaded: &kiln_models::LoadedModel<B>) {
    assert_eq!(loaded.format, ModelFormat::Gguf);
    let reference = json("gguf/tiny-llama.reference.json");
    // `<|eot_id|>` (the file's EOS), then what llama.cpp also ends on by text: its
    // `print_info` lists EOG tokens 385 `<|end_of_text|>`, 392 `<|eom_id|>`, 393.
    assert_eq!(
        loaded.generation.eos,
        vec![TokenId(393), TokenId(385), TokenId(392)]
    );
    assert!(loaded.generation.add_bos);
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let logits = all_logits(&loaded.model, &prompt);
        let vocab = loaded.model.config().vocab;
        let last = &logits[logits.len() - vocab..];
        let expected: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let diff = max_abs_diff(last, &expected);
        assert!(diff <= 1e-4, "case {i}: max |diff| {diff}");
        let greedy = ids(&case["greedy"]);
        assert_eq!(
            greedy_cached(&loaded.model, &prompt, greedy.len()),
            greedy,
            "case {i}"
        );
    }
}

#[test]
fn tiny_llama_matches_transformers_on_cpu() {
    tiny_llama_matches_transformers(&load::<burn::backend::Flex>(
        "gguf/tiny-llama.gguf",
        Dtype::F32,
    ));
}

/// The tiny GGUF with its Q8_0 weights kept in their blocks on a GPU backend (multiplied by
/// kiln-cube's kernels, f32 activations): still transformers' logits within 1e-4, since the
/// blocks decode exactly and the sums run in f32.
fn tiny_llama_quantized_on_the_device<B: InferenceBackend>() {
    let options = kiln_models::LoadOptions {
        dtype: Dtype::F32,
        weights: kiln_models::WeightStorage::Quantized,
        ..Default::default()
    };
    let loaded = kiln_models::load::<B>(&tiny_path(), &options, &B::inference_device()).unwrap();
    let kinds = loaded.model.weight_summary();
    assert!(
        kinds.iter().any(|(kind, _, _)| kind == "Q8_0 (quantized)"),
        "{kinds:?}"
    );
    tiny_llama_matches_transformers(&loaded);
}

#[test]
fn tiny_llama_quantized_on_wgpu_matches_transformers() {
    tiny_llama_quantized_on_the_device::<burn::backend::Wgpu>();
}

#[cfg(feature = "cuda")]
#[test]
fn tiny_llama_quantized_on_cuda_matches_transformers() {
    if cuda_here("tiny_llama_quantized_on_cuda_matches_transformers") {
        tiny_llama_quantized_on_the_device::<burn::backend::Cuda>();
    }
}

/// Families' F16 and BF16 files (llama-quantize of the F32 files, `make_family_ggufs.py`):
/// kept in 16 bits on the cpu backend (`WeightStorage::Quantized`) every weight widens exactly
/// and the sums run in f32, so the logits are the same file's on the exact path (weights
/// widened to f32 at load) within 1e-4, with the same greedy tokens. Against transformers on the F32 model they carry the weights' own
/// rounding: mean KL printed, and within docs/kernels.md's bound. qwen2-tiny's file has Q/K/V
/// biases; phi3-tiny's fused QKV and gate/up projections.
#[test]
fn sixteen_bit_ggufs_compute_as_their_widened_weights_on_cpu() {
    type B = burn::backend::Flex;
    let options = |weights| kiln_models::LoadOptions {
        dtype: Dtype::F32,
        weights,
        ..Default::default()
    };
    let device = <B as InferenceBackend>::inference_device();
    for (name, ty) in [("qwen2-tiny", "F16"), ("phi3-tiny", "BF16")] {
        let path = fixture(&format!("gguf/{name}.{}.gguf", ty.to_lowercase()));
        let kept_options = options(kiln_models::WeightStorage::Quantized);
        let kept = kiln_models::load::<B>(&path, &kept_options, &device).unwrap();
        let kinds = kept.model.weight_summary();
        assert!(
            kinds
                .iter()
                .all(|(kind, _, _)| *kind == format!("{ty} (16-bit)")),
            "{name}: {kinds:?}"
        );
        let exact_options = options(kiln_models::WeightStorage::Dequantized);
        let exact = kiln_models::load::<B>(&path, &exact_options, &device).unwrap();
        assert!(!exact.model.holds_quantized_weights());
        let dir = fixture("gguf");
        let (_, cases) = reference_at(
            &dir.join(format!("{name}.reference.json")),
            &dir.join(format!("{name}.logits.safetensors")),
        );
        let vocab = kept.model.config().vocab;
        let (mut kl, mut agree, mut positions) = (0.0, 0, 0);
        for (i, case) in cases.iter().enumerate() {
            let ours = all_logits(&kept.model, &case.prompt);
            let diff = max_abs_diff(&ours, &all_logits(&exact.model, &case.prompt));
            assert!(diff <= 1e-4, "{name} {ty} case {i}: max |diff| {diff}");
            let n = case.greedy.len();
            assert_eq!(
                greedy_cached(&kept.model, &case.prompt, n),
                greedy_cached(&exact.model, &case.prompt, n),
                "{name} {ty} case {i}"
            );
            let (k, a, p) = divergence(&case.logits, &ours, vocab);
            (kl, agree, positions) = (kl + k, agree + a, positions + p);
        }
        let (kl, top1) = (kl / positions as f64, agree as f64 / positions as f64);
        eprintln!(
            "{name} {ty} against transformers on the F32 model: mean KL {kl:.2e}, top-1 {:.1} % \
             of {positions} positions",
            top1 * 100.0
        );
        assert!(kl <= 2e-3, "{name} {ty}: mean KL {kl}");
    }
}

/// On a GPU backend a 16-bit file's weights are held dense in the model's dtype
/// (`KEEPS_16_BIT_WEIGHTS` is false there), with no second copy in host memory.
#[test]
fn sixteen_bit_ggufs_are_dense_on_wgpu() {
    type B = burn::backend::Wgpu;
    let options = kiln_models::LoadOptions {
        dtype: Dtype::F32,
        weights: kiln_models::WeightStorage::Quantized,
        ..Default::default()
    };
    let path = fixture("gguf/qwen2-tiny.f16.gguf");
    let loaded = kiln_models::load::<B>(&path, &options, &B::inference_device()).unwrap();
    let kinds = loaded.model.weight_summary();
    assert!(kinds.iter().all(|(kind, _, _)| kind == "f32"), "{kinds:?}");
}

/// Each family's GGUF as llama.cpp's converter writes it (`make_family_ggufs.py`), from its HF
/// fixture: the F32 file gives transformers' logits on every position (within 1e-4) and its
/// greedy tokens, with the family's names, key prefix and Q/K row order. Its vocabulary
/// tokenizes as llama.cpp does: for the byte-level BPE files that is the HF `tokenizer.json`'s
/// tokenization (on text already in NFC: llama.cpp applies none, the HF file does, and the
/// fixture's one decomposed case, `e` + U+0301, tells them apart); for the SentencePiece file
/// files (llama2-tiny, phi3-tiny) the GGUF reference's own cases, which differ from
/// transformers' where llama.cpp puts a space before text that follows a special token or
/// starts with spaces, and for Phi-3 drops the whitespace after its chat tokens. phi3-tiny's
/// file has fused QKV and gate/up projections, LongRoPE factors as tensors, a sliding window
/// and a vocabulary padded past the tokenizer's (`[PAD…]` pieces). qwen2-yarn-tiny is
/// qwen2-tiny with YaRN (original context 32, factor 4), read from the converter's
/// `rope.scaling.*` keys as llama.cpp reads them.
#[test]
fn family_ggufs_match_transformers_on_cpu() {
    for (name, family) in [
        ("qwen2-tiny", "qwen2"),
        ("qwen3-tiny", "qwen3"),
        ("llama2-tiny", "llama"),
        ("phi3-tiny", "phi3"),
        ("gemma2-tiny", "gemma2"),
        ("gemma3-tiny", "gemma3_text"),
        ("gpt2-tiny", "gpt2"),
        ("gpt-bigcode-tiny", "gpt_bigcode"),
        ("qwen2-yarn-tiny", "qwen2"),
    ] {
        let loaded = load::<burn::backend::Flex>(&format!("gguf/{name}.f32.gguf"), Dtype::F32);
        assert_eq!(loaded.model.config().architecture.name(), family);
        let dir = fixture("gguf");
        let (gguf_reference, cases) = reference_at(
            &dir.join(format!("{name}.reference.json")),
            &dir.join(format!("{name}.logits.safetensors")),
        );
        for (i, case) in cases.iter().enumerate() {
            let diff = max_abs_diff(&all_logits(&loaded.model, &case.prompt), &case.logits);
            assert!(diff <= 1e-4, "{name} case {i}: max |diff| {diff}");
            let greedy = greedy_cached(&loaded.model, &case.prompt, case.greedy.len());
            assert_eq!(greedy, case.greedy, "{name} case {i}");
        }
        let tokenizer = loaded.tokenizer.as_ref().unwrap();
        let tokenizer_cases = match gguf_reference.get("tokenizer_cases") {
            Some(cases) => cases.clone(),
            None => reference(name).0["tokenizer_cases"].clone(),
        };
        for case in tokenizer_cases.as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            if !text.contains('\u{301}') {
                assert_eq!(
                    tokenizer.encode(text, true).unwrap(),
                    ids(&case["ids"]),
                    "{name}: {text:?}"
                );
            }
        }
    }
}

/// The SentencePiece GGUF's framing and pieces as llama.cpp reads them: BOS added
/// (`add_bos_token`), `</s>` ends a reply, decoding drops the space the encoder put
/// first, byte pieces mean their bytes, control pieces are special. (Text after an added
/// token does not round-trip: like llama.cpp, the encoder puts a space before it.)
#[test]
fn sentencepiece_gguf_frames_and_decodes_as_llama_cpp() {
    let loaded = load::<burn::backend::Flex>("gguf/llama2-tiny.f32.gguf", Dtype::F32);
    assert!(loaded.generation.add_bos);
    assert_eq!(loaded.generation.bos, Some(TokenId(1)));
    assert_eq!(loaded.generation.eos, vec![TokenId(2)]);
    assert!(loaded.chat_template.as_deref().unwrap().contains("[INST]"));
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    for text in [
        "Hello  world\n",
        "  two leading",
        "naïve café 🙂",
        "日本語 x",
    ] {
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
    let texts = tokenizer.token_texts(tokenizer.vocab_size());
    assert_eq!(texts[1], kiln_core::ids::TokenText::Special("<s>".into()));
    let newline = tokenizer.token_id("<0x0A>").unwrap();
    assert_eq!(
        texts[newline.0 as usize],
        kiln_core::ids::TokenText::Bytes(b"\n".to_vec())
    );
}

/// Hyper-parameters that lie are refused before anything is allocated: 2^32 - 1 layers
/// (which once asked the allocator for 20 TB and aborted), a negative RoPE base, a NaN norm
/// epsilon (which loaded and generated garbage).
#[test]
fn lying_hyper_parameters_are_refused() {
    let bytes = std::fs::read(fixture("gguf/qwen2-tiny.f32.gguf")).unwrap();
    // A scalar's value after its key: the type (u32), then the value.
    let patched = |key: &[u8], kind: u8, value: [u8; 4]| {
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
        assert_eq!(&bytes[at..at + 4], &[kind, 0, 0, 0], "{key:?}");
        let mut out = bytes.clone();
        out[at + 4..at + 8].copy_from_slice(&value);
        out
    };
    for (key, kind, value, expected) in [
        (
            &b"qwen2.block_count"[..],
            4,
            u32::MAX.to_le_bytes(),
            "n_layers is 4294967295, more than kiln accepts (4096)",
        ),
        (
            b"qwen2.rope.freq_base",
            6,
            (-1.0f32).to_le_bytes(),
            "the RoPE base (rope_theta) must be positive and finite, got -1",
        ),
        (
            b"qwen2.attention.layer_norm_rms_epsilon",
            6,
            f32::NAN.to_le_bytes(),
            "the norm epsilon must be positive and finite, got NaN",
        ),
    ] {
        let err = load_bytes(&patched(key, kind, value))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{err}");
    }
}

/// Nonsense YaRN values in a GGUF are refused naming the key: a negative factor, an original
/// context of 0.
#[test]
fn yarn_metadata_errors_are_named() {
    let bytes = std::fs::read(fixture("gguf/qwen2-yarn-tiny.f32.gguf")).unwrap();
    // A scalar's value after its key: the type (u32), then the value.
    let value_at =
        |key: &[u8]| bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();

    let at = value_at(b"qwen2.rope.scaling.factor");
    assert_eq!(&bytes[at..at + 4], &[6, 0, 0, 0], "an f32");
    let mut negative = bytes.clone();
    negative[at + 4..at + 8].copy_from_slice(&(-4.0f32).to_le_bytes());
    let err = load_bytes(&negative).unwrap_err().to_string();
    assert!(
        err.contains("qwen2.rope.scaling.factor must be a positive number, got -4"),
        "{err}"
    );

    let at = value_at(b"qwen2.rope.scaling.original_context_length");
    assert_eq!(&bytes[at..at + 4], &[4, 0, 0, 0], "a u32");
    let mut zero = bytes.clone();
    zero[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    let err = load_bytes(&zero).unwrap_err().to_string();
    assert!(
        err.contains("qwen2.rope.scaling.original_context_length must be between 1"),
        "{err}"
    );
}

/// A SentencePiece vocabulary whose metadata lies is refused, naming the key and entry: a NaN
/// score, an unknown token type, a BOS asked for and not named.
#[test]
fn sentencepiece_metadata_errors_are_named() {
    let bytes = std::fs::read(fixture("gguf/llama2-tiny.f32.gguf")).unwrap();
    // An array's header after its key: ARRAY (9), the element type, the count (u64).
    let array_at =
        |key: &[u8]| bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();

    let at = array_at(b"tokenizer.ggml.scores");
    assert_eq!(&bytes[at..at + 8], &[9, 0, 0, 0, 6, 0, 0, 0], "f32 scores");
    let mut nan_score = bytes.clone();
    nan_score[at + 16..at + 20].copy_from_slice(&f32::NAN.to_le_bytes());
    let err = load_bytes(&nan_score).unwrap_err();
    assert!(
        err.to_string()
            .contains("`tokenizer.ggml.scores`[0] is not a number"),
        "{err}"
    );

    let at = array_at(b"tokenizer.ggml.token_type");
    assert_eq!(&bytes[at..at + 8], &[9, 0, 0, 0, 5, 0, 0, 0], "i32 types");
    let mut bad_type = bytes.clone();
    bad_type[at + 16..at + 20].copy_from_slice(&9i32.to_le_bytes());
    let err = load_bytes(&bad_type).unwrap_err();
    assert!(
        err.to_string()
            .contains("`tokenizer.ggml.token_type`[0] is 9, not a token type"),
        "{err}"
    );

    // BOS asked for (`add_bos_token`) but not named.
    let no_bos = replace(
        &bytes,
        b"tokenizer.ggml.bos_token_id",
        b"tokenizer.ggml.bos_token_xx",
    );
    let err = load_bytes(&no_bos).unwrap_err();
    assert!(
        err.to_string()
            .contains("prompts are to start or end with BOS")
            && err.to_string().contains("no `tokenizer.ggml.bos_token_id`"),
        "{err}"
    );
}

/// The families' Q8_0 files (llama-quantize), kept in their blocks on the cpu fast path,
/// against the F32 files on the exact path: mean KL divergence within docs/kernels.md's bound.
/// Against the same Q8_0 file on the exact path (its blocks dequantized to f32), the top token
/// is the same wherever the exact path's choice is clear (its top-2 margin above 0.05; the
/// tiny random models have near ties, where 8-bit activations may flip it). Flips against the
/// F32 file are the weights' own (phi3-tiny's widest, at margin 0.082, is transformers' too
/// on the dequantized Q8_0 weights) and are printed, not bounded.
#[test]
fn family_ggufs_quantized_track_the_f32_files() {
    type B = burn::backend::Flex;
    let quantized = kiln_models::LoadOptions {
        dtype: Dtype::F32,
        weights: kiln_models::WeightStorage::Quantized,
        ..Default::default()
    };
    // The exact path's top-2 margin where `q`'s top token differs from `p`'s (0 if never).
    let widest_flip = |p: &[f32], q: &[f32], vocab: usize| {
        let mut widest = 0.0f32;
        for (p, q) in p.chunks(vocab).zip(q.chunks(vocab)) {
            let top = kiln_core::sampling::first_max_index(p);
            if top != kiln_core::sampling::first_max_index(q) {
                let second = (0..vocab)
                    .filter(|&i| i != top)
                    .map(|i| p[i])
                    .fold(f32::MIN, f32::max);
                widest = widest.max(p[top] - second);
            }
        }
        widest
    };
    for name in [
        "qwen2-tiny",
        "qwen3-tiny",
        "phi3-tiny",
        "gemma2-tiny",
        "gemma3-tiny",
        "gpt2-tiny",
        "gpt-bigcode-tiny",
    ] {
        let exact = load::<B>(&format!("gguf/{name}.f32.gguf"), Dtype::F32);
        let path = fixture(&format!("gguf/{name}.q8_0.gguf"));
        let ours = kiln_models::load::<B>(&path, &quantized, &Default::default()).unwrap();
        assert!(ours.model.holds_quantized_weights());
        let blocks_exact = load::<B>(&format!("gguf/{name}.q8_0.gguf"), Dtype::F32);
        assert!(!blocks_exact.model.holds_quantized_weights());
        let vocab = exact.model.config().vocab;
        let (mut kl, mut agree, mut positions) = (0.0, 0, 0);
        let (mut weights_flip, mut kernel_flip) = (0.0f32, 0.0f32);
        for case in reference(name).1 {
            let p = all_logits(&exact.model, &case.prompt);
            let q = all_logits(&ours.model, &case.prompt);
            let (k, a, n) = divergence(&p, &q, vocab);
            (kl, agree, positions) = (kl + k, agree + a, positions + n);
            weights_flip = weights_flip.max(widest_flip(&p, &q, vocab));
            let same_weights = all_logits(&blocks_exact.model, &case.prompt);
            kernel_flip = kernel_flip.max(widest_flip(&same_weights, &q, vocab));
        }
        let (kl, top1) = (kl / positions as f64, agree as f64 / positions as f64);
        eprintln!(
            "{name} Q8_0 against F32: mean KL {kl:.2e}, top-1 {:.1} % of {positions} positions, \
             widest exact-path margin among the flips {weights_flip:.4} (against the Q8_0 \
             weights dequantized: {kernel_flip:.4})",
            top1 * 100.0
        );
        assert!(kl <= 2e-3, "{name}: mean KL {kl}");
        assert!(
            kernel_flip <= 0.05,
            "{name}: a top token with margin {kernel_flip} flipped against the same weights"
        );
    }
}

/// `inspect` reads what a model is without loading it: the configuration's parameter count
/// equals the elements stored in the weight files (which transformers wrote with every
/// parameter once), in every format.
#[test]
fn inspect_counts_what_the_files_hold() {
    let options = kiln_models::LoadOptions::default();
    for name in [
        "llama-tiny",
        "llama-tiny-tied",
        "gpt2-tiny",
        "llama-tiny-meta",
        "gguf/tiny-llama.gguf",
    ] {
        let info = kiln_models::inspect(&fixture(name), &options).unwrap();
        let stored: usize = info
            .stored_types
            .iter()
            .map(|(_, n)| n)
            .sum::<usize>()
            // GGUF's precomputed RoPE divisors are not a parameter.
            - GgufFile::open(&fixture(name))
                .ok()
                .and_then(|f| f.tensor_info("rope_freqs.weight").map(|t| t.len()))
                .unwrap_or(0);
        assert_eq!(info.config.parameters(), stored, "{name}");
        assert!(info.file_bytes > 0, "{name}");
        assert!(info.tokenizer.is_some(), "{name}");
    }
    let gguf = kiln_models::inspect(&tiny_path(), &options).unwrap();
    assert_eq!(gguf.format, ModelFormat::Gguf);
    let reference = json("gguf/tiny-llama.reference.json");
    let types: Vec<&str> = gguf.stored_types.iter().map(|(t, _)| t.as_str()).collect();
    for ty in reference["tensor_types"].as_object().unwrap().values() {
        assert!(
            types.contains(&ty.as_str().unwrap()),
            "{ty} missing from {types:?}"
        );
    }
    assert!(kiln_models::inspect(&fixture("no-such-model"), &options).is_err());
}

/// A GGUF v3 file assembled from encoded metadata entries and tensor infos.
#[derive(Default)]
struct GgufWriter {
    n_kv: u64,
    kvs: Vec<u8>,
    n_tensors: u64,
    infos: Vec<u8>,
}

fn gguf_str(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s.as_bytes());
    out
}

impl GgufWriter {
    /// A key of value type `type_id` whose value is encoded as `value`.
    fn kv(&mut self, key: &str, type_id: u32, value: &[u8]) -> &mut Self {
        self.n_kv += 1;
        self.kvs.extend(gguf_str(key));
        self.kvs.extend(type_id.to_le_bytes());
        self.kvs.extend(value);
        self
    }

    /// A tensor info: `dims` in ggml's order (innermost first), offset into the data.
    fn tensor(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.n_tensors += 1;
        self.infos.extend(gguf_str(name));
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(type_id.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self
    }

    /// The file, `data` at the default alignment after the header.
    fn bytes(&self, data: &[u8]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kvs);
        out.extend(&self.infos);
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend(data);
        out
    }
}

/// Two tensors whose data share bytes are refused naming both (300 layers pointing at layer
/// 0's bytes once made 877 MiB of weights out of a 100 MB file); so is a real file edited so.
#[test]
fn overlapping_tensor_data_is_refused_naming_both() {
    let mut w = GgufWriter::default();
    w.tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32);
    let err = parse_error(&w.bytes(&[0; 64]));
    assert!(
        err.contains("tensor `b` (bytes 128..160) overlaps tensor `a` (bytes 96..160)"),
        "{err}"
    );
    // Side by side, and empty tensors anywhere, are fine.
    let mut w = GgufWriter::default();
    w.tensor("a", &[8], 0, 0)
        .tensor("b", &[8], 0, 32)
        .tensor("empty", &[0], 0, 32);
    parse::parse(&w.bytes(&[0; 64])).unwrap();

    // qwen2-tiny with layer 1's query projection pointing at layer 0's.
    let bytes = std::fs::read(fixture("gguf/qwen2-tiny.f32.gguf")).unwrap();
    let header = parse::parse(&bytes).unwrap();
    let layer0 = header
        .tensors
        .iter()
        .find(|t| t.name == "blk.0.attn_q.weight")
        .unwrap();
    let name = b"blk.1.attn_q.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let offset_at = at + 4 + 2 * 8 + 4;
    let mut edited = bytes.clone();
    let relative = (layer0.data.start - header.data_offset) as u64;
    edited[offset_at..offset_at + 8].copy_from_slice(&relative.to_le_bytes());
    let err = load_bytes(&edited).unwrap_err().to_string();
    assert!(
        err.contains("model.gguf")
            && err.contains("overlaps")
            && err.contains("`blk.0.attn_q.weight`")
            && err.contains("`blk.1.attn_q.weight`"),
        "{err}"
    );
}

/// A shape whose size in bytes overflows is refused: 2^62 f32 values once took 0 bytes (the
/// product wrapped), passed the range check, and asked for 16 EiB when read.
#[test]
fn tensor_sizes_that_overflow_are_refused() {
    let mut w = GgufWriter::default();
    w.tensor("huge", &[1 << 62], 0, 0);
    let err = parse_error(&w.bytes(&[]));
    assert!(
        err.contains("tensor `huge`: 4611686018427387904 F32 values") && err.contains("past"),
        "{err}"
    );
    let mut w = GgufWriter::default();
    w.tensor("wide", &[1 << 32, 1 << 32], 0, 0);
    let err = parse_error(&w.bytes(&[]));
    assert!(
        err.contains("tensor `wide`: shape [4294967296, 4294967296] has more values"),
        "{err}"
    );
}

/// The parsed header takes at most `HEADER_MEMORY_FACTOR` bytes per byte of header (plus
/// `HEADER_MEMORY_SLACK`), for the smallest entries of every kind. A 24 MiB `u8` array once
/// took 800 MiB (one 32-byte value per byte).
#[test]
fn metadata_memory_is_bounded_by_its_bytes() {
    use crate::fuzz::harness::peak_of;
    use kiln_models::gguf::{HEADER_MEMORY_FACTOR, HEADER_MEMORY_SLACK, MetaArray};

    let array = |item_type: u32, count: usize, items: &[u8]| {
        let mut value = item_type.to_le_bytes().to_vec();
        value.extend((count as u64).to_le_bytes());
        value.extend(items);
        value
    };
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let n = 24 << 20;
    cases.push((
        "a 24 MiB u8 array",
        GgufWriter::default()
            .kv("big", 9, &array(0, n, &vec![7; n]))
            .bytes(&[]),
    ));
    let mut keys = GgufWriter::default();
    for i in 0..200_000 {
        keys.kv(&format!("{i:x}"), 0, &[1]);
    }
    cases.push(("200k one-byte keys", keys.bytes(&[])));
    let n = 2_000_000;
    cases.push((
        "2M empty strings",
        GgufWriter::default()
            .kv("s", 9, &array(8, n, &vec![0; 8 * n]))
            .bytes(&[]),
    ));
    let n = 1_000_000;
    let invalid: Vec<u8> = (0..n)
        .flat_map(|_| [1, 0, 0, 0, 0, 0, 0, 0, 0xff])
        .collect();
    cases.push((
        "1M one-byte strings of invalid UTF-8",
        GgufWriter::default()
            .kv("s", 9, &array(8, n, &invalid))
            .bytes(&[]),
    ));
    let empty_arrays: Vec<u8> = (0..n).flat_map(|_| array(0, 0, &[])).collect();
    cases.push((
        "1M empty nested arrays",
        GgufWriter::default()
            .kv("a", 9, &array(9, n, &empty_arrays))
            .bytes(&[]),
    ));
    let mut tensors = GgufWriter::default();
    for i in 0..200_000 {
        tensors.tensor(&format!("{i:x}"), &[0], 0, 0);
    }
    cases.push(("200k empty tensors", tensors.bytes(&[])));

    for (what, bytes) in cases {
        let (header, peak) = peak_of(|| parse::parse(&bytes));
        let header = header.unwrap();
        let bound = HEADER_MEMORY_FACTOR * bytes.len() + HEADER_MEMORY_SLACK;
        eprintln!(
            "{what}: {peak} bytes for {} ({:.2} per byte)",
            bytes.len(),
            peak as f64 / bytes.len() as f64
        );
        assert!(
            peak <= bound,
            "{what}: {peak} bytes for {} ({:.1} per byte)",
            bytes.len(),
            peak as f64 / bytes.len() as f64
        );
        drop(header);
    }

    // The audit's array is held as what it is: one vector of bytes.
    let n = 1000;
    let bytes = GgufWriter::default()
        .kv("big", 9, &array(0, n, &vec![7; n]))
        .bytes(&[]);
    let header = parse::parse(&bytes).unwrap();
    assert_eq!(
        header.metadata["big"].as_array(),
        Some(&MetaArray::U8(vec![7; n]))
    );
}
