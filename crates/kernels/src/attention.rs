//! Grouped-query attention over explicit masks, on the thread pool, computed so that a query's
//! output depends only on the keys it sees: each query row takes its scores, softmax and
//! weighted sum over its *visible* keys in key order, skipping masked ones, with a fixed
//! summation order. So a sequence's outputs are bit-identical whether it runs alone, packed
//! with other prompts (their keys are masked) or padded beside longer histories (padding is
//! masked): batches equal single runs exactly, also on the quantized path, where activation
//! rounding would otherwise turn a last-bit difference into a different token.
//!
//! A row's keys are taken in partitions of [`PARTITION_KEYS`] counted from its first visible
//! key; each partition gives a partial result (its normalized weighted sum, its largest score
//! and its sum of exponentials) and the partials are merged in partition order. Where a step
//! has few rows (decoding), the partitions of one row run as separate tasks on the threads
//! (flash-decoding), so one long sequence with three KV heads keeps every thread busy; where
//! it has many (prefill), a task takes all partitions of its rows. Which one ran does not
//! change a bit: the partials and their merge are the same.
//!
//! The work splits into tasks of (batch row, KV head, a run of query rows[, a partition]);
//! each KV head's keys are read once per task for all the query heads sharing it
//! (grouped-query attention). Keys and values may be f32, f16, bf16 or Q8_0 blocks
//! ([`KvElement`]): the kernels widen or dequantize them as they load them.

mod element;
#[cfg(target_arch = "x86_64")]
mod tile;

use std::ops::Range;

pub use element::{
    KvElement, Q8_0_VALUES, Q8_0_WORDS, Q8_0Block, dequantize_q8_0, q8_0_blocks, q8_0_blocks_mut,
    quantize_q8_0,
};

use crate::SharedOut;
use crate::error::KernelError;
use crate::pool::ThreadPool;
use crate::tier::Tier;

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

/// How a query-key dot product becomes a score before the softmax: `s = q·k × scale`, then,
/// where there is a soft cap `c`, `c tanh(s / c)` (Gemma 2's `attn_logit_softcapping`). The
/// default is `1/√head_dim` and no cap.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Scoring {
    /// The factor on `q·k`; `None`: `1/√head_dim`.
    pub scale: Option<f32>,
    /// The soft cap, where scores are capped (positive).
    pub softcap: Option<f32>,
}

impl Scoring {
    /// The factor on `q·k` for heads of `head_dim`.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.scale.unwrap_or(1.0 / (head_dim as f32).sqrt())
    }

    /// The score of a dot product `dot` with heads of `head_dim`, as every tier computes it.
    pub fn score(&self, dot: f32, head_dim: usize) -> f32 {
        Scorer::new(*self, head_dim).score(dot)
    }
}

/// [`Scoring`] resolved for one call: what the row kernels apply to each dot product.
#[derive(Debug, Clone, Copy)]
struct Scorer {
    scale: f32,
    softcap: Option<f32>,
}

impl Scorer {
    fn new(scoring: Scoring, head_dim: usize) -> Self {
        Self {
            scale: scoring.scale_for(head_dim),
            softcap: scoring.softcap,
        }
    }

    #[inline]
    fn score(self, dot: f32) -> f32 {
        let s = dot * self.scale;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }
}

impl AttentionShape {
    fn q_rows(&self) -> usize {
        self.n_rep * self.q_len
    }

    fn check<T: KvElement>(
        &self,
        q: &[f32],
        kv: &KvBlocks<'_, T>,
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
        if !self.head_dim.is_multiple_of(T::VALUES) {
            return shape_error(format!(
                "heads of {} values are not whole units of {}",
                self.head_dim,
                T::VALUES
            ));
        }
        let heads = self.batch * self.n_kv_heads;
        let block_len = kv.block_keys * self.head_dim / T::VALUES;
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
                "k has {} units, not whole blocks of {block_len}",
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
/// into one tensor first. The values are f32, f16, bf16 or Q8_0 blocks ([`KvElement`]), a row
/// of `head_dim` values being `head_dim / T::VALUES` units.
#[derive(Debug, Clone, Copy)]
pub struct KvBlocks<'a, T = f32> {
    /// `[blocks, block_keys, head_dim / T::VALUES]`
    pub k: &'a [T],
    /// `[blocks, block_keys, head_dim / T::VALUES]`
    pub v: &'a [T],
    /// `[batch, n_kv_heads, blocks_per_head]`: the blocks holding a head's keys, in key order
    /// (key `j` is row `j % block_keys` of block `j / block_keys`); may cover more keys than
    /// the mask, whose columns are the first of them.
    pub table: &'a [usize],
    /// Keys per block.
    pub block_keys: usize,
}

/// One (batch row, KV head)'s keys and values, wherever their blocks lie.
struct HeadKv<'a, T> {
    kv: KvBlocks<'a, T>,
    blocks: &'a [usize],
    head_dim: usize,
    /// Units per key row: `head_dim / T::VALUES`.
    row_units: usize,
}

