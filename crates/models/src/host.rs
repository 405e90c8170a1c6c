//! [`HostTensor`]: a checkpoint tensor read into host memory as f32, and the few reshapes
//! loaders need before upload (transpose, RoPE row permutations).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_core::Dtype;

/// A tensor read from a checkpoint, converted to f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Its name in the file.
    pub name: String,
    /// The file it came from (for error messages).
    pub file: String,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// Uploads as a `D`-dimensional tensor in `dtype`.
    ///
    /// # Panics
    /// If the tensor does not have `D` dimensions (loaders check shapes first).
    pub fn upload<B: Backend, const D: usize>(
        self,
        dtype: Dtype,
        device: &B::Device,
    ) -> Tensor<B, D> {
        assert_eq!(
            self.shape.len(),
            D,
            "{}: rank checked by the loader",
            self.name
        );
        let data = TensorData::new(self.data, self.shape);
        Tensor::<B, D>::from_data(data, device).cast(dtype.burn_float())
    }

    /// The transpose of a 2-D tensor (`[out, in]` checkpoints to kiln's `[in, out]`).
    pub fn transposed(mut self) -> Self {
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let mut out = vec![0.0f32; self.data.len()];
        for r in 0..rows {
            for c in 0..cols {
                out[c * rows + r] = self.data[r * cols + c];
            }
        }
        self.data = out;
        self.shape = vec![cols, rows];
        self
    }

    /// Reorders the rows of a Q or K projection (`[n_heads * head_dim, ...]`) from Meta's
    /// interleaved RoPE pairs `(x0, x1), (x2, x3)...` to Hugging Face's rotate-half halves
    /// `(x0, x2, ...), (x1, x3, ...)`, head by head: HF row `h*d + j*d/2 + p` is Meta row
    /// `h*d + 2p + j`. The same permutation turns GGUF's Q/K (which llama.cpp's converter stores
    /// in Meta order) into HF order. Works on biases (1-D) too.
    pub fn interleaved_to_half_split(mut self, n_heads: usize) -> Self {
        let rows = self.shape[0];
        let cols = self.data.len() / rows;
        let mut out = vec![0.0f32; self.data.len()];
        for (hf, meta) in half_split_order(rows, n_heads).into_iter().enumerate() {
            out[hf * cols..(hf + 1) * cols]
                .copy_from_slice(&self.data[meta * cols..(meta + 1) * cols]);
        }
        self.data = out;
        self
    }
}

/// The row order of [`HostTensor::interleaved_to_half_split`]: entry `i` is the Meta-order
/// row that becomes row `i`. Quantized weights are permuted with it row by row.
pub fn half_split_order(rows: usize, n_heads: usize) -> Vec<usize> {
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut order = vec![0; rows];
    for h in 0..n_heads {
        for j in 0..2 {
            for p in 0..half {
                order[h * head_dim + j * half + p] = h * head_dim + 2 * p + j;
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(shape: Vec<usize>, data: Vec<f32>) -> HostTensor {
        HostTensor {
            name: "t".into(),
            file: "f".into(),
            shape,
            data,
        }
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let t = tensor(vec![2, 3], vec![1., 2., 3., 4., 5., 6.]).transposed();
        assert_eq!(t.shape, vec![3, 2]);
        assert_eq!(t.data, vec![1., 4., 2., 5., 3., 6.]);
    }

    #[test]
    fn interleaved_rows_become_half_split_per_head() {
        // Two heads of dim 4, one column: Meta rows (a0 a1 b0 b1) per head -> HF (a0 b0 a1 b1).
        let meta = tensor(vec![8, 1], vec![0., 1., 2., 3., 10., 11., 12., 13.]);
        let hf = meta.interleaved_to_half_split(2);
        assert_eq!(hf.data, vec![0., 2., 1., 3., 10., 12., 11., 13.]);
    }
}
