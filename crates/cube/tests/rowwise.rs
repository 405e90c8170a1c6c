//! The row kernels against plain host loops, on wgpu.

#![allow(clippy::unwrap_used)]

use crate::common::*;

#[test]
fn rms_norm_matches_the_host_loop() {
    for (rows, d) in [(1, 64), (3, 576), (5, 1000), (2, 2048)] {
        let x = random(rows * d, 1);
        let gamma = random(d, 2);
        let eps = 1e-5;
        let ours = host(
            kiln_cube::rowwise::rms_norm(f32s(&x, &[rows, d]), f32s(&gamma, &[d]), eps).unwrap(),
        );
        let mut expected = Vec::new();
        for row in x.chunks(d) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let rms = (ms + eps as f32).sqrt();
            expected.extend(row.iter().zip(&gamma).map(|(v, g)| v / rms * g));
        }
        let diff = max_abs_diff(&ours, &expected);
        assert!(diff < 1e-5, "rows {rows} d {d}: max |diff| {diff}");
    }
}

#[test]
fn rms_norm_reads_strided_rows() {
    // The first 64 columns of a [4, 96] tensor: rows 96 apart.
    let (rows, d, width) = (4, 64, 96);
    let wide = random(rows * width, 3);
    let gamma = random(d, 4);
    let view = burn_cubecl::tensor::CubeTensor {
        meta: Box::new(burn_std::Metadata::new(
            burn_backend::Shape::new([rows, d]),
            burn_std::strides![width, 1],
        )),
        ..f32s(&wide, &[rows, width])
    };
    let ours = host(kiln_cube::rowwise::rms_norm(view, f32s(&gamma, &[d]), 1e-6).unwrap());
    let dense: Vec<f32> = wide.chunks(width).flat_map(|r| r[..d].to_vec()).collect();
    let reference = host(
        kiln_cube::rowwise::rms_norm(f32s(&dense, &[rows, d]), f32s(&gamma, &[d]), 1e-6).unwrap(),
    );
    assert_eq!(ours, reference);
}

#[test]
fn rotate_half_matches_the_host_loop() {
    let (n, heads, dim) = (3, 4, 16);
    let half = dim / 2;
    let x = random(n * heads * dim, 5);
    let cos = random(n * half, 6);
    let sin = random(n * half, 7);
    let ours = host(
        kiln_cube::rowwise::rotate_half(
            f32s(&x, &[n, heads, dim]),
            f32s(&cos, &[n, 1, half]),
            f32s(&sin, &[n, 1, half]),
        )
        .unwrap(),
    );
    let mut expected = vec![0f32; x.len()];
    for t in 0..n {
        for h in 0..heads {
            let at = (t * heads + h) * dim;
            for i in 0..half {
                let (x1, x2) = (x[at + i], x[at + i + half]);
                let (c, s) = (cos[t * half + i], sin[t * half + i]);
                expected[at + i] = x1 * c - x2 * s;
                expected[at + i + half] = x2 * c + x1 * s;
            }
        }
    }
    let diff = max_abs_diff(&ours, &expected);
    assert!(diff < 1e-6, "max |diff| {diff}");
}

#[test]
fn swiglu_matches_the_host_loop() {
    let (n, d_ff) = (3, 300);
    let gate_up = random(n * 2 * d_ff, 8);
    let ours = host(kiln_cube::rowwise::swiglu(f32s(&gate_up, &[n, 2 * d_ff])).unwrap());
    let mut expected = Vec::new();
    for row in gate_up.chunks(2 * d_ff) {
        for i in 0..d_ff {
            let (g, u) = (row[i], row[d_ff + i]);
            expected.push(g / (1.0 + (-g).exp()) * u);
        }
    }
    let diff = max_abs_diff(&ours, &expected);
    assert!(diff < 1e-6, "max |diff| {diff}");
}

#[test]
fn shapes_that_disagree_are_errors_not_launches() {
    let x = f32s(&random(8, 9), &[2, 4]);
    let err = kiln_cube::rowwise::rms_norm(x.clone(), f32s(&random(3, 1), &[3]), 1e-5).unwrap_err();
    assert!(err.to_string().contains("gamma must be [4]"), "{err}");
    let err = kiln_cube::rowwise::swiglu(f32s(&random(6, 1), &[2, 3])).unwrap_err();
    assert!(err.to_string().contains("odd"), "{err}");
}

