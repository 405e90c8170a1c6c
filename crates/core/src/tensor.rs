//! Small tensor constructors every kiln crate needs.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// A 1-D Int tensor of indices, in the device's default int dtype.
///
/// # Shapes
/// - returns `[values.len()]`
pub fn int_tensor<B: Backend>(
    values: impl IntoIterator<Item = usize>,
    device: &B::Device,
) -> Tensor<B, 1, Int> {
    let values: Vec<i64> = values.into_iter().map(|v| v as i64).collect();
    let len = values.len();
    Tensor::from_data(TensorData::new(values, [len]), device)
}
