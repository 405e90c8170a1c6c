//! Tensors on the wgpu device (lavapipe without a GPU) from host values and back, and seeded
//! random inputs.

#![allow(dead_code)] // each test file uses part of it

use burn_backend::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::Runtime;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub type R = WgpuRuntime;

pub fn device() -> WgpuDevice {
    WgpuDevice::DefaultDevice
}

/// An f32 tensor of `shape` holding `values`.
pub fn f32s(values: &[f32], shape: &[usize]) -> CubeTensor<R> {
    assert_eq!(values.len(), shape.iter().product::<usize>());
    let client = R::client(&device());
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let handle = client.create_from_slice(&bytes);
    CubeTensor::new_contiguous(
        client,
        device(),
        Shape::from(shape.to_vec()),
        handle,
        DType::F32,
    )
}

/// An i32 tensor of `shape` holding `values`.
pub fn i32s(values: &[i32], shape: &[usize]) -> CubeTensor<R> {
    assert_eq!(values.len(), shape.iter().product::<usize>());
    let client = R::client(&device());
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let handle = client.create_from_slice(&bytes);
    CubeTensor::new_contiguous(
        client,
        device(),
        Shape::from(shape.to_vec()),
        handle,
        DType::I32,
    )
}

/// The values of an f32 tensor, row-major.
pub fn host(t: CubeTensor<R>) -> Vec<f32> {
    assert_eq!(t.dtype, DType::F32);
    let t = burn_cubecl::kernel::into_contiguous(t);
    let n = t.meta.shape().num_elements();
    let bytes = t.client.read_one(t.handle.clone()).expect("read back");
    bytes[..n * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `n` values uniform in [-1, 1) from `seed`.
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}
