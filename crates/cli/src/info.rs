//! `kiln info`: what a model is, read from its files without loading the weights.

use std::path::PathBuf;

use anyhow::{Context, Result};
use kiln_core::KvDtype;
use kiln_models::config::{PositionKind, RopeScaling, TransformerConfig};
use kiln_models::{LoadOptions, ModelInfo};
use serde_json::json;

use crate::model_args::model_path;

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Model: a GGUF file, a Hugging Face folder or a Meta folder. Default: the embedded
    /// SmolLM2-135M-Instruct (fetched once).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Meta folders: the llama3 RoPE scaling factor when params.json lacks it.
    #[arg(long)]
    rope_scaling_factor: Option<f32>,
    /// The context to describe the model at, in tokens (as `kiln generate --context`).
    #[arg(long, value_name = "TOKENS")]
    context: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let path = model_path(args.model.as_deref())?;
    let options = LoadOptions {
        rope_scaling_factor: args.rope_scaling_factor,
        context: args.context,
        ..LoadOptions::default()
    };
    let info = kiln_models::inspect(&path, &options)
        .with_context(|| format!("reading {}", path.display()))?;
    for warning in &info.warnings {
        eprintln!("warning: {warning}");
    }
    if args.json {
        println!("{}", report_json(&info));
    } else {
        for (name, value) in rows(&info) {
            println!("{name:<14}{value}");
        }
    }
    Ok(())
}

/// `1234567` as `1.23 M`.
fn short_count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// What the weights are stored as: each type's share of the elements.
fn stored_as(info: &ModelInfo) -> String {
    // Saturating, as the counts are: never a wrapped total.
    let total = info
        .stored_types
        .iter()
        .fold(0usize, |total, (_, n)| total.saturating_add(*n));
    let parts: Vec<String> = info
        .stored_types
        .iter()
        .map(|(ty, n)| match *n as f64 * 100.0 / total.max(1) as f64 {
            share if share < 0.1 => format!("{ty} <0.1%"),
            share => format!("{ty} {share:.1}%"),
        })
        .collect();
    parts.join(", ")
}

/// What the attention layers have beyond projections: biases, per-head norms, windows.
fn attention(c: &TransformerConfig) -> String {
    let mut parts = Vec::new();
    match (c.qkv_bias, c.out_bias) {
        (true, true) => parts.push("biases on Q, K, V and output".to_string()),
        (true, false) => parts.push("biases on Q, K, V".to_string()),
        (false, true) => parts.push("bias on the output".to_string()),
        (false, false) => {}
    }
    if c.qk_norm {
        parts.push("RMSNorm on each Q and K head".to_string());
    }
    let windowed: Vec<usize> = c.attention_windows.iter().flatten().copied().collect();
    if let Some(w) = windowed.first() {
        parts.push(format!(
            "sliding window {w} on {} of {} layers",
            windowed.len(),
            c.n_layers
        ));
    }
    if let Some(scale) = c.attention_scoring.scale {
        parts.push(format!("scores scaled by {scale}"));
    }
    if let Some(cap) = c.attention_scoring.softcap {
        parts.push(format!("scores soft-capped at {cap}"));
    }
    if c.sandwich_norms {
        parts.push("norms on the attention and MLP outputs".to_string());
    }
    if parts.is_empty() {
        "plain (no biases, no window)".to_string()
    } else {
        parts.join(", ")
    }
}

fn rows(info: &ModelInfo) -> Vec<(&'static str, String)> {
    let c = &info.config;
    let heads = if c.n_kv_heads == c.n_heads {
        format!("{} ({} dims each)", c.n_heads, c.head_dim)
    } else {
        format!(
            "{} query, {} key/value (grouped-query), {} dims each",
            c.n_heads, c.n_kv_heads, c.head_dim
        )
    };
    let positions = match &c.positions {
        PositionKind::Learned => "learned".to_string(),
        PositionKind::Rope(rope) => {
            let scaling = match (&rope.scaling, &rope.frequency_divisors) {
                (Some(RopeScaling::LongRope(s)), _) => format!(
                    ", longrope scaling x{}, {} factors (original context {})",
                    s.factor,
                    if c.max_positions > s.original_max_positions {
                        "long"
                    } else {
                        "short"
                    },
                    s.original_max_positions
                ),
                (Some(s), _) => format!(", {} scaling x{}", s.name(), s.factor()),
                (None, Some(_)) => ", scaled (rope_freqs)".to_string(),
                (None, None) => String::new(),
            };
            let local = match &c.local_rope {
                Some(local) => format!(" (theta {} on windowed layers)", local.theta),
                None => String::new(),
            };
            format!("RoPE, theta {}{scaling}{local}", rope.theta)
        }
    };
    let family = c.architecture.family();
    let architecture = format!("{} ({})", family.name, family.models);
    vec![
        ("model", info.path.display().to_string()),
        (
            "format",
            format!(
                "{} ({:.1} MB)",
                info.format.name(),
                info.file_bytes as f64 / 1e6
            ),
        ),
        ("architecture", architecture),
        (
            "parameters",
            format!("{} ({})", short_count(c.parameters()), c.parameters()),
        ),
        ("layers", c.n_layers.to_string()),
        ("heads", heads),
        ("hidden", format!("{} (feed-forward {})", c.d_model, c.d_ff)),
        ("vocabulary", c.vocab.to_string()),
        ("context", format!("{} tokens", c.max_positions)),
        ("positions", positions),
        ("attention", attention(c)),
        (
            "head",
            match (c.tied_head, c.final_softcap) {
                (true, None) => "tied to the embedding".to_string(),
                (false, None) => "separate".to_string(),
                (true, Some(cap)) => format!("tied to the embedding, logits soft-capped at {cap}"),
                (false, Some(cap)) => format!("separate, logits soft-capped at {cap}"),
            },
        ),
        ("stored as", stored_as(info)),
        ("on cpu", cpu_path(info)),
        ("KV cache", kv_cache(c)),
        (
            "tokenizer",
            info.tokenizer
                .clone()
                .unwrap_or_else(|| "none (use --token-ids)".into()),
        ),
        (
            "chat template",
            if info.chat_template { "yes" } else { "no" }.to_string(),
        ),
    ]
}

