//! What the two GPU backends (burn's `CubeBackend` on CUDA and on wgpu) share: the
//! [`InferenceBackend`] hooks run on kiln-cube's kernels, reached through burn-cubecl's raw
//! tensors. Where a kernel refuses its inputs (a shape it does not take), the hook falls back to
//! burn's composition, so the result is the same either way.

use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};

use crate::attention::StepIndex;

/// A GPU backend as kiln builds it: burn's `CubeBackend` with f32 defaults and i32 indices.
pub(super) type Cube<R, BT> = CubeBackend<R, f32, i32, BT>;

fn raw<R: CubeRuntime, BT: BoolElement, const D: usize>(
    t: Tensor<Cube<R, BT>, D>,
) -> CubeTensor<R> {
    t.into_primitive().tensor()
}

fn raw_int<R: CubeRuntime, BT: BoolElement, const D: usize>(
    t: Tensor<Cube<R, BT>, D, Int>,
) -> CubeTensor<R> {
    t.into_primitive()
}

fn wrap<R: CubeRuntime, BT: BoolElement, const D: usize>(
    t: CubeTensor<R>,
) -> Tensor<Cube<R, BT>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

pub(super) fn rms_norm<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 2>,
    gamma: &Tensor<Cube<R, BT>, 1>,
    eps: f64,
) -> Tensor<Cube<R, BT>, 2> {
    match kiln_cube::rowwise::rms_norm(raw(x.clone()), raw(gamma.clone()), eps) {
        Ok(out) => wrap(out),
        Err(_) => crate::layer_ops::rms_norm(x, gamma, eps),
    }
}

pub(super) fn rotate_half<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 3>,
    cos: &Tensor<Cube<R, BT>, 3>,
    sin: &Tensor<Cube<R, BT>, 3>,
) -> Tensor<Cube<R, BT>, 3> {
    match kiln_cube::rowwise::rotate_half(raw(x.clone()), raw(cos.clone()), raw(sin.clone())) {
        Ok(out) => wrap(out),
        Err(_) => crate::layer_ops::rotate_half(x, cos, sin),
    }
}

pub(super) fn swiglu<R: CubeRuntime, BT: BoolElement>(
    gate_up: Tensor<Cube<R, BT>, 2>,
) -> Tensor<Cube<R, BT>, 2> {
    match kiln_cube::rowwise::swiglu(raw(gate_up.clone())) {
        Ok(out) => wrap(out),
        Err(_) => crate::layer_ops::swiglu(gate_up),
    }
}

pub(super) fn split_columns<R: CubeRuntime, BT: BoolElement, const N: usize>(
    x: Tensor<Cube<R, BT>, 2>,
    widths: [usize; N],
) -> [Tensor<Cube<R, BT>, 2>; N] {
    if let Ok(three) = <[usize; 3]>::try_from(&widths[..])
        && let Ok(parts) = kiln_cube::rowwise::split3(raw(x.clone()), three)
    {
        let mut parts = parts.into_iter().map(wrap);
        return std::array::from_fn(|_| parts.next().expect("three parts for three widths"));
    }
    crate::layer_ops::split_columns(x, widths)
}

pub(super) fn linear_dense<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 2>,
    w: &Tensor<Cube<R, BT>, 2>,
) -> Tensor<Cube<R, BT>, 2> {
    if x.dtype() != w.dtype() {
        return x.matmul(w.clone());
    }
    match kiln_cube::matmul::matmul(raw(x.clone()), raw(w.clone())) {
        Ok(out) => wrap(out),
        Err(_) => x.matmul(w.clone()),
    }
}

pub(super) fn write_kv_places<R: CubeRuntime, BT: BoolElement>(
    k_store: &mut Tensor<Cube<R, BT>, 4>,
    v_store: &mut Tensor<Cube<R, BT>, 4>,
    index: &StepIndex<Cube<R, BT>>,
    k: Tensor<Cube<R, BT>, 3>,
    v: Tensor<Cube<R, BT>, 3>,
) where
    Cube<R, BT>: super::InferenceBackend,
{
    let (ks, vs) = (raw(k_store.clone()), raw(v_store.clone()));
    let written = kiln_cube::kv::write(
        raw(k.clone()),
        raw(v.clone()),
        &device_index(index),
        &ks,
        &vs,
    );
    if written.is_err() {
        // A shape the kernel does not take: the writes one token at a time.
        super::write_kv_one_by_one(k_store, v_store, &index.host.places, k, v);
    }
}

/// kiln-cube's view of a step index.
fn device_index<R: CubeRuntime, BT: BoolElement>(
    index: &StepIndex<Cube<R, BT>>,
) -> kiln_cube::attention::StepIndex<R> {
    let layout = &index.layout;
    kiln_cube::attention::StepIndex {
        data: raw_int(index.data.clone()),
        n_tokens: layout.n_tokens,
        tokens: layout.tokens,
        positions: layout.positions,
        places: layout.places,
        key_positions: layout.key_positions,
        keys: layout.keys,
        table: layout.table,
        blocks_per_row: layout.blocks_per_row,
        max_keys: index.max_keys,
        window: index.window,
    }
}

pub(super) fn step_attention<R: CubeRuntime, BT: BoolElement>(
    q: Tensor<Cube<R, BT>, 3>,
    k: Tensor<Cube<R, BT>, 3>,
    v: Tensor<Cube<R, BT>, 3>,
    k_store: Tensor<Cube<R, BT>, 4>,
    v_store: Tensor<Cube<R, BT>, 4>,
    index: &StepIndex<Cube<R, BT>>,
) -> Tensor<Cube<R, BT>, 2>
where
    Cube<R, BT>: super::InferenceBackend,
{
    let head_dim = q.dims()[2];
    let device_index = device_index(index);
    let scale = 1.0 / (head_dim as f64).sqrt();
    match kiln_cube::attention::attention(
        raw(q.clone()),
        raw(k.clone()),
        raw(v.clone()),
        raw(k_store.clone()),
        raw(v_store.clone()),
        &device_index,
        scale,
    ) {
        Ok(out) => wrap(out),
        Err(_) => crate::attention::step_attention_reference(q, k, v, k_store, v_store, index),
    }
}

pub(super) fn argmax_rows<R: CubeRuntime, BT: BoolElement>(
    logits: Tensor<Cube<R, BT>, 2>,
) -> Vec<u32>
where
    Cube<R, BT>: super::InferenceBackend,
{
    let Ok(ids) = kiln_cube::rowwise::argmax(raw(logits.clone())) else {
        return super::argmax_on_host(logits);
    };
    let rows = ids.meta.shape()[0];
    crate::tensor::count_read();
    let Ok(bytes) = ids.client.read_one(ids.handle.clone()) else {
        return super::argmax_on_host(logits);
    };
    bytes[..rows * 4]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
