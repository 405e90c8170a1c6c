//! [`QuantMatrix`]: a weight matrix kept in its ggml blocks, one output row after another (the
//! layout of a GGUF tensor), and its product with f32 activations.

use crate::SharedOut;
use crate::act::{ACT_BLOCK, ActBlock, quantize_rows};
use crate::error::KernelError;
use crate::ggml::{GgmlType, dequantize};
use crate::pool::ThreadPool;
use crate::quant::{DotKernel, has_kernel};
use crate::tier::Tier;

/// A quantized `[rows, cols]` matrix: row `r` is `cols / block` ggml blocks of its type. A
/// linear layer's weight is stored `[d_out, d_in]` this way, as in GGUF and PyTorch.
#[derive(Clone, PartialEq, Eq)]
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantMatrix({} [{}, {}])",
            self.ty.name(),
            self.rows,
            self.cols
        )
    }
}

/// Output rows per task: enough tasks to balance the threads, few enough that claiming one
/// costs nothing next to its work.
fn rows_per_task(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads * 4).clamp(8, 256)
}

impl QuantMatrix {
    /// Wraps `data`, the blocks of a `[rows, cols]` matrix of type `ty`.
    ///
    /// # Errors
    /// [`KernelError::NoKernel`] for a type without a kernel, [`KernelError::Shape`] when `cols`
    /// is not a whole number of blocks or `data` has the wrong length.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, KernelError> {
        if !has_kernel(ty) {
            return Err(KernelError::NoKernel(ty.name()));
        }
        let row_bytes = ty.bytes_for(cols).ok_or_else(|| {
            KernelError::Shape(format!(
                "a row of {cols} values is not a whole number of {} blocks of {}",
                ty.name(),
                ty.block_size()
            ))
        })?;
        if data.len() != rows * row_bytes {
            return Err(KernelError::Shape(format!(
                "{} bytes for a [{rows}, {cols}] {} matrix, expected {}",
                data.len(),
                ty.name(),
                rows * row_bytes
            )));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// The weight type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output rows (`d_out`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row (`d_in`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The blocks of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Dequantizes row `r` into `out` (`cols` values).
    ///
    /// # Panics
    /// If `r` is out of range or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out);
    }

    /// The matrix with its rows in the order `order` (row `i` of the result is row `order[i]`).
    ///
    /// # Panics
    /// If an index is out of range.
    pub fn permute_rows(&self, order: &[usize]) -> Self {
        let mut data = Vec::with_capacity(order.len() * self.row_bytes);
        for &r in order {
            data.extend_from_slice(self.row(r));
        }
        Self {
            rows: order.len(),
            data,
            ..self.clone()
        }
    }

    /// `out = x · selfᵀ` on the active tier and the global pool.
    ///
    /// # Shapes
    /// - `x`: `[m, cols]` row-major → `out`: `[m, rows]` row-major
    ///
    /// # Panics
    /// If the lengths disagree with `m` and the matrix's shape.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_with(x, m, out, Tier::active(), ThreadPool::global());
    }

    /// [`matmul`](Self::matmul) on a given tier and pool.
    ///
    /// # Panics
    /// As [`matmul`](Self::matmul), and if this CPU cannot run `tier`.
    pub fn matmul_with(&self, x: &[f32], m: usize, out: &mut [f32], tier: Tier, pool: &ThreadPool) {
        assert_eq!(x.len(), m * self.cols, "activations are not [m, cols]");
        assert_eq!(out.len(), m * self.rows, "output is not [m, rows]");
        let kernel = DotKernel::new(self.ty, tier)
            .unwrap_or_else(|| panic!("kernel tier {tier} is not supported on this CPU"));
        let acts = quantize_activations(x, m, self.cols, pool);
        let per_row = self.cols / ACT_BLOCK;
        let chunk = rows_per_task(self.rows, pool.threads());
        let out = SharedOut::new(out);
        pool.run(self.rows.div_ceil(chunk), &|task| {
            let rows = task * chunk..((task + 1) * chunk).min(self.rows);
            for r in rows {
                let w = self.row(r);
                for t in 0..m {
                    // SAFETY: `w` is one whole row, `acts` one row of `cols / 32` blocks.
                    let v =
                        unsafe { kernel.dot_unchecked(w, &acts[t * per_row..(t + 1) * per_row]) };
                    // SAFETY: every (t, r) is written by exactly one task.
                    unsafe { out.write(t * self.rows + r, v) };
                }
            }
        });
    }
}

/// `x` (`[m, cols]`) as activation blocks, rows quantized in parallel when there are many.
fn quantize_activations(x: &[f32], m: usize, cols: usize, pool: &ThreadPool) -> Vec<ActBlock> {
    let mut acts = Vec::new();
    if m < 8 {
        quantize_rows(x, cols, &mut acts);
        return acts;
    }
    let per_row = cols / ACT_BLOCK;
    acts.resize(
        m * per_row,
        ActBlock {
            qs: [0; 32],
            d: 0.0,
            d_sum: 0.0,
        },
    );
    let rows_per_task = m.div_ceil(pool.threads() * 2);
    let shared = SharedOut::new(&mut acts);
    pool.run(m.div_ceil(rows_per_task), &|task| {
        let rows = task * rows_per_task..((task + 1) * rows_per_task).min(m);
        for row in rows {
            for (b, chunk) in x[row * cols..(row + 1) * cols]
                .chunks_exact(ACT_BLOCK)
                .enumerate()
            {
                let block = ActBlock::quantize(chunk.try_into().expect("chunks of 32"));
                // SAFETY: each row is quantized by exactly one task.
                unsafe { shared.write(row * per_row + b, block) };
            }
        }
    });
    acts
}
