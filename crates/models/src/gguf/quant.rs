//! ggml tensor types and their dequantization to f32: they live in `kiln-kernels` (beside the
//! kernels that read the same blocks without dequantizing) and are re-exported here.

pub use kiln_kernels::ggml::{GgmlType, dequantize, ggml_type_name};
pub use kiln_kernels::quant::has_kernel;
