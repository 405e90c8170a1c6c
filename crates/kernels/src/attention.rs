//! Grouped-query attention over explicit masks, on the thread pool, computed so that a query's
//! output depends only on the keys it sees: each query row takes its scores, softmax and
//! weighted sum over its *visible* keys in key order, skipping masked ones, with a fixed
//! summation order. So a sequence's outputs are bit-identical whether it runs alone, packed
//! with other prompts (their keys are masked) or padded beside longer histories (padding is
//! masked): batches equal single runs exactly, also on the quantized path, where activation
//! rounding would otherwise turn a last-bit difference into a different token.
//!
//! The work splits into tasks of (batch row, KV head, a run of query rows); each KV head's
//! keys are read once per task for all the query heads sharing it (grouped-query attention).

use crate::SharedOut;
use crate::error::KernelError;
use crate::pool::ThreadPool;

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Independent rows (sequences, or one packed row).
    pub batch: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Query heads per KV head.
    pub n_rep: usize,
    /// Query positions per row.
    pub q_len: usize,
    /// Key positions per row.
    pub keys: usize,
    /// Width of a head.
    pub head_dim: usize,
}

impl AttentionShape {
    fn q_rows(&self) -> usize {
        self.n_rep * self.q_len
    }

    fn check(
        &self,
        q: &[f32],
        kv: &KvBlocks<'_>,
        mask: &[bool],
        out: &[f32],
    ) -> Result<(), KernelError> {
        let shape_error =
            |what: String| Err(KernelError::Shape(format!("attention {what} for {self:?}")));
        let q_len = self.batch * self.n_kv_heads * self.q_rows() * self.head_dim;
        let mask_len = self.batch * self.q_len * self.keys;
        let checks = [
            ("q", q.len(), q_len),
            ("mask", mask.len(), mask_len),
            ("out", out.len(), q_len),
            ("v", kv.v.len(), kv.k.len()),
        ];
        for (name, got, expected) in checks {
            if got != expected {
                return shape_error(format!("{name} has {got} values, expected {expected}"));
            }
        }
        let heads = self.batch * self.n_kv_heads;
        let block_len = kv.block_keys * self.head_dim;
        if heads == 0 || block_len == 0 {
            return Ok(());
        }
        let per_head = kv.table.len() / heads;
        if kv.table.len() != per_head * heads || per_head * kv.block_keys < self.keys {
            return shape_error(format!(
                "block table of {} entries of {} keys does not cover {} keys per head",
                kv.table.len(),
                kv.block_keys,
                self.keys
            ));
        }
        let blocks = kv.k.len() / block_len;
        if kv.k.len() != blocks * block_len {
            return shape_error(format!(
                "k has {} values, not whole blocks of {block_len}",
                kv.k.len()
            ));
        }
        if let Some(bad) = kv.table.iter().find(|&&b| b >= blocks) {
            return shape_error(format!("block table names block {bad} of {blocks}"));
        }
        Ok(())
    }
}

/// Keys and values stored in blocks of `block_keys` rows of `head_dim`, and which blocks each
/// (batch row, KV head) reads: a paged KV cache read where it lies, without gathering it
/// into one tensor first.
#[derive(Debug, Clone, Copy)]
pub struct KvBlocks<'a> {
    /// `[blocks, block_keys, head_dim]`
    pub k: &'a [f32],
    /// `[blocks, block_keys, head_dim]`
    pub v: &'a [f32],
    /// `[batch, n_kv_heads, blocks_per_head]`: the blocks holding a head's keys, in key order
    /// (key `j` is row `j % block_keys` of block `j / block_keys`); may cover more keys than
    /// the mask, whose columns are the first of them.
    pub table: &'a [usize],
    /// Keys per block.
    pub block_keys: usize,
}

/// One (batch row, KV head)'s keys and values, wherever their blocks lie.
struct HeadKv<'a> {
    kv: KvBlocks<'a>,
    blocks: &'a [usize],
    head_dim: usize,
}

impl HeadKv<'_> {
    /// The offsets (into `k` and `v`) of keys `span`, in key order: walked block by block, so
    /// the inner loop pays no division per key.
    fn offsets(&self, span: std::ops::Range<usize>) -> impl Iterator<Item = usize> + '_ {
        let block_keys = self.kv.block_keys;
        let first = span.start / block_keys;
        let last = span.end.div_ceil(block_keys);
        (first..last).flat_map(move |b| {
            let base = self.blocks[b] * block_keys;
            let rows = span.start.max(b * block_keys) - b * block_keys
                ..span.end.min((b + 1) * block_keys) - b * block_keys;
            rows.map(move |r| (base + r) * self.head_dim)
        })
    }
}

/// Query rows per task: small enough to spread a decode step's few rows over the threads,
/// large enough that a prefill's tasks each reuse their keys from cache. (Finer tasks for
/// decoding, one per query row, measured slower: each reads its KV head's keys again.)
const ROWS_PER_TASK: usize = 16;

