//! GPT-2 (every size, from one configuration): Hugging Face `config.json` and weight names.
//!
//! HF stores `c_attn`, `c_proj` and `c_fc` as `Conv1D`, i.e. `[d_in, d_out]`: loaded as they
//! are, never transposed. Checkpoints may name tensors with or without the `transformer.`
//! prefix, and old ones carry `attn.bias` / `attn.masked_bias` causal-mask buffers, which are
//! ignored. The output head is the token embedding.

use std::path::Path;

use kiln_core::{Dtype, InferenceBackend, TokenId};
use serde::Deserialize;

use crate::config::{Architecture, MlpKind, NormKind, PositionKind, TransformerConfig};
use crate::error::{ModelError, Result};
use crate::layers::attention::{Attention, QkvProjection};
use crate::layers::embedding::Embedding;
use crate::layers::mlp::Mlp;
use crate::layers::norm::Norm;
use crate::loaders::WeightStorage;
use crate::transformer::{Block, Transformer, WeightLoader};
use crate::weights::TensorSource;

/// The keys of a GPT-2 `config.json` kiln reads.
#[derive(Debug, Deserialize)]
pub struct Gpt2HfConfig {
    vocab_size: usize,
    n_positions: usize,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_inner: Option<usize>,
    #[serde(default = "default_eps")]
    layer_norm_epsilon: f64,
    #[serde(default = "default_activation")]
    activation_function: String,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
}

fn default_eps() -> f64 {
    1e-5
}

fn default_activation() -> String {
    "gelu_new".into()
}

impl Gpt2HfConfig {
    /// The validated configuration.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `path` for an unsupported activation or inconsistent sizes.
    pub fn to_config(&self, path: &Path) -> Result<TransformerConfig> {
        if !matches!(
            self.activation_function.as_str(),
            "gelu_new" | "gelu_pytorch_tanh"
        ) {
            return Err(ModelError::config(
                path,
                format!(
                    "activation_function `{}` is not supported (GPT-2 uses gelu_new)",
                    self.activation_function
                ),
            ));
        }
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(ModelError::config(
                path,
                format!(
                    "n_embd ({}) must be a multiple of n_head ({})",
                    self.n_embd, self.n_head
                ),
            ));
        }
        let config = TransformerConfig {
            architecture: Architecture::Gpt2,
            vocab: self.vocab_size,
            d_model: self.n_embd,
            n_layers: self.n_layer,
            n_heads: self.n_head,
            n_kv_heads: self.n_head,
            head_dim: self.n_embd / self.n_head,
            d_ff: self.n_inner.unwrap_or(4 * self.n_embd),
            max_positions: self.n_positions,
            norm: NormKind::LayerNorm,
            norm_eps: self.layer_norm_epsilon,
            positions: PositionKind::Learned,
            mlp: MlpKind::GeluTanh,
            attention_bias: true,
            mlp_bias: true,
            tied_head: true,
            bos: self.bos_token_id.map(TokenId),
            eos: self.eos_token_id.map(TokenId).into_iter().collect(),
        };
        config.validate().map_err(|e| ModelError::config(path, e))?;
        Ok(config)
    }
}

/// Loads GPT-2 weights in HF names.
///
/// # Errors
/// A missing tensor or one whose shape disagrees with `config`, naming file and tensor.
pub fn load<B: InferenceBackend>(
    config: TransformerConfig,
    source: &dyn TensorSource,
    dtype: Dtype,
    device: &B::Device,
) -> Result<Transformer<B>> {
    let prefix = if source.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let w = WeightLoader::<B> {
        source,
        dtype,
        device,
        storage: WeightStorage::Dequantized,
    };
    let (d, ff) = (config.d_model, config.d_ff);
    let name = |s: &str| format!("{prefix}{s}");
    let norm = |base: &str| -> Result<Norm<B>> {
        Ok(Norm {
            kind: NormKind::LayerNorm,
            gamma: w.vector(&name(&format!("{base}.weight")), d)?,
            beta: Some(w.vector(&name(&format!("{base}.bias")), d)?),
            eps: config.norm_eps,
        })
    };
    let linear = |base: &str, d_in: usize, d_out: usize| {
        w.linear_in_out(
            &name(&format!("{base}.weight")),
            Some(&name(&format!("{base}.bias"))),
            d_in,
            d_out,
        )
    };
    let mut blocks = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let h = format!("h.{i}");
        blocks.push(Block {
            attn_norm: norm(&format!("{h}.ln_1"))?,
            attn: Attention {
                qkv: QkvProjection::Fused(linear(&format!("{h}.attn.c_attn"), d, 3 * d)?),
                out: linear(&format!("{h}.attn.c_proj"), d, d)?,
                n_heads: config.n_heads,
                n_kv_heads: config.n_kv_heads,
                head_dim: config.head_dim,
            },
            mlp_norm: norm(&format!("{h}.ln_2"))?,
            mlp: Mlp::GeluTanh {
                up: linear(&format!("{h}.mlp.c_fc"), d, ff)?,
                down: linear(&format!("{h}.mlp.c_proj"), ff, d)?,
            },
        });
    }
    let embed = Embedding::Dense(w.matrix(&name("wte.weight"), config.vocab, d)?);
    let positions = w.matrix(&name("wpe.weight"), config.max_positions, d)?;
    let final_norm = norm("ln_f")?;
    Ok(Transformer::from_parts(
        config,
        dtype,
        device.clone(),
        embed,
        Some(positions),
        blocks,
        final_norm,
        None,
    ))
}
