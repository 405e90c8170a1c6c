//! K/V values to and from the form a cache of a given [`KvDtype`] stores: a cast for the float
//! precisions; for Q8_0, rows of `head_dim` values as ggml's blocks (`kiln_kernels`' layout)
//! laid in the f16 words of an f16 tensor, 17 words per 32 values, so every cache kind moves
//! them with the same slice, copy and gather operations as float rows.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, f16};
use kiln_kernels::attention::{dequantize_q8_0, q8_0_blocks, q8_0_blocks_mut, quantize_q8_0};

use crate::dtype::KvDtype;

/// `values` as `dtype` stores them. Values already stored (Q8_0 rows of the stored width)
/// pass through, so a write may be handed either.
///
/// # Shapes
/// - `values`: `[.., head_dim]`, any float dtype
/// - returns `[.., dtype.stored_width(head_dim)]` in `dtype.storage()`
///
/// # Panics
/// If a Q8_0 row is not whole blocks of 32 (the cache refuses such layouts when it is made).
pub fn encode<B: Backend, const D: usize>(
    dtype: KvDtype,
    values: Tensor<B, D>,
    head_dim: usize,
) -> Tensor<B, D> {
    let Some(float) = dtype.float() else {
        let dims = values.dims();
        if dims[D - 1] != head_dim {
            debug_assert_eq!(dims[D - 1], dtype.stored_width(head_dim));
            return values;
        }
        return encode_q8_0(values, head_dim);
    };
    values.cast(float.burn_float())
}

/// Stored values back as `to` floats.
///
/// # Shapes
/// - `stored`: `[.., dtype.stored_width(head_dim)]`
/// - returns `[.., head_dim]`
pub fn decode<B: Backend, const D: usize>(
    dtype: KvDtype,
    stored: Tensor<B, D>,
    head_dim: usize,
    to: FloatDType,
) -> Tensor<B, D> {
    match dtype {
        KvDtype::Q8_0 => decode_q8_0(stored, head_dim).cast(to),
        _ => stored.cast(to),
    }
}

/// # Shapes
/// - `values`: `[.., head_dim]`; returns `[.., head_dim / 32 * 17]` f16 words
fn encode_q8_0<B: Backend, const D: usize>(values: Tensor<B, D>, head_dim: usize) -> Tensor<B, D> {
    let device = values.device();
    let mut dims = values.dims();
    let host: Vec<f32> = crate::tensor::host_f32(values);
    let width = KvDtype::Q8_0.stored_width(head_dim);
    let rows = host.len() / head_dim.max(1);
    let mut words = vec![f16::ZERO; rows * width];
    // Rows of whole blocks lie end to end: the values quantize as one run of blocks.
    quantize_q8_0(
        &host,
        q8_0_blocks_mut(&mut words).expect("whole blocks by construction"),
    );
    dims[D - 1] = width;
    Tensor::from_data(TensorData::new(words, dims), (&device, DType::F16))
}

/// # Shapes
/// - `stored`: `[.., head_dim / 32 * 17]` f16 words; returns `[.., head_dim]` f32
fn decode_q8_0<B: Backend, const D: usize>(stored: Tensor<B, D>, head_dim: usize) -> Tensor<B, D> {
    let device = stored.device();
    let mut dims = stored.dims();
    debug_assert_eq!(stored.dtype(), DType::F16);
    let words: Vec<f16> = crate::tensor::read_back(stored)
        .to_vec()
        .expect("a Q8_0 cache is stored in f16 words");
    let blocks = q8_0_blocks(&words).expect("rows of whole blocks");
    let mut values = vec![0f32; blocks.len() * KvDtype::Q8_0_BLOCK];
    dequantize_q8_0(blocks, &mut values);
    dims[D - 1] = head_dim;
    Tensor::from_data(TensorData::new(values, dims), (&device, DType::F32))
}

#[cfg(test)]
mod tests {
    use super::*;

    type B = burn::backend::Flex;

    #[test]
    fn q8_0_rows_round_trip_within_half_a_step_and_pass_through_once_stored() {
        let device = Default::default();
        let values: Vec<f32> = (0..2 * 3 * 64)
            .map(|i| ((i * 37) % 101) as f32 / 25.0 - 2.0)
            .collect();
        let t = Tensor::<B, 3>::from_data(TensorData::new(values.clone(), [2, 3, 64]), &device);
        let stored = encode(KvDtype::Q8_0, t, 64);
        assert_eq!(stored.dims(), [2, 3, 34]);
        assert_eq!(stored.dtype(), DType::F16);
        let again = encode(KvDtype::Q8_0, stored.clone(), 64);
        assert_eq!(again.into_data(), stored.clone().into_data());
        let back = crate::tensor::host_f32(decode(KvDtype::Q8_0, stored, 64, FloatDType::F32));
        for (row, got) in values.chunks(32).zip(back.chunks(32)) {
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in row.iter().zip(got) {
                assert!((x - y).abs() <= amax / 127.0 * 0.51, "{x} vs {y}");
            }
        }
    }

    #[test]
    fn float_precisions_are_casts() {
        let device = Default::default();
        let t = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32 / 3.0; 8], [2, 4]), &device);
        let stored = encode(KvDtype::F16, t, 4);
        assert_eq!(stored.dtype(), DType::F16);
        let back = crate::tensor::host_f32(decode(KvDtype::F16, stored, 4, FloatDType::F32));
        assert_eq!(back[0], f16::from_f32(1.0 / 3.0).to_f32());
    }
}