impl<'a, T: KvElement> HeadKv<'a, T> {
    fn new(kv: KvBlocks<'a, T>, blocks: &'a [usize], head_dim: usize) -> Self {
        Self {
            kv,
            blocks,
            head_dim,
            row_units: head_dim / T::VALUES,
        }
    }

    /// The key row at unit offset `at`.
    #[inline]
    fn key(&self, at: usize) -> &'a [T] {
        &self.kv.k[at..at + self.row_units]
    }

    /// The value row at unit offset `at`.
    #[inline]
    fn value(&self, at: usize) -> &'a [T] {
        &self.kv.v[at..at + self.row_units]
    }

    /// A cursor at key `span.start` for [`Self::next_key`] and [`Self::next_run`], which walk
    /// `span`. A head's blocks are not adjacent in a paged cache (the pool interleaves the KV
    /// heads' blocks): the walk finds the next block through the table, and so can prefetch
    /// what neither a fixed distance ahead nor the hardware prefetchers would find.
    #[cfg(target_arch = "x86_64")]
    fn cursor(&self, span: std::ops::Range<usize>) -> KeyCursor {
        let block_keys = self.kv.block_keys;
        let (block, row) = (span.start / block_keys, span.start % block_keys);
        let at = match self.blocks.get(block) {
            Some(&b) if !span.is_empty() => (b * block_keys + row) * self.row_units,
            _ => 0,
        };
        KeyCursor {
            block,
            row,
            at,
            left: span.len(),
        }
    }

    /// The next key row of `cursor`'s span, `None` past its end.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn next_key(&self, cursor: &mut KeyCursor) -> Option<&'a [T]> {
        self.next_run(cursor, 1).map(|(at, _)| self.key(at))
    }

    /// The next keys of `cursor`'s span that lie one after another, at most `most` of them
    /// (`most > 0`): the unit offset of the first one's row and how many (up to the end of
    /// its block), `None` past the span's end; a table lookup at each new block only.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn next_run(&self, cursor: &mut KeyCursor, most: usize) -> Option<(usize, usize)> {
        let block_keys = self.kv.block_keys;
        let n = most.min(cursor.left).min(block_keys - cursor.row);
        if n == 0 {
            return None;
        }
        let at = cursor.at;
        cursor.left -= n;
        cursor.row += n;
        if cursor.row < block_keys {
            cursor.at += n * self.row_units;
        } else if cursor.left > 0 {
            cursor.block += 1;
            cursor.row = 0;
            cursor.at = self.blocks[cursor.block] * block_keys * self.row_units;
        }
        Some((at, n))
    }

    /// Walks `cursor` on by up to `keys` keys, handing each run of adjacent rows to
    /// `prefetch` (unit offset, rows: [`Self::prefetch_run`] or [`Self::prefetch_values`]);
    /// returns how many keys it passed (fewer at the span's end).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn prefetch_next(
        &self,
        cursor: &mut KeyCursor,
        keys: usize,
        prefetch: impl Fn(&Self, usize, usize),
    ) -> usize {
        let mut passed = 0;
        while passed < keys {
            let Some((at, n)) = self.next_run(cursor, keys - passed) else {
                break;
            };
            prefetch(self, at, n);
            passed += n;
        }
        passed
    }

    /// Prefetches the rows of `rows` keys from unit offset `at`, one after another: the keys
    /// into L1 and the values into L2 (the values are read after the whole partition's
    /// scores, so they only need to be near).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn prefetch_run(&self, at: usize, rows: usize) {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        let (k, v) = (
            self.kv.k.as_ptr().wrapping_add(at).cast::<i8>(),
            self.kv.v.as_ptr().wrapping_add(at).cast::<i8>(),
        );
        for line in (0..rows * self.row_units * size_of::<T>()).step_by(64) {
            // SAFETY: SSE is part of x86_64; a prefetch reads nothing and cannot fault.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(k.wrapping_add(line));
                _mm_prefetch::<_MM_HINT_T1>(v.wrapping_add(line));
            }
        }
    }

    /// Prefetches the value rows of `rows` keys from unit offset `at`, one after another,
    /// into L1.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    fn prefetch_values(&self, at: usize, rows: usize) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let v = self.kv.v.as_ptr().wrapping_add(at).cast::<i8>();
        for line in (0..rows * self.row_units * size_of::<T>()).step_by(64) {
            // SAFETY: SSE is part of x86_64; a prefetch reads nothing and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(line)) };
        }
    }

    /// Keys `span` as runs of keys that lie one after another (a block's, or a part of one),
    /// in key order: (the run's first key, counted from `span.start`; the unit offset of its
    /// first row; its length).
    fn runs(
        &self,
        span: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let block_keys = self.kv.block_keys;
        let first = span.start / block_keys;
        let last = span.end.div_ceil(block_keys);
        (first..last).map(move |b| {
            let from = span.start.max(b * block_keys);
            let to = span.end.min((b + 1) * block_keys);
            let at = (self.blocks[b] * block_keys + from - b * block_keys) * self.row_units;
            (from - span.start, at, to - from)
        })
    }

    /// The unit offsets (into `k` and `v`) of keys `span`, in key order: walked run by run
    /// ([`Self::runs`]), so the inner loop pays no division per key.
    fn offsets(&self, span: std::ops::Range<usize>) -> impl Iterator<Item = usize> + '_ {
        self.runs(span)
            .flat_map(move |(_, at, len)| (0..len).map(move |i| at + i * self.row_units))
    }
}

