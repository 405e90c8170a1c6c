//! Small tensor constructors every kiln crate needs, and the counted way values cross between
//! the host and the device.
//!
//! Every upload and read-back on a forward's path goes through [`upload`] and [`read_back`],
//! which count them ([`transfers`]): `kiln bench --verbose` prints the counts per decode step,
//! and a test holds them constant whatever the batch or the context.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Int, Tensor, TensorData};

static UPLOADS: AtomicU64 = AtomicU64::new(0);
static READS: AtomicU64 = AtomicU64::new(0);

/// Host-device transfers kiln has made in this process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Host-to-device copies ([`upload`]).
    pub uploads: u64,
    /// Blocking device-to-host reads ([`read_back`]): each waits for the device's queued work.
    pub reads: u64,
}

impl std::ops::Sub for Transfers {
    type Output = Transfers;

    fn sub(self, earlier: Transfers) -> Transfers {
        Transfers {
            uploads: self.uploads - earlier.uploads,
            reads: self.reads - earlier.reads,
        }
    }
}

/// The transfers counted so far.
pub fn transfers() -> Transfers {
    Transfers {
        uploads: UPLOADS.load(Ordering::Relaxed),
        reads: READS.load(Ordering::Relaxed),
    }
}

/// `data` as a tensor on `device` (of the device's default dtype for its kind), counted as one
/// upload.
///
/// # Shapes
/// - `data`'s shape → the tensor's
pub fn upload<B: Backend, const D: usize, K: BasicOps<B>>(
    data: TensorData,
    device: &B::Device,
) -> Tensor<B, D, K> {
    UPLOADS.fetch_add(1, Ordering::Relaxed);
    Tensor::from_data(data, device)
}

/// Counts a blocking read a backend made below burn's tensors (a raw device buffer).
#[cfg(feature = "gpu-runtime")]
pub(crate) fn count_read() {
    READS.fetch_add(1, Ordering::Relaxed);
}

/// `tensor`'s values on the host, counted as one blocking read.
pub fn read_back<B: Backend, const D: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D, K>,
) -> TensorData {
    READS.fetch_add(1, Ordering::Relaxed);
    tensor.into_data()
}

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
    upload(TensorData::new(values, [len]), device)
}

/// A float tensor's values on the host as f32, row-major: one copy of the buffer where the
/// tensor holds f32 (`TensorData::iter` goes through a boxed iterator, a dynamic call a value,
/// which shows on every sampled row of a large vocabulary), converted value by value otherwise.
///
/// # Shapes
/// - `tensor`: any shape → `[tensor.shape().num_elements()]`
pub fn host_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    let data = read_back(tensor);
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
