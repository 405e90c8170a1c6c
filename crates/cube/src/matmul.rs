//! Products on fixed kernel choices (cubek-matmul's strategies, picked by shape and dtype),
//! where burn's matmul autotunes: benchmarking every candidate the first time a shape bucket
//! appears costs seconds on a request's path, and on CUDA its tensor-core candidates run f32
//! products in TF32, off by ~1e-3 from an exact f32 product.
//!
//! | weight | rows | kernel |
//! |---|---|---|
//! | stored `[d_out, d_in]` (kiln's layout on the GPU) | up to [`few_rows_max`] (64 in f32, 24 in f16/bf16) | kiln's `few_rows_kernel`: 32 units per output, 16-byte reads along the input width (decode's matrix-vector products: bandwidth-bound) |
//! | any, f32 | more | cubek's `SimpleUnit` (exact f32 on every device) |
//! | any, f16 or bf16 | up to [`SKINNY_MAX`] (64) | cubek's `SimpleCyclicCmma` on a [`SkinnyTiles`] blueprint: one cube over every row and a narrow strip of columns (batched decode) |
//! | any, f16 or bf16 | more | cubek's `SimpleCyclicCmma` (tensor cores), `SimpleUnit` where the device has none |

use burn_backend::DType;
use burn_backend::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::Plane;
use cubecl::prelude::*;
use cubek::matmul::components::stage::PartitionBuffering;
use cubek::matmul::components::tile::TileMatmulKind;
use cubek::matmul::definition::{
    MatmulElems, MatmulGlobalElems, MatmulProblem, TilingBlueprint, TilingScheme,
};
use cubek::matmul::launch::{Strategy, launch_ref};
use cubek::matmul::routines::BlueprintStrategy;
use cubek::std::InputBinding;

use crate::util::{CubeError, Result, cube_index, empty_like, grid, input_error, unit_last_stride};

/// The most rows `few_rows_kernel` multiplies in f32; more go to cubek's tiled kernels.
pub const FEW_ROWS_MAX: usize = 64;

/// The most rows `few_rows_kernel` multiplies in f16 or bf16, three passes of `CHUNK` (8)
/// rows: each pass reads the activations again, and past about three the tensor-core tiles are
/// faster (the step times on an H200 are in docs/benchmarks.md, "Figures that were in code
/// comments").
pub const FEW_ROWS_MAX_HALF: usize = 3 * CHUNK;

/// The most rows `x` may have for the few-rows kernels (`few_rows_kernel`, and the
/// quantized blocks' `quant_rows_kernel`): [`FEW_ROWS_MAX`] in f32, [`FEW_ROWS_MAX_HALF`] in
/// f16 and bf16, where the tiled products run on tensor cores.
pub fn few_rows_max(dtype: DType) -> usize {
    match dtype {
        DType::F32 => FEW_ROWS_MAX,
        _ => FEW_ROWS_MAX_HALF,
    }
}

/// Rows a unit accumulates at once in `few_rows_kernel`.
const CHUNK: usize = 8;

/// Units that share one output column in `few_rows_kernel` (a warp on NVIDIA).
const LANES: usize = 32;

/// Output columns per cube of `few_rows_kernel`.
const COLUMNS_PER_CUBE: usize = 4;

/// `out[r, j] = Σ_k x[r, k] · w[j, k]`, [`LANES`] units per output column `j`: they stride
/// over the input width a vector at a time (16-byte reads of `w`'s row, contiguous across the
/// lanes), each holding the sums of [`CHUNK`] rows at a time, then add their sums up, with
/// plane operations where the device's planes are [`LANES`] wide and through shared memory
/// elsewhere. More than [`CHUNK`] rows take further passes over the row, which a cube reads
/// again from its cache, not from device memory.
#[cube(launch_unchecked)]
fn few_rows_kernel<F: Float, W: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    w: &Tensor<Vector<W, N>>,
    out: &mut Tensor<F>,
    rows: usize,
    #[comptime] planes: bool,
    #[define(F, W)] _dtypes: [StorageType; 2],
) {
    let unit = UNIT_POS_X as usize;
    let lane = unit % LANES;
    let col = cube_index() * COLUMNS_PER_CUBE + unit / LANES;
    let n = w.shape(0);
    let width = w.vector_size();
    let vectors = w.shape(1) / width;
    let live = col < n;
    let w_row = col * w.stride(0) / width;
    let mut partial = SharedMemory::<f32>::new(LANES * COLUMNS_PER_CUBE * CHUNK);
    let mut first = 0;
    while first < rows {
        let mut acc = Array::<f32>::new(CHUNK);
        #[unroll]
        for r in 0..CHUNK {
            acc[r] = 0.0f32;
        }
        if live {
            let mut i = lane;
            while i < vectors {
                let weight = Vector::<f32, N>::cast_from(w[w_row + i]);
                #[unroll]
                for r in 0..CHUNK {
                    if first + r < rows {
                        let input =
                            Vector::<f32, N>::cast_from(x[(first + r) * x.stride(0) / width + i]);
                        let product = input * weight;
                        #[unroll]
                        for v in 0..width {
                            acc[r] += product[v];
                        }
                    }
                }
                i += LANES;
            }
        }
        if planes {
            #[unroll]
            for r in 0..CHUNK {
                let sum = plane_sum(acc[r]);
                if live && lane == 0 && first + r < rows {
                    out[(first + r) * n + col] = F::cast_from(sum);
                }
            }
        } else {
            // One barrier, then a unit per row adds its column's sums: barriers cost most where
            // there are no planes (lavapipe runs a cube's units as coroutines on a CPU core).
            #[unroll]
            for r in 0..CHUNK {
                partial[r * LANES * COLUMNS_PER_CUBE + unit] = acc[r];
            }
            sync_cube();
            if live && lane < CHUNK && first + lane < rows {
                let base = lane * LANES * COLUMNS_PER_CUBE + unit - lane;
                let mut total = 0.0f32;
                for i in 0..LANES {
                    total += partial[base + i];
                }
                out[(first + lane) * n + col] = F::cast_from(total);
            }
            sync_cube();
        }
        first += CHUNK;
    }
}