/// Which storage types the cpu backend keeps as stored (kiln's kernels multiply a GGUF file's
/// quantized blocks and 16-bit floats, and a safetensors checkpoint's 16-bit floats, as they
/// are) and which it dequantizes to f32 at load, by default.
fn cpu_path(info: &ModelInfo) -> String {
    use kiln_models::ModelFormat;
    let kept_here = |ty: kiln_models::gguf::GgmlType| match info.format {
        ModelFormat::Gguf => kiln_kernels::QuantMatrix::takes(ty),
        ModelFormat::HuggingFace => kiln_kernels::float16::is_float16(ty),
        ModelFormat::MetaOriginal | ModelFormat::TorchDistributed => false,
    };
    let (kept, converted): (Vec<&str>, Vec<&str>) = info
        .stored_types
        .iter()
        .map(|(t, _)| t.as_str())
        .filter(|t| !matches!(*t, "F32"))
        .partition(|t| {
            kiln_models::gguf::GgmlType::ALL
                .iter()
                .any(|g| g.name() == *t && kept_here(*g))
        });
    let mut parts = Vec::new();
    if !kept.is_empty() {
        parts.push(format!(
            "{} kept as stored (kiln's kernels)",
            kept.join(", ")
        ));
    }
    if !converted.is_empty() {
        parts.push(format!(
            "{} dequantized to f32 at load",
            converted.join(", ")
        ));
    }
    if parts.is_empty() {
        "f32 as stored".to_string()
    } else {
        format!("{}; --dtype dequantizes everything", parts.join("; "))
    }
}

/// Bytes the KV cache holds per token (K and V of every layer) in `dtype`.
fn kv_bytes_per_token(c: &TransformerConfig, dtype: KvDtype) -> usize {
    2 * c.n_layers * c.n_kv_heads * dtype.row_bytes(c.head_dim)
}

/// The KV cache's memory per token in the cpu default (f16), q8_0 where the heads allow it and
/// the exact path's f32, and for a full context.
fn kv_cache(c: &TransformerConfig) -> String {
    let kib = |d| kv_bytes_per_token(c, d) as f64 / 1024.0;
    let q8_0 = if KvDtype::Q8_0.holds_rows_of(c.head_dim) {
        format!(", {:.1} KiB in q8_0", kib(KvDtype::Q8_0))
    } else {
        String::new()
    };
    format!(
        "{:.1} KiB per token in f16 (cpu default, --kv-dtype){q8_0}, {:.1} KiB in f32; full context: {:.0} MB in f16",
        kib(KvDtype::F16),
        kib(KvDtype::F32),
        (kv_bytes_per_token(c, KvDtype::F16) * c.max_positions) as f64 / 1e6
    )
}

fn report_json(info: &ModelInfo) -> serde_json::Value {
    let c = &info.config;
    let kv_bytes: serde_json::Map<String, serde_json::Value> = KvDtype::ALL
        .iter()
        .filter(|d| d.holds_rows_of(c.head_dim))
        .map(|d| (d.name().to_string(), kv_bytes_per_token(c, *d).into()))
        .collect();
    json!({
        "path": info.path,
        "format": info.format.name(),
        "file_bytes": info.file_bytes,
        "architecture": c.architecture.name(),
        "parameters": c.parameters(),
        "layers": c.n_layers,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden": c.d_model,
        "feed_forward": c.d_ff,
        "vocab": c.vocab,
        "context": c.max_positions,
        "tied_head": c.tied_head,
        "kv_bytes_per_token": kv_bytes,
        "stored_types": info.stored_types.iter().map(|(t, n)| json!({"type": t, "elements": n})).collect::<Vec<_>>(),
        "tokenizer": info.tokenizer,
        "chat_template": info.chat_template,
        "warnings": info.warnings,
    })
}
