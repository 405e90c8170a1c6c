//! [`KernelError`]: why a matrix cannot be used by a kernel.

/// Why a kernel cannot take a matrix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The weight type has no kernel (it is dequantized at load instead).
    #[error("no kernel for weight type {0}")]
    NoKernel(&'static str),
    /// The matrix's dimensions or byte length do not fit its type.
    #[error("{0}")]
    Shape(String),
}
