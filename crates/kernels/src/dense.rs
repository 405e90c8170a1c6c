//! f32 matrix products for the exact path, for the few-row products of decoding: burn-flex's
//! gemm runs those on one thread, and its matrix-vector path reaches about half the memory
//! bandwidth. Two weight layouts:
//! - `[d_in, d_out]` (kiln's `Linear` layout, [`matmul_in_out`]): each task owns a run of
//!   weight rows, reads it front to back (one sequential stream per thread, which is what
//!   reaches the memory bandwidth) and adds `x[t, i] × w[i, ..]` into its own partial sums
//!   for every activation row; the partial sums are added in task order at the end. Very
//!   wide matrices (an untied output head), whose partial sums would not stay in cache, split
//!   by columns instead: each task owns a range of output columns for up to four activation
//!   rows at a time. Either way the order of the sums depends on the shape and the thread
//!   count only, not on the tier.
//! - `[d_out, d_in]` (a tied output head reading the embedding table, [`matmul_out_in`]):
//!   each task owns a range of output rows and takes dot products with up to four activation
//!   rows at a time; the SIMD tiers sum in eight lanes, so they differ from the scalar order
//!   by rounding.
//!
//! The weights are read once per call (per four activation rows in the column split and the
//! `[d_out, d_in]` layout).

use crate::SharedOut;
use crate::pool::ThreadPool;
use crate::tier::Tier;

/// Output columns per task at most: four rows of accumulators fit in L1.
const MAX_TASK_COLS: usize = 512;

/// Activation rows sharing one pass over the weights in the column split and the
/// `[d_out, d_in]` layout.
const ROW_TILE: usize = 4;

/// Widest `[d_in, d_out]` matrix split by weight rows: `m × d_out` partial sums per task stay
/// in L2 (16 rows × 8192 × 4 bytes = 512 KiB at most).
const ROW_SPLIT_MAX_COLS: usize = 8192;

/// `out = x · w` on the active tier and the global pool.
///
/// # Shapes
/// - `w`: `[k, n]` row-major, `x`: `[m, k]` → `out`: `[m, n]`
///
/// # Panics
/// If the lengths disagree with the shapes.
pub fn matmul_in_out(w: &[f32], k: usize, n: usize, x: &[f32], m: usize, out: &mut [f32]) {
    matmul_in_out_with(w, k, n, x, m, out, Tier::active(), ThreadPool::global());
}

/// [`matmul_in_out`] on a given tier and pool.
///
/// # Panics
/// As [`matmul_in_out`], and if this CPU cannot run `tier`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_in_out_with(
    w: &[f32],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
) {
    check_shapes(w, k, n, x, m, out, tier);
    if n == 0 || m == 0 {
        return;
    }
    if n <= ROW_SPLIT_MAX_COLS {
        in_out_by_rows(w, k, n, x, m, out, tier, pool);
        return;
    }
    let width = n
        .div_ceil(pool.threads() * 2)
        .next_multiple_of(16)
        .min(MAX_TASK_COLS);
    let out = SharedOut::new(out);
    pool.run(n.div_ceil(width), &|task| {
        let cols = task * width..((task + 1) * width).min(n);
        let job = ColumnTask {
            w,
            k,
            n,
            x,
            m,
            cols,
            out: &out,
        };
        match tier {
            Tier::Scalar => job.run(axpy),
            // SAFETY: the tier's features were checked above.
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512Vnni => unsafe { job.run_fma() },
            #[allow(unreachable_patterns)]
            _ => unreachable!("no such tier on this architecture"),
        }
    });
}

/// `acc += a × w`, the scalar tier's step of both `[d_in, d_out]` splits.
#[inline(always)]
fn axpy(acc: &mut [f32], a: f32, w: &[f32]) {
    for (y, x) in acc.iter_mut().zip(w) {
        *y += a * x;
    }
}

/// `acc += a × w` with fused multiply-adds: the SIMD tiers' step, vectorized inside their
/// `#[target_feature]` callers.
#[inline(always)]
fn axpy_fused(acc: &mut [f32], a: f32, w: &[f32]) {
    for (y, x) in acc.iter_mut().zip(w) {
        *y = a.mul_add(*x, *y);
    }
}

