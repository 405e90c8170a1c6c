//! Dot products of one quantized weight row with quantized activations, for each weight type
//! with a kernel ([`has_kernel`]) and each [`Tier`].

pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::iq4_table;

use crate::act::{ACT_BLOCK, ActBlock};
use crate::ggml::GgmlType;
use crate::tier::Tier;

/// A dot product: a weight row of whole blocks and its activations (one block per 32 values).
///
/// # Safety
/// The CPU must support the tier the function was chosen for, and `w` must hold exactly
/// `a.len() × 32` values of the function's type ([`kernel`] hands out only such pairs through
/// [`DotKernel`]).
pub(crate) type DotFn = unsafe fn(&[u8], &[ActBlock]) -> f32;

/// The weight types kiln multiplies without dequantizing.
pub fn has_kernel(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Iq4Nl
            | GgmlType::Iq4Xs
    )
}

/// A dot product chosen for one weight type on one tier: checked once, called many times.
#[derive(Clone, Copy)]
pub struct DotKernel {
    ty: GgmlType,
    tier: Tier,
    f: DotFn,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DotKernel({}, {})", self.ty.name(), self.tier)
    }
}

impl DotKernel {
    /// The kernel for `ty` at `tier` (the best implementation at or below it), or `None` when
    /// `ty` has no kernel or this CPU cannot run `tier`.
    pub fn new(ty: GgmlType, tier: Tier) -> Option<Self> {
        if !has_kernel(ty) || !tier.is_supported() {
            return None;
        }
        Some(Self {
            ty,
            tier,
            f: kernel(ty, tier),
        })
    }

    /// The weight type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// The tier asked for.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// `Σ w_i x_i` for one weight row `w` and its activations `a`.
    ///
    /// # Panics
    /// If `w` does not hold exactly `a.len() × 32` values of the kernel's type.
    #[inline]
    pub fn dot(&self, w: &[u8], a: &[ActBlock]) -> f32 {
        assert_eq!(
            Some(w.len()),
            self.ty.bytes_for(a.len() * ACT_BLOCK),
            "weight row and activations differ in length"
        );
        // SAFETY: the tier was checked in `new`, the lengths just now.
        unsafe { (self.f)(w, a) }
    }

    /// As [`dot`](Self::dot), lengths unchecked.
    ///
    /// # Safety
    /// `w` must hold exactly `a.len() × 32` values of the kernel's type.
    #[inline]
    pub(crate) unsafe fn dot_unchecked(&self, w: &[u8], a: &[ActBlock]) -> f32 {
        debug_assert_eq!(Some(w.len()), self.ty.bytes_for(a.len() * ACT_BLOCK));
        // SAFETY: the tier was checked in `new`; the caller vouches for the lengths.
        unsafe { (self.f)(w, a) }
    }
}

fn scalar_kernel(ty: GgmlType) -> DotFn {
    match ty {
        GgmlType::Q8_0 => scalar::q8_0,
        GgmlType::Q4_0 => scalar::q4_0,
        GgmlType::Q4_1 => scalar::q4_1,
        GgmlType::Q5_0 => scalar::q5_0,
        GgmlType::Q5_1 => scalar::q5_1,
        GgmlType::Q4K => scalar::q4_k,
        GgmlType::Q5K => scalar::q5_k,
        GgmlType::Q6K => scalar::q6_k,
        GgmlType::Q2K => scalar::q2_k,
        GgmlType::Q3K => scalar::q3_k,
        GgmlType::Iq4Nl => scalar::iq4_nl,
        GgmlType::Iq4Xs => scalar::iq4_xs,
        other => unreachable!("{} has no kernel (has_kernel)", other.name()),
    }
}

/// The implementation of `ty`'s dot product at `tier`.
fn kernel(ty: GgmlType, tier: Tier) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        let simd: Option<DotFn> = match (tier, ty) {
            (Tier::Avx512Vnni, GgmlType::Q8_0) => Some(x86::vnni::q8_0),
            (Tier::Avx512Vnni, GgmlType::Q4_0) => Some(x86::vnni::q4_0),
            (Tier::Avx512Vnni, GgmlType::Q4_1) => Some(x86::vnni::q4_1),
            (Tier::Avx512Vnni, GgmlType::Q4K) => Some(x86::vnni::q4_k),
            (Tier::Avx512Vnni, GgmlType::Q6K) => Some(x86::vnni::q6_k),
            (Tier::Avx512Vnni, GgmlType::Q2K) => Some(x86::vnni::q2_k),
            (Tier::Avx512Vnni, GgmlType::Q3K) => Some(x86::vnni::q3_k),
            (Tier::Avx512Vnni, GgmlType::Iq4Nl) => Some(x86::vnni::iq4_nl),
            (Tier::Avx512Vnni, GgmlType::Iq4Xs) => Some(x86::vnni::iq4_xs),
            (Tier::Avx2, GgmlType::Q8_0) => Some(x86::avx2::q8_0),
            (Tier::Avx2, GgmlType::Q4_0) => Some(x86::avx2::q4_0),
            (Tier::Avx2, GgmlType::Q4_1) => Some(x86::avx2::q4_1),
            (Tier::Avx2, GgmlType::Q4K) => Some(x86::avx2::q4_k),
            (Tier::Avx2, GgmlType::Q6K) => Some(x86::avx2::q6_k),
            (Tier::Avx2, GgmlType::Q2K) => Some(x86::avx2::q2_k),
            (Tier::Avx2, GgmlType::Q3K) => Some(x86::avx2::q3_k),
            (Tier::Avx2, GgmlType::Iq4Nl) => Some(x86::avx2::iq4_nl),
            (Tier::Avx2, GgmlType::Iq4Xs) => Some(x86::avx2::iq4_xs),
            _ => None,
        };
        if let Some(f) = simd {
            return f;
        }
    }
    let _ = tier;
    scalar_kernel(ty)
}
