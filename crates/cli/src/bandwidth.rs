//! Memory bandwidth, for the decode bound in `kiln bench`: decoding one token at batch 1 reads
//! every weight once, so tokens/s can be at most bandwidth / weight bytes.

use std::time::Instant;

use burn::tensor::Tensor;
use kiln_core::InferenceBackend;

/// Host memory read bandwidth in bytes/s: the best of 3 passes summing a 1 GiB buffer, split
/// over every core.
pub fn host() -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = (1usize << 30) / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|scope| {
            let parts: Vec<_> = buffer
                .chunks(chunk)
                .map(|part| scope.spawn(|| part.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts
                .into_iter()
                .map(|p| p.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words * 8) as f64 / best
}

/// Device memory bandwidth in bytes/s: the best of 3 rounds of 16 chained element-wise passes
/// over a 64 MiB f32 tensor (each reads and writes it once; wgpu refuses buffers of 256 MiB),
/// timed from one sync to the next so that a launch and a sync are a small part of a round (a
/// single 64 MiB pass takes ~30 µs on an H200, about what the sync costs), or `None` when the
/// device reports an error.
pub fn device<B: InferenceBackend>(device: &B::Device) -> Option<f64> {
    const PASSES: usize = 16;
    let n = (64usize << 20) / 4;
    let x = Tensor::<B, 1>::ones([n], device);
    // A first round allocates the outputs the next rounds reuse.
    let mut best = f64::INFINITY;
    for round in 0..4 {
        B::sync(device).ok()?;
        let start = Instant::now();
        let mut y = x.clone();
        for _ in 0..PASSES {
            y = y.mul_scalar(1.0);
        }
        B::sync(device).ok()?;
        if round > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
        drop(y);
    }
    Some((PASSES * 2 * n * 4) as f64 / best)
}
