//! Attention for every query of a step in one launch per layer: fresh prompts over their own
//! tokens' K/V (taken from the step's new K/V, so a sliding ring shorter than a prompt does not
//! matter), sequences with history over the cache storage read through their block table, with
//! no gather of the cache into a contiguous tensor. The keys of each query are split into
//! chunks handled by separate cubes when there are too few queries to fill the device, and a
//! second launch combines the chunks' partial softmaxes (flash-decoding); the launch count per
//! layer is two whatever the batch or the context.
//!
//! A query sees a key when the key's position is at most its own (and, with a window, less than
//! `window` behind it); for history rows a key slot holding no token has position −1. Sums run
//! in f32 over visible keys only, so a sequence's outputs do not depend on what it was batched
//! with.

// Kernel bodies are cubecl's language, expanded at compile time, not plain Rust: it has no
// `div_ceil` or `is_multiple_of` on its integers, and a comptime condition stays its own `if`
// so the expansion drops the branch.
#![allow(clippy::manual_div_ceil)]

use burn_backend::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::util::{Result, cube_index, empty_like, grid, input_error, unit_last_stride};

/// Keys scored together, one per unit of the cube: a cube has this many units.
const TILE: usize = 128;

/// Below this many cubes (query tokens × head groups) in a step, the keys are split over more
/// cubes.
const FILL_CUBES: usize = 1024;

/// Below this many (query token, KV head) pairs in a step, each query head gets its own cubes
/// instead of sharing one with its group: at batch 1 the grouped kernel has too few cubes (8
/// for a 1B model, 2 splits each) to fill the GPU, and a cube per head decodes faster
/// (docs/benchmarks.md, "Figures that were in code comments").
const GROUP_MIN_CUBES: usize = 64;

/// The most outputs (query heads × head_dim) one cube accumulates: 8 per unit.
const MAX_OUTPUTS_PER_CUBE: usize = 8 * TILE;

/// How many of the `per_kv_head` query heads that share a KV head one cube serves: all of them
/// where their outputs fit [`MAX_OUTPUTS_PER_CUBE`] (each key and value row is then read once
/// for the group), else the largest divisor that fits.
fn head_group(per_kv_head: usize, head_dim: usize) -> usize {
    (1..=per_kv_head.max(1))
        .rev()
        .find(|g| per_kv_head.is_multiple_of(*g) && g * head_dim <= MAX_OUTPUTS_PER_CUBE)
        .unwrap_or(1)
}

/// The widest vector (16 bytes at most) that divides `head_dim` and every stride of the key
/// tensors, so a key row is read in whole vectors.
fn key_vector_width<R: CubeRuntime>(keys: &[&CubeTensor<R>], head_dim: usize) -> usize {
    let widest = keys.iter().map(|k| 16 / k.dtype.size()).min().unwrap_or(1);
    [8, 4, 2, 1]
        .into_iter()
        .find(|&w| {
            w <= widest
                && head_dim.is_multiple_of(w)
                && keys.iter().all(|k| {
                    let strides = k.meta.strides();
                    strides[..strides.len() - 1]
                        .iter()
                        .all(|s| s.is_multiple_of(w))
                })
        })
        .unwrap_or(1)
}

/// Per query token, four integers (`[n_tokens, 4]` at [`StepIndex::tokens`]): where its keys
/// are and its position.
///
/// | column | fresh token | token with history |
/// |---|---|---|
/// | 0 | −1 | its row in the history tables |
/// | 1 | first batch token of its sequence | 0 |
/// | 2 | its sequence's token count | key slots its row reads |
/// | 3 | its position | its position |
pub const TOKEN_FIELDS: usize = 4;

