//! Products on fixed kernel choices (cubek-matmul's strategies, picked by shape and dtype),
//! where burn's matmul autotunes: benchmarking every candidate the first time a shape bucket
//! appears costs seconds on a request's path, and on CUDA its tensor-core candidates run f32
//! products in TF32, off by ~1e-3 from an exact f32 product.
//!
//! | weight | rows | kernel |
//! |---|---|---|
//! | stored `[d_out, d_in]` (kiln's layout on the GPU) | up to [`FEW_ROWS_MAX`] | kiln's [`few_rows_kernel`]: a cube per output, its dot products over the input width (decode's matrix-vector products: bandwidth-bound) |
//! | any, f32 | more | cubek's `SimpleUnit` (exact f32 on every device) |
//! | any, f16 or bf16 | more | cubek's `SimpleCyclicCmma` (tensor cores), `SimpleUnit` where the device has none |

use burn_backend::DType;
use burn_backend::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::Plane;
use cubecl::prelude::*;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{Strategy, launch_ref};
use cubek::std::InputBinding;

use crate::util::{CubeError, Result, cube_index, empty_like, grid, input_error, unit_last_stride};

/// The most rows [`few_rows_kernel`] multiplies; more go to cubek's tiled kernels.
pub const FEW_ROWS_MAX: usize = 64;

/// Rows a unit accumulates at once in [`few_rows_kernel`].
const CHUNK: usize = 8;

/// Units per cube of [`few_rows_kernel`].
const BLOCK: usize = 128;

/// `out[r, j] = Σ_k x[r, k] · w[j, k]` for one output column `j` per cube: its units stride
/// over the input width (reads of `w`'s row are contiguous across units), each holding the sums
/// of [`CHUNK`] rows at a time, then add their sums up, with plane operations where the device
/// has them and through shared memory where it has not.
#[cube(launch_unchecked)]
fn few_rows_kernel<F: Float, W: Float>(
    x: &Tensor<F>,
    w: &Tensor<W>,
    out: &mut Tensor<F>,
    rows: usize,
    #[comptime] block: usize,
    #[comptime] planes: bool,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let col = cube_index();
    let n = w.shape(0);
    let k = w.shape(1);
    let t = UNIT_POS_X as usize;
    let live = col < n;
    let mut partial = SharedMemory::<f32>::new(block * CHUNK);
    let mut first = 0;
    while first < rows {
        let mut acc = Array::<f32>::new(CHUNK);
        #[unroll]
        for r in 0..CHUNK {
            acc[r] = 0.0f32;
        }
        if live {
            let mut i = t;
            while i < k {
                let weight = f32::cast_from(w[col * w.stride(0) + i]);
                #[unroll]
                for r in 0..CHUNK {
                    if first + r < rows {
                        acc[r] += f32::cast_from(x[(first + r) * x.stride(0) + i]) * weight;
                    }
                }
                i += block;
            }
        }
        if planes {
            let lanes = PLANE_DIM as usize;
            let warps = block / lanes;
            let warp = t / lanes;
            #[unroll]
            for r in 0..CHUNK {
                let sum = plane_sum(acc[r]);
                if UNIT_POS_PLANE == 0 {
                    partial[r * block + warp] = sum;
                }
            }
            sync_cube();
            if live && t < CHUNK && first + t < rows {
                let mut total = 0.0f32;
                for i in 0..warps {
                    total += partial[t * block + i];
                }
                out[(first + t) * n + col] = F::cast_from(total);
            }
        } else {
            // One barrier, then a unit per row adds the cube's sums: barriers cost most where
            // there are no planes (lavapipe runs a cube's units as coroutines on a CPU core).
            #[unroll]
            for r in 0..CHUNK {
                partial[r * block + t] = acc[r];
            }
            sync_cube();
            if live && t < CHUNK && first + t < rows {
                let mut total = 0.0f32;
                for i in 0..block {
                    total += partial[t * block + i];
                }
                out[(first + t) * n + col] = F::cast_from(total);
            }
        }
        sync_cube();
        first += CHUNK;
    }
}

