//! [`QuantMatrix`]: a weight matrix kept in its ggml blocks, and its product with f32
//! activations. Every quantized type has an interleaved layout ([`crate::interleaved`]): a
//! matrix whose rows come in eights is repacked eight rows at a time at construction; others
//! stay one output row after another (the layout of a GGUF tensor) on the row kernels.
//! Activations are quantized in two 8-bit passes ([`crate::act::quantize_split`]) unless the
//! matrix was given one ([`ActPasses`]). The 16-bit float types (F16, BF16) stay in rows and
//! multiply f32 activations as they are ([`crate::float16`]).

use crate::SharedOut;
use std::borrow::Cow;
use std::ops::Range;

use crate::act::{
    ACT_BLOCK, Act16Block, ActBlock, ActPasses, quantize_row, quantize_row_16, quantize_split_row,
};
use crate::error::KernelError;
use crate::float16::{self, is_float16};
use crate::ggml::{GgmlType, dequantize};
use crate::interleaved::{
    GROUP, Q16Tiles, TileKernels, WIDE_ROWS, WideKernels, group_block_bytes, pack, pack_parts,
    unpack_row, zeroed_on_huge_pages,
};
use crate::pool::ThreadPool;
use crate::quant::{DotKernel, has_kernel};
use crate::tier::Tier;

/// A `[rows, cols]` matrix kept in its storage type ([`QuantMatrix::takes`]): row `r` is
/// `cols / block` ggml blocks of its type (one 16-bit value a block for F16 and BF16). A
/// linear layer's weight is stored `[d_out, d_in]` this way, as in GGUF and PyTorch.
#[derive(Clone, PartialEq, Eq)]
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    /// Groups of [`GROUP`] rows interleaved, or plain rows.
    interleaved: bool,
    /// How the products quantize their activations.
    passes: ActPasses,
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

/// Activation rows a task's groups take at a time: 32 rows of a 1536-wide input are 123 KB of
/// two-pass blocks, which stay in a core's L2 while the task's groups read them.
const ACT_ROWS_PER_PASS: usize = 32;

/// Groups a thread claims at a time in a product of one activation pass
/// ([`ThreadPool::run_split`]): two are 18 KB of a 2,048-wide Q4_K matrix, a claim's
/// compare-and-swap nothing next to them.
const SPLIT_GROUPS: usize = 2;

/// What [`QuantMatrix::for_each_tile`] hands a group (or a pair of groups) of weights: their
/// bytes, the (first) group's index, and the activation rows to multiply them with.
type GroupWork<'a> = dyn Fn(&[u8], usize, Range<usize>) + Sync + 'a;

/// Output rows per task: enough tasks to balance the threads, few enough that claiming one
/// costs nothing next to its work.
fn rows_per_task(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads * 4).clamp(8, 256)
}

impl QuantMatrix {
    /// Whether a matrix can be kept in `ty` and multiplied as it is stored: the quantized
    /// types with kernels ([`has_kernel`]) and the 16-bit floats ([`is_float16`]).
    pub fn takes(ty: GgmlType) -> bool {
        has_kernel(ty) || is_float16(ty)
    }

    /// This matrix with its products' activations quantized in `passes` (two unless set).
    /// [`ActPasses::Q16`] has kernels for interleaved Q8_0 matrices only; any other matrix
    /// given it takes two passes, its precision.
    pub fn with_activation_passes(mut self, passes: ActPasses) -> Self {
        self.passes = match passes {
            ActPasses::Q16 if !(self.ty == GgmlType::Q8_0 && self.interleaved) => ActPasses::Two,
            passes => passes,
        };
        self
    }

    /// How the products quantize their activations.
    pub fn activation_passes(&self) -> ActPasses {
        self.passes
    }