/// A step's index arrays: one integer buffer, uploaded once per forward and shared by every
/// layer, and where each part starts in it.
#[derive(Debug, Clone)]
pub struct StepIndex<R: CubeRuntime> {
    /// Every part, one after the other (any int dtype). `[len]`
    pub data: CubeTensor<R>,
    /// Query tokens in the step.
    pub n_tokens: usize,
    /// `[n_tokens, TOKEN_FIELDS]` from here (see [`TOKEN_FIELDS`]).
    pub tokens: usize,
    /// The position of each batch token, `[n_tokens]` from here.
    pub positions: usize,
    /// Each token's `(target, slot)` in the cache storage, `[n_tokens, 2]` from here.
    pub places: usize,
    /// The position in each key slot of each history row, −1 where the slot holds no token,
    /// `[rows, keys]` from here.
    pub key_positions: usize,
    /// Key slots per history row.
    pub keys: usize,
    /// Each history row's blocks per KV head, indices into the storage viewed as
    /// `[targets * n_kv_heads, slots, head_dim]`, `[rows, n_kv_heads, blocks_per_row]` from
    /// here.
    pub table: usize,
    /// Blocks per history row and KV head.
    pub blocks_per_row: usize,
    /// The most keys any query reads (sizes the split).
    pub max_keys: usize,
    /// Keys further back than this many positions are invisible.
    pub window: Option<usize>,
}

#[cube]
fn sentinel() -> f32 {
    // WGSL has no infinity literal; scores are far above this.
    f32::new(-1.0e30)
}

