//! The per-layer operations around the matrix products, each one pass over its rows: RMSNorm,
//! the rotate-half rotary embedding and SwiGLU's gating; [`par_rows`] spreads a prefill's
//! rows over the threads.
//!
//! Composed from burn's element-wise operations, an RMSNorm is seven tensors allocated and
//! walked (square, mean, add, sqrt, divide, cast, scale) and a rotation nine (two slices, four
//! broadcast products, a difference, a sum, a concatenation). In a decode step each is a few
//! hundred values, so their fixed costs, not their arithmetic, took a tenth of the step. Here
//! each is one loop that rounds exactly as the composition does (no fused multiply-adds), so
//! swapping one for the other moves no result by more than the order of a sum.

use std::ops::Range;

use crate::SharedOut;
use crate::pool::ThreadPool;
use crate::tier::Tier;

/// Lanes of the sum of squares: a fixed order that vectorizes, so every tier and every
/// machine sums the same way.
const LANES: usize = 8;

/// Rows a task of [`par_rows`] takes at least: a decode step's few rows stay on the calling
/// thread, where waking the pool would cost more than the rows.
pub const MIN_ROWS_PER_TASK: usize = 16;

/// `op(rows, out_rows)` over `rows` rows whose outputs are `out`'s equal parts, split by rows
/// over `pool` when there are at least two tasks' worth ([`MIN_ROWS_PER_TASK`]; a prefill's
/// hundreds of tokens). `op` computes rows `rows` into `out_rows` (their part of `out`), each
/// row as it would alone, so the split changes no bit.
///
/// # Panics
/// If `out` is not `rows` equal parts.
pub fn par_rows(
    pool: &ThreadPool,
    rows: usize,
    out: &mut [f32],
    op: &(dyn Fn(Range<usize>, &mut [f32]) + Sync),
) {
    if rows == 0 {
        return;
    }
    let width = out.len() / rows;
    assert_eq!(width * rows, out.len(), "out is not {rows} equal rows");
    let tasks = (rows / MIN_ROWS_PER_TASK).clamp(1, pool.threads());
    if tasks == 1 {
        op(0..rows, out);
        return;
    }
    let per_task = rows.div_ceil(tasks);
    let shared = SharedOut::new(out);
    pool.run(rows.div_ceil(per_task), &|task| {
        let span = task * per_task..((task + 1) * per_task).min(rows);
        // SAFETY: the tasks' row spans are disjoint, and the job ends before `out` does.
        let out = unsafe { shared.slice(span.start * width, span.len() * width) };
        op(span, out);
    });
}

/// RMSNorm of each row of `x` (`rows × d`), as transformers computes it in f32:
/// `x / sqrt(mean(x²) + eps) × gamma`.
///
/// # Panics
/// If `gamma` is not `d` long, or `x` and `out` are not whole rows of the same length.
pub fn rms_norm(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) {
    let d = gamma.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "x is not whole rows of {d}"
    );
    assert_eq!(x.len(), out.len(), "out is not the size of x");
    for (row, out) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let rms = (sum_of_squares(row) / d as f32 + eps).sqrt();
        for ((o, v), g) in out.iter_mut().zip(row).zip(gamma) {
            *o = (v / rms) * g;
        }
    }
}

