//! A small transformer-shaped workload (8 blocks: RMS-normalised residual MLP plus causal
//! softmax attention, d=256, 64 tokens), run either through `burn::Dispatch` (one
//! instantiation) or through a `match` over concrete backends (one instantiation per backend).
//!
//! cargo build --release --features mono|dispatch; ./dispatch-cost <cpu|wgpu|ndarray> <iters>

use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, activation};

const D: usize = 256;
const SEQ: usize = 64;
const LAYERS: usize = 8;

struct Model<B: Backend> {
    layers: Vec<[Tensor<B, 2>; 4]>,
}

impl<B: Backend> Model<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 0);
        let w = |a, b| Tensor::random([a, b], Distribution::Normal(0.0, 0.05), device);
        Self {
            layers: (0..LAYERS)
                .map(|_| [w(D, D), w(D, D), w(D, 4 * D), w(4 * D, D)])
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        let device = x.device();
        let mask = Tensor::<B, 2, burn::tensor::Bool>::tril_mask([SEQ, SEQ], 0, &device);
        for [wq, wv, w1, w2] in &self.layers {
            let h = rms(x.clone());
            let q = h.clone().matmul(wq.clone());
            let scores = q.matmul(h.clone().transpose()).div_scalar((D as f64).sqrt());
            let att = activation::softmax(scores.mask_fill(mask.clone(), f32::NEG_INFINITY), 1);
            x = x + att.matmul(h.matmul(wv.clone()));
            let h = rms(x.clone());
            x = x + activation::silu(h.matmul(w1.clone())).matmul(w2.clone());
        }
        x
    }
}

fn rms<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let norm = x.clone().powf_scalar(2.0).mean_dim(1).add_scalar(1e-5).sqrt();
    x / norm
}

fn bench<B: Backend>(device: B::Device, iters: usize) -> f64 {
    let model = Model::<B>::new(&device);
    let x = Tensor::<B, 2>::random([SEQ, D], Distribution::Normal(0.0, 1.0), &device);
    for _ in 0..3 {
        let _ = model.forward(x.clone()).into_data();
    }
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            let _ = model.forward(x.clone()).into_data();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let kind = args.get(1).map_or("cpu", String::as_str);
    let iters = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(50);
    let median_ms = run(kind, iters);
    println!("{kind}: median forward {median_ms:.3} ms over {iters} runs");
}

#[cfg(feature = "mono")]
fn run(kind: &str, iters: usize) -> f64 {
    use burn::backend::{Cuda, Flex, NdArray, Wgpu};
    match kind {
        "cpu" => bench::<Flex>(Default::default(), iters),
        "ndarray" => bench::<NdArray>(Default::default(), iters),
        "wgpu" => bench::<Wgpu>(Default::default(), iters),
        "cuda" => bench::<Cuda>(Default::default(), iters),
        other => panic!("unknown backend {other}"),
    }
}

#[cfg(feature = "dispatch")]
fn run(kind: &str, iters: usize) -> f64 {
    use burn::{Dispatch, DispatchDevice};
    let device: DispatchDevice = match kind {
        "cpu" => burn::backend::flex::FlexDevice.into(),
        "ndarray" => burn::backend::ndarray::NdArrayDevice::Cpu.into(),
        "wgpu" => burn::backend::wgpu::WgpuDevice::DefaultDevice.into(),
        "cuda" => burn::backend::cuda::CudaDevice::new(0).into(),
        other => panic!("unknown backend {other}"),
    };
    bench::<Dispatch>(device, iters)
}
