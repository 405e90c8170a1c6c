//! The floating-point precisions kiln runs a model in.

use std::fmt;
use std::str::FromStr;

use burn::tensor::{DType, FloatDType};

use crate::error::CoreError;

/// Precision of weights, activations and the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dtype {
    /// 32-bit IEEE float: the reference precision.
    #[default]
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16: f32's range with 8 bits of mantissa.
    Bf16,
}

impl Dtype {
    /// Every precision, in the order `--help` lists them.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// burn's tensor dtype.
    pub fn burn(self) -> DType {
        match self {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::Bf16 => DType::BF16,
        }
    }

    /// burn's float dtype (what `Tensor::cast` takes).
    pub fn burn_float(self) -> FloatDType {
        match self {
            Dtype::F32 => FloatDType::F32,
            Dtype::F16 => FloatDType::F16,
            Dtype::Bf16 => FloatDType::BF16,
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Dtype::F32),
            "f16" | "float16" | "half" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            _ => Err(CoreError::UnknownDtype(s.to_string())),
        }
    }
}