/// [`few_rows_kernel`] on `x` `[m, k]` and `w_out_in` `[n, k]` (its rows may be strided).
fn few_rows<R: CubeRuntime>(x: CubeTensor<R>, w_out_in: CubeTensor<R>) -> CubeTensor<R> {
    let m = x.meta.shape()[0];
    let n = w_out_in.meta.shape()[0];
    let x = unit_last_stride(x);
    let out = empty_like(&x, Shape::new([m, n]), x.dtype);
    let client = x.client.clone();
    let hardware = &client.properties().hardware;
    // Planes of one fixed size that divides the cube: sums reduce within a plane first.
    let planes = client.features().plane.contains(Plane::Ops)
        && hardware.plane_size_min == hardware.plane_size_max
        && hardware.plane_size_max > 0
        && BLOCK.is_multiple_of(hardware.plane_size_max as usize);
    let dtypes = [x.dtype.into(), w_out_in.dtype.into()];
    // SAFETY: cube `j < n` reads row `j` of `w` (its `k` values through its row stride) and
    // rows below `m` of `x`, and writes `out[r, j]` for `r < m`.
    unsafe {
        few_rows_kernel::launch_unchecked::<R>(
            &client,
            grid(n),
            CubeDim::new_1d(BLOCK as u32),
            x.into_tensor_arg(),
            w_out_in.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            m,
            BLOCK,
            planes,
            dtypes,
        );
    }
    out
}

/// `w` `[k, n]` as the `[n, k]` tensor it is a transposed view of, when it is one (its first
/// dimension has a unit stride).
fn as_out_in<R: CubeRuntime>(w: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    let (shape, strides) = (w.meta.shape(), w.meta.strides());
    (strides[0] == 1 || shape[0] == 1).then(|| CubeTensor {
        meta: Box::new(burn_std::Metadata::new(
            Shape::new([shape[1], shape[0]]),
            burn_std::strides![strides[1], 1],
        )),
        ..w.clone()
    })
}

/// The cubek strategies [`matmul`] tries for more than [`FEW_ROWS_MAX`] rows, best first.
fn strategies<R: CubeRuntime>(x: &CubeTensor<R>) -> Vec<Strategy> {
    match x.dtype {
        DType::F32 => vec![Strategy::SimpleUnit(Default::default())],
        _ => vec![
            Strategy::SimpleCyclicCmma(Default::default()),
            Strategy::SimpleUnit(Default::default()),
        ],
    }
}

/// `x · w` on a fixed kernel choice (see the module's table), accumulated in f32.
///
/// # Shapes
/// - `x`: `[m, k]`, `w`: `[k, n]` (row-major, or the transposed view of a row-major
///   `[n, k]`) → `[m, n]` in `x`'s dtype
///
/// # Errors
/// [`CubeError::Input`] when the shapes disagree; [`CubeError::Launch`] when no kernel takes
/// the problem.
pub fn matmul<R: CubeRuntime>(x: CubeTensor<R>, w: CubeTensor<R>) -> Result<CubeTensor<R>> {
    let (xs, ws) = (x.meta.shape().to_vec(), w.meta.shape().to_vec());
    if xs.len() != 2 || ws.len() != 2 || xs[1] != ws[0] {
        return input_error("matmul", format!("x {xs:?} and w {ws:?} do not multiply"));
    }
    if xs[0] <= FEW_ROWS_MAX
        && let Some(w_out_in) = as_out_in(&w)
    {
        return Ok(few_rows(x, w_out_in));
    }
    let mut last = String::new();
    for strategy in strategies(&x) {
        let out = init_matmul_output(&x, &w, x.dtype);
        let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
            lhs: x.dtype.into(),
            rhs: w.dtype.into(),
            out: out.dtype.into(),
        });
        let (x_dtype, w_dtype) = (x.dtype, w.dtype);
        match launch_ref(
            &strategy,
            &x.client,
            InputBinding::new(x.clone().binding(), x_dtype.into()),
            InputBinding::new(w.clone().binding(), w_dtype.into()),
            out.clone().binding(),
            &mut dtypes,
        ) {
            Ok(()) => return Ok(out),
            Err(err) => last = format!("{strategy}: {err:?}"),
        }
    }
    Err(CubeError::Launch {
        kernel: "matmul",
        reason: format!("no kernel takes x {xs:?} · w {ws:?} ({last})"),
    })
}
