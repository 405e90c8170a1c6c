//! [`Transformer`]: the decoder both GPT-2 and Llama are, configured by
//! [`TransformerConfig`]. Implements [`CausalLm`].

use burn::tensor::{FloatDType, Tensor};
use kiln_core::attention::AttentionPlan;
use kiln_core::kv_cache::KvCache;
use kiln_core::tensor::int_tensor;
use kiln_core::{Batch, CausalLm, CoreError, Dtype, InferenceBackend, LogitsFor, ModelShape};

use crate::config::{PositionKind, TransformerConfig};
use crate::error::{ModelError, Result};
use crate::host::HostTensor;
use crate::layers::attention::Attention;
use crate::layers::linear::Linear;
use crate::layers::mlp::Mlp;
use crate::layers::norm::Norm;
use crate::layers::rope::{RopeTables, inverse_frequencies};
use crate::weights::TensorSource;

/// One transformer block: pre-norm attention and pre-norm MLP, each with a residual.
#[derive(Debug, Clone)]
pub struct Block<B: InferenceBackend> {
    /// Before attention.
    pub attn_norm: Norm<B>,
    /// Self-attention.
    pub attn: Attention<B>,
    /// Before the MLP.
    pub mlp_norm: Norm<B>,
    /// Feed-forward.
    pub mlp: Mlp<B>,
}

/// A decoder-only transformer with its weights on a device.
#[derive(Debug, Clone)]
pub struct Transformer<B: InferenceBackend> {
    config: TransformerConfig,
    dtype: Dtype,
    device: B::Device,
    /// `[vocab, d_model]`
    embed: Tensor<B, 2>,
    /// `[max_positions, d_model]` (learned positions only)
    position_embed: Option<Tensor<B, 2>>,
    blocks: Vec<Block<B>>,
    final_norm: Norm<B>,
    /// `[d_model, vocab]` (a transposed view of `embed` when tied)
    head: Tensor<B, 2>,
    /// RoPE inverse frequencies (rotary models only).
    inv_freq: Option<Vec<f32>>,
    /// Configuration, dtype and a digest of some weights (see [`CausalLm::fingerprint`]).
    fingerprint: String,
}