/// `few_rows_kernel` on `x` `[m, k]` and `w_out_in` `[n, k]` (its rows may be strided).
fn few_rows<R: CubeRuntime>(x: CubeTensor<R>, w_out_in: CubeTensor<R>) -> CubeTensor<R> {
    let m = x.meta.shape()[0];
    let n = w_out_in.meta.shape()[0];
    let x = unit_last_stride(x);
    let out = empty_like(&x, Shape::new([m, n]), x.dtype);
    let client = x.client.clone();
    let hardware = &client.properties().hardware;
    // Planes exactly as wide as a column's lanes: their sums reduce in registers.
    let planes = client.features().plane.contains(Plane::Ops)
        && hardware.plane_size_min == LANES as u32
        && hardware.plane_size_max == LANES as u32;
    // The widest vector both operands' rows allow (16 bytes of the narrower type at most).
    let width = [&x, &w_out_in]
        .iter()
        .map(|t| {
            cubecl::tensor_vector_size_parallel(
                client.io_optimized_vector_sizes(t.dtype.size()),
                t.meta.shape(),
                t.meta.strides(),
                1,
            )
        })
        .min()
        .unwrap_or(1);
    let dtypes = [x.dtype.into(), w_out_in.dtype.into()];
    // SAFETY: the lanes of column `j < n` read row `j` of `w` (`k / width` vectors from its
    // row start, `width` dividing the row stride and `k`) and the rows below `m` of `x`
    // likewise, and write `out[r, j]` for `r < m`.
    unsafe {
        few_rows_kernel::launch_unchecked::<R>(
            &client,
            grid(n.div_ceil(COLUMNS_PER_CUBE)),
            CubeDim::new_1d((LANES * COLUMNS_PER_CUBE) as u32),
            width,
            x.into_tensor_arg(),
            w_out_in.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            m,
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

/// The cubek strategies [`matmul`] tries for more rows than [`few_rows_max`], best first.
fn strategies<R: CubeRuntime>(x: &CubeTensor<R>, w: &CubeTensor<R>) -> Vec<Strategy> {
    match x.dtype {
        DType::F32 => vec![Strategy::SimpleUnit(Default::default())],
        _ => skinny_strategy(x, w)
            .into_iter()
            .chain([
                Strategy::SimpleCyclicCmma(Default::default()),
                Strategy::SimpleUnit(Default::default()),
            ])
            .collect(),
    }
}

/// The most rows the skinny tensor-core tiles ([`SKINNY_TILES`]) take: batched decode.
pub const SKINNY_MAX: usize = 64;

/// A tensor-core tiling for products of a few dozen rows (batched decode) by a wide weight:
/// one cube covers every row (`stage_m` planes of `partition_m` tiles of `tile.0` rows) and a
/// narrow strip of output columns, so each weight element is read once and the grid has one
/// cube per strip (cubek's own choice for such shapes covers 32 rows by 128 columns, so a
/// 2048-wide output ran on 32 cubes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SkinnyTiles {
    /// The tensor-core instruction's `(m, n, k)`.
    pub tile: (u32, u32, u32),
    /// Tiles per plane along `(m, n, k)`.
    pub partition: (u32, u32, u32),
    /// Planes per cube along `m`.
    pub stage_m: u32,
    /// Double-buffered loads (cubek's `DoubleCyclic`) instead of one stage at a time.
    pub double_buffered: bool,
}

/// The skinny tilings `KILN_GPU_SKINNY_TILES=<index>` picks from (index 0 turns them off); the
/// default is [`SKINNY_DEFAULT`], the fastest at batch 64 on an H200 (docs/benchmarks.md has
/// the comparison; `scripts/gpu/tiles.sh` repeats it).
pub const SKINNY_TILES: [SkinnyTiles; 8] = [
    skinny((16, 16, 16), (1, 1, 8), 4, false),
    skinny((16, 16, 16), (1, 2, 8), 4, false),
    skinny((8, 32, 16), (1, 1, 8), 8, false),
    skinny((16, 16, 16), (1, 1, 4), 4, false),
    skinny((16, 16, 16), (1, 1, 8), 4, true),
    skinny((16, 16, 16), (4, 1, 8), 1, false),
    skinny((8, 32, 16), (2, 1, 8), 4, false),
    skinny((16, 16, 16), (2, 1, 8), 2, false),
];

/// A [`SkinnyTiles`] from its fields in order (one row of the table above per tiling).
const fn skinny(
    tile: (u32, u32, u32),
    partition: (u32, u32, u32),
    stage_m: u32,
    double_buffered: bool,
) -> SkinnyTiles {
    SkinnyTiles {
        tile,
        partition,
        stage_m,
        double_buffered,
    }
}

/// The 1-based index into [`SKINNY_TILES`] used when `KILN_GPU_SKINNY_TILES` is unset.
pub const SKINNY_DEFAULT: usize = 3;

/// `KILN_GPU_SKINNY_TILES`, read once: `None` when unset (the default applies and a failing
/// launch falls back to the general tiles), `Some(0)` for off, `Some(i)` for tiling `i`
/// (a failing launch is then an error: the comparison asked for that tiling).
fn skinny_choice() -> Option<usize> {
    static CHOICE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        std::env::var("KILN_GPU_SKINNY_TILES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
}

/// cubek's strategy for [`SkinnyTiles`] `tiles` on `x` `[m, k]` · `w` `[k, n]`.
fn skinny_blueprint<R: CubeRuntime>(
    tiles: SkinnyTiles,
    x: &CubeTensor<R>,
    w: &CubeTensor<R>,
) -> Option<Strategy> {
    let (m, k, n) = (x.meta.shape()[0], x.meta.shape()[1], w.meta.shape()[1]);
    let layout = |t: &CubeTensor<R>| {
        cubek::std::MatrixLayout::from_shape_and_strides(t.meta.shape(), t.meta.strides(), None)
            .ok()
    };
    let problem = MatmulProblem::from_parameters(
        m,
        n,
        k,
        Shape::new([]),
        Shape::new([]),
        layout(x)?,
        layout(w)?,
        cubek::std::MatrixLayout::RowMajor,
        None,
        None,
        MatmulGlobalElems {
            lhs: x.dtype.into(),
            rhs: w.dtype.into(),
            out: x.dtype.into(),
        },
        Default::default(),
    );
    let scheme = TilingScheme::builder()
        .with_tile_size(tiles.tile.into())
        .with_partition_size(tiles.partition.into())
        .with_stage_size((tiles.stage_m, 1, 1).into())
        .build()
        .ok()?;
    let plane_dim = x.client.properties().hardware.plane_size_max;
    let blueprint = TilingBlueprint::builder(TileMatmulKind::Cmma, scheme, plane_dim, &problem)
        .partition_buffering(PartitionBuffering::Single)
        .build();
    Some(if tiles.double_buffered {
        Strategy::DoubleCyclicCmma(BlueprintStrategy::Forced(blueprint))
    } else {
        Strategy::SimpleCyclicCmma(BlueprintStrategy::Forced(blueprint))
    })
}

/// The skinny strategy for `x` · `w`, when `x` has at most [`SKINNY_MAX`] rows and a tiling is
/// chosen.
fn skinny_strategy<R: CubeRuntime>(x: &CubeTensor<R>, w: &CubeTensor<R>) -> Option<Strategy> {
    if x.meta.shape()[0] > SKINNY_MAX {
        return None;
    }
    let index = skinny_choice().unwrap_or(SKINNY_DEFAULT);
    let tiles = *SKINNY_TILES.get(index.checked_sub(1)?)?;
    skinny_blueprint(tiles, x, w)
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
    if xs[0] <= few_rows_max(x.dtype)
        && let Some(w_out_in) = as_out_in(&w)
    {
        return Ok(few_rows(x, w_out_in));
    }
    let mut last = String::new();
    // A skinny tiling asked for by name is the only one tried: the comparison is about it.
    let strict = x.dtype != DType::F32
        && x.meta.shape()[0] <= SKINNY_MAX
        && skinny_choice().is_some_and(|i| i > 0);
    for strategy in strategies(&x, &w) {
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
        if strict {
            break;
        }
    }
    Err(CubeError::Launch {
        kernel: "matmul",
        reason: format!("no kernel takes x {xs:?} · w {ws:?} ({last})"),
    })
}
