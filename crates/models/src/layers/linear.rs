//! [`Linear`]: `y = x W + b` with `W` stored `[d_in, d_out]`.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// A dense layer. Checkpoints storing `[d_out, d_in]` (PyTorch `nn.Linear`) are transposed on
/// load; GPT-2's `Conv1D` already stores `[d_in, d_out]`.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    /// `[d_in, d_out]`
    pub weight: Tensor<B, 2>,
    /// `[d_out]`
    pub bias: Option<Tensor<B, 1>>,
}

impl<B: Backend> Linear<B> {
    /// # Shapes
    /// - `x`: `[n, d_in]` → `[n, d_out]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = x.matmul(self.weight.clone());
        match &self.bias {
            Some(b) => y + b.clone().unsqueeze_dim(0),
            None => y,
        }
    }
}