impl<B: InferenceBackend> Transformer<B> {
    /// Assembles a model from its parts (the loaders' job).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        config: TransformerConfig,
        dtype: Dtype,
        device: B::Device,
        embed: Tensor<B, 2>,
        position_embed: Option<Tensor<B, 2>>,
        blocks: Vec<Block<B>>,
        final_norm: Norm<B>,
        head: Option<Tensor<B, 2>>,
    ) -> Self {
        let head = head.unwrap_or_else(|| embed.clone().transpose());
        let fingerprint = fingerprint(&config, dtype, &embed, &head);
        let inv_freq = match &config.positions {
            PositionKind::Rope(rope) => Some(inverse_frequencies(rope, config.head_dim)),
            PositionKind::Learned => None,
        };
        Self {
            config,
            dtype,
            device,
            embed,
            position_embed,
            blocks,
            final_norm,
            head,
            inv_freq,
            fingerprint,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    fn check_input(&self, batch: &Batch) -> kiln_core::Result<()> {
        if batch.is_empty() {
            return Err(CoreError::InvalidBatch("no tokens".into()));
        }
        if let Some(t) = batch
            .tokens()
            .iter()
            .find(|t| t.0 as usize >= self.config.vocab)
        {
            return Err(CoreError::ModelInput(format!(
                "token id {t} is outside the vocabulary of {}",
                self.config.vocab
            )));
        }
        if let Some(p) = batch
            .positions()
            .iter()
            .find(|p| p.index() >= self.config.max_positions)
        {
            return Err(CoreError::ModelInput(format!(
                "position {p} is past the model's context of {} tokens",
                self.config.max_positions
            )));
        }
        Ok(())
    }
}

impl<B: InferenceBackend> CausalLm<B> for Transformer<B> {
    fn shape(&self) -> ModelShape {
        self.config.shape()
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    fn device(&self) -> B::Device {
        self.device.clone()
    }

    fn forward(
        &self,
        batch: &Batch,
        cache: &mut dyn KvCache<B>,
        logits: LogitsFor,
    ) -> kiln_core::Result<Tensor<B, 2>> {
        self.check_input(batch)?;
        let device = &self.device;
        let cfg = &self.config;
        let step = cache.plan(batch)?;
        let plan = AttentionPlan::new(batch, step, cfg.n_heads, cfg.n_kv_heads, device);

        let tokens: Vec<usize> = batch.tokens().iter().map(|t| t.0 as usize).collect();
        let mut x = self
            .embed
            .clone()
            .select(0, int_tensor::<B>(tokens, device));
        let rope = match (&self.position_embed, &self.inv_freq) {
            (Some(table), _) => {
                let positions: Vec<usize> = batch.positions().iter().map(|p| p.index()).collect();
                x = x + table.clone().select(0, int_tensor::<B>(positions, device));
                None
            }
            (None, Some(inv_freq)) => Some(RopeTables::new(
                inv_freq,
                batch.positions(),
                self.dtype.burn_float(),
                device,
            )),
            (None, None) => None,
        };
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = block.attn_norm.forward(x.clone());
            x = x + block.attn.forward(h, layer, cache, &plan, rope.as_ref());
            let h = block.mlp_norm.forward(x.clone());
            x = x + block.mlp.forward(h);
        }
        let x = match logits {
            LogitsFor::All => x,
            LogitsFor::LastOfEachSequence => {
                x.select(0, int_tensor::<B>(batch.last_indices(), device))
            }
        };
        let x = self.final_norm.forward(x);
        Ok(x.matmul(self.head.clone()).cast(FloatDType::F32))
    }
}

/// The architecture, dtype and an FNV-1a digest of the first row of the embedding and the
/// first column of the head: two checkpoints of one architecture differ there.
fn fingerprint<B: InferenceBackend>(
    config: &TransformerConfig,
    dtype: Dtype,
    embed: &Tensor<B, 2>,
    head: &Tensor<B, 2>,
) -> String {
    let [_, d] = embed.dims();
    let [_, vocab] = head.dims();
    let rows = [
        embed.clone().slice([0..1, 0..d]).cast(FloatDType::F32),
        head.clone()
            .slice([0..1, 0..vocab.min(4096)])
            .cast(FloatDType::F32),
    ];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for row in rows {
        for x in row.into_data().iter::<f32>() {
            for byte in x.to_bits().to_le_bytes() {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!(
        "{:?} {}x{} vocab {} {} weights {hash:016x}",
        config.architecture,
        config.n_layers,
        config.d_model,
        config.vocab,
        dtype.name()
    )
}

/// Reads tensors from a [`TensorSource`], checks their shapes against the configuration, and
/// uploads them in the model's dtype.
pub struct WeightLoader<'a, B: InferenceBackend> {
    /// Where the tensors are.
    pub source: &'a dyn TensorSource,
    /// The precision to upload in.
    pub dtype: Dtype,
    /// The device to upload to.
    pub device: &'a B::Device,
}

impl<B: InferenceBackend> WeightLoader<'_, B> {
    /// Reads `name`, failing unless its shape is `expected`.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] or [`ModelError::ShapeMismatch`], naming file and tensor.
    pub fn host(&self, name: &str, expected: &[usize]) -> Result<HostTensor> {
        let tensor = self.source.read(name)?;
        if tensor.shape != expected {
            return Err(ModelError::ShapeMismatch {
                file: tensor.file,
                tensor: name.to_string(),
                expected: expected.to_vec(),
                got: tensor.shape,
            });
        }
        Ok(tensor)
    }

    /// A 1-D tensor of `len`.
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor<B, 1>> {
        Ok(self.host(name, &[len])?.upload(self.dtype, self.device))
    }

    /// A 2-D tensor of `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor<B, 2>> {
        Ok(self
            .host(name, &[rows, cols])?
            .upload(self.dtype, self.device))
    }

    /// A layer stored `[d_in, d_out]` (GPT-2's `Conv1D`), with an optional bias.
    pub fn linear_in_out(
        &self,
        weight: &str,
        bias: Option<&str>,
        d_in: usize,
        d_out: usize,
    ) -> Result<Linear<B>> {
        Ok(Linear {
            weight: self.matrix(weight, d_in, d_out)?,
            bias: bias.map(|b| self.vector(b, d_out)).transpose()?,
        })
    }

    /// A layer stored `[d_out, d_in]` (PyTorch `nn.Linear`), transposed on load. With
    /// `interleaved_heads = Some(n)`, the output rows are first permuted from Meta's
    /// interleaved RoPE order to rotate-half order for `n` heads.
    pub fn linear_out_in(
        &self,
        weight: &str,
        bias: Option<&str>,
        d_in: usize,
        d_out: usize,
        interleaved_heads: Option<usize>,
    ) -> Result<Linear<B>> {
        let mut w = self.host(weight, &[d_out, d_in])?;
        let mut b = bias.map(|b| self.host(b, &[d_out])).transpose()?;
        if let Some(heads) = interleaved_heads {
            w = w.interleaved_to_half_split(heads);
            b = b.map(|b| b.interleaved_to_half_split(heads));
        }
        Ok(Linear {
            weight: w.transposed().upload(self.dtype, self.device),
            bias: b.map(|b| b.upload(self.dtype, self.device)),
        })
    }
}
