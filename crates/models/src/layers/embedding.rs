//! [`Embedding`]: the token table, dense on the device or kept in its quantized GGUF blocks,
//! and the output head it becomes when the model ties them.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use kiln_core::InferenceBackend;
use kiln_core::backend::QuantWeight;
use kiln_core::tensor::int_tensor;
use kiln_kernels::QuantMatrix;

use super::linear::{Linear, LinearWeight};

/// A `[vocab, d_model]` token table.
#[derive(Debug, Clone)]
pub enum Embedding<B: InferenceBackend> {
    /// In the model's dtype, on the device.
    Dense(Tensor<B, 2>),
    /// In ggml blocks on the host; looked-up rows are dequantized to f32.
    Quantized(Arc<QuantMatrix>),
}

impl<B: InferenceBackend> Embedding<B> {
    /// The rows of `tokens`.
    ///
    /// # Shapes
    /// - `tokens`: `n` ids → `[n, d_model]`
    pub fn lookup(&self, tokens: Vec<usize>, device: &B::Device) -> Tensor<B, 2> {
        match self {
            Embedding::Dense(table) => table.clone().select(0, int_tensor::<B>(tokens, device)),
            Embedding::Quantized(table) => {
                let d = table.cols();
                let mut rows = vec![0f32; tokens.len() * d];
                for (row, &t) in rows.chunks_exact_mut(d).zip(&tokens) {
                    table.dequantize_row(t, row);
                }
                kiln_core::tensor::upload(TensorData::new(rows, [tokens.len(), d]), device)
            }
        }
    }

    /// The output head of a tied model: the same table read as `[d_model, vocab]` (a
    /// transposed view, or the same quantized blocks, which are already `[d_out, d_in]`).
    pub fn as_head(&self) -> Linear<B> {
        let weight = match self {
            Embedding::Dense(table) => LinearWeight::Dense(table.clone().transpose()),
            Embedding::Quantized(table) => {
                LinearWeight::Quantized(B::QuantWeight::new(Arc::clone(table)))
            }
        };
        Linear { weight, bias: None }
    }

    /// The first row, in f32 (for the model's fingerprint).
    pub fn first_row(&self) -> Vec<f32> {
        match self {
            Embedding::Dense(table) => {
                let [_, d] = table.dims();
                table
                    .clone()
                    .slice([0..1, 0..d])
                    .cast(burn::tensor::FloatDType::F32)
                    .into_data()
                    .iter::<f32>()
                    .collect()
            }
            Embedding::Quantized(table) => {
                let mut row = vec![0f32; table.cols()];
                table.dequantize_row(0, &mut row);
                row
            }
        }
    }
}
