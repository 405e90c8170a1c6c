//! Half precision against transformers' f32 logits.
//!
//! Tolerances, from the formats: bf16 keeps 8 significant bits (relative rounding 2^-9 ≈
//! 2e-3), f16 keeps 11 (2^-12 ≈ 2.4e-4). Weights and every activation are rounded, through
//! 2 blocks, and the fixtures' logits reach |10|, so errors of tens of roundings of the
//! largest logit are expected (the errors measured when the bounds were set are in
//! docs/benchmarks.md, "Figures that were in code comments"). Accepted: 0.15 for bf16, 0.03
//! for f16; both are far below the logit gaps that decide sampling on real models, and far
//! above f32's 1e-4.
//! The KV cache stores the same dtype. Norms and softmax run in f32 on every backend.

#![allow(clippy::unwrap_used)] // a test that fails on unwrap is the point

use crate::common::*;
use kiln_core::{CoreError, Dtype, InferenceBackend};
use kiln_models::ModelError;

fn worst_diff<B: InferenceBackend>(dtype: Dtype, fixtures: &[&str]) -> f32 {
    let mut worst = 0.0f32;
    for &name in fixtures {
        let loaded = load::<B>(name, dtype);
        let (_, cases) = reference(name);
        for case in &cases {
            let diff = max_abs_diff(&all_logits(&loaded.model, &case.prompt), &case.logits);
            eprintln!("{dtype} {name}: max |diff| {diff}");
            worst = worst.max(diff);
        }
    }
    worst
}

/// Mean KL divergence `KL(p_f32 || p_dtype)` of the next-token distributions and the share of
/// positions whose top token agrees, over every position of every prompt of `fixtures`, the
/// dtype's run on `B` against the f32 run on the cpu backend (the exact path).
fn agreement<B: InferenceBackend>(dtype: Dtype, fixtures: &[&str]) -> (f64, f64) {
    let (mut kl, mut agree, mut positions) = (0.0f64, 0usize, 0usize);
    for &name in fixtures {
        let exact = load::<burn::backend::Flex>(name, Dtype::F32);
        let ours = load::<B>(name, dtype);
        let (_, cases) = reference(name);
        for case in &cases {
            let p = all_logits(&exact.model, &case.prompt);
            let q = all_logits(&ours.model, &case.prompt);
            let (k, a, n) = divergence(&p, &q, p.len() / case.prompt.len());
            (kl, agree, positions) = (kl + k, agree + a, positions + n);
        }
    }
    (kl / positions as f64, agree as f64 / positions as f64)
}

/// bf16 against the f32 path, stated as the quantized paths' accuracy is (mean KL divergence
/// and top-1 agreement over every position of every fixture prompt; the tiny random models
/// have near ties, so top-1 stays below 100 % (the measured values: docs/benchmarks.md,
/// "Figures that were in code comments"). The CUDA test holds bf16 there to the same bounds.
const BF16_MEAN_KL: f64 = 2e-3;
const BF16_TOP1: f64 = 0.97;

/// bf16 on `B` (named `backend` in the output) within [`BF16_MEAN_KL`] and [`BF16_TOP1`] of
/// the f32 path.
fn bf16_agrees_with_f32<B: InferenceBackend>(backend: &str) {
    let (kl, top1) = agreement::<B>(Dtype::Bf16, &FIXTURES);
    eprintln!(
        "bf16 on {backend} against f32: mean KL {kl:.2e}, top-1 agreement {:.1} %",
        top1 * 100.0
    );
    assert!(
        kl <= BF16_MEAN_KL && top1 >= BF16_TOP1,
        "mean KL {kl}, top-1 {top1}"
    );
}

#[test]
fn bf16_on_cpu_agrees_with_f32() {
    bf16_agrees_with_f32::<burn::backend::Flex>("cpu");
}

#[cfg(feature = "cuda")]
#[test]
fn bf16_on_cuda_agrees_with_f32() {
    if cuda_here("bf16_on_cuda_agrees_with_f32") {
        bf16_agrees_with_f32::<burn::backend::Cuda>("cuda");
    }
}

/// The largest logit difference over every position of every fixture: a guard against a
/// broken bf16 path (a wrong cast is off by whole logits), not an accuracy statement (that is
/// [`BF16_MEAN_KL`]). Its worst case grows with the positions sampled: 0.18 on llama2-tiny,
/// at most 0.15 on the others (logits within ±5.3 on all of them).
#[test]
fn bf16_on_cpu_is_within_tolerance() {
    let worst = worst_diff::<burn::backend::Flex>(Dtype::Bf16, &FIXTURES);
    assert!(worst <= 0.25, "bf16: {worst}");
}

#[test]
fn f16_on_cpu_is_within_tolerance() {
    let worst = worst_diff::<burn::backend::Flex>(Dtype::F16, &FIXTURES);
    assert!(worst <= 0.03, "f16: {worst}");
}