/// Where [`HeadKv::next_run`] is in a span of keys: the block (of the head's table), the row
/// in it, that row's unit offset, and the keys left.
#[cfg(target_arch = "x86_64")]
struct KeyCursor {
    block: usize,
    row: usize,
    at: usize,
    left: usize,
}

/// Query rows per task: small enough to spread a decode step's few rows over the threads,
/// large enough that a prefill's tasks each reuse their keys from cache. (Finer tasks for
/// decoding, one per query row, measured slower: each reads its KV head's keys again.)
const ROWS_PER_TASK: usize = 16;

/// `out = softmax(scores(q kᵀ), masked) v` for every (row, query head), the scores as
/// `scoring` says ([`Scoring`]: `q·k / √head_dim` by default).
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
#[allow(clippy::too_many_arguments)]
pub fn attention(
    shape: AttentionShape,
    scoring: Scoring,
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
    attention_blocks(shape, scoring, q, kv, mask, out, pool)
}

/// [`attention`] over keys and values read through a block table ([`KvBlocks`]), which may
/// hold f32, f16 or bf16.
///
/// # Shapes
/// As [`attention`], with `k` and `v` as `kv` lays them out.
///
/// # Errors
/// [`KernelError::Shape`] when a slice's length disagrees with `shape`, or the table names a
/// block `kv` does not hold or covers fewer than `shape.keys` keys.
pub fn attention_blocks<T: KvElement>(
    shape: AttentionShape,
    scoring: Scoring,
    q: &[f32],
    kv: KvBlocks<'_, T>,
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<(), KernelError> {
    attention_blocks_with(shape, scoring, q, kv, mask, out, pool, Tier::active())
}

/// [`attention_blocks`] on a given tier: [`Tier::Scalar`] is the reference; the x86 tiers
/// take each row's scores, exponentials and weighted sums eight lanes at a time with FMA, and
/// [`Tier::Avx512Vnni`] takes heads whose width is a multiple of 16 four query rows by sixteen
/// keys at a time (`attention/tile.rs`). Each rounds differently from the reference, the same
/// way on every call: a row's output depends only on its visible keys.
///
/// # Errors
/// As [`attention_blocks`].
///
/// # Panics
/// If this CPU cannot run `tier`.
#[allow(clippy::too_many_arguments)]
pub fn attention_blocks_with<T: KvElement>(
    shape: AttentionShape,
    scoring: Scoring,
    q: &[f32],
    kv: KvBlocks<'_, T>,
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
    tier: Tier,
) -> Result<(), KernelError> {
    attention_partitioned(shape, scoring, q, kv, mask, out, pool, tier, PARTITION_KEYS)
}

/// Keys a row takes per partition (see the module doc): a decode step of one sequence at a
/// depth of 4,096 gives each KV head eight tasks. (Each partition costs a pass of its own
/// over the tile's setup and a partial to merge, so smaller ones lose at short depths.)
pub const PARTITION_KEYS: usize = 512;

/// A step whose tasks (without splitting rows by partition) number fewer than this many per
/// thread splits them: a decode step of a few sequences, where a task per KV head would leave
/// threads idle.
const SPLIT_BELOW_TASKS_PER_THREAD: usize = 4;

/// [`attention_blocks_with`] with partitions of `partition_keys` keys instead of
/// [`PARTITION_KEYS`]: a row's output depends on the partition size (a partition's partial is
/// rounded before the merge), on nothing else but its visible keys. Small partitions let the
/// tests reach the merge with few keys.
///
/// # Errors
/// As [`attention_blocks`], and [`KernelError::Shape`] for a partition of no keys.
///
/// # Panics
/// If this CPU cannot run `tier`.
#[allow(clippy::too_many_arguments)]
pub fn attention_partitioned<T: KvElement>(
    shape: AttentionShape,
    scoring: Scoring,
    q: &[f32],
    kv: KvBlocks<'_, T>,
    mask: &[bool],
    out: &mut [f32],
    pool: &ThreadPool,
    tier: Tier,
    partition_keys: usize,
) -> Result<(), KernelError> {
    assert!(
        tier.is_supported(),
        "kernel tier {tier} is not supported on this CPU"
    );
    shape.check(q, &kv, mask, out)?;
    if partition_keys == 0 {
        return Err(KernelError::Shape(
            "attention partitions of 0 keys".to_string(),
        ));
    }
    let AttentionShape {
        batch,
        n_kv_heads,
        q_len,
        keys,
        head_dim,
        n_rep,
    } = shape;
    if shape.q_rows() == 0 || head_dim == 0 || batch * n_kv_heads == 0 {
        return Ok(());
    }
    // A task takes a run of positions with every query head of its KV head at them: those
    // rows see the same keys, so the AVX-512 tiles share one pass over them.
    let positions = (ROWS_PER_TASK / n_rep).max(1);
    let job = Job {
        shape,
        q,
        kv,
        mask,
        per_head: kv.table.len() / (batch * n_kv_heads),
        positions,
        chunks: q_len.div_ceil(positions),
        scorer: Scorer::new(scoring, head_dim),
        tier,
        partition_keys,
    };
    let tasks = batch * n_kv_heads * job.chunks;
    let parts = keys.div_ceil(partition_keys).max(1);
    let record = record_len(head_dim);
    let task_rows = positions * n_rep;
    let shared = SharedOut::new(out);
    if parts > 1 && tasks < SPLIT_BELOW_TASKS_PER_THREAD * pool.threads() {
        // Every (task, partition) on its own, then every row's partials merged.
        let per_task = task_rows * parts * record;
        let mut records = vec![0f32; tasks * per_task];
        let sink = SharedOut::new(&mut records);
        pool.run(tasks * parts, &|t| {
            let (task, part) = (t / parts, t % parts);
            let dest = |row: usize, _: usize| task * per_task + (row * parts + part) * record;
            job.partials(task, part..part + 1, &dest, &sink);
        });
        pool.run(tasks, &|task| {
            job.merge(
                task,
                &records[task * per_task..][..per_task],
                parts,
                &shared,
            );
        });
    } else {
        pool.run(tasks, &|task| {
            let mut records = vec![0f32; task_rows * parts * record];
            let dest = |row: usize, part: usize| (row * parts + part) * record;
            job.partials(task, 0..parts, &dest, &SharedOut::new(&mut records));
            job.merge(task, &records, parts, &shared);
        });
    }
    Ok(())
}

/// Floats in one partial result: the partition's normalized weighted sum (`head_dim`), its
/// largest score, its sum of exponentials (0 when the row sees no key in it).
fn record_len(head_dim: usize) -> usize {
    head_dim + 2
}

/// Partition `part` of the visible keys `visible`: `partition_keys` keys from the first
/// visible one on (empty past the last).
fn partition_span(visible: &Range<usize>, part: usize, partition_keys: usize) -> Range<usize> {
    let start = visible
        .start
        .saturating_add(part.saturating_mul(partition_keys));
    start.min(visible.end)..start.saturating_add(partition_keys).min(visible.end)
}

/// A tile kernel's entry ([`tile::attend_rows`] for one register width).
#[cfg(target_arch = "x86_64")]
type TileFn<T> = unsafe fn(
    &[tile::Row],
    tile::Partition,
    &[f32],
    &HeadKv<'_, T>,
    &[bool],
    usize,
    f32,
    &SharedOut<f32>,
);

/// One attention call's operands and how it splits into tasks.
struct Job<'a, T> {
    shape: AttentionShape,
    q: &'a [f32],
    kv: KvBlocks<'a, T>,
    mask: &'a [bool],
    per_head: usize,
    positions: usize,
    chunks: usize,
    scorer: Scorer,
    tier: Tier,
    partition_keys: usize,
}

