//! Writing a step's new keys and values into the KV cache storage: every token of every
//! sequence in one launch per layer (vLLM's `reshape_and_cache`), where a write per contiguous
//! run would cost a launch per sequence.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::attention::StepIndex;
use crate::util::{Result, cube_index, grid, input_error, unit_last_stride};

const BLOCK: usize = 256;

#[cube(launch_unchecked)]
fn kv_write_kernel<F: Float, S: Float, I: Int>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    index: &Tensor<I>,
    places: usize,
    k_store: &mut Tensor<S>,
    v_store: &mut Tensor<S>,
    total: usize,
    #[define(F, S, I)] _dtypes: [StorageType; 3],
) {
    let unit = cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if unit < total {
        let heads = k.shape(1);
        let dim = k.shape(2);
        let d = unit % dim;
        let head = (unit / dim) % heads;
        let token = unit / (dim * heads);
        let target = i32::cast_from(index[places + token * 2]);
        let slot = i32::cast_from(index[places + token * 2 + 1]);
        // Places outside the storage are skipped like negative ones: never an out-of-bounds write.
        if target >= 0
            && slot >= 0
            && usize::cast_from(target) < k_store.shape(0)
            && usize::cast_from(slot) < k_store.shape(2)
        {
            let (target, slot) = (usize::cast_from(target), usize::cast_from(slot));
            let at = target * k_store.stride(0)
                + head * k_store.stride(1)
                + slot * k_store.stride(2)
                + d;
            let from = token * k.stride(0) + head * k.stride(1) + d;
            k_store[at] = S::cast_from(k[from]);
            let from = token * v.stride(0) + head * v.stride(1) + d;
            v_store[at] = S::cast_from(v[from]);
        }
    }
}

/// Writes token `t`'s K and V to its place in `index` (slot `places[t, 1]` of target
/// `places[t, 0]`; a negative place, or one outside the storage, skips the token), converting to
/// the storage's dtype. The storage tensors are written where they lie: the caller must hold
/// their only handles.
///
/// # Shapes
/// - `k`, `v`: `[n_tokens, n_kv_heads, head_dim]` (rows may be strided)
/// - `k_store`, `v_store`: `[targets, n_kv_heads, slots, head_dim]`
///
/// # Errors
/// [`crate::CubeError::Input`] when the shapes disagree.
pub fn write<R: CubeRuntime>(
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    index: &StepIndex<R>,
    k_store: &CubeTensor<R>,
    v_store: &CubeTensor<R>,
) -> Result<()> {
    let dims = k.meta.shape().to_vec();
    let [n, heads, dim] = dims[..] else {
        return input_error("kv_write", format!("k must be 3-D, got {dims:?}"));
    };
    let store = k_store.meta.shape().to_vec();
    if v.meta.shape().to_vec() != dims
        || store.len() != 4
        || store[1] != heads
        || store[3] != dim
        || v_store.meta.shape().to_vec() != store
        || k_store.meta.strides() != v_store.meta.strides()
        || index.n_tokens != n
    {
        return input_error(
            "kv_write",
            format!(
                "k, v {dims:?} (v {:?}), an index of {} tokens and stores {store:?} / {:?} \
                 disagree",
                v.meta.shape(),
                index.n_tokens,
                v_store.meta.shape()
            ),
        );
    }
    if n == 0 {
        return Ok(());
    }
    let (k, v) = (unit_last_stride(k), unit_last_stride(v));
    let total = n * heads * dim;
    let dtypes = [
        k.dtype.into(),
        k_store.dtype.into(),
        index.data.dtype.into(),
    ];
    // SAFETY: indices below `total` read `k`/`v` and the index's places inside their shapes;
    // the kernel writes only places inside the storage.
    unsafe {
        kv_write_kernel::launch_unchecked::<R>(
            &k.client,
            grid(total.div_ceil(BLOCK)),
            CubeDim::new_1d(BLOCK as u32),
            k.clone().into_tensor_arg(),
            v.into_tensor_arg(),
            index.data.clone().into_tensor_arg(),
            index.places,
            k_store.clone().into_tensor_arg(),
            v_store.clone().into_tensor_arg(),
            total,
            dtypes,
        );
    }
    Ok(())
}
