//! What every kernel's host side shares: the error type, output allocation and grid sizes.

use burn_backend::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::CubeCount;

/// Why a kernel was not launched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CubeError {
    /// An input's shape or dtype does not fit the kernel.
    #[error("{kernel}: {reason}")]
    Input {
        /// The kernel.
        kernel: &'static str,
        /// What is wrong, with the shapes involved.
        reason: String,
    },
    /// The kernel library the product needs refused the problem.
    #[error("{kernel}: {reason}")]
    Launch {
        /// The kernel.
        kernel: &'static str,
        /// The library's error.
        reason: String,
    },
}

/// kiln-cube's result.
pub type Result<T> = std::result::Result<T, CubeError>;

pub(crate) fn input_error<T>(kernel: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(CubeError::Input {
        kernel,
        reason: reason.into(),
    })
}

/// A new row-major tensor of `shape` on `like`'s device, never padded (CUDA pads the rows of
/// the tensors burn allocates for its own kernels; kiln's kernels index plain rows).
pub(crate) fn empty_like<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: impl Into<Shape>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// `t` with a unit stride on its last dimension and rows that may be padded or strided (a copy
/// only when its last dimension is not contiguous).
pub(crate) fn unit_last_stride<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    let rank = t.meta.shape().len();
    if rank == 0 || t.meta.strides()[rank - 1] == 1 || t.meta.shape()[rank - 1] == 1 {
        t
    } else {
        into_contiguous(t)
    }
}

/// `t` row-major without padding (a copy only when it is not).
pub(crate) fn contiguous<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    into_contiguous(t)
}

/// The largest cube count along one grid dimension every backend accepts (WebGPU's minimum
/// limit, and lavapipe's).
pub(crate) const MAX_GRID: u32 = 65_535;

/// A grid of at least `cubes` cubes laid over two dimensions when one is not enough; kernels
/// find their index with `cube_index()` and skip indices past `cubes`.
pub(crate) fn grid(cubes: usize) -> CubeCount {
    let cubes = cubes.max(1) as u32;
    if cubes <= MAX_GRID {
        CubeCount::Static(cubes, 1, 1)
    } else {
        let x = MAX_GRID;
        CubeCount::Static(x, cubes.div_ceil(x), 1)
    }
}

/// The cube's index in a grid made by [`grid`].
#[cubecl::cube]
pub(crate) fn cube_index() -> usize {
    use cubecl::prelude::*;
    CUBE_POS_X as usize + CUBE_POS_Y as usize * CUBE_COUNT_X as usize
}
