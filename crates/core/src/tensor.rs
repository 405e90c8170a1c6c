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

/// A float tensor's values on the host as f32, row-major: one copy of the buffer where the
/// tensor holds f32 (`TensorData::iter` goes through a boxed iterator, a dynamic call a value:
/// ~0.1 ms for one row of a 49k-token vocabulary), converted value by value otherwise.
///
/// # Shapes
/// - `tensor`: any shape → `[tensor.shape().num_elements()]`
pub fn host_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    let data = tensor.into_data();
    match data.as_slice::<f32>() {
        Ok(values) => values.to_vec(),
        Err(_) => data.iter::<f32>().collect(),
    }
}

#[cfg(all(test, feature = "cpu"))]
mod tests {
    use burn::tensor::{FloatDType, Tensor};

    use super::host_f32;

    type B = burn::backend::Flex;

    #[test]
    fn host_f32_reads_f32_and_converts_other_dtypes() {
        let device = Default::default();
        let values = [1.5f32, -2.25, 0.0, 1e-3, 65504.0, -7.0];
        let t = Tensor::<B, 2>::from_floats([[1.5, -2.25, 0.0], [1e-3, 65504.0, -7.0]], &device);
        assert_eq!(host_f32(t.clone()), values);
        // f16 holds these exactly but 1e-3, which it rounds.
        let half = host_f32(t.cast(FloatDType::F16));
        let expected: Vec<f32> = values
            .iter()
            .map(|&v| burn::tensor::f16::from_f32(v).to_f32())
            .collect();
        assert_eq!(half, expected);
    }
}