impl<T: KvElement> Job<'_, T> {
    /// Task `task`'s KV head block (batch row × KV head) and its query rows, as (position,
    /// row of the block) in the order their partials are stored.
    fn rows(&self, task: usize) -> (usize, impl Iterator<Item = (usize, usize)>) {
        let (block, chunk) = (task / self.chunks, task % self.chunks);
        let (q_len, n_rep) = (self.shape.q_len, self.shape.n_rep);
        let span = chunk * self.positions..((chunk + 1) * self.positions).min(q_len);
        let rows = span.flat_map(move |i| (0..n_rep).map(move |rep| (i, rep * q_len + i)));
        (block, rows)
    }

    /// Writes the partials of task `task`'s rows over partitions `parts`, the record of the
    /// task's `r`-th row and partition `p` at `dest(r, p)` of `sink`.
    fn partials(
        &self,
        task: usize,
        parts: Range<usize>,
        dest: &(dyn Fn(usize, usize) -> usize + Sync),
        sink: &SharedOut<f32>,
    ) {
        let AttentionShape {
            n_kv_heads,
            q_len,
            keys,
            head_dim,
            ..
        } = self.shape;
        let q_rows = self.shape.q_rows();
        let (block, rows) = self.rows(task);
        let b = block / n_kv_heads;
        let head = HeadKv::new(
            self.kv,
            &self.kv.table[block * self.per_head..(block + 1) * self.per_head],
            head_dim,
        );
        let rows = rows.map(|(i, row)| {
            let mask_at = (b * q_len + i) * keys;
            let visible = visible_span(&self.mask[mask_at..mask_at + keys]);
            (mask_at, (block * q_rows + row) * head_dim, visible)
        });
        // The tiles scale a register of scores at a time and have no tanh: capped scores take
        // the row kernels, as do widths that are not a whole number of registers.
        #[cfg(target_arch = "x86_64")]
        if self.scorer.softcap.is_none() {
            let tile = match self.tier {
                Tier::Avx512Vnni
                    if head_dim.is_multiple_of(<tile::Avx512 as tile::TileSimd>::LANES) =>
                {
                    Some(tile::attend_rows::<T, tile::Avx512> as TileFn<T>)
                }
                Tier::Avx2 | Tier::Avx512Vnni
                    if head_dim.is_multiple_of(<tile::Avx2 as tile::TileSimd>::LANES) =>
                {
                    Some(tile::attend_rows::<T, tile::Avx2> as TileFn<T>)
                }
                _ => None,
            };
            if let Some(attend_rows) = tile {
                let mut rows: Vec<tile::Row> = rows
                    .map(|(mask_at, at, visible)| tile::Row {
                        at,
                        mask_at,
                        visible,
                        dest: 0,
                    })
                    .collect();
                for part in parts {
                    for (r, row) in rows.iter_mut().enumerate() {
                        row.dest = dest(r, part);
                    }
                    let partition = tile::Partition {
                        index: part,
                        keys: self.partition_keys,
                    };
                    // SAFETY: the tier was checked by the caller and has the tile's features
                    // (AVX-512 F, BW and VL on `Avx512Vnni`; AVX2, FMA, F16C on both), the
                    // width is a multiple of its lanes; the records are this task's.
                    unsafe {
                        attend_rows(
                            &rows,
                            partition,
                            self.q,
                            &head,
                            self.mask,
                            keys,
                            self.scorer.scale,
                            sink,
                        )
                    };
                }
                return;
            }
        }
        let mut scores = Vec::new();
        let mut probs = Vec::new();
        for (r, (mask_at, at, visible)) in rows.enumerate() {
            let row_mask = &self.mask[mask_at..mask_at + keys];
            let q_row = &self.q[at..at + head_dim];
            for part in parts.clone() {
                let span = partition_span(&visible, part, self.partition_keys);
                // SAFETY: each (row, partition) record belongs to exactly one task.
                let record = unsafe { sink.slice(dest(r, part), record_len(head_dim)) };
                match self.tier {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the tier was checked by the caller (AVX2, FMA and F16C are part
                    // of both).
                    Tier::Avx2 | Tier::Avx512Vnni => unsafe {
                        x86::attend_row(
                            q_row,
                            &head,
                            row_mask,
                            span,
                            self.scorer,
                            &mut scores,
                            &mut probs,
                            record,
                        )
                    },
                    _ => attend_row(
                        q_row,
                        &head,
                        row_mask,
                        span,
                        self.scorer,
                        &mut scores,
                        record,
                    ),
                }
            }
        }
    }

    /// Merges the partials of task `task`'s rows (`records`, `parts` per row) into `out`.
    fn merge(&self, task: usize, records: &[f32], parts: usize, out: &SharedOut<f32>) {
        let head_dim = self.shape.head_dim;
        let q_rows = self.shape.q_rows();
        let record = record_len(head_dim);
        let (block, rows) = self.rows(task);
        for (r, (_, row)) in rows.enumerate() {
            let at = (block * q_rows + row) * head_dim;
            // SAFETY: each (block, row) belongs to exactly one task.
            let out = unsafe { out.slice(at, head_dim) };
            merge_partials(
                &records[r * parts * record..][..parts * record],
                head_dim,
                out,
                self.tier,
            );
        }
    }
}