#[test]
fn wgpu_has_no_bf16_and_says_so() {
    type B = burn::backend::Wgpu;
    let options = kiln_models::LoadOptions {
        dtype: Dtype::Bf16,
        ..Default::default()
    };
    let err = kiln_models::load::<B>(&fixture("llama-tiny"), &options, &B::inference_device())
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Core(CoreError::UnsupportedDtype { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("wgpu has no bf16"), "{err}");
}

/// f16 on wgpu runs within tolerance where the adapter has `shader-f16` (lavapipe, every
/// recent GPU). An adapter without it is skipped by name, with the reason printed: what it
/// must do instead (refuse with a typed error) is asserted on every machine by
/// `wgpu_has_no_bf16_and_says_so`, through the same check.
#[test]
fn wgpu_f16_runs_within_tolerance() {
    type B = burn::backend::Wgpu;
    let device = B::inference_device();
    if !B::supports(&device, Dtype::F16) {
        eprintln!(
            "skipped wgpu_f16_runs_within_tolerance: the adapter has no shader-f16 ({:?})",
            kiln_core::backend::BackendKind::Wgpu.probe()
        );
        return;
    }
    let worst = worst_diff::<B>(Dtype::F16, &["gpt2-tiny", "llama-tiny"]);
    assert!(worst <= 0.03, "f16 on wgpu: {worst}");
}

/// `fixture`'s folder copied into `dir` with every f32 tensor of its safetensors files stored
/// in `dtype` (F16 or BF16), as most checkpoints are published.
fn sixteen_bit_copy(fixture_name: &str, dtype: safetensors::Dtype, dir: &std::path::Path) {
    for entry in std::fs::read_dir(fixture(fixture_name)).unwrap() {
        let path = entry.unwrap().path();
        let target = dir.join(path.file_name().unwrap());
        let is_weights = path.extension().is_some_and(|e| e == "safetensors")
            && path.file_name().is_some_and(|n| n != "logits.safetensors");
        if !is_weights {
            std::fs::copy(&path, &target).unwrap();
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                if view.dtype() != safetensors::Dtype::F32 {
                    return (
                        name,
                        view.shape().to_vec(),
                        view.dtype(),
                        view.data().to_vec(),
                    );
                }
                let words: Vec<u8> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .flat_map(|v| match dtype {
                        safetensors::Dtype::F16 => half::f16::from_f32(v).to_le_bytes(),
                        _ => half::bf16::from_f32(v).to_le_bytes(),
                    })
                    .collect();
                (name, view.shape().to_vec(), dtype, words)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(name, shape, dtype, data)| {
                let view =
                    safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
                (name.clone(), view)
            })
            .collect();
        std::fs::write(&target, safetensors::serialize(views, None).unwrap()).unwrap();
    }
}

/// Checkpoints saved in F16 or BF16, kept in 16 bits on the cpu backend (what `kiln` does
/// without `--dtype`: `WeightStorage::Quantized`): every weight widens exactly and the sums
/// run in f32, so each family's logits are the same checkpoint's widened to f32 at load (the
/// exact path) within 1e-4, with the same greedy tokens. GPT-2's `Conv1D` weights (stored
/// `[d_in, d_out]`) stay dense; its token table, read by the tied head, is kept.
#[test]
fn sixteen_bit_checkpoints_kept_as_stored_compute_as_widened() {
    type B = burn::backend::Flex;
    let options = |weights| kiln_models::LoadOptions {
        dtype: Dtype::F32,
        weights,
        ..Default::default()
    };
    let device = <B as InferenceBackend>::inference_device();
    for (name, dtype, label) in [
        ("llama-tiny", safetensors::Dtype::BF16, "BF16"),
        ("llama-tiny-tied", safetensors::Dtype::F16, "F16"),
        ("mistral-tiny", safetensors::Dtype::BF16, "BF16"),
        ("qwen2-tiny", safetensors::Dtype::F16, "F16"),
        ("qwen3-tiny", safetensors::Dtype::BF16, "BF16"),
        ("phi3-tiny", safetensors::Dtype::BF16, "BF16"),
        ("gemma2-tiny", safetensors::Dtype::BF16, "BF16"),
        ("gemma3-tiny", safetensors::Dtype::F16, "F16"),
        ("gpt2-tiny", safetensors::Dtype::BF16, "BF16"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        sixteen_bit_copy(name, dtype, dir.path());
        let kept_options = options(kiln_models::WeightStorage::Quantized);
        let kept = kiln_models::load::<B>(dir.path(), &kept_options, &device).unwrap();
        let kinds = kept.model.weight_summary();
        // (A fixture already stored in 16 bits keeps its own type.)
        assert!(
            kinds.iter().any(|(kind, _, _)| kind.ends_with(" (16-bit)")),
            "{name}: {kinds:?}"
        );
        let exact_options = options(kiln_models::WeightStorage::Dequantized);
        let exact = kiln_models::load::<B>(dir.path(), &exact_options, &device).unwrap();
        assert!(!exact.model.holds_quantized_weights(), "{name}");
        for (i, case) in reference(name).1.iter().enumerate() {
            let ours = all_logits(&kept.model, &case.prompt);
            let diff = max_abs_diff(&ours, &all_logits(&exact.model, &case.prompt));
            assert!(diff <= 1e-4, "{name} {label} case {i}: max |diff| {diff}");
            let n = case.greedy.len();
            assert_eq!(
                greedy_cached(&kept.model, &case.prompt, n),
                greedy_cached(&exact.model, &case.prompt, n),
                "{name} {label} case {i}"
            );
        }
    }
}
