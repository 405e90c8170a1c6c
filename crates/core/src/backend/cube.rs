//! What the two GPU backends (burn's `CubeBackend` on CUDA and on wgpu) share: the
//! [`InferenceBackend`] hooks run on kiln-cube's kernels, reached through burn-cubecl's raw
//! tensors. Where a kernel refuses its inputs (a shape it does not take), the hook falls back to
//! burn's composition, so the result is the same either way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use kiln_cube::quant::{BlockType, QuantWeights};
use kiln_kernels::{GgmlType, QuantMatrix};

use super::QuantWeight;

use crate::attention::StepIndex;

/// A GPU backend as kiln builds it: burn's `CubeBackend` with f32 defaults and i32 indices.
pub(super) type Cube<R, BT> = CubeBackend<R, f32, i32, BT>;

/// A pair of 2-D tensors of a GPU backend (a sum and its norm).
type Pair<R, BT> = (Tensor<Cube<R, BT>, 2>, Tensor<Cube<R, BT>, 2>);

/// The rotary tables `(cos, sin)` of a GPU backend.
type RopeRefs<'a, R, BT> = Option<(&'a Tensor<Cube<R, BT>, 3>, &'a Tensor<Cube<R, BT>, 3>)>;

/// Hook calls whose kiln-cube kernel refused its inputs and ran burn's composition instead,
/// and the first refusal's reason: [`kernel_fallbacks`](super::kernel_fallbacks).
static FALLBACKS: AtomicU64 = AtomicU64::new(0);
static FIRST_FALLBACK: OnceLock<String> = OnceLock::new();

fn fell_back(err: &kiln_cube::CubeError) {
    fell_back_because(|| err.to_string());
}

fn fell_back_because(reason: impl FnOnce() -> String) {
    FALLBACKS.fetch_add(1, Ordering::Relaxed);
    if FIRST_FALLBACK.get().is_none() {
        let _ = FIRST_FALLBACK.set(reason());
    }
}

/// See [`super::kernel_fallbacks`].
pub(super) fn fallbacks() -> (u64, Option<String>) {
    (
        FALLBACKS.load(Ordering::Relaxed),
        FIRST_FALLBACK.get().cloned(),
    )
}

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
        Err(err) => {
            fell_back(&err);
            crate::layer_ops::rms_norm(x, gamma, eps)
        }
    }
}

pub(super) fn rotate_half<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 3>,
    cos: &Tensor<Cube<R, BT>, 3>,
    sin: &Tensor<Cube<R, BT>, 3>,
) -> Tensor<Cube<R, BT>, 3> {
    match kiln_cube::rowwise::rotate_half(raw(x.clone()), raw(cos.clone()), raw(sin.clone())) {
        Ok(out) => wrap(out),
        Err(err) => {
            fell_back(&err);
            crate::layer_ops::rotate_half(x, cos, sin)
        }
    }
}

pub(super) fn swiglu<R: CubeRuntime, BT: BoolElement>(
    gate_up: Tensor<Cube<R, BT>, 2>,
) -> Tensor<Cube<R, BT>, 2> {
    match kiln_cube::rowwise::swiglu(raw(gate_up.clone())) {
        Ok(out) => wrap(out),
        Err(err) => {
            fell_back(&err);
            crate::layer_ops::swiglu(gate_up)
        }
    }
}

pub(super) fn add_rms_norm<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 2>,
    delta: Tensor<Cube<R, BT>, 2>,
    gamma: &Tensor<Cube<R, BT>, 1>,
    eps: f64,
) -> Pair<R, BT> {
    match kiln_cube::rowwise::add_rms_norm(
        raw(x.clone()),
        raw(delta.clone()),
        raw(gamma.clone()),
        eps,
    ) {
        Ok((sum, normed)) => (wrap(sum), wrap(normed)),
        Err(err) => {
            fell_back(&err);
            let sum = x + delta;
            (sum.clone(), rms_norm(sum, gamma, eps))
        }
    }
}

