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

/// Precision of the KV cache: a float [`Dtype`], or ggml's Q8_0 blocks (32 values as signed
/// bytes and one f16 scale, 34 bytes: 8.5 bits a value), which the cpu backend's attention
/// reads in place and other backends dequantize when they gather the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// 32-bit IEEE float: the exact path.
    #[default]
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// ggml's `block_q8_0`, kept as 17 f16 words per block in an f16 tensor.
    Q8_0,
}

impl KvDtype {
    /// Every KV precision, in the order `--help` lists them.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0];

    /// Values in one Q8_0 block (a row's width must be a multiple of it).
    pub const Q8_0_BLOCK: usize = kiln_kernels::attention::Q8_0_VALUES;

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self.float() {
            Some(float) => float.name(),
            None => "q8_0",
        }
    }

    /// The float precision, `None` for a quantized cache.
    pub fn float(self) -> Option<Dtype> {
        match self {
            KvDtype::F32 => Some(Dtype::F32),
            KvDtype::F16 => Some(Dtype::F16),
            KvDtype::Bf16 => Some(Dtype::Bf16),
            KvDtype::Q8_0 => None,
        }
    }

    /// The precision of the tensors that hold it (Q8_0 blocks lie in f16 words).
    pub fn storage(self) -> Dtype {
        self.float().unwrap_or(Dtype::F16)
    }

    /// Elements of the storage tensor per row of `head_dim` values.
    pub fn stored_width(self, head_dim: usize) -> usize {
        match self {
            KvDtype::Q8_0 => head_dim / Self::Q8_0_BLOCK * kiln_kernels::attention::Q8_0_WORDS,
            _ => head_dim,
        }
    }

    /// Bytes a row of `head_dim` values takes.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        self.stored_width(head_dim) * self.storage().size_bytes()
    }

    /// Whether rows of `head_dim` values can be stored (Q8_0 needs whole blocks of 32).
    pub fn holds_rows_of(self, head_dim: usize) -> bool {
        self != KvDtype::Q8_0 || head_dim.is_multiple_of(Self::Q8_0_BLOCK)
    }
}

impl From<Dtype> for KvDtype {
    fn from(dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => KvDtype::F32,
            Dtype::F16 => KvDtype::F16,
            Dtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" | "q8" => Ok(KvDtype::Q8_0),
            other => other
                .parse::<Dtype>()
                .map(KvDtype::from)
                .map_err(|_| CoreError::UnknownKvDtype(s.to_string())),
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