    /// Wraps `data`, the blocks of a `[rows, cols]` matrix of type `ty`.
    ///
    /// # Errors
    /// [`KernelError::NoKernel`] for a type without a kernel, [`KernelError::Shape`] when `cols`
    /// is not a whole number of blocks or `data` has the wrong length.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, KernelError> {
        Self::build(ty, rows, cols, Cow::Owned(data), &mut |_| {})
    }

    /// [`Self::new`] from borrowed blocks (a memory-mapped file's): an interleaved type is
    /// repacked straight from `data` on the global thread pool, the others copied once.
    /// `consumed` is handed each span of `data` (byte ranges, in order) once it has been read,
    /// so that a loader can let go of a mapped file's pages while the rest is repacked.
    ///
    /// # Errors
    /// As [`Self::new`] (before anything is consumed).
    pub fn from_slice(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
        consumed: &mut dyn FnMut(Range<usize>),
    ) -> Result<Self, KernelError> {
        Self::build(ty, rows, cols, Cow::Borrowed(data), consumed)
    }

    /// Several matrices of type `ty` and width `cols` stacked, their rows one after the other
    /// (`[Σ rows, cols]`), repacked once from their borrowed blocks (a mapped file's) where
    /// [`Self::concat_rows`] would repack each and then copy them: for projections of one
    /// input run as one product (Q, K and V; gate and up). `consumed` gets the index of the
    /// part with each span of it once read, as [`Self::from_slice`]'s does.
    ///
    /// # Errors
    /// As [`Self::new`], and [`KernelError::Shape`] when `parts` is empty, `ty` has no
    /// interleaved layout or a part's height is not a multiple of eight rows (each part would
    /// not be whole groups; [`Self::concat_rows`] takes those).
    pub fn from_slices(
        ty: GgmlType,
        cols: usize,
        parts: &[&[u8]],
        consumed: &mut dyn FnMut(usize, Range<usize>),
    ) -> Result<Self, KernelError> {
        if !has_kernel(ty) {
            return Err(KernelError::NoKernel(ty.name()));
        }
        let row_bytes = ty.bytes_for(cols).filter(|&b| b > 0).ok_or_else(|| {
            KernelError::Shape(format!(
                "a row of {cols} values is not a whole, non-zero number of {} blocks of {}",
                ty.name(),
                ty.block_size()
            ))
        })?;
        let whole_groups = |p: &&[u8]| p.len().is_multiple_of(GROUP * row_bytes);
        if parts.is_empty() || group_block_bytes(ty).is_none() || !parts.iter().all(whole_groups) {
            return Err(KernelError::Shape(format!(
                "cannot stack {} {} parts of {cols} values a row as whole groups of {GROUP} rows",
                parts.len(),
                ty.name()
            )));
        }
        let rows = parts.iter().map(|p| p.len() / row_bytes).sum();
        Ok(Self {
            ty,
            rows,
            cols,
            row_bytes,
            interleaved: true,
            passes: ActPasses::default(),
            data: pack_parts(ty, parts, row_bytes, consumed),
        })
    }

    fn build(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: Cow<'_, [u8]>,
        consumed: &mut dyn FnMut(Range<usize>),
    ) -> Result<Self, KernelError> {
        if !Self::takes(ty) {
            return Err(KernelError::NoKernel(ty.name()));
        }
        let row_bytes = ty.bytes_for(cols).ok_or_else(|| {
            KernelError::Shape(format!(
                "a row of {cols} values is not a whole number of {} blocks of {}",
                ty.name(),
                ty.block_size()
            ))
        })?;
        if rows.checked_mul(row_bytes) != Some(data.len()) {
            return Err(KernelError::Shape(format!(
                "{} bytes for a [{rows}, {cols}] {} matrix, expected {rows} rows of {row_bytes}",
                data.len(),
                ty.name(),
            )));
        }
        let interleaved = group_block_bytes(ty).is_some() && rows.is_multiple_of(GROUP);
        let data = if interleaved {
            pack(ty, &data, rows, row_bytes, consumed)
        } else {
            let len = data.len();
            let owned = data.into_owned();
            consumed(0..len);
            owned
        };
        Ok(Self {
            ty,
            rows,
            cols,
            row_bytes,
            interleaved,
            passes: ActPasses::default(),
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

    /// Bytes of one group of [`GROUP`] interleaved rows.
    fn group_bytes(&self) -> usize {
        let column = group_block_bytes(self.ty).expect("an interleaved type");
        self.cols / self.ty.block_size() * column
    }

    /// How the matrix keeps its values, for people: `"quantized"` (ggml blocks) or
    /// `"16-bit"` (F16, BF16).
    pub fn storage_kind(&self) -> &'static str {
        if is_float16(self.ty) {
            "16-bit"
        } else {
            "quantized"
        }
    }

    /// Whether the rows are stored in interleaved groups (the fast layout for decoding).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    /// The blocks of row `r`, as GGUF stores them (rebuilt from the group when interleaved).
    ///
    /// # Panics
    /// If `r` is out of range.
    pub fn row(&self, r: usize) -> Cow<'_, [u8]> {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        if self.interleaved {
            let group_bytes = self.group_bytes();
            let group = &self.data[r / GROUP * group_bytes..][..group_bytes];
            let mut row = Vec::with_capacity(self.row_bytes);
            unpack_row(self.ty, group, r % GROUP, &mut row);
            Cow::Owned(row)
        } else {
            Cow::Borrowed(&self.data[r * self.row_bytes..(r + 1) * self.row_bytes])
        }
    }

    /// Dequantizes row `r` into `out` (`cols` values).
    ///
    /// # Panics
    /// If `r` is out of range or `out.len() != cols`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, &self.row(r), out);
    }

    /// The matrix with its rows in the order `order` (row `i` of the result is row `order[i]`).
    ///
    /// # Panics
    /// If an index is out of range.
    pub fn permute_rows(&self, order: &[usize]) -> Self {
        let mut data = Vec::with_capacity(order.len() * self.row_bytes);
        for &r in order {
            data.extend_from_slice(&self.row(r));
        }
        Self::new(self.ty, order.len(), self.cols, data)
            .expect("rows of a valid matrix make a valid matrix")
            .with_activation_passes(self.passes)
    }

    /// The matrices' rows one after the other: `[Σ rows, cols]`, for projections of the same
    /// input run as one product (Q, K and V; gate and up). Each output row is the same dot
    /// product by the same kernel as in its part, so a fused product gives the same bits.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `parts` is empty, differ in type, width or activation
    /// passes, or the stack would be stored otherwise than a part (interleaved or not: another
    /// kernel, other rounding), which happens when some parts' heights are not multiples of
    /// eight.
    pub fn concat_rows(parts: &[&QuantMatrix]) -> Result<Self, KernelError> {
        let first = parts
            .first()
            .ok_or_else(|| KernelError::Shape("no matrices to concatenate".into()))?;
        if let Some(odd) = parts
            .iter()
            .find(|m| m.ty != first.ty || m.cols != first.cols || m.passes != first.passes)
        {
            return Err(KernelError::Shape(format!(
                "cannot stack {odd:?} under {first:?}: types, widths and activation passes \
                 must agree"
            )));
        }
        let rows: usize = parts.iter().map(|m| m.rows).sum();
        let interleaved = group_block_bytes(first.ty).is_some() && rows.is_multiple_of(GROUP);
        if parts.iter().any(|m| m.interleaved != interleaved) {
            return Err(KernelError::Shape(format!(
                "cannot stack matrices of {} rows: some would change kernel",
                parts
                    .iter()
                    .map(|m| m.rows.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if interleaved {
            // Groups are independent: the packed groups of each part, in order, are the
            // packed groups of the whole.
            let mut data = zeroed_on_huge_pages(parts.iter().map(|m| m.data.len()).sum());
            let mut at = 0;
            for m in parts {
                data[at..at + m.data.len()].copy_from_slice(&m.data);
                at += m.data.len();
            }
            return Ok(Self {
                rows,
                data,
                ..**first
            });
        }
        let mut data = Vec::with_capacity(rows * first.row_bytes);
        for m in parts {
            for r in 0..m.rows {
                data.extend_from_slice(&m.row(r));
            }
        }
        Ok(Self::new(first.ty, rows, first.cols, data)?.with_activation_passes(first.passes))
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
        assert!(
            tier.is_supported(),
            "kernel tier {tier} is not supported on this CPU"
        );
        if is_float16(self.ty) {
            let (k, n) = (self.cols, self.rows);
            float16::matmul_with(self.ty, &self.data, k, n, x, m, out, tier, pool);
            return;
        }
        let per_row = self.cols / ACT_BLOCK;
        let chunk = rows_per_task(self.rows, pool.threads());
        let out = SharedOut::new(out);
        // Hands a tile's eight outputs for activation row `t` and group `g` to `out`.
        let write = |t: usize, g: usize, y: &[f32]| {
            // One copy of the group's adjacent outputs.
            // SAFETY: every (t, row) is written by exactly one task.
            unsafe {
                out.slice(t * self.rows + g * GROUP, y.len())
                    .copy_from_slice(y)
            };
        };
        if self.interleaved && self.passes == ActPasses::Q16 {
            let acts = quantize_activations_16(x, m, self.cols, tier, pool);
            // Every row's blocks found once, so a tile takes its rows as a slice of them.
            let act_rows: Vec<&[Act16Block]> = acts.chunks_exact(per_row).collect();
            let tiles = Q16Tiles::new(tier);
            self.for_each_tile(m, pool, chunk, tiles.rows(), None, |w, g, rows| {
                // SAFETY: the tier was checked above; `w` is one group of `cols / 32` block
                // columns, each activation row as many blocks.
                unsafe {
                    tiles.run(w, &act_rows[rows.clone()], |i, y| {
                        write(rows.start + i, g, &y)
                    })
                };
            });
            return;
        }
        let (hi, lo) = quantize_activations(x, m, self.cols, self.passes, tier, pool);
        let stride = act_row_stride(per_row);
        let acts = |t: usize| {
            let span = t * stride..t * stride + per_row;
            match self.passes {
                // One row of zero blocks stands for every row's second pass.
                ActPasses::One => (&hi[span], &lo[..per_row]),
                ActPasses::Two | ActPasses::Q16 => (&hi[span.clone()], &lo[span]),
            }
        };
        if self.interleaved {
            let tiles = TileKernels::new(self.ty, tier, self.passes)
                .expect("interleaved types have tile kernels");
            // Prefill-sized products (as many rows as the wide tiles need to pay, at least
            // more than a narrow tile takes) multiply two groups at once where the type has
            // wide tiles; their outputs are the narrow tiles' bits.
            let wide = WideKernels::new(self.ty, tier, self.passes).filter(|w| m >= w.min_rows());
            // Every row's passes found once, so a tile takes its rows as a slice of them (an
            // array built per tile was 2 % of a decode step).
            let act_rows: Vec<_> = (0..m).map(acts).collect();
            let run_wide = |w: &[u8], g: usize, pass: Range<usize>| {
                let wide = wide.expect("wide tiles when asked for");
                // SAFETY: the tier was checked above (wide tiles exist only for it); `w` is
                // groups `g` and `g + 1`, each of `cols / 32` blocks' columns, each row of `hi`
                // and `lo` as many blocks.
                unsafe {
                    wide.run_pass(w, &act_rows[pass.clone()], |i, y: [f32; WIDE_ROWS]| {
                        write(pass.start + i, g, &y)
                    })
                };
            };
            let wide_pairs: Option<&GroupWork<'_>> = wide.is_some().then_some(&run_wide);
            self.for_each_tile(m, pool, chunk, tiles.rows(), wide_pairs, |w, g, rows| {
                // SAFETY: the tier was checked above; `w` is one group of `cols / 32` block
                // columns, each row of `hi` and `lo` as many blocks.
                unsafe {
                    tiles.run(w, &act_rows[rows.clone()], |i, y| {
                        write(rows.start + i, g, &y)
                    })
                };
            });
            return;
        }
        let kernel = DotKernel::new(self.ty, tier).expect("a type with a kernel, a supported tier");
        pool.run(self.rows.div_ceil(chunk), &|task| {
            let rows = task * chunk..((task + 1) * chunk).min(self.rows);
            for r in rows {
                let w = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
                for t in 0..m {
                    let (hi, lo) = acts(t);
                    // SAFETY: `w` is one whole row, `hi` and `lo` one row of `cols / 32`
                    // blocks each.
                    let v = unsafe {
                        match self.passes {
                            ActPasses::One => kernel.dot_unchecked(w, hi),
                            // Q16 is not kept by a matrix of rows (`with_activation_passes`).
                            ActPasses::Two | ActPasses::Q16 => {
                                kernel.dot_unchecked(w, hi) + kernel.dot_unchecked(w, lo)
                            }
                        }
                    };
                    // SAFETY: every (t, r) is written by exactly one task.
                    unsafe { out.write(t * self.rows + r, v) };
                }
            }
        });
    }

    /// The schedule of an interleaved product: tasks of `chunk` output rows (whole groups,
    /// pairs of them where there are wide tiles) over the pool; each task meets one pass of
    /// [`ACT_ROWS_PER_PASS`] activation rows at a time, so that the rows stay in cache while
    /// each of its groups reads them (a prompt's whole activations would not), and hands
    /// `narrow` a group (its bytes, its index) with a tile of at most `tile_rows` of the
    /// pass's rows, or `wide` a pair of groups (the first one's index) with the whole pass.
    /// A product of one pass without wide tiles (decoding) has no tasks of `chunk` rows: the
    /// groups are split into one share a thread ([`ThreadPool::run_split`]).
    fn for_each_tile(
        &self,
        m: usize,
        pool: &ThreadPool,
        chunk: usize,
        tile_rows: usize,
        wide: Option<&GroupWork<'_>>,
        narrow: impl Fn(&[u8], usize, Range<usize>) + Sync,
    ) {
        let group_bytes = self.group_bytes();
        let groups = self.rows / GROUP;
        // Group `g` with the activation rows `pass`, a tile of `tile_rows` at a time.
        let narrow_group = |g: usize, pass: Range<usize>| {
            let w = &self.data[g * group_bytes..(g + 1) * group_bytes];
            for start in pass.clone().step_by(tile_rows) {
                narrow(w, g, start..(start + tile_rows).min(pass.end));
            }
        };
        if wide.is_none() && m <= ACT_ROWS_PER_PASS {
            // One pass of activation rows (decoding): each thread streams its share of the
            // groups and takes the last ones from the other's back ([`ThreadPool::run_split`]).
            pool.run_split(groups, SPLIT_GROUPS, &|claim| {
                for g in claim {
                    narrow_group(g, 0..m);
                }
            });
            return;
        }
        let mut groups_per_task = chunk.div_ceil(GROUP);
        if wide.is_some() {
            groups_per_task = groups_per_task.next_multiple_of(2);
        }
        pool.run(groups.div_ceil(groups_per_task), &|task| {
            let task_groups = task * groups_per_task..((task + 1) * groups_per_task).min(groups);
            for pass in (0..m).step_by(ACT_ROWS_PER_PASS) {
                let pass = pass..(pass + ACT_ROWS_PER_PASS).min(m);
                let mut g = task_groups.start;
                while g < task_groups.end {
                    if let Some(wide) = wide
                        && g + 1 < task_groups.end
                    {
                        wide(
                            &self.data[g * group_bytes..(g + 2) * group_bytes],
                            g,
                            pass.clone(),
                        );
                        g += 2;
                        continue;
                    }
                    narrow_group(g, pass.clone());
                    g += 1;
                }
            }
        });
    }
}

/// Runs `quantize_row` for each of `m` activation rows, in parallel when there are many.
fn for_each_row(m: usize, pool: &ThreadPool, quantize_row: impl Fn(usize) + Sync) {
    if m < 8 {
        (0..m).for_each(quantize_row);
    } else {
        let rows_per_task = m.div_ceil(pool.threads() * 2);
        pool.run(m.div_ceil(rows_per_task), &|task| {
            for row in task * rows_per_task..((task + 1) * rows_per_task).min(m) {
                quantize_row(row);
            }
        });
    }
}

/// `x` (`[m, cols]`) as 16-bit activation blocks ([`ActPasses::Q16`]).
fn quantize_activations_16(
    x: &[f32],
    m: usize,
    cols: usize,
    tier: Tier,
    pool: &ThreadPool,
) -> Vec<Act16Block> {
    let per_row = cols / ACT_BLOCK;
    let mut blocks = vec![Act16Block::ZERO; m * per_row];
    let out = SharedOut::new(&mut blocks);
    for_each_row(m, pool, |row| {
        // SAFETY: each row is quantized by exactly one task.
        let out = unsafe { out.slice(row * per_row, per_row) };
        quantize_row_16(&x[row * cols..(row + 1) * cols], out, tier);
    });
    blocks
}

/// Blocks from one activation row's start to the next's: the row's blocks and one more. A
/// 2,048-wide row is 64 blocks of 64 bytes, 4 KB, and rows 4 KB apart fall in the same sets of
/// L1: a wide tile reading the same block of its eight rows in two passes asked one 8-way set
/// for 16 lines (docs/kernels.md, item 5). One more block puts each row a line further on.
fn act_row_stride(per_row: usize) -> usize {
    per_row + 1
}

/// `x` (`[m, cols]`) as activation blocks in `passes` (for one, `lo` is a single row of zero
/// blocks, the second pass of every row), rows quantized in parallel when there are many.
fn quantize_activations(
    x: &[f32],
    m: usize,
    cols: usize,
    passes: ActPasses,
    tier: Tier,
    pool: &ThreadPool,
) -> (Vec<ActBlock>, Vec<ActBlock>) {
    let per_row = cols / ACT_BLOCK;
    let stride = act_row_stride(per_row);
    let empty = ActBlock::ZERO;
    let lo_rows = match passes {
        ActPasses::One => 1,
        ActPasses::Two | ActPasses::Q16 => m,
    };
    let (mut hi, mut lo) = (vec![empty; m * stride], vec![empty; lo_rows * stride]);
    let (hi_out, lo_out) = (SharedOut::new(&mut hi), SharedOut::new(&mut lo));
    for_each_row(m, pool, |row| {
        let (hi, lo) = (&hi_out, &lo_out);
        // SAFETY: each row is quantized by exactly one task.
        let hi = unsafe { hi.slice(row * stride, per_row) };
        let x = &x[row * cols..(row + 1) * cols];
        match passes {
            ActPasses::One => quantize_row(x, hi, tier),
            ActPasses::Two | ActPasses::Q16 => {
                // SAFETY: as `hi`'s: row `row` of `lo` is this task's alone.
                let lo = unsafe { lo.slice(row * stride, per_row) };
                quantize_split_row(x, hi, lo, tier)
            }
        }
    });
    (hi, lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_rows_are_never_4_kb_apart() {
        for cols in [576, 1024, 1536, 2048, 3072, 4096, 8192, 14336, 16384] {
            let bytes = act_row_stride(cols / ACT_BLOCK) * size_of::<ActBlock>();
            assert_ne!(bytes % 4096, 0, "{cols}-wide rows {bytes} bytes apart");
        }
    }
}
