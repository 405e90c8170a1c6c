//! Fixed-strategy products against a host f64 product, on wgpu: exact f32, for a weight stored
//! `[d_in, d_out]` and for the transposed view of one stored `[d_out, d_in]`.

#![allow(clippy::unwrap_used)]

use crate::common::*;

fn host_product(x: &[f32], w_out_in: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let sum: f64 = (0..k)
                .map(|p| f64::from(x[i * k + p]) * f64::from(w_out_in[j * k + p]))
                .sum();
            out[i * n + j] = sum as f32;
        }
    }
    out
}

#[test]
fn f32_products_are_exact_for_both_weight_layouts() {
    // Few rows (one chunk, a partial chunk, several chunks) and more rows than the few-rows
    // kernel takes; widths that are not multiples of its cube.
    for (m, k, n) in [
        (1, 64, 48),
        (3, 96, 130),
        (9, 300, 17),
        // An odd width: no vector wider than one value divides it.
        (2, 301, 7),
        (17, 128, 64),
        (70, 64, 40),
    ] {
        let x = random(m * k, 70);
        let w_out_in = random(n * k, 71);
        let expected = host_product(&x, &w_out_in, m, k, n);

        // [d_out, d_in] seen as [d_in, d_out] through swapped strides.
        let stored = f32s(&w_out_in, &[n, k]);
        let transposed = burn_cubecl::tensor::CubeTensor {
            meta: Box::new(burn_std::Metadata::new(
                burn_backend::Shape::new([k, n]),
                burn_std::strides![1, k],
            )),
            ..stored
        };
        let ours = host(kiln_cube::matmul::matmul(f32s(&x, &[m, k]), transposed).unwrap());
        let diff = max_abs_diff(&ours, &expected);
        assert!(diff < 2e-5, "{m}x{k}x{n} transposed: max |diff| {diff}");

        let mut w_in_out = vec![0f32; k * n];
        for j in 0..n {
            for p in 0..k {
                w_in_out[p * n + j] = w_out_in[j * k + p];
            }
        }
        let ours =
            host(kiln_cube::matmul::matmul(f32s(&x, &[m, k]), f32s(&w_in_out, &[k, n])).unwrap());
        let diff = max_abs_diff(&ours, &expected);
        assert!(diff < 2e-5, "{m}x{k}x{n} row-major: max |diff| {diff}");
    }
}
