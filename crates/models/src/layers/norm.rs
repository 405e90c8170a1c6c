//! LayerNorm and RMSNorm, computed in f32 whatever the model's dtype (as transformers does for
//! RMSNorm, and as PyTorch's CPU kernels accumulate LayerNorm).

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use kiln_core::InferenceBackend;

use crate::config::NormKind;

/// A normalisation layer.
#[derive(Debug, Clone)]
pub struct Norm<B: Backend> {
    /// Which normalisation.
    pub kind: NormKind,
    /// Scale. `[d_model]`
    pub gamma: Tensor<B, 1>,
    /// Shift (LayerNorm only). `[d_model]`
    pub beta: Option<Tensor<B, 1>>,
    /// Added to the variance.
    pub eps: f64,
}

impl<B: InferenceBackend> Norm<B> {
    /// RMSNorm through the backend ([`InferenceBackend::rms_norm`], one pass on the cpu
    /// backend); LayerNorm (GPT-2) as burn's composition.
    ///
    /// # Shapes
    /// - `x`: `[n, d_model]` → `[n, d_model]`, in `x`'s dtype
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        if self.kind == NormKind::RmsNorm {
            return B::rms_norm(x, &self.gamma, self.eps);
        }
        let dtype = FloatDType::from(x.dtype());
        let x32 = x.cast(FloatDType::F32);
        let mean = x32.clone().mean_dim(1);
        let centered = x32 - mean;
        let var = centered.clone().powi_scalar(2).mean_dim(1);
        let y = centered / var.add_scalar(self.eps).sqrt();
        let y = y * self.gamma.clone().cast(FloatDType::F32).unsqueeze_dim(0);
        let y = match &self.beta {
            Some(b) => y + b.clone().cast(FloatDType::F32).unsqueeze_dim(0),
            None => y,
        };
        y.cast(dtype)
    }

    /// The residual stream after adding `delta` (when there is one), and its normalisation:
    /// `(x + delta, norm(x + delta))`, through [`InferenceBackend::add_rms_norm`] for RMSNorm
    /// (one launch on the GPU backends).
    ///
    /// # Shapes
    /// - `x`, `delta`: `[n, d_model]` → (`[n, d_model]`, `[n, d_model]`)
    pub fn forward_after(
        &self,
        x: Tensor<B, 2>,
        delta: Option<Tensor<B, 2>>,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        match delta {
            Some(delta) if self.kind == NormKind::RmsNorm => {
                B::add_rms_norm(x, delta, &self.gamma, self.eps)
            }
            Some(delta) => {
                let x = x + delta;
                (x.clone(), self.forward(x))
            }
            None => (x.clone(), self.forward(x)),
        }
    }
}