/// A row's output from its partials (`[parts, head_dim + 2]`, see [`record_len`]): the one
/// partition that saw keys as it is; several weighted by `Σ exp(score)` relative to the largest
/// score of all, in partition order; zeros when none saw a key.
fn merge_partials(records: &[f32], head_dim: usize, out: &mut [f32], tier: Tier) {
    #[cfg(target_arch = "x86_64")]
    if matches!(tier, Tier::Avx2 | Tier::Avx512Vnni) {
        // SAFETY: both tiers have FMA.
        return unsafe { merge_partials_fma(records, head_dim, out) };
    }
    let _ = tier;
    merge_partials_in(records, head_dim, out);
}

/// [`merge_partials`] where `mul_add` is one instruction (the same single rounding as the
/// library call a baseline x86-64 build makes of it, per value).
///
/// # Safety
/// The CPU must have FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn merge_partials_fma(records: &[f32], head_dim: usize, out: &mut [f32]) {
    merge_partials_in(records, head_dim, out);
}

/// [`merge_partials`]'s arithmetic, inlined into each caller's instruction set.
#[inline(always)]
fn merge_partials_in(records: &[f32], head_dim: usize, out: &mut [f32]) {
    let record = record_len(head_dim);
    let seen = || {
        records
            .chunks_exact(record)
            .filter(|p| p[head_dim + 1] > 0.0)
    };
    let mut live = seen();
    match (live.next(), live.next()) {
        (None, _) => out.fill(0.0),
        (Some(one), None) => out.copy_from_slice(&one[..head_dim]),
        _ => {
            let max = seen().fold(f32::NEG_INFINITY, |m, p| m.max(p[head_dim]));
            out.fill(0.0);
            let mut total = 0f32;
            for p in seen() {
                let weight = p[head_dim + 1] * (p[head_dim] - max).exp();
                total += weight;
                for (o, &x) in out.iter_mut().zip(&p[..head_dim]) {
                    *o = weight.mul_add(x, *o);
                }
            }
            let inv = 1.0 / total;
            for o in out.iter_mut() {
                *o *= inv;
            }
        }
    }
}