#[test]
fn split3_cuts_columns_into_contiguous_parts() {
    let (n, widths) = (3, [8, 4, 4]);
    let x = random(n * 16, 10);
    let parts = kiln_cube::rowwise::split3(f32s(&x, &[n, 16]), widths).unwrap();
    let mut start = 0;
    for (part, w) in parts.into_iter().zip(widths) {
        let expected: Vec<f32> = x
            .chunks(16)
            .flat_map(|r| r[start..start + w].to_vec())
            .collect();
        assert_eq!(host(part), expected);
        start += w;
    }
}

#[test]
fn argmax_takes_the_first_of_equal_maxima() {
    let (rows, width) = (4, 1000);
    let mut x = random(rows * width, 11);
    // Row 1: the maximum twice, the lower index must win; row 2: at the very end; row 3: at 0.
    x[width + 700] = 5.0;
    x[width + 300] = 5.0;
    x[2 * width + width - 1] = 9.0;
    x[3 * width] = 2.0;
    let expected: Vec<i32> = x
        .chunks(width)
        .map(|r| {
            let max = r.iter().copied().fold(f32::MIN, f32::max);
            r.iter().position(|&v| v == max).unwrap() as i32
        })
        .collect();
    let out = kiln_cube::rowwise::argmax(f32s(&x, &[rows, width])).unwrap();
    let bytes = out.client.read_one(out.handle.clone()).unwrap();
    let got: Vec<i32> = bytes[..rows * 4]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(got, expected);
    assert_eq!(got[1], 300);
}

#[test]
fn add_rms_norm_equals_the_sum_then_rms_norm() {
    for (rows, d) in [(1, 64), (3, 576), (2, 2048)] {
        let (x, delta, gamma) = (random(rows * d, 12), random(rows * d, 13), random(d, 14));
        let (sum, normed) = kiln_cube::rowwise::add_rms_norm(
            f32s(&x, &[rows, d]),
            f32s(&delta, &[rows, d]),
            f32s(&gamma, &[d]),
            1e-5,
        )
        .unwrap();
        let expected_sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let sum = host(sum);
        assert_eq!(sum, expected_sum, "rows {rows} d {d}");
        let apart = host(
            kiln_cube::rowwise::rms_norm(f32s(&sum, &[rows, d]), f32s(&gamma, &[d]), 1e-5).unwrap(),
        );
        assert_eq!(host(normed), apart, "rows {rows} d {d}");
    }
    let err = kiln_cube::rowwise::add_rms_norm(
        f32s(&random(8, 1), &[2, 4]),
        f32s(&random(4, 1), &[1, 4]),
        f32s(&random(4, 1), &[4]),
        1e-5,
    )
    .unwrap_err();
    assert!(err.to_string().contains("delta"), "{err}");
}

#[test]
fn split3_rope_equals_split3_then_rotate_half() {
    // 4 query heads, 2 key and value heads of 16, over 3 tokens, rows strided.
    let (n, dim) = (3, 16);
    let widths = [4 * dim, 2 * dim, 2 * dim];
    let width: usize = widths.iter().sum();
    let x = random(n * width, 15);
    let (cos, sin) = (random(n * dim / 2, 16), random(n * dim / 2, 17));
    let table = |v: &[f32]| f32s(v, &[n, 1, dim / 2]);
    let fused = kiln_cube::rowwise::split3_rope(
        f32s(&x, &[n, width]),
        widths,
        dim,
        table(&cos),
        table(&sin),
    )
    .unwrap();
    let [q, k, v] = kiln_cube::rowwise::split3(f32s(&x, &[n, width]), widths).unwrap();
    let rotate = |t: burn_cubecl::tensor::CubeTensor<R>, heads: usize| {
        let t = burn_cubecl::tensor::CubeTensor {
            meta: Box::new(burn_std::Metadata::new(
                burn_backend::Shape::new([n, heads, dim]),
                burn_std::strides![heads * dim, dim, 1],
            )),
            ..t
        };
        host(kiln_cube::rowwise::rotate_half(t, table(&cos), table(&sin)).unwrap())
    };
    let [fq, fk, fv] = fused;
    assert_eq!(host(fq), rotate(q, 4));
    assert_eq!(host(fk), rotate(k, 2));
    assert_eq!(host(fv), host(v));
    let err = kiln_cube::rowwise::split3_rope(
        f32s(&x, &[n, width]),
        [4 * dim + 1, 2 * dim - 1, 2 * dim],
        dim,
        table(&cos),
        table(&sin),
    )
    .unwrap_err();
    assert!(err.to_string().contains("heads"), "{err}");
}
