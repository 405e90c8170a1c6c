//! [`Linear`]: `y = x W + b`, with `W` dense on the device or kept in its quantized GGUF
//! blocks ([`LinearWeight`]: on the host for the cpu backends, on the device for the GPU
//! backends); the backend picks the kernel ([`InferenceBackend::linear_dense`],
//! [`InferenceBackend::linear_quantized`]).

use std::sync::Arc;

use burn::tensor::Tensor;
use kiln_core::InferenceBackend;
use kiln_core::backend::QuantWeight;
use kiln_kernels::QuantMatrix;

/// A linear layer's weight.
#[derive(Debug, Clone)]
pub enum LinearWeight<B: InferenceBackend> {
    /// `[d_in, d_out]` in the model's dtype. Checkpoints storing `[d_out, d_in]` (PyTorch
    /// `nn.Linear`) are transposed on load; GPT-2's `Conv1D` already stores `[d_in, d_out]`.
    Dense(Tensor<B, 2>),
    /// `[d_out, d_in]` in ggml blocks (GGUF's own layout), multiplied without dequantizing;
    /// its host blocks shared with the embedding when the output head is tied.
    Quantized(B::QuantWeight),
}

/// A dense layer.
#[derive(Debug, Clone)]
pub struct Linear<B: InferenceBackend> {
    /// The weight.
    pub weight: LinearWeight<B>,
    /// `[d_out]`
    pub bias: Option<Tensor<B, 1>>,
}

impl<B: InferenceBackend> Linear<B> {
    /// A layer with a dense `[d_in, d_out]` weight.
    pub fn dense(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: LinearWeight::Dense(weight),
            bias,
        }
    }

    /// # Shapes
    /// - `x`: `[n, d_in]` → `[n, d_out]` (f32 for a quantized weight on the cpu backends, else
    ///   `x`'s dtype)
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = match &self.weight {
            LinearWeight::Dense(w) => B::linear_dense(x, w),
            LinearWeight::Quantized(w) => B::linear_quantized(x, w),
        };
        match &self.bias {
            Some(b) => y + b.clone().unsqueeze_dim(0),
            None => y,
        }
    }

    /// One layer computing `parts`' outputs side by side (`[n, Σ d_out]`), when every part
    /// reads the same input width and every weight is dense in one dtype, or quantized with
    /// one type: projections of one input (Q, K and V; gate and up) then run as one product,
    /// one dispatch to the pool instead of two or three (and a quantized input is quantized
    /// once). On the cpu backend the outputs keep the bits of the parts apart (kiln's kernels
    /// order each output's sum by the input width and the thread count) unless the wider
    /// product crosses into another split of the work (`dense`'s column split past 8192
    /// outputs); other backends' products may round a wider product differently. Both stay
    /// within the parity tolerances. `None` when the parts differ.
    pub fn fuse_outputs(parts: &[&Linear<B>]) -> Option<Self> {
        let bias = match parts
            .iter()
            .map(|l| l.bias.clone())
            .collect::<Option<Vec<_>>>()
        {
            Some(biases) => Some(Tensor::cat(biases, 0)),
            None if parts.iter().all(|l| l.bias.is_none()) => None,
            None => return None,
        };
        let weight = match parts.first().map(|l| &l.weight)? {
            LinearWeight::Dense(_) => LinearWeight::Dense(fuse_dense(parts)?),
            LinearWeight::Quantized(_) => {
                LinearWeight::Quantized(B::QuantWeight::new(Arc::new(fuse_quantized(parts)?)))
            }
        };
        Some(Self { weight, bias })
    }

    /// Whether the weight is kept quantized.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, LinearWeight::Quantized(_))
    }
}

/// `parts`' dense `[d_in, d_out_i]` weights side by side, `[d_in, Σ d_out_i]`; `None` unless
/// every weight is dense, with one input width and one dtype.
fn fuse_dense<B: InferenceBackend>(parts: &[&Linear<B>]) -> Option<Tensor<B, 2>> {
    let weights: Vec<&Tensor<B, 2>> = parts
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Dense(w) => Some(w),
            LinearWeight::Quantized(_) => None,
        })
        .collect::<Option<_>>()?;
    let (first, rest) = weights.split_first()?;
    let same = |w: &&Tensor<B, 2>| w.dims()[0] == first.dims()[0] && w.dtype() == first.dtype();
    if !rest.iter().all(same) {
        return None;
    }
    let weights: Vec<Tensor<B, 2>> = weights.into_iter().cloned().collect();
    Some(if B::DENSE_WEIGHTS_OUT_IN {
        // The parts are transposed views of `[d_out_i, d_in]` tensors: stacked as such and
        // viewed again, so the fused weight keeps the layout.
        Tensor::cat(weights.into_iter().map(|w| w.transpose()).collect(), 0).transpose()
    } else {
        Tensor::cat(weights, 1)
    })
}

/// `parts`' quantized weights stacked by output rows; `None` unless every weight is
/// quantized and [`QuantMatrix::concat_rows`] can join them (one type, one width).
fn fuse_quantized<B: InferenceBackend>(parts: &[&Linear<B>]) -> Option<QuantMatrix> {
    let matrices: Vec<&QuantMatrix> = parts
        .iter()
        .map(|l| match &l.weight {
            LinearWeight::Quantized(w) => Some(w.host().as_ref()),
            LinearWeight::Dense(_) => None,
        })
        .collect::<Option<_>>()?;
    QuantMatrix::concat_rows(&matrices).ok()
}