/// One query row over the keys `span` of its mask row: `record` gets `Σ_j p_j v_j / Σ_j p_j`
/// over the visible keys `j` of the span, in key order, then the largest score and `Σ_j p_j`
/// (see [`record_len`]; `scores` holds each visible key's offset and score).
fn attend_row<T: KvElement>(
    q: &[f32],
    kv: &HeadKv<'_, T>,
    mask: &[bool],
    span: Range<usize>,
    scorer: Scorer,
    scores: &mut Vec<(usize, f32)>,
    record: &mut [f32],
) {
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    let head_dim = q.len();
    for (at, _) in kv
        .offsets(span.clone())
        .zip(&mask[span])
        .filter(|(_, masked)| !**masked)
    {
        let s = scorer.score(dot(q, kv.key(at)));
        max = max.max(s);
        scores.push((at, s));
    }
    let (acc, tail) = record.split_at_mut(head_dim);
    acc.fill(0.0);
    tail[0] = max;
    tail[1] = 0.0;
    if scores.is_empty() {
        return;
    }
    let mut sum = 0f32;
    for &(at, s) in scores.iter() {
        let p = (s - max).exp();
        sum += p;
        let row = kv.value(at);
        for (d, a) in acc.iter_mut().enumerate() {
            *a += p * T::value(row, d);
        }
    }
    let inv = 1.0 / sum;
    for a in acc.iter_mut() {
        *a *= inv;
    }
    tail[1] = sum;
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

/// `a · b` (`b` a row of `a.len()` values) in eight interleaved partial sums (one vector
/// register), a fixed order on every machine.
#[inline]
fn dot<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let mut lanes = [0f32; 8];
    let whole = a.len() / 8 * 8;
    for (i, x) in a[..whole].chunks_exact(8).enumerate() {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane += x[l] * T::value(b, 8 * i + l);
        }
    }
    let mut tail = 0f32;
    for (d, x) in a.iter().enumerate().skip(whole) {
        tail += x * T::value(b, d);
    }
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
        + tail
}

