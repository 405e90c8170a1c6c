//! Which SIMD instruction set a kernel uses, chosen at run time.
//!
//! Every kernel has a [`Tier::Scalar`] version (plain Rust, the reference the others are tested
//! against) and may have faster ones. [`Tier::active`] is the best tier this CPU supports,
//! unless the `KILN_KERNEL_TIER` environment variable names a lower one, so that every tier
//! can be exercised on any machine that has it (CI forces each in turn); the kernels also take
//! a tier as an argument.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// The environment variable that forces a tier (`scalar`, `avx2`, `avx512vnni`).
pub const TIER_ENV: &str = "KILN_KERNEL_TIER";

/// A SIMD instruction set kiln's kernels are written for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Plain Rust; the reference every other tier is tested against.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C (Haswell, Zen 1 and later).
    Avx2,
    /// AVX2 plus AVX-512 VNNI on 256-bit registers (`vpdpbusd`; Ice Lake, Zen 4 and later).
    Avx512Vnni,
}

impl Tier {
    /// Every tier, lowest first.
    pub const ALL: [Tier; 3] = [Tier::Scalar, Tier::Avx2, Tier::Avx512Vnni];

    /// The name `KILN_KERNEL_TIER` takes.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            Tier::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512Vnni => {
                Tier::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The tiers this CPU supports, lowest first.
    pub fn supported() -> Vec<Tier> {
        Self::ALL.into_iter().filter(|t| t.is_supported()).collect()
    }

    /// The best tier this CPU supports.
    pub fn best() -> Tier {
        Self::supported().into_iter().last().unwrap_or(Tier::Scalar)
    }

    /// The tier `KILN_KERNEL_TIER` asks for, if set.
    ///
    /// # Errors
    /// [`TierError`] when the value names no tier, or one this CPU cannot run.
    pub fn from_env() -> Result<Option<Tier>, TierError> {
        match std::env::var(TIER_ENV) {
            Err(_) => Ok(None),
            Ok(value) if value.is_empty() => Ok(None),
            Ok(value) => {
                let tier: Tier = value.parse()?;
                if tier.is_supported() {
                    Ok(Some(tier))
                } else {
                    Err(TierError::Unsupported(tier))
                }
            }
        }
    }

    /// The tier kernels use when not told otherwise: `KILN_KERNEL_TIER` if it is set and
    /// valid, else [`Tier::best`]. Decided once per process; an invalid variable is reported
    /// by [`Tier::from_env`] (the CLI checks it at start) and ignored here.
    pub fn active() -> Tier {
        static ACTIVE: OnceLock<Tier> = OnceLock::new();
        *ACTIVE.get_or_init(|| Tier::from_env().ok().flatten().unwrap_or_else(Tier::best))
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Tier {
    type Err = TierError;

    fn from_str(s: &str) -> Result<Self, TierError> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| TierError::Unknown(s.to_string()))
    }
}

/// A tier that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The name is not a tier.
    #[error("unknown kernel tier `{0}` in {TIER_ENV} (expected scalar, avx2 or avx512vnni)")]
    Unknown(String),
    /// This CPU lacks the instructions.
    #[error("kernel tier `{0}` in {TIER_ENV} needs instructions this CPU does not have")]
    Unsupported(Tier),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_scalar_is_always_supported() {
        for t in Tier::ALL {
            assert_eq!(t.name().parse::<Tier>(), Ok(t));
        }
        assert!(Tier::Scalar.is_supported());
        assert!(Tier::supported().contains(&Tier::best()));
        assert!(matches!("sse9".parse::<Tier>(), Err(TierError::Unknown(_))));
    }
}
