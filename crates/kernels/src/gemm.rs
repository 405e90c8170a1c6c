//! f32 matrix products with many activation rows (a prefill's hundreds of tokens) on the
//! exact path, `out = x · w` with `w` in kiln's `Linear` layout `[d_in, d_out]`, and the same
//! walk for 16-bit float weights ([`crate::float16`]), whose columns are widened as they are
//! packed.
//!
//! Register blocking as in BLIS: each task owns 32 or 64 output columns (and all rows, unless
//! the columns alone make too few tasks for the threads; `Blocks`), copies those weight
//! columns once into a scratch buffer of 32-wide panels (`[panel][k][32]`, contiguous from a
//! cache line's start, zero-padded past `n`: 74 KiB a panel at k = 576, 197 KiB at k = 1536,
//! in L2), then walks its rows in tiles (AVX-512: 12 rows × 32 columns, 24 accumulator
//! registers; AVX2: 6 rows × 16 columns, 12 of its 16 registers; the scalar reference,
//! 3 × 32): per step of `k`, two loads of the panel, one broadcast per row, two fused
//! multiply-adds per row. On AVX2 the broadcasts come from a copy of `x` packed once per
//! product as BLIS packs its A (`[m / 6][k][6]`: a tile's six values of a step side by side,
//! one pointer for all six). The whole `k` is summed in registers (AVX2: in blocks of `k`) and
//! each output is written once.
//!
//! Every output element is `Σ_i x[t, i] · w[i, j]` summed in order of `i` with one fused
//! multiply-add per term, in every tier, so the tiers agree bit for bit with the scalar
//! reference (and a row's result does not depend on which other rows share the call).

use crate::SharedOut;
use crate::pool::ThreadPool;
use crate::tier::Tier;

/// Columns of a packed panel: two AVX-512 registers.
pub(crate) const PANEL: usize = 32;

/// Rows of the widest tile (AVX-512: 12 × 2 accumulators + 2 panel loads + 1 broadcast of the
/// 32 registers).
const MAX_TILE_ROWS: usize = 12;

/// Rows per tile of the portable walk (the scalar reference): 3 rows × 32 columns.
const PORTABLE_TILE_ROWS: usize = 3;

/// The AVX2 tile: 6 rows × 16 columns, 12 accumulators of the 16 registers (as BLIS's
/// Haswell kernel). 6 divides [`MAX_TILE_ROWS`], so a task's rows split into whole tiles but
/// for its last.
#[cfg(target_arch = "x86_64")]
const AVX2_TILE_ROWS: usize = 6;
#[cfg(target_arch = "x86_64")]
const AVX2_TILE_COLS: usize = 16;

/// Rows of an AVX2 block: their steps of `k` (`AVX2_BLOCK_K × 4` bytes each, 96 KiB in
/// all) stay in L2 while each half of the panel walks them. A multiple of the tile's 6.
#[cfg(target_arch = "x86_64")]
const AVX2_BLOCK_ROWS: usize = 96;

/// Steps of `k` an AVX2 block sums before the next: a 16-column half of the panel over them
/// is 16 KiB, half of L1.
#[cfg(target_arch = "x86_64")]
const AVX2_BLOCK_K: usize = 256;

/// From this size of `x` (bytes) on, past what a core's share of L3 keeps, the AVX2 walk
/// reads each block of `x` once for all of its task's panels ([`Task::run_avx2`])
/// instead of once per panel, and its tasks take four panels where there are enough.
#[cfg(target_arch = "x86_64")]
const AVX2_LONG_X_BYTES: usize = 8 << 20;

/// Rows of a block in the long walk: their steps of a `k` block (192 KiB) and the task's
/// four panels over those steps (128 KiB) share L2.
#[cfg(target_arch = "x86_64")]
const AVX2_LONG_BLOCK_ROWS: usize = 192;

/// One AVX2 tile's work: its first row `t`, the steps of `k` it adds, where its 16 columns
/// start in the panel, and its rows' running sums (`[R][PANEL]`).
#[cfg(target_arch = "x86_64")]
struct Avx2Tile<'a> {
    t: usize,
    steps: std::ops::Range<usize>,
    offset: usize,
    sums: &'a mut [f32],
}