/// The exponential's constants, shared by `exp8` and the tile kernel's `exp16` so that both
/// give the same value for each lane (and by SwiGLU's `rowwise::exp`): inputs below `EXP_MIN`
/// give 0; ln 2 split in two so that `n × LN2_HI` is exact; Cephes' `expf` polynomial,
/// highest degree first.
pub(crate) const EXP_MIN: f32 = -87.336_55;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::{EXP_MIN, EXP_POLY, HeadKv, KvElement, LN2_HI, LN2_LO, Scorer};
    use crate::lanes::hsum;

    /// [`super::attend_row`] with AVX2 and FMA: the scores as dot products in two 8-lane
    /// accumulators, the exponentials eight at a time ([`exp8`]), and the weighted sum of the
    /// values with a 64-wide slice of the output held in registers; f16 and bf16 keys and
    /// values widened as they load ([`KvElement::load8`]).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_row<T: KvElement>(
        q: &[f32],
        kv: &HeadKv<'_, T>,
        mask: &[bool],
        span: Range<usize>,
        scorer: Scorer,
        scores: &mut Vec<(usize, f32)>,
        probs: &mut Vec<f32>,
        record: &mut [f32],
    ) {
        scores.clear();
        let head_dim = q.len();
        let mut max = f32::NEG_INFINITY;
        for (at, _) in kv
            .offsets(span.clone())
            .zip(&mask[span])
            .filter(|(_, masked)| !**masked)
        {
            let s = scorer.score(dot(q, kv.key(at)));
            max = max.max(s);
            scores.push((at, s));
        }
        let (acc, tail) = record.split_at_mut(head_dim);
        acc.fill(0.0);
        tail[0] = max;
        tail[1] = 0.0;
        if scores.is_empty() {
            return;
        }
        // p_j = exp(s_j - max), eight at a time; the last few padded with -inf (exp: 0).
        probs.clear();
        let mut sums = _mm256_setzero_ps();
        let max8 = _mm256_set1_ps(max);
        for chunk in scores.chunks(8) {
            let mut x = [f32::NEG_INFINITY; 8];
            for (x, &(_, s)) in x.iter_mut().zip(chunk) {
                *x = s;
            }
            // SAFETY: `x` is eight f32, the unaligned load's width.
            let p = exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(x.as_ptr()) }, max8));
            sums = _mm256_add_ps(sums, p);
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` is eight f32, the unaligned store's width.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), p) };
            probs.extend_from_slice(&lanes[..chunk.len()]);
        }
        let sum = hsum(sums);
        let inv = 1.0 / sum;
        tail[1] = sum;
        // acc = Σ_j p_j v_j, 64 columns at a time in eight registers, then 8, then one.
        let mut c = 0;
        while c + 64 <= head_dim {
            let mut lanes = [_mm256_setzero_ps(); 8];
            for (&(at, _), &p) in scores.iter().zip(probs.iter()) {
                let p = _mm256_set1_ps(p);
                let row = kv.value(at);
                for (u, lane) in lanes.iter_mut().enumerate() {
                    // SAFETY: values `c + 8u..c + 8u + 8` of a row of `head_dim`; the CPU has
                    // F16C (this function's contract).
                    let x = unsafe { T::load8(row.as_ptr(), c + 8 * u) };
                    *lane = _mm256_fmadd_ps(p, x, *lane);
                }
            }
            for (u, lane) in lanes.into_iter().enumerate() {
                let out = _mm256_mul_ps(lane, _mm256_set1_ps(inv));
                // SAFETY: a slice of eight f32 (checked), the unaligned store's width.
                unsafe { _mm256_storeu_ps(acc[c + 8 * u..c + 8 * u + 8].as_mut_ptr(), out) };
            }
            c += 64;
        }
        while c + 8 <= head_dim {
            let mut lane = _mm256_setzero_ps();
            for (&(at, _), &p) in scores.iter().zip(probs.iter()) {
                // SAFETY: values `c..c + 8` of a row of `head_dim`.
                let x = unsafe { T::load8(kv.value(at).as_ptr(), c) };
                lane = _mm256_fmadd_ps(_mm256_set1_ps(p), x, lane);
            }
            let out = _mm256_mul_ps(lane, _mm256_set1_ps(inv));
            // SAFETY: a slice of eight f32 (checked), the unaligned store's width.
            unsafe { _mm256_storeu_ps(acc[c..c + 8].as_mut_ptr(), out) };
            c += 8;
        }
        for (d, a) in acc.iter_mut().enumerate().skip(c) {
            let sum: f32 = scores
                .iter()
                .zip(probs.iter())
                .fold(0.0, |sum, (&(at, _), &p)| {
                    p.mul_add(T::value(kv.value(at), d), sum)
                });
            *a = sum * inv;
        }
    }

    /// `a · b` (`b` a row of `a.len()` values): sixteen lanes in two accumulators, then
    /// eight, then the rest one by one.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
        let n = a.len().min(b.len() * T::VALUES);
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY: every load reads eight values below `n`, which both rows hold; F16C, which
        // `load8` of f16 needs, is one of this function's features.
        unsafe {
            while i + 16 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb, i), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), T::load8(pb, i + 8), s1);
                i += 16;
            }
            if i + 8 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb, i), s0);
                i += 8;
            }
        }
        let mut sum = hsum(_mm256_add_ps(s0, s1));
        for (j, x) in a.iter().enumerate().take(n).skip(i) {
            sum = x.mul_add(T::value(b, j), sum);
        }
        sum
    }

    /// `e^x` for eight lanes with `x ≤ 0` (softmax's exponents after subtracting the max):
    /// `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`, `e^r` by a degree-6 polynomial (Cephes'
    /// `expf` coefficients; within 2 ulp of the exact value), scaled by `2^n` through the
    /// exponent bits. Below -87.3 (and for -inf) the result is 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        let min = _mm256_set1_ps(EXP_MIN);
        let underflow = _mm256_cmp_ps(x, min, _CMP_LT_OQ);
        let x = _mm256_max_ps(x, min);
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // r = x - n ln 2, with ln 2 split in two so that n × hi is exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let e_r = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        // 2^n: n + 127 in the exponent field (n ≥ -126 after the clamp).
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        ));
        _mm256_andnot_ps(underflow, _mm256_mul_ps(e_r, two_n))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn exp8_is_within_two_ulp_of_libm() {
            if !crate::tier::Tier::Avx2.is_supported() {
                eprintln!("skipped exp8_is_within_two_ulp_of_libm: this CPU has no AVX2 and FMA");
                return;
            }
            let mut x = -90.0f32;
            while x <= 0.0 {
                let lanes: [f32; 8] = std::array::from_fn(|i| x - i as f32 * 1e-3);
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and FMA were checked above; `lanes` and `got` are eight f32.
                unsafe {
                    _mm256_storeu_ps(got.as_mut_ptr(), exp8(_mm256_loadu_ps(lanes.as_ptr())))
                };
                for (g, l) in got.iter().zip(lanes) {
                    let want = l.exp();
                    if l < -87.336_55 {
                        assert_eq!(*g, 0.0, "exp({l})");
                    } else {
                        let ulps = (g.to_bits() as i64 - want.to_bits() as i64).abs();
                        assert!(
                            ulps <= 2 || want < f32::MIN_POSITIVE,
                            "exp({l}) = {g}, libm {want}"
                        );
                    }
                }
                x += 0.0137;
            }
            let mut got = [1f32; 8];
            // SAFETY: AVX2 and FMA were checked above; `got` is eight f32.
            unsafe {
                let inf = _mm256_set1_ps(f32::NEG_INFINITY);
                _mm256_storeu_ps(got.as_mut_ptr(), exp8(inf));
            }
            assert_eq!(got, [0.0; 8]);
        }
    }
}