/// [`matmul_in_out_with`] split by weight rows: task `p` adds rows `rows(p)` of `w` into its
/// own `[m, n]` partial sums, which are then summed in task order.
#[allow(clippy::too_many_arguments)]
fn in_out_by_rows(
    w: &[f32],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
) {
    let rows_per_task = k.div_ceil(pool.threads() * 2).max(1);
    let tasks = k.div_ceil(rows_per_task);
    let mut partials = vec![0f32; tasks * m * n];
    let shared = SharedOut::new(&mut partials);
    pool.run(tasks, &|task| {
        // SAFETY: each task owns its `[m, n]` block of partial sums.
        let acc = unsafe { shared.slice(task * m * n, m * n) };
        let rows = task * rows_per_task..((task + 1) * rows_per_task).min(k);
        let job = RowTask {
            w,
            k,
            n,
            x,
            m,
            rows,
        };
        match tier {
            Tier::Scalar => job.run(acc, axpy),
            // SAFETY: the tier's features were checked by the caller.
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512Vnni => unsafe { job.run_fma(acc) },
            #[allow(unreachable_patterns)]
            _ => unreachable!("no such tier on this architecture"),
        }
    });
    let (first, rest) = partials.split_at(m * n);
    out.copy_from_slice(first);
    for partial in rest.chunks_exact(m * n) {
        for (y, p) in out.iter_mut().zip(partial) {
            *y += p;
        }
    }
}

/// One task of the row split: weight rows `rows` for every activation row.
struct RowTask<'a> {
    w: &'a [f32],
    k: usize,
    n: usize,
    x: &'a [f32],
    m: usize,
    rows: std::ops::Range<usize>,
}

impl RowTask<'_> {
    /// Runs the task into `acc` (`[m, n]`) with `axpy(acc, a, w)`: `acc += a × w`.
    #[inline(always)]
    fn run(&self, acc: &mut [f32], axpy: impl Fn(&mut [f32], f32, &[f32])) {
        for i in self.rows.clone() {
            let row = &self.w[i * self.n..(i + 1) * self.n];
            for (t, sums) in acc.chunks_exact_mut(self.n).take(self.m).enumerate() {
                axpy(sums, self.x[t * self.k + i], row);
            }
        }
    }

    /// [`run`](Self::run) compiled for AVX2 with fused multiply-adds.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_fma(&self, acc: &mut [f32]) {
        self.run(acc, axpy_fused);
    }
}

/// The checks every f32 product shares (both layouts here, and [`crate::gemm`]): `w` holds
/// `k × n` values (either way round), `x` is `[m, k]`, `out` is `[m, n]`, and this CPU runs
/// `tier`.
pub(crate) fn check_shapes(
    w: &[f32],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &[f32],
    tier: Tier,
) {
    assert_eq!(w.len(), k * n, "weights do not hold k × n values");
    assert_eq!(x.len(), m * k, "activations are not [m, k]");
    assert_eq!(out.len(), m * n, "output is not [m, n]");
    assert!(
        tier.is_supported(),
        "kernel tier {tier} is not supported on this CPU"
    );
}

/// One task: the columns `cols` of every output row.
struct ColumnTask<'a> {
    w: &'a [f32],
    k: usize,
    n: usize,
    x: &'a [f32],
    m: usize,
    cols: std::ops::Range<usize>,
    out: &'a SharedOut<f32>,
}

impl ColumnTask<'_> {
    /// Runs the task with `axpy(acc, a, w)`: `acc += a × w`.
    #[inline(always)]
    fn run(&self, axpy: impl Fn(&mut [f32], f32, &[f32])) {
        let width = self.cols.len();
        let mut acc = [[0f32; MAX_TASK_COLS]; ROW_TILE];
        for t0 in (0..self.m).step_by(ROW_TILE) {
            let tile = (self.m - t0).min(ROW_TILE);
            for row in acc.iter_mut().take(tile) {
                row[..width].fill(0.0);
            }
            for i in 0..self.k {
                let seg = &self.w[i * self.n + self.cols.start..i * self.n + self.cols.end];
                for (t, row) in acc.iter_mut().take(tile).enumerate() {
                    axpy(&mut row[..width], self.x[(t0 + t) * self.k + i], seg);
                }
            }
            for (t, row) in acc.iter().take(tile).enumerate() {
                for (c, &v) in row[..width].iter().enumerate() {
                    // SAFETY: each (row, column) belongs to exactly one task.
                    unsafe { self.out.write((t0 + t) * self.n + self.cols.start + c, v) };
                }
            }
        }
    }

    /// [`run`](Self::run) compiled for AVX2 with fused multiply-adds.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_fma(&self) {
        self.run(axpy_fused);
    }
}