/// `Σ v²` over `row` in [`LANES`] partial sums, added pairwise at the end.
fn sum_of_squares(row: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (acc, v) in lanes.iter_mut().zip(chunk) {
            *acc += v * v;
        }
    }
    for (acc, v) in lanes.iter_mut().zip(chunks.remainder()) {
        *acc += v * v;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

/// Rotates each head of each token in Hugging Face's rotate-half layout: a head's first half
/// `x1` and second half `x2` become `(x1 cos − x2 sin, x2 cos + x1 sin)`, with the token's
/// `cos` and `sin` (`head_dim / 2` each) shared by its heads.
///
/// # Shapes
/// - `x`, `out`: `[tokens, heads, head_dim]`
/// - `cos`, `sin`: `[tokens, head_dim / 2]`
///
/// # Panics
/// If the lengths do not fit those shapes.
pub fn rotate_half(x: &[f32], cos: &[f32], sin: &[f32], head_dim: usize, out: &mut [f32]) {
    let half = head_dim / 2;
    assert!(
        half > 0 && head_dim.is_multiple_of(2),
        "head_dim {head_dim} is not even"
    );
    assert_eq!(cos.len(), sin.len(), "cos and sin differ in length");
    let tokens = cos.len() / half;
    assert_eq!(cos.len(), tokens * half, "cos is not whole tokens");
    assert!(
        !x.is_empty() || tokens == 0,
        "x is empty but there are tokens"
    );
    let per_token = x.len().checked_div(tokens).unwrap_or(0);
    assert!(
        per_token.is_multiple_of(head_dim) && per_token * tokens == x.len(),
        "x is not [tokens, heads, {head_dim}]"
    );
    assert_eq!(x.len(), out.len(), "out is not the size of x");
    for t in 0..tokens {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        let span = t * per_token..(t + 1) * per_token;
        for (head, out) in x[span.clone()]
            .chunks_exact(head_dim)
            .zip(out[span].chunks_exact_mut(head_dim))
        {
            let (x1, x2) = head.split_at(half);
            let (o1, o2) = out.split_at_mut(half);
            for i in 0..half {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}

/// SwiGLU's gating, `silu(g) × u`, for rows holding the gate's outputs then up's
/// (`[g | u]`, a fused gate-and-up product): one pass where burn slices, applies SiLU and
/// multiplies in three. `silu(g) = g / (1 + e^-g)`, with [`exp`] (within 2 ulp of libm's,
/// and the same bits on every tier), on the active tier.
///
/// # Shapes
/// - `gate_up`: `[rows, 2 d_ff]` → `out`: `[rows, d_ff]`
///
/// # Panics
/// If the lengths do not fit those shapes.
pub fn swiglu(gate_up: &[f32], d_ff: usize, out: &mut [f32]) {
    swiglu_with(gate_up, d_ff, out, Tier::active());
}

/// [`swiglu`] on a given tier: every tier computes the same operations, so the same bits;
/// the SIMD tiers only let the compiler run them on eight or sixteen lanes.
///
/// # Panics
/// As [`swiglu`], and if this CPU cannot run `tier`.
pub fn swiglu_with(gate_up: &[f32], d_ff: usize, out: &mut [f32], tier: Tier) {
    assert!(
        d_ff > 0 && gate_up.len().is_multiple_of(2 * d_ff),
        "gate_up is not whole rows of 2 × {d_ff}"
    );
    assert_eq!(out.len() * 2, gate_up.len(), "out is not [rows, {d_ff}]");
    assert!(
        tier.is_supported(),
        "kernel tier {tier} is not supported on this CPU"
    );
    match tier {
        Tier::Scalar => swiglu_rows(gate_up, d_ff, out),
        // SAFETY: the tier's features were checked above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { swiglu_avx2(gate_up, d_ff, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512Vnni => unsafe { swiglu_avx512(gate_up, d_ff, out) },
        #[allow(unreachable_patterns)]
        _ => unreachable!("no such tier on this architecture"),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn swiglu_avx2(gate_up: &[f32], d_ff: usize, out: &mut [f32]) {
    swiglu_rows(gate_up, d_ff, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
fn swiglu_avx512(gate_up: &[f32], d_ff: usize, out: &mut [f32]) {
    swiglu_rows(gate_up, d_ff, out);
}

#[inline(always)]
fn swiglu_rows(gate_up: &[f32], d_ff: usize, out: &mut [f32]) {
    for (row, out) in gate_up
        .chunks_exact(2 * d_ff)
        .zip(out.chunks_exact_mut(d_ff))
    {
        let (gate, up) = row.split_at(d_ff);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + exp(-g)) * u;
        }
    }
}

/// Inputs above this make `e^x` overflow f32; [`exp`] clamps to it (`e^88.37` ≈ 2.5e38).
const EXP_MAX: f32 = 88.376_26;

/// `e^x` in plain f32 operations that compile to SIMD lanes (libm's `expf` is a call per
/// value): the steps of the attention kernel's `exp8` (`x = n ln 2 + r`, Cephes' degree-6
/// polynomial for `e^r`, `2^n` through the exponent bits), with `x` clamped to the range
/// where `2^n` is a normal number, so below -87.3 it gives about 1e-38 instead of 0 and above
/// 88.4 about 2.5e38 instead of infinity. Fused multiply-adds are `mul_add`, rounded once
/// whether or not the tier has FMA, so every tier gives the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use crate::attention::{EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    let e_r = p.mul_add(r * r, r) + 1.0;
    // n is an integer in -126..=127 after the clamp: n + 127 is a normal exponent.
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    e_r * two_n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_scales_each_row_to_unit_root_mean_square() {
        let x: Vec<f32> = (0..24).map(|i| (i as f32 - 7.5) * 0.3).collect();
        let gamma: Vec<f32> = (0..12).map(|i| 1.0 + i as f32 * 0.1).collect();
        let mut out = vec![0.0; 24];
        rms_norm(&x, &gamma, 1e-5, &mut out);
        for (row, out) in x.chunks(12).zip(out.chunks(12)) {
            let ms: f64 = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                / 12.0;
            let rms = (ms + 1e-5).sqrt();
            for ((o, v), g) in out.iter().zip(row).zip(&gamma) {
                let want = f64::from(*v) / rms * f64::from(*g);
                assert!((f64::from(*o) - want).abs() < 1e-6, "{o} vs {want}");
            }
        }
    }

    #[test]
    fn swiglu_gates_up_by_silu_of_gate() {
        let gate_up = [0.0, 1.0, -2.0, 3.0, 4.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 6];
        swiglu(&gate_up, 3, &mut out);
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let want = [0.0, silu(1.0) * 4.0, silu(-2.0) * 5.0];
        for (o, w) in out.iter().zip(want.iter().chain(&[silu(1.0); 3])) {
            assert!((f64::from(*o) - w).abs() < 1e-6, "{o} vs {w}");
        }
    }

    /// Distance in units in the last place between two finite positive floats.
    fn ulps(a: f32, b: f32) -> u32 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_clamps_outside_the_normal_range() {
        let mut x = -87.3f32;
        while x < 88.3 {
            let (got, want) = (exp(x), x.exp());
            assert!(ulps(got, want) <= 2, "e^{x}: {got} against libm's {want}");
            x += 0.0137;
        }
        for tiny in [-0.0, 0.0, 1e-30, -1e-30] {
            assert_eq!(exp(tiny), 1.0);
        }
        // Clamped, not 0 or infinite: what SwiGLU needs of a gate's extremes.
        assert_eq!(exp(-1000.0), exp(-87.336_55));
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1.2e-38);
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 2.4e38);
        assert_eq!(exp(f32::INFINITY), exp(1000.0));
    }

    #[test]
    fn swiglu_gives_the_same_bits_on_every_tier() {
        let d_ff = 37;
        let gate_up: Vec<f32> = (0..5 * 2 * d_ff)
            .map(|i| (i as f32 * 0.731).sin() * 12.0 - 1.5)
            .collect();
        let mut scalar = vec![0.0; 5 * d_ff];
        swiglu_with(&gate_up, d_ff, &mut scalar, Tier::Scalar);
        for (i, o) in scalar.iter().enumerate() {
            let (g, u) = (
                f64::from(gate_up[(i / d_ff) * 2 * d_ff + i % d_ff]),
                f64::from(gate_up[(i / d_ff) * 2 * d_ff + d_ff + i % d_ff]),
            );
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (f64::from(*o) - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{o} vs {want}"
            );
        }
        for tier in Tier::supported() {
            let mut out = vec![f32::NAN; 5 * d_ff];
            swiglu_with(&gate_up, d_ff, &mut out, tier);
            assert_eq!(
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                scalar.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{tier}"
            );
        }
    }

    #[test]
    fn par_rows_splits_by_rows_and_changes_no_bit() {
        let pool = ThreadPool::new(3);
        for rows in [0, 1, MIN_ROWS_PER_TASK, 2 * MIN_ROWS_PER_TASK + 5, 200] {
            let gate_up: Vec<f32> = (0..rows * 10)
                .map(|i| (i as f32 * 0.37).sin() * 3.0)
                .collect();
            let mut alone = vec![0.0; rows * 5];
            swiglu(&gate_up, 5, &mut alone);
            let mut split = vec![f32::NAN; rows * 5];
            let spans = std::sync::Mutex::new(Vec::new());
            par_rows(&pool, rows, &mut split, &|span, out| {
                spans.lock().expect("no task panicked").push(span.clone());
                swiglu(&gate_up[span.start * 10..span.end * 10], 5, out);
            });
            assert_eq!(
                split.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{rows} rows"
            );
            let mut spans = spans.into_inner().expect("no task panicked");
            spans.sort_by_key(|s| s.start);
            let tasks = (rows / MIN_ROWS_PER_TASK).clamp(1, 3);
            assert_eq!(
                spans.len(),
                if rows == 0 { 0 } else { tasks },
                "{rows} rows"
            );
            assert!(spans.windows(2).all(|w| w[0].end == w[1].start));
        }
    }

    #[test]
    fn rotate_half_turns_each_pair_by_its_angle() {
        // One token, two heads of width 4: pairs (0, 2) and (1, 3) turn by 90° and 180°.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let (cos, sin) = ([0.0, -1.0], [1.0, 0.0]);
        let mut out = [0.0; 8];
        rotate_half(&x, &cos, &sin, 4, &mut out);
        assert_eq!(out, [-3.0, -2.0, 1.0, -4.0, -7.0, -6.0, 5.0, -8.0]);
    }
}
