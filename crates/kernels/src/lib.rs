//! kiln's CPU kernels: matrix products on weights kept in their ggml quantized blocks
//! ([`QuantMatrix`]) and f32 products for decoding ([`dense`]) and prefill ([`gemm`]), each
//! written once in plain Rust (the [`Tier::Scalar`] reference) and again with x86 SIMD chosen
//! at run time ([`Tier`]), run on a persistent thread pool ([`ThreadPool`]), and the per-layer
//! row operations around them ([`rowwise`]: RMSNorm, rotary embeddings) as single passes.
//!
//! This crate knows nothing of burn or of models: it multiplies slices. kiln-core's backend
//! trait hands it the host memory of burn-flex tensors; kiln-models decides which weights use
//! it. The ggml block formats and their dequantization ([`ggml`]) live here too, as the
//! reference for the quantized kernels.
//!
//! ```
//! use kiln_kernels::{GgmlType, QuantMatrix};
//! // A 2 × 32 Q8_0 matrix: each row one block (f16 scale 1.0, then 32 signed bytes).
//! let mut data = Vec::new();
//! for row in 0..2i8 {
//!     data.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
//!     data.extend((0..32).map(|i| (row + 1) as u8 * (i % 2) as u8));
//! }
//! let w = QuantMatrix::new(GgmlType::Q8_0, 2, 32, data).unwrap();
//! let x = vec![1.0f32; 32];
//! let mut y = vec![0.0; 2];
//! w.matmul(&x, 1, &mut y);
//! assert!((y[0] - 16.0).abs() < 0.2 && (y[1] - 32.0).abs() < 0.3);
//! ```

pub mod act;
pub mod attention;
pub mod dense;
mod error;
pub mod float16;
pub mod gemm;
pub mod ggml;
pub mod interleaved;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod matrix;
pub mod pool;
pub mod quant;
pub mod rowwise;
pub mod tier;

pub use act::ActPasses;
pub use error::KernelError;
pub use ggml::GgmlType;
pub use matrix::QuantMatrix;
pub use pool::{ThreadPool, ThreadsAlreadySet};
pub use tier::Tier;

/// An output buffer that several tasks write disjoint elements of.
pub(crate) struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: tasks write disjoint indices (each caller's contract), and the buffer outlives the
// pool job that uses it.
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    pub(crate) fn new(out: &mut [T]) -> Self {
        Self {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// Writes `v` at `i`.
    ///
    /// # Safety
    /// No other task may write or read index `i` during the job.
    #[inline]
    pub(crate) unsafe fn write(&self, i: usize, v: T) {
        assert!(i < self.len, "output index out of range");
        // SAFETY: in bounds (just checked); exclusive per the caller's contract.
        unsafe { self.ptr.add(i).write(v) };
    }

    /// The elements `start..start + len`, to write in place.
    ///
    /// # Safety
    /// No other task may touch those elements during the job, and the returned slice must not
    /// outlive it.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "output range out of bounds");
        // SAFETY: in bounds (just checked); exclusive per the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}