// cubecl wants every variable initialised before branches assign it.
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
fn attention_kernel<F: Float, S: Float, I: Int, N: Size>(
    q: &Tensor<F>,
    k_new: &Tensor<Vector<F, N>>,
    v_new: &Tensor<F>,
    k_store: &Tensor<Vector<S, N>>,
    v_store: &Tensor<S>,
    index: &Tensor<I>,
    tokens: usize,
    positions: usize,
    key_positions: usize,
    keys: usize,
    table: usize,
    blocks_per_row: usize,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    total: usize,
    splits: usize,
    window: u32,
    scale: f32,
    softcap: f32,
    #[comptime] head_dim: usize,
    #[comptime] group: usize,
    #[define(F, S, I)] _dtypes: [StorageType; 3],
) {
    let cube = cube_index();
    let t = UNIT_POS_X as usize;
    let width = k_store.vector_size();
    // Outputs of the cube (its `group` query heads' values), `per_unit` per unit.
    let outputs = comptime!(group * head_dim);
    let per_unit = comptime!((group * head_dim + TILE - 1) / TILE);
    let mut qs = SharedMemory::<f32>::new(outputs);
    let mut scores = SharedMemory::<f32>::new(comptime!(group * TILE));
    let mut places = SharedMemory::<u32>::new(TILE);
    let mut from_batch = SharedMemory::<u32>::new(TILE);

    let live = cube < total;
    let split = cube % splits;
    let group_index = cube / splits;
    let n_heads = q.shape(1);
    let groups_per_token = n_heads / group;
    let first_head = (group_index % groups_per_token) * group;
    let token = group_index / groups_per_token;
    let kv_heads = v_new.shape(1);
    let kv_head = first_head / (n_heads / kv_heads);

    let mut row = 0i32;
    let mut key_start = 0usize;
    let mut key_count = 0usize;
    let mut q_pos = 0i32;
    if live {
        let meta = tokens + token * TOKEN_FIELDS;
        row = i32::cast_from(index[meta]);
        key_start = usize::cast_from(index[meta + 1]);
        key_count = usize::cast_from(index[meta + 2]);
        q_pos = i32::cast_from(index[meta + 3]);
    }
    // This cube's keys: an equal share of the query's, in whole tiles.
    let share = (key_count + splits - 1) / splits;
    let share = (share + TILE - 1) / TILE * TILE;
    let lo = split * share;
    let hi = min(lo + share, key_count);

    let mut o = t;
    while o < outputs {
        if live {
            let at = token * q.stride(0) + (first_head + o / head_dim) * q.stride(1) + o % head_dim;
            qs[o] = f32::cast_from(q[at]) * scale;
        }
        o += TILE;
    }
    sync_cube();

    let slots = v_store.shape(2);
    // Per query head of the group: the running maximum (every unit keeps all of them).
    let mut running_max = Array::<f32>::new(group);
    // Per output of this unit: its weighted sum of values and its head's sum of weights.
    let mut acc = Array::<f32>::new(per_unit);
    let mut weight_sum = Array::<f32>::new(per_unit);
    #[unroll]
    for g in 0..group {
        running_max[g] = sentinel();
    }
    #[unroll]
    for r in 0..per_unit {
        acc[r] = 0.0f32;
        weight_sum[r] = 0.0f32;
    }
    let mut score = Array::<f32>::new(group);
    let mut new_max = Array::<f32>::new(group);

    let mut start = lo;
    // Every unit runs the same number of tiles (the cube's `hi` is uniform), so the barriers
    // below are reached by all.
    while start < hi {
        let j = start + t;
        #[unroll]
        for g in 0..group {
            score[g] = sentinel();
        }
        let mut place = 0u32;
        let mut batch = 0u32;
        if j < hi {
            let mut key_pos = 0i32;
            if row < 0 {
                let key_token = key_start + j;
                key_pos = i32::cast_from(index[positions + key_token]);
                place = (key_token * v_new.stride(0) + kv_head * v_new.stride(1)) as u32;
                batch = 1u32;
            } else {
                let r = usize::cast_from(row);
                key_pos = i32::cast_from(index[key_positions + r * keys + j]);
                let block = table + (r * kv_heads + kv_head) * blocks_per_row + j / slots;
                let head_block = usize::cast_from(index[block]);
                place = ((head_block / kv_heads) * v_store.stride(0)
                    + (head_block % kv_heads) * v_store.stride(1)
                    + (j % slots) * v_store.stride(2)) as u32;
            }
            let behind = q_pos - key_pos;
            let visible =
                key_pos >= 0 && behind >= 0 && (window == 0u32 || u32::cast_from(behind) < window);
            if visible {
                // The key row is read once, a vector at a time, for every head of the group.
                let mut dots = Array::<f32>::new(group);
                #[unroll]
                for g in 0..group {
                    dots[g] = 0.0f32;
                }
                let base = usize::cast_from(place) / width;
                for i in 0..head_dim / width {
                    let key = if batch == 1u32 {
                        Vector::<f32, N>::cast_from(k_new[base + i])
                    } else {
                        Vector::<f32, N>::cast_from(k_store[base + i])
                    };
                    #[unroll]
                    for g in 0..group {
                        #[unroll]
                        for e in 0..width {
                            dots[g] += qs[g * head_dim + i * width + e] * key[e];
                        }
                    }
                }
                // A soft cap of 0 means none (`Scoring::softcap`).
                #[unroll]
                for g in 0..group {
                    if softcap > 0.0f32 {
                        score[g] = softcap * f32::tanh(dots[g] / softcap);
                    } else {
                        score[g] = dots[g];
                    }
                }
            }
        }
        #[unroll]
        for g in 0..group {
            scores[g * TILE + t] = score[g];
        }
        places[t] = place;
        from_batch[t] = batch;
        sync_cube();

        #[unroll]
        for g in 0..group {
            let mut tile_max = sentinel();
            for i in 0..TILE {
                tile_max = max(tile_max, scores[g * TILE + i]);
            }
            new_max[g] = max(running_max[g], tile_max);
        }
        sync_cube();
        // Masked keys stay at the sentinel and weigh exactly 0.
        #[unroll]
        for g in 0..group {
            let mut p = 0.0f32;
            if score[g] > sentinel() {
                p = f32::exp(score[g] - new_max[g]);
            }
            scores[g * TILE + t] = p;
        }
        sync_cube();

        #[unroll]
        for r in 0..per_unit {
            let o = t + r * TILE;
            if o < outputs {
                let g = o / head_dim;
                let d = o % head_dim;
                let rescale = f32::exp(running_max[g] - new_max[g]);
                let mut tile_sum = 0.0f32;
                let mut sum = 0.0f32;
                for i in 0..TILE {
                    let w = scores[g * TILE + i];
                    tile_sum += w;
                    if w > 0.0f32 {
                        let base = usize::cast_from(places[i]);
                        if from_batch[i] == 1u32 {
                            sum += w * f32::cast_from(v_new[base + d]);
                        } else {
                            sum += w * f32::cast_from(v_store[base + d]);
                        }
                    }
                }
                acc[r] = acc[r] * rescale + sum;
                weight_sum[r] = weight_sum[r] * rescale + tile_sum;
            }
        }
        #[unroll]
        for g in 0..group {
            running_max[g] = new_max[g];
        }
        sync_cube();
        start += TILE;
    }

    if live {
        #[unroll]
        for r in 0..per_unit {
            let o = t + r * TILE;
            if o < outputs {
                let g = o / head_dim;
                let d = o % head_dim;
                let query = token * n_heads + first_head + g;
                let part = query * splits + split;
                part_acc[part * head_dim + d] = acc[r];
                if d == 0 {
                    part_stats[part * 2] = running_max[g];
                    part_stats[part * 2 + 1] = weight_sum[r];
                }
            }
        }
    }
}