/// f32 values in a 64-byte cache line.
const LINE_FLOATS: usize = 16;

thread_local! {
    /// Each thread's packed weight panels, reused across calls.
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The calling thread's activations packed in AVX2 tiles ([`pack_x_tiles`]), reused
    /// across calls: as long as the widest `x` this thread has multiplied.
    #[cfg(target_arch = "x86_64")]
    static X_TILES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out = x · w` on the active tier and the global pool.
///
/// # Shapes
/// - `w`: `[k, n]` row-major, `x`: `[m, k]` → `out`: `[m, n]`
///
/// # Panics
/// If the lengths disagree with the shapes.
pub fn gemm_in_out(w: &[f32], k: usize, n: usize, x: &[f32], m: usize, out: &mut [f32]) {
    gemm_in_out_with(w, k, n, x, m, out, Tier::active(), ThreadPool::global());
}

/// [`gemm_in_out`] on a given tier and pool.
///
/// # Panics
/// As [`gemm_in_out`], and if this CPU cannot run `tier`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_in_out_with(
    w: &[f32],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
) {
    crate::dense::check_shapes(w, k, n, x, m, out, tier);
    gemm_packed_with(k, n, x, m, out, tier, pool, &|cols, packed| {
        pack_in_out(w, k, n, cols, packed)
    });
}

/// What a product's weights give the tile walk: the columns `cols` of the `[k, n]` weight
/// matrix written into `packed` as `[panel][k][PANEL]` panels, zero past the last column
/// (`packed` is `cols.len().div_ceil(PANEL) × k × PANEL` long). f32 `[k, n]` weights copy
/// them ([`pack_in_out`]); 16-bit `[n, k]` rows widen them ([`crate::float16`]).
pub(crate) type PackPanels<'a> = dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync + 'a;

/// `out = x · w` for a weight matrix `[k, n]` that `pack` lays out in panels, on `tier`
/// and `pool`: the product every store of weights shares, so that each gives the same bits
/// for the same values.
///
/// # Shapes
/// - `x`: `[m, k]` → `out`: `[m, n]`
///
/// The caller checks the shapes and the tier.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_packed_with(
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
    pack: &PackPanels<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if tier == Tier::Avx2 {
        let long = m * k * size_of::<f32>() >= AVX2_LONG_X_BYTES;
        X_TILES.with_borrow_mut(|x_tiles| {
            pack_x_tiles(x, m, k, x_tiles, pool);
            run_tasks(k, n, x, x_tiles, long, m, out, tier, pool, pack);
        });
        return;
    }
    run_tasks(k, n, x, &[], false, m, out, tier, pool, pack);
}

/// The tasks of [`gemm_packed_with`]; `x_tiles` is `x` packed in AVX2 tiles
/// ([`pack_x_tiles`]) on the AVX2 tier, empty on the others; `long` (AVX2 only) takes the
/// walk's order for a large `x` ([`Task::run_avx2`]).
#[allow(clippy::too_many_arguments)]
fn run_tasks(
    k: usize,
    n: usize,
    x: &[f32],
    x_tiles: &[f32],
    long: bool,
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
    pack: &PackPanels<'_>,
) {
    let blocks = Blocks::new(m, n, pool.threads(), long);
    let out = SharedOut::new(out);
    pool.run(blocks.tasks(), &|task| {
        let (cols, rows) = blocks.task(task);
        PACKED.with_borrow_mut(|scratch| {
            let len = cols.len().div_ceil(PANEL) * k * PANEL;
            // A panel row's 16-column halves each fill one cache line only from a 64-byte
            // boundary (the allocator promises 16).
            if scratch.len() < len + LINE_FLOATS {
                scratch.resize(len + LINE_FLOATS, 0.0);
            }
            let start = scratch.as_ptr().align_offset(64).min(LINE_FLOATS);
            let packed = &mut scratch[start..start + len];
            pack(cols.clone(), packed);
            let job = Task {
                x,
                x_tiles,
                long,
                k,
                n,
                packed,
                rows,
                cols,
                out: &out,
            };
            match tier {
                Tier::Scalar => job.run_portable(),
                // SAFETY: the tier's features were checked by the caller.
                #[cfg(target_arch = "x86_64")]
                Tier::Avx2 => unsafe { job.run_avx2() },
                // SAFETY: as above; this tier includes AVX-512F.
                #[cfg(target_arch = "x86_64")]
                Tier::Avx512Vnni => unsafe { job.run_avx512() },
                #[allow(unreachable_patterns)]
                _ => unreachable!("no such tier on this architecture"),
            }
        });
    });
}

/// How a product's outputs split into tasks: by columns first, so that each weight column
/// is packed once per call (a task splitting rows too packs its columns again); by rows as
/// well only when the columns alone make too few tasks to keep every thread busy.
struct Blocks {
    m: usize,
    n: usize,
    /// Columns per task: one or two panels.
    cols: usize,
    /// Rows per task, a multiple of the widest tile.
    rows: usize,
}

impl Blocks {
    /// `long`: the walk reads each block of `x` once for all of a task's panels, so tasks
    /// take four panels where there are enough of them.
    fn new(m: usize, n: usize, threads: usize, long: bool) -> Self {
        // Two-panel tasks halve the number of tasks (each a claim on the pool and a scratch
        // borrow) where there are plenty; one-panel tasks halve the granularity where two
        // would leave threads unevenly loaded.
        let cols = if long && n.div_ceil(4 * PANEL) >= 8 * threads {
            4 * PANEL
        } else if n.div_ceil(2 * PANEL) >= 8 * threads {
            2 * PANEL
        } else {
            PANEL
        };
        let col_tasks = n.div_ceil(cols);
        let row_blocks = (4 * threads)
            .div_ceil(col_tasks)
            .min(m.div_ceil(MAX_TILE_ROWS))
            .max(1);
        let rows = m.div_ceil(row_blocks).next_multiple_of(MAX_TILE_ROWS);
        Self { m, n, cols, rows }
    }

    fn tasks(&self) -> usize {
        self.n.div_ceil(self.cols) * self.m.div_ceil(self.rows)
    }

    /// Task `task`'s (columns, rows); a column block's row blocks are consecutive tasks.
    fn task(&self, task: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let row_blocks = self.m.div_ceil(self.rows);
        let (cb, rb) = (task / row_blocks, task % row_blocks);
        (
            cb * self.cols..((cb + 1) * self.cols).min(self.n),
            rb * self.rows..((rb + 1) * self.rows).min(self.m),
        )
    }
}

/// Copies the columns `cols` of the `[k, n]` matrix `w` into `packed`'s `[panel][k][PANEL]`
/// panels, zero past the last column.
fn pack_in_out(w: &[f32], k: usize, n: usize, cols: std::ops::Range<usize>, packed: &mut [f32]) {
    for (p, panel) in packed.chunks_exact_mut(k * PANEL).enumerate() {
        let start = cols.start + p * PANEL;
        let width = (cols.end - start).min(PANEL);
        for (i, dst) in panel.chunks_exact_mut(PANEL).enumerate() {
            dst[..width].copy_from_slice(&w[i * n + start..i * n + start + width]);
            dst[width..].fill(0.0);
        }
    }
}

/// `x` (`[m, k]`) packed for the AVX2 tile walk as `[m / 6][k][6]` (the rows past `m` in the
/// last tile zero): a tile's six broadcasts per step of `k` then come from one pointer at
/// constant offsets, as BLIS packs its A. Packed once per product, by the pool.
#[cfg(target_arch = "x86_64")]
fn pack_x_tiles(x: &[f32], m: usize, k: usize, x_tiles: &mut Vec<f32>, pool: &ThreadPool) {
    const R: usize = AVX2_TILE_ROWS;
    let tiles = m.div_ceil(R);
    // Every value is written below (the last tile's missing rows as zeros): no clearing.
    if x_tiles.len() < tiles * k * R {
        x_tiles.resize(tiles * k * R, 0.0);
    }
    let x_tiles = &mut x_tiles[..tiles * k * R];
    let dst = SharedOut::new(x_tiles);
    // Eight tiles a task: 48 rows, tens of microseconds of copying at prefill's widths.
    const TILES_PER_TASK: usize = 8;
    pool.run(tiles.div_ceil(TILES_PER_TASK), &|task| {
        for tile in task * TILES_PER_TASK..((task + 1) * TILES_PER_TASK).min(tiles) {
            // SAFETY: each tile's `k × 6` values are written by exactly one task.
            let packed = unsafe { dst.slice(tile * k * R, k * R) };
            let rows = R.min(m - tile * R);
            let x = &x[tile * R * k..(tile * R + rows) * k];
            for (i, step) in packed.chunks_exact_mut(R).enumerate() {
                for (r, v) in step.iter_mut().enumerate() {
                    *v = if r < rows { x[r * k + i] } else { 0.0 };
                }
            }
        }
    });
}

/// One task: output rows `rows` × columns `cols`, with those columns' weights packed.
struct Task<'a> {
    x: &'a [f32],
    /// `x` packed in AVX2 tiles ([`pack_x_tiles`]) on the AVX2 tier; empty on the others.
    x_tiles: &'a [f32],
    /// `x` is large enough for the AVX2 walk's long order ([`AVX2_LONG_X_BYTES`]).
    long: bool,
    k: usize,
    n: usize,
    packed: &'a [f32],
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    out: &'a SharedOut<f32>,
}

impl Task<'_> {
    /// Each panel of the task's columns, as (first column, width, packed `[k][PANEL]`).
    fn panels(&self) -> impl Iterator<Item = (usize, usize, &[f32])> {
        let k = self.k;
        self.packed
            .chunks_exact(k * PANEL)
            .enumerate()
            .map(move |(p, panel)| {
                let start = self.cols.start + p * PANEL;
                (start, (self.cols.end - start).min(PANEL), panel)
            })
    }

    /// The portable tile walk, the scalar reference.
    fn run_portable(&self) {
        for (col, width, panel) in self.panels() {
            let mut t = self.rows.start;
            while t < self.rows.end {
                let rows = (self.rows.end - t).min(PORTABLE_TILE_ROWS);
                let mut acc = [[0f32; PANEL]; PORTABLE_TILE_ROWS];
                for (i, wv) in panel.chunks_exact(PANEL).enumerate() {
                    for (r, acc) in acc.iter_mut().take(rows).enumerate() {
                        let a = self.x[(t + r) * self.k + i];
                        for (y, b) in acc.iter_mut().zip(wv) {
                            *y = a.mul_add(*b, *y);
                        }
                    }
                }
                for (r, acc) in acc.iter().take(rows).enumerate() {
                    // SAFETY: each (row, column) belongs to exactly one task.
                    let dst = unsafe { self.out.slice((t + r) * self.n + col, width) };
                    dst.copy_from_slice(&acc[..width]);
                }
                t += rows;
            }
        }
    }

    /// The AVX2 tile walk, blocked as BLIS blocks it: per block of [`AVX2_BLOCK_ROWS`] rows
    /// and [`AVX2_BLOCK_K`] steps of `k`, each 16-column half of the panel is walked in 6-row
    /// tiles (then one tile of the rows left), so that the half's slice of the panel (16 KiB)
    /// and a tile's rows of `x` stay in L1 and the block's rows in L2. A tile's sums wait in
    /// `sums` between blocks of `k` (stored and loaded unrounded), so each output is still one
    /// fused multiply-add per term in order of `k`. (Compiled for AVX2, the portable walk
    /// stayed scalar: LLVM did not vectorize its row loop of run-time length.)
    ///
    /// A large `x` (`long`) is walked in blocks of [`AVX2_LONG_BLOCK_ROWS`] rows, each block
    /// and block of `k` serving every panel of the task, so that each block of `x` comes from
    /// memory once per task rather than once per panel.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self) {
        let panels: Vec<_> = self.panels().collect();
        if self.long {
            // SAFETY: as this function's.
            unsafe { self.walk_avx2(&panels, AVX2_LONG_BLOCK_ROWS) };
        } else {
            for panel in panels.chunks(1) {
                // SAFETY: as this function's.
                unsafe { self.walk_avx2(panel, AVX2_BLOCK_ROWS) };
            }
        }
    }

    /// The task's rows past `panels` (as [`Self::panels`] gives them) in blocks of
    /// `block_rows` rows: per block and block of `k`, every panel in turn.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `block_rows` is a multiple of 6.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn walk_avx2(&self, panels: &[(usize, usize, &[f32])], block_rows: usize) {
        let panel_sums = block_rows * PANEL;
        let mut sums = vec![0f32; panel_sums * panels.len()];
        for block in (self.rows.start..self.rows.end).step_by(block_rows) {
            let rows = block..(block + block_rows).min(self.rows.end);
            sums.fill(0.0);
            for k0 in (0..self.k).step_by(AVX2_BLOCK_K) {
                let steps = k0..(k0 + AVX2_BLOCK_K).min(self.k);
                for (&(_, width, panel), sums) in
                    panels.iter().zip(sums.chunks_exact_mut(panel_sums))
                {
                    // SAFETY: as this function's; `sums` holds the block's rows.
                    unsafe { self.block_avx2(panel, width, rows.clone(), steps.clone(), sums) };
                }
            }
            for (&(col, width, _), sums) in panels.iter().zip(sums.chunks_exact(panel_sums)) {
                self.store_block(col, width, rows.clone(), sums);
            }
        }
    }

    /// Adds steps `steps` of the block of rows `rows` × one panel's `width` columns to the
    /// block's sums (`[rows.len()][PANEL]` at the start of `sums`): each 16-column half of
    /// the panel walked in 6-row tiles, then one tile of the rows left.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `rows` start at a multiple of 6 and lie in `x`,
    /// `steps` in `0..k`; `panel` is `[k][PANEL]`; `sums` holds at least `rows.len()` rows of
    /// `PANEL` values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(
        &self,
        panel: &[f32],
        width: usize,
        rows: std::ops::Range<usize>,
        steps: std::ops::Range<usize>,
        sums: &mut [f32],
    ) {
        for half in (0..width).step_by(AVX2_TILE_COLS) {
            let mut t = rows.start;
            while t < rows.end {
                let tile_rows = (rows.end - t).min(AVX2_TILE_ROWS);
                let at = (t - rows.start) * PANEL;
                let tile = Avx2Tile {
                    t,
                    steps: steps.clone(),
                    offset: half,
                    sums: &mut sums[at..at + tile_rows * PANEL],
                };
                // SAFETY: the contract, and `half + 16 <= PANEL`; `tile.sums` holds the
                // tile's rows of PANEL values.
                unsafe {
                    match tile_rows {
                        6 => self.tile_avx2::<6>(tile, panel),
                        5 => self.tile_avx2::<5>(tile, panel),
                        4 => self.tile_avx2::<4>(tile, panel),
                        3 => self.tile_avx2::<3>(tile, panel),
                        2 => self.tile_avx2::<2>(tile, panel),
                        _ => self.tile_avx2::<1>(tile, panel),
                    }
                }
                t += tile_rows;
            }
        }
    }

    /// Writes a block's finished sums (`[rows.len()][PANEL]`) to the output's rows `rows`,
    /// columns `col..col + width`.
    #[cfg(target_arch = "x86_64")]
    fn store_block(&self, col: usize, width: usize, rows: std::ops::Range<usize>, sums: &[f32]) {
        for (row, row_sums) in rows.zip(sums.chunks_exact(PANEL)) {
            // SAFETY: the row's columns col..col + width belong to this task alone.
            let dst = unsafe { self.out.slice(row * self.n + col, width) };
            dst.copy_from_slice(&row_sums[..width]);
        }
    }

    /// Adds steps `tile.steps` of rows `tile.t..tile.t + R` × 16 of the panel's columns (from
    /// `tile.offset`) to the tile's sums, in 2R registers (12 of the 16 with 6 rows, beside
    /// two panel loads and a broadcast). The rows' values come from `x_tiles`, a tile's six of
    /// a step of `k` side by side, so that the broadcasts share one pointer.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `x_tiles` is `x` packed by [`pack_x_tiles`] and
    /// `tile.t` a multiple of 6 with rows `tile.t..tile.t + R` in `x`; `panel` is
    /// `[k][PANEL]`, `tile.steps` lie in `0..k`, `tile.offset + 16 <= PANEL` and `tile.sums`
    /// holds `R` rows of `PANEL` values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_avx2<const R: usize>(&self, tile: Avx2Tile<'_>, panel: &[f32]) {
        use std::arch::x86_64::*;
        const STRIDE: usize = AVX2_TILE_ROWS;
        let (k, t) = (self.k, tile.t);
        debug_assert!(t % STRIDE == 0 && (t / STRIDE + 1) * k * STRIDE <= self.x_tiles.len());
        debug_assert!(tile.offset + AVX2_TILE_COLS <= PANEL && tile.steps.end <= k);
        debug_assert!(tile.sums.len() == R * PANEL);
        let sums = tile.sums.as_mut_ptr();
        // SAFETY: `sums` holds R rows of PANEL values and `offset + 16 <= PANEL`.
        let mut lo: [__m256; R] =
            std::array::from_fn(|r| unsafe { _mm256_loadu_ps(sums.add(r * PANEL + tile.offset)) });
        // SAFETY: as above.
        let mut hi: [__m256; R] = std::array::from_fn(|r| unsafe {
            _mm256_loadu_ps(sums.add(r * PANEL + tile.offset + 8))
        });
        // SAFETY: tile t / 6 of x_tiles exists (the contract).
        let xt = unsafe { self.x_tiles.as_ptr().add(t / STRIDE * k * STRIDE) };
        // SAFETY: `offset + 16 <= PANEL`, so every load below lies in row `i` of the panel.
        let b = unsafe { panel.as_ptr().add(tile.offset) };
        // One step of k: two panel loads, a broadcast and two fused multiply-adds per row.
        let step = |i: usize, lo: &mut [__m256; R], hi: &mut [__m256; R]| {
            // SAFETY: i < k, so both loads lie in the panel and every x read in the tile.
            unsafe {
                let b_lo = _mm256_loadu_ps(b.add(i * PANEL));
                let b_hi = _mm256_loadu_ps(b.add(i * PANEL + 8));
                let a_row = xt.add(i * STRIDE);
                for r in 0..R {
                    let a = _mm256_broadcast_ss(&*a_row.add(r));
                    lo[r] = _mm256_fmadd_ps(a, b_lo, lo[r]);
                    hi[r] = _mm256_fmadd_ps(a, b_hi, hi[r]);
                }
            }
        };
        // Four steps a turn: the loop's own instructions, not the multiply-adds, limited
        // the one-step loop.
        let mut i = tile.steps.start;
        while i + 4 <= tile.steps.end {
            step(i, &mut lo, &mut hi);
            step(i + 1, &mut lo, &mut hi);
            step(i + 2, &mut lo, &mut hi);
            step(i + 3, &mut lo, &mut hi);
            i += 4;
        }
        for i in i..tile.steps.end {
            step(i, &mut lo, &mut hi);
        }
        for r in 0..R {
            // SAFETY: as for the loads.
            unsafe {
                _mm256_storeu_ps(sums.add(r * PANEL + tile.offset), lo[r]);
                _mm256_storeu_ps(sums.add(r * PANEL + tile.offset + 8), hi[r]);
            }
        }
    }

    /// The AVX-512 tile walk: 12-row tiles, then one tile of the rows left.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self) {
        for (col, width, panel) in self.panels() {
            let mut t = self.rows.start;
            while t < self.rows.end {
                let rows = (self.rows.end - t).min(MAX_TILE_ROWS);
                // SAFETY: rows `t..t + rows` of x and out exist; the panel is `[k][PANEL]`.
                unsafe {
                    match rows {
                        12 => self.tile_avx512::<12>(t, col, width, panel),
                        11 => self.tile_avx512::<11>(t, col, width, panel),
                        10 => self.tile_avx512::<10>(t, col, width, panel),
                        9 => self.tile_avx512::<9>(t, col, width, panel),
                        8 => self.tile_avx512::<8>(t, col, width, panel),
                        7 => self.tile_avx512::<7>(t, col, width, panel),
                        6 => self.tile_avx512::<6>(t, col, width, panel),
                        5 => self.tile_avx512::<5>(t, col, width, panel),
                        4 => self.tile_avx512::<4>(t, col, width, panel),
                        3 => self.tile_avx512::<3>(t, col, width, panel),
                        2 => self.tile_avx512::<2>(t, col, width, panel),
                        _ => self.tile_avx512::<1>(t, col, width, panel),
                    }
                }
                t += rows;
            }
        }
    }

    /// Rows `t..t + R` × the panel's columns `col..col + width`, summed over all of `k` in 2R
    /// registers and stored once (masked past `width`).
    ///
    /// # Safety
    /// AVX-512F must be available; rows `t..t + R` must exist; `panel` is `[k][PANEL]`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_avx512<const R: usize>(
        &self,
        t: usize,
        col: usize,
        width: usize,
        panel: &[f32],
    ) {
        use std::arch::x86_64::*;
        let k = self.k;
        debug_assert!(panel.len() == k * PANEL && (t + R) * k <= self.x.len());
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        let x = self.x.as_ptr();
        let b = panel.as_ptr();
        for i in 0..k {
            // SAFETY: i < k, so both loads lie in the panel and every x read in row t + r.
            unsafe {
                let b_lo = _mm512_loadu_ps(b.add(i * PANEL));
                let b_hi = _mm512_loadu_ps(b.add(i * PANEL + 16));
                for r in 0..R {
                    let a = _mm512_set1_ps(*x.add((t + r) * k + i));
                    lo[r] = _mm512_fmadd_ps(a, b_lo, lo[r]);
                    hi[r] = _mm512_fmadd_ps(a, b_hi, hi[r]);
                }
            }
        }
        let mask_lo: __mmask16 = if width >= 16 {
            0xffff
        } else {
            (1u16 << width) - 1
        };
        let mask_hi: __mmask16 = if width >= 32 {
            0xffff
        } else if width > 16 {
            (1u16 << (width - 16)) - 1
        } else {
            0
        };
        for r in 0..R {
            // SAFETY: the row's columns col..col + width belong to this task alone; the masks
            // keep the stores inside them.
            unsafe {
                let dst = self.out.slice((t + r) * self.n + col, width).as_mut_ptr();
                _mm512_mask_storeu_ps(dst, mask_lo, lo[r]);
                _mm512_mask_storeu_ps(dst.add(16), mask_hi, hi[r]);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Values in [-1, 1) from a fixed sequence.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
            })
            .collect()
    }

    /// The in-order fused sum every tier gives.
    fn reference(w: &[f32], k: usize, n: usize, x: &[f32], m: usize) -> Vec<f32> {
        (0..m * n)
            .map(|o| (0..k).fold(0f32, |s, i| x[(o / n) * k + i].mul_add(w[i * n + o % n], s)))
            .collect()
    }

    /// The long order (blocks of 192 rows, every panel of a task per block of `x`, four-panel
    /// tasks) gives the in-order sum's bits; shapes small enough for the reference, with
    /// partial row blocks, `k` blocks, panels and tiles.
    #[test]
    fn the_long_avx2_walk_gives_the_in_order_sums() {
        if !Tier::Avx2.is_supported() {
            return;
        }
        for (threads, m, k, n) in [(1, 200, 300, 1030), (2, 397, 520, 2100), (3, 13, 40, 75)] {
            let pool = ThreadPool::new(threads);
            let (w, x) = (values(k * n, 7), values(m * k, 11));
            let mut x_tiles = Vec::new();
            pack_x_tiles(&x, m, k, &mut x_tiles, &pool);
            let mut out = vec![f32::NAN; m * n];
            run_tasks(
                k,
                n,
                &x,
                &x_tiles,
                true,
                m,
                &mut out,
                Tier::Avx2,
                &pool,
                &|cols, p| pack_in_out(&w, k, n, cols, p),
            );
            let want = reference(&w, k, n, &x, m);
            let same = out
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "threads {threads}, [{m}, {k}] x [{k}, {n}]");
        }
    }

    /// An `x` past [`AVX2_LONG_X_BYTES`] takes the long walk through the public entry, with
    /// the same bits.
    #[test]
    fn a_large_x_takes_the_long_walk_with_the_same_bits() {
        if !Tier::Avx2.is_supported() {
            return;
        }
        let (m, n) = (100, 40);
        let k = (AVX2_LONG_X_BYTES / size_of::<f32>()).div_ceil(m);
        let (w, x) = (values(k * n, 3), values(m * k, 5));
        let mut out = vec![f32::NAN; m * n];
        gemm_in_out_with(&w, k, n, &x, m, &mut out, Tier::Avx2, &ThreadPool::new(2));
        let want = reference(&w, k, n, &x, m);
        assert!(
            out.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