pub(super) fn split_heads_rope<R: CubeRuntime, BT: BoolElement>(
    qkv: Tensor<Cube<R, BT>, 2>,
    heads: [usize; 2],
    head_dim: usize,
    rope: RopeRefs<'_, R, BT>,
) -> [Tensor<Cube<R, BT>, 3>; 3] {
    let [n, _] = qkv.dims();
    let [q_heads, kv_heads] = heads;
    let widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim];
    let fused = match rope {
        Some((cos, sin)) => kiln_cube::rowwise::split3_rope(
            raw(qkv.clone()),
            widths,
            head_dim,
            raw(cos.clone()),
            raw(sin.clone()),
        ),
        None => kiln_cube::rowwise::split3(raw(qkv.clone()), widths),
    };
    let shapes = [
        [n, q_heads, head_dim],
        [n, kv_heads, head_dim],
        [n, kv_heads, head_dim],
    ];
    match fused {
        Ok(parts) => {
            let mut parts = parts.into_iter().zip(shapes);
            return std::array::from_fn(|_| {
                let (part, shape) = parts.next().expect("three parts");
                wrap::<R, BT, 2>(part).reshape(shape)
            });
        }
        Err(err) => fell_back(&err),
    }
    let [q, k, v] = crate::layer_ops::split_columns(qkv, widths);
    let [q, k, v] = [
        q.reshape(shapes[0]),
        k.reshape(shapes[1]),
        v.reshape(shapes[2]),
    ];
    match rope {
        Some((cos, sin)) => [rotate_half(q, cos, sin), rotate_half(k, cos, sin), v],
        None => [q, k, v],
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
        Err(err) => {
            fell_back(&err);
            x.matmul(w.clone())
        }
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
    scoring: crate::attention::Scoring,
) -> Tensor<Cube<R, BT>, 2>
where
    Cube<R, BT>: super::InferenceBackend,
{
    let device_index = device_index(index);
    match kiln_cube::attention::attention(
        raw(q.clone()),
        raw(k.clone()),
        raw(v.clone()),
        raw(k_store.clone()),
        raw(v_store.clone()),
        &device_index,
        scoring.scale_for(q.dims()[2]),
        scoring.softcap,
    ) {
        Ok(out) => wrap(out),
        Err(err) => {
            fell_back(&err);
            crate::attention::step_attention_reference(q, k, v, k_store, v_store, index, scoring)
        }
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

/// A quantized weight on a GPU backend: the host blocks, and their copy on the device, made
/// when the weight first multiplies (on the device of that product's input; a model lives on
/// one device). `None` inside when the device takes no such block type: the product then runs
/// on the host ([`super::linear_quantized_on_host`]).
#[derive(Clone)]
pub struct DeviceQuant<R: CubeRuntime> {
    host: Arc<QuantMatrix>,
    device: Arc<OnceLock<Option<QuantWeights<R>>>>,
}

impl<R: CubeRuntime> std::fmt::Debug for DeviceQuant<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on_device = matches!(self.device.get(), Some(Some(_)));
        write!(f, "DeviceQuant({:?}, on device: {on_device})", self.host)
    }
}

impl<R: CubeRuntime> QuantWeight for DeviceQuant<R> {
    fn new(host: Arc<QuantMatrix>) -> Self {
        Self {
            host,
            device: Arc::new(OnceLock::new()),
        }
    }

    fn host(&self) -> &Arc<QuantMatrix> {
        &self.host
    }
}

/// The device's block type for a GGUF type, where kiln-cube has one.
fn block_type(ty: GgmlType) -> Option<BlockType> {
    Some(match ty {
        GgmlType::Q8_0 => BlockType::Q8_0,
        GgmlType::Q4_0 => BlockType::Q4_0,
        GgmlType::Q4_1 => BlockType::Q4_1,
        GgmlType::Q5_0 => BlockType::Q5_0,
        GgmlType::Q5_1 => BlockType::Q5_1,
        GgmlType::Q4K => BlockType::Q4K,
        GgmlType::Q5K => BlockType::Q5K,
        GgmlType::Q6K => BlockType::Q6K,
        // No device kernels yet: their products run on the host (`linear_quantized`).
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Iq4Nl | GgmlType::Iq4Xs => return None,
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => return None,
    })
}

/// `w`'s blocks in GGUF's row-after-row layout (the host may keep them interleaved for its
/// own kernels), copied to `like`'s device.
fn upload_blocks<R: CubeRuntime>(w: &QuantMatrix, like: &CubeTensor<R>) -> Option<QuantWeights<R>> {
    let ty = block_type(w.ty())?;
    let mut bytes = Vec::with_capacity(w.bytes());
    for r in 0..w.rows() {
        bytes.extend_from_slice(&w.row(r));
    }
    QuantWeights::upload(&like.client, &like.device, ty, w.rows(), w.cols(), &bytes).ok()
}

pub(super) fn linear_quantized<R: CubeRuntime, BT: BoolElement>(
    x: Tensor<Cube<R, BT>, 2>,
    w: &DeviceQuant<R>,
) -> Tensor<Cube<R, BT>, 2> {
    let x_raw = raw(x.clone());
    let device = w.device.get_or_init(|| upload_blocks(&w.host, &x_raw));
    match device {
        Some(weights) => match kiln_cube::quant::matmul(x_raw, weights) {
            Ok(out) => return wrap(out),
            Err(err) => fell_back(&err),
        },
        None => fell_back_because(|| {
            format!(
                "{} weights are not on the device (no kernel for the type, or the upload \
                 failed): their products run on the host",
                w.host.ty().name()
            )
        }),
    }
    super::linear_quantized_on_host(x, &w.host)
}