/// `out = softmax(q kᵀ / √head_dim, masked) v` for every (row, query head).
///
/// # Shapes
/// - `q`: `[batch, n_kv_heads, n_rep * q_len, head_dim]`: query head `kv * n_rep + rep`, at
///   position `i`, is row `rep * q_len + i` of KV head `kv`'s block
/// - `k`, `v`: `[batch, n_kv_heads, keys, head_dim]`
/// - `mask`: `[batch, q_len, keys]`, `true` = masked (shared by the query heads)
/// - `out`: `[batch, n_kv_heads, n_rep * q_len, head_dim]`
///
/// A query that sees no key gets zeros.
///
/// # Errors
/// [`KernelError::Shape`] when a slice's length disagrees with `shape`.
pub fn attention(
    shape: AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    let expected = shape.batch * shape.n_kv_heads * shape.keys * shape.head_dim;
    for (name, got) in [("k", k.len()), ("v", v.len())] {
        if got != expected {
            return Err(KernelError::Shape(format!(
                "attention {name} has {got} values, expected {expected} for {shape:?}"
            )));
        }
    }
    // Each head's keys are one block.
    let table: Vec<usize> = (0..shape.batch * shape.n_kv_heads).collect();
    let kv = KvBlocks {
        k,
        v,
        table: &table,
        block_keys: shape.keys,
    };
    attention_blocks(shape, q, kv, mask, out, pool)
}

/// [`attention`] over keys and values read through a block table ([`KvBlocks`]).
///
/// # Shapes
/// As [`attention`], with `k` and `v` as `kv` lays them out.
///
/// # Errors
/// [`KernelError::Shape`] when a slice's length disagrees with `shape`, or the table names a
/// block `kv` does not hold or covers fewer than `shape.keys` keys.
pub fn attention_blocks(
    shape: AttentionShape,
    q: &[f32],
    kv: KvBlocks<'_>,
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    shape.check(q, &kv, mask, out)?;
    let AttentionShape {
        batch,
        n_kv_heads,
        q_len,
        keys,
        head_dim,
        ..
    } = shape;
    let q_rows = shape.q_rows();
    if q_rows == 0 || head_dim == 0 || batch * n_kv_heads == 0 {
        return Ok(());
    }
    let per_head = kv.table.len() / (batch * n_kv_heads);
    let chunks = q_rows.div_ceil(ROWS_PER_TASK);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let shared = SharedOut::new(out);
    pool.run(batch * n_kv_heads * chunks, &|task| {
        let (block, chunk) = (task / chunks, task % chunks);
        let b = block / n_kv_heads;
        let head = HeadKv {
            kv,
            blocks: &kv.table[block * per_head..(block + 1) * per_head],
            head_dim,
        };
        let mut scores = Vec::with_capacity(keys);
        let mut acc = vec![0f32; head_dim];
        let rows = chunk * ROWS_PER_TASK..((chunk + 1) * ROWS_PER_TASK).min(q_rows);
        for row in rows {
            let i = row % q_len;
            let row_mask = &mask[(b * q_len + i) * keys..][..keys];
            let q_start = (block * q_rows + row) * head_dim;
            let q_row = &q[q_start..q_start + head_dim];
            attend_row(q_row, &head, row_mask, scale, &mut scores, &mut acc);
            for (d, &value) in acc.iter().enumerate() {
                // SAFETY: each (block, row) belongs to exactly one task.
                unsafe { shared.write(q_start + d, value) };
            }
        }
    });
    Ok(())
}

/// One query row: `acc = Σ_j p_j v_j / Σ_j p_j` over the visible keys `j`, in key order
/// (`scores` holds each visible key's offset and score).
fn attend_row(
    q: &[f32],
    kv: &HeadKv<'_>,
    mask: &[bool],
    scale: f32,
    scores: &mut Vec<(usize, f32)>,
    acc: &mut [f32],
) {
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    let head_dim = q.len();
    let visible = visible_span(mask);
    for (at, _) in kv
        .offsets(visible.clone())
        .zip(&mask[visible])
        .filter(|(_, masked)| !**masked)
    {
        let s = dot(q, &kv.kv.k[at..at + head_dim]) * scale;
        max = max.max(s);
        scores.push((at, s));
    }
    acc.fill(0.0);
    if scores.is_empty() {
        return;
    }
    let mut sum = 0f32;
    for &(at, s) in scores.iter() {
        let p = (s - max).exp();
        sum += p;
        for (a, &x) in acc.iter_mut().zip(&kv.kv.v[at..at + head_dim]) {
            *a += p * x;
        }
    }
    let inv = 1.0 / sum;
    for a in acc.iter_mut() {
        *a *= inv;
    }
}

/// The keys from the first visible one to the last: a packed prompt's row sees one span of a
/// long mask, so the masked runs around it are skipped eight bytes at a time.
fn visible_span(mask: &[bool]) -> std::ops::Range<usize> {
    const ALL_MASKED: u64 = 0x0101_0101_0101_0101;
    // SAFETY: `bool` is one byte, 0 or 1.
    let bytes: &[u8] = unsafe { std::slice::from_raw_parts(mask.as_ptr().cast(), mask.len()) };
    let word = |c: &[u8]| u64::from_ne_bytes(c.try_into().expect("chunks of 8"));
    let mut start = bytes
        .chunks_exact(8)
        .position(|c| word(c) != ALL_MASKED)
        .map_or(bytes.len() / 8 * 8, |c| c * 8);
    while start < bytes.len() && bytes[start] == 1 {
        start += 1;
    }
    let mut end = bytes.len();
    while end > start && !end.is_multiple_of(8) && bytes[end - 1] == 1 {
        end -= 1;
    }
    if end.is_multiple_of(8) {
        let whole = bytes[start.div_ceil(8) * 8..end].chunks_exact(8).rev();
        let skipped = whole.take_while(|c| word(c) == ALL_MASKED).count();
        end -= skipped * 8;
        while end > start && bytes[end - 1] == 1 {
            end -= 1;
        }
    }
    start..end
}

/// `a · b` in eight interleaved partial sums (one vector register), a fixed order on every
/// machine.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in a_rest.iter().zip(b_rest) {
        tail += x * y;
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}