#[cube(launch_unchecked)]
fn combine_kernel<F: Float>(
    part_acc: &Tensor<f32>,
    part_stats: &Tensor<f32>,
    out: &mut Tensor<F>,
    queries: usize,
    splits: usize,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let query = cube_index();
    if query < queries {
        let mut top = sentinel();
        for s in 0..splits {
            top = max(top, part_stats[(query * splits + s) * 2]);
        }
        let mut sum = 0.0f32;
        for s in 0..splits {
            let at = (query * splits + s) * 2;
            sum += part_stats[at + 1] * f32::exp(part_stats[at] - top);
        }
        let mut d = UNIT_POS_X as usize;
        while d < head_dim {
            let mut value = 0.0f32;
            for s in 0..splits {
                let part = query * splits + s;
                value += part_acc[part * head_dim + d] * f32::exp(part_stats[part * 2] - top);
            }
            // A query that sees no key (none in a valid step) gets zeros, not NaN.
            let mut result = 0.0f32;
            if sum > 0.0f32 {
                result = value / sum;
            }
            out[query * head_dim + d] = F::cast_from(result);
            d += CUBE_DIM_X as usize;
        }
    }
}

/// Attention of every query token of a step, in batch order, each score `q·k × scale`,
/// then `c tanh(s / c)` where there is a soft cap `c` (Gemma 2).
///
/// # Shapes
/// - `q`: `[n_tokens, n_heads, head_dim]` (rows may be strided), RoPE applied
/// - `k_new`, `v_new`: `[n_tokens, n_kv_heads, head_dim]`, the step's own K/V (fresh tokens'
///   keys are read here)
/// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`, the layer's cache storage
///   after this step's write (history rows' keys are read here)
/// - returns `[n_tokens, n_heads * head_dim]` in `q`'s dtype
///
/// # Errors
/// [`crate::CubeError::Input`] when the shapes disagree.
#[allow(clippy::too_many_arguments)]
pub fn attention<R: CubeRuntime>(
    q: CubeTensor<R>,
    k_new: CubeTensor<R>,
    v_new: CubeTensor<R>,
    k_store: CubeTensor<R>,
    v_store: CubeTensor<R>,
    index: &StepIndex<R>,
    scale: f32,
    softcap: Option<f32>,
) -> Result<CubeTensor<R>> {
    let dims = q.meta.shape().to_vec();
    let [n_tokens, n_heads, head_dim] = dims[..] else {
        return input_error("attention", format!("q must be 3-D, got {dims:?}"));
    };
    let kv = k_new.meta.shape().to_vec();
    let store = k_store.meta.shape().to_vec();
    let shapes_agree = kv.len() == 3
        && kv[0] == n_tokens
        && kv[2] == head_dim
        && kv[1] > 0
        && n_heads.is_multiple_of(kv[1])
        && v_new.meta.shape().to_vec() == kv
        && store.len() == 4
        && store[1] == kv[1]
        && store[3] == head_dim
        && v_store.meta.shape().to_vec() == store
        && k_store.meta.strides() == v_store.meta.strides()
        && k_new.meta.strides() == v_new.meta.strides()
        && index.n_tokens == n_tokens
        && index.data.meta.shape().len() == 1;
    if !shapes_agree || head_dim > MAX_OUTPUTS_PER_CUBE {
        return input_error(
            "attention",
            format!(
                "q {dims:?}, k/v {kv:?} / {:?}, storage {store:?} / {:?}, index of {} tokens \
                 disagree (head_dim at most {})",
                v_new.meta.shape(),
                v_store.meta.shape(),
                index.n_tokens,
                MAX_OUTPUTS_PER_CUBE
            ),
        );
    }
    let q = unit_last_stride(q);
    let (k_new, v_new) = (unit_last_stride(k_new), unit_last_stride(v_new));
    let queries = n_tokens * n_heads;
    // Grouped heads cut the cube count by the group size: worth it once the step has enough
    // query tokens to fill the device anyway (batched decode, prefill); a lone decoding query
    // keeps a cube per head, whose keys are then split further.
    let group = if n_tokens * kv[1] >= GROUP_MIN_CUBES {
        head_group(n_heads / kv[1], head_dim)
    } else {
        1
    };
    let cubes_per_split = queries / group;
    let splits = if cubes_per_split >= FILL_CUBES {
        1
    } else {
        FILL_CUBES
            .div_ceil(cubes_per_split.max(1))
            .min(index.max_keys.div_ceil(TILE))
            .max(1)
    };
    let width = key_vector_width(&[&k_new, &k_store], head_dim);
    let part_acc = empty_like(&q, Shape::new([queries * splits, head_dim]), DType::F32);
    let part_stats = empty_like(&q, Shape::new([queries * splits, 2]), DType::F32);
    let out = empty_like(&q, Shape::new([n_tokens, n_heads * head_dim]), q.dtype);
    let window = index.window.map_or(0, |w| w.min(u32::MAX as usize) as u32);
    let dtypes = [
        q.dtype.into(),
        k_store.dtype.into(),
        index.data.dtype.into(),
    ];

    let client = q.client.clone();
    // SAFETY: every read is inside its tensor: query `token < n_tokens` and `head < n_heads`;
    // a fresh query's keys lie in its sequence's batch tokens and a history query's key slots
    // in its row of the key positions and, through its blocks, in the storage (the index was
    // built from the cache that owns the storage); partial outputs are written below
    // `queries * splits` rows.
    unsafe {
        attention_kernel::launch_unchecked::<R>(
            &client,
            grid(cubes_per_split * splits),
            CubeDim::new_1d(TILE as u32),
            width,
            q.into_tensor_arg(),
            k_new.into_tensor_arg(),
            v_new.into_tensor_arg(),
            k_store.into_tensor_arg(),
            v_store.into_tensor_arg(),
            index.data.clone().into_tensor_arg(),
            index.tokens,
            index.positions,
            index.key_positions,
            index.keys,
            index.table,
            index.blocks_per_row,
            part_acc.clone().into_tensor_arg(),
            part_stats.clone().into_tensor_arg(),
            cubes_per_split * splits,
            splits,
            window,
            scale,
            softcap.unwrap_or(0.0),
            head_dim,
            group,
            dtypes,
        );
        // SAFETY: reads the partials written above, writes `out`'s `queries * head_dim` values.
        combine_kernel::launch_unchecked::<R>(
            &client,
            grid(queries),
            CubeDim::new_1d(TILE.min(head_dim.next_power_of_two()) as u32),
            part_acc.into_tensor_arg(),
            part_stats.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            queries,
            splits,
            head_dim,
            out.dtype.into(),
        );
    }
    Ok(out)
}