/// `out = x · wᵀ` on the active tier and the global pool.
///
/// # Shapes
/// - `w`: `[n, k]` row-major, `x`: `[m, k]` → `out`: `[m, n]`
///
/// # Panics
/// If the lengths disagree with the shapes.
pub fn matmul_out_in(w: &[f32], k: usize, n: usize, x: &[f32], m: usize, out: &mut [f32]) {
    matmul_out_in_with(w, k, n, x, m, out, Tier::active(), ThreadPool::global());
}

/// [`matmul_out_in`] on a given tier and pool.
///
/// # Panics
/// As [`matmul_out_in`], and if this CPU cannot run `tier`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_out_in_with(
    w: &[f32],
    k: usize,
    n: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    tier: Tier,
    pool: &ThreadPool,
) {
    check_shapes(w, k, n, x, m, out, tier);
    if n == 0 || m == 0 {
        return;
    }
    let chunk = n.div_ceil(pool.threads() * 4).clamp(8, 256);
    let out = SharedOut::new(out);
    pool.run(n.div_ceil(chunk), &|task| {
        for r in task * chunk..((task + 1) * chunk).min(n) {
            let row = &w[r * k..(r + 1) * k];
            for t0 in (0..m).step_by(ROW_TILE) {
                let tile = (m - t0).min(ROW_TILE);
                let xs: [&[f32]; ROW_TILE] = std::array::from_fn(|t| {
                    let t = t0 + t.min(tile - 1);
                    &x[t * k..(t + 1) * k]
                });
                let dots = match tier {
                    Tier::Scalar => dot4_scalar(row, xs),
                    // SAFETY: `check_shapes` checked the tier (both include AVX2 and FMA);
                    // `row` and every `xs[t]` are `k` long.
                    #[cfg(target_arch = "x86_64")]
                    Tier::Avx2 | Tier::Avx512Vnni => unsafe { dot4_avx2(row, xs) },
                    #[allow(unreachable_patterns)]
                    _ => unreachable!("no such tier on this architecture"),
                };
                for (t, v) in dots.into_iter().take(tile).enumerate() {
                    // SAFETY: each (row, column) belongs to exactly one task.
                    unsafe { out.write((t0 + t) * n + r, v) };
                }
            }
        }
    });
}

/// `w · x_t` for four activation rows, summed in order.
fn dot4_scalar(w: &[f32], xs: [&[f32]; ROW_TILE]) -> [f32; ROW_TILE] {
    xs.map(|x| w.iter().zip(x).map(|(a, b)| a * b).sum())
}

/// `w · x_t` for four activation rows in eight FMA lanes each.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and every `xs[t]` must be at least as long as `w`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(w: &[f32], xs: [&[f32]; ROW_TILE]) -> [f32; ROW_TILE] {
    use std::arch::x86_64::*;
    let k = w.len();
    let whole = k - k % 8;
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= whole <= k, the length of `w`.
        let wv = unsafe { _mm256_loadu_ps(w.as_ptr().add(i)) };
        for (a, x) in acc.iter_mut().zip(&xs) {
            // SAFETY: i + 8 <= k, and every `xs[t]` is at least `k` long (the contract).
            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            *a = _mm256_fmadd_ps(wv, xv, *a);
        }
    }
    let mut sums = [0f32; ROW_TILE];
    for ((s, a), x) in sums.iter_mut().zip(acc).zip(&xs) {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        *s = lanes.iter().sum::<f32>()
            + w[whole..]
                .iter()
                .zip(&x[whole..])
                .map(|(a, b)| a * b)
                .sum::<f32>();
    }
    sums
}
