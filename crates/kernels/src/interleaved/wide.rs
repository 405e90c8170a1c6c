//! Prefill's tiles on AVX-512 VNNI: two neighbouring groups (16 weight rows) times up to
//! [`WIDE_TILE`] activation rows, in 512-bit registers. (On AVX2, Q5_K's groups, and Q6_K's
//! with one activation pass, are unpacked the same way and then multiplied eight rows at a
//! time: the [`avx2`] module.)
//!
//! The groups keep their layout ([`super`]); a 512-bit register holds chunk `j` of the first
//! group in its low half and of the second in its high half, so one `vpdpbusd` with four
//! broadcast activation bytes advances sixteen rows where the 256-bit tiles advance eight, and
//! each chunk, unpacked once, serves up to eight activation rows in both passes; the
//! K-quants' pairs of groups are unpacked once for a whole pass of activation rows
//! ([`UnpackedSub`]). Prefill spends its time in them: the K-quants (Q4_K, Q5_K, Q6_K, Q3_K:
//! the bulk of the Q4_K_M, Q5_K_M, Q6_K and Q3_K_M files), Q8_0, and Q4_0, Q4_1, Q5_0 and Q5_1
//! (the default model's Q4_1, and the fallbacks llama-quantize writes where a width is not a
//! multiple of 256).
//!
//! Each lane goes through the 256-bit VNNI tile's float steps in the same order (a float
//! step per sub-block and row, the same `cvtdq2ps`, multiplies and FMAs), and the integer
//! sums are exact in any order, so every output is the same bits as the narrow tile's: a
//! row's products do not depend on whether prefill (wide) or decoding (narrow) computed them.

use std::cell::RefCell;

use crate::act::{ActBlock, ActPasses};
use crate::ggml::GgmlType;
use crate::tier::Tier;

use super::{AnyTileFn, GROUP, call_tile};

/// Weight rows a wide tile multiplies: two groups.
pub const WIDE_ROWS: usize = 2 * GROUP;

/// Activation rows a wide tile multiplies at most at once.
pub const WIDE_TILE: usize = 8;

/// Sixteen rows' products (two neighbouring groups, `w` their bytes end to end) with `N`
/// activation rows, each given in two passes (`hi[i]`, `lo[i]`).
///
/// # Safety
/// The CPU must support the tier the function was chosen for ([`WideKernels::new`]); `w`
/// must be two groups of the function's type, each holding exactly the block columns that
/// `hi[i].len()` activation blocks cover (one per eight blocks) for every `i`, and
/// `lo[i].len() == hi[i].len()`. For the types [`WideKernels`] unpacks, `w` is instead the
/// bytes of the two groups' [`UnpackedSub`]s, one per activation block.
pub(crate) type WideFn<const N: usize> = AnyTileFn<N, WIDE_ROWS>;

/// One sub-block (32 values) of a wide tile's sixteen weight rows unpacked: the registers
/// the K-quant tiles multiply and the float scales they apply. A pass of activation rows
/// unpacks a pair of groups once and every tile of the pass loads the registers (load ports)
/// instead of forming them again from nibbles (vector ports, which the `vpdpbusd`s need:
/// docs/kernels.md, item 6).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct UnpackedSub {
    /// Chunk `j`'s two registers: values `4 j .. 4 j + 4` of each of the sixteen rows (four
    /// bytes a row, the first group's eight rows in the low half), then values `16 + 4 j ..`.
    values: [[[u8; 64]; 2]; 4],
    /// Per row: Q4_K's and Q5_K's `d × scale` and `dmin × min`; Q6_K's and Q3_K's `d ×` the
    /// scale of the sub-block's first half and of its second.
    scales: [[f32; WIDE_ROWS]; 2],
}

impl UnpackedSub {
    /// A sub-block of zeros: what a buffer grows with before the unpacking writes it.
    const ZERO: Self = Self {
        values: [[[0; 64]; 2]; 4],
        scales: [[0.0; WIDE_ROWS]; 2],
    };
}

/// The sub-blocks whose bytes `w` is.
///
/// # Safety
/// `w` must be the bytes of a slice of [`UnpackedSub`], as [`WideKernels`] hands the unpacked
/// types' tiles their weights.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn unpacked(w: &[u8]) -> &[UnpackedSub] {
    let subs = w.as_ptr().cast::<UnpackedSub>();
    debug_assert!(subs.is_aligned() && w.len().is_multiple_of(size_of::<UnpackedSub>()));
    // SAFETY: the caller's contract: `w` is whole, aligned `UnpackedSub`s, plain data.
    unsafe { std::slice::from_raw_parts(subs, w.len() / size_of::<UnpackedSub>()) }
}

/// Unpacks two groups (`w`, their bytes end to end) into `out`, one [`UnpackedSub`] per
/// sub-block.
///
/// # Safety
/// The CPU must support the tier the function was chosen for; `w` must be two groups of the
/// function's type, each holding exactly the block columns of `out.len()` sub-blocks.
type UnpackFn = unsafe fn(&[u8], &mut [UnpackedSub]);

thread_local! {
    /// This thread's unpacked pair of groups: one at a time, the buffer kept for every
    /// product after (a pair of 8,192-wide rows is 160 KB, which stays in L2).
    static UNPACKED: RefCell<Vec<UnpackedSub>> = const { RefCell::new(Vec::new()) };
}

/// The wide tiles of one weight type, for one to [`WIDE_TILE`] activation rows.
#[derive(Clone, Copy)]
pub(crate) struct WideKernels {
    /// The most activation rows a call takes: [`WIDE_TILE`], or, with two activation passes,
    /// five for the types whose two scales per sub-block need four sums per row and pass (six
    /// rows' 24 sums spill out of the 32 registers; docs/benchmarks.md has the three timings).
    tile: usize,
    /// The fewest activation rows for which unpacking and the wide tiles pay; products of
    /// fewer rows run the narrow tiles.
    min_rows: usize,
    /// For the K-quants: what unpacks a pair of groups for the tiles, which take the
    /// [`UnpackedSub`]s.
    unpack: Option<UnpackFn>,
    one: WideFn<1>,
    two: WideFn<2>,
    three: WideFn<3>,
    four: WideFn<4>,
    five: WideFn<5>,
    six: WideFn<6>,
    seven: WideFn<7>,
    eight: WideFn<8>,
}

/// [`WideKernels`] from one kernel generic over its row count (after it, its extra generic
/// parameters), and for the unpacked types what unpacks their weights.
#[cfg(target_arch = "x86_64")]
macro_rules! wide_kernels {
    ($tile:expr, $unpack:expr, $($f:ident)::+ $(, $extra:expr)*) => {
        WideKernels {
            tile: $tile,
            min_rows: super::TILE + 1,
            unpack: $unpack,
            one: $($f)::+::<1 $(, $extra)*, SPLIT>,
            two: $($f)::+::<2 $(, $extra)*, SPLIT>,
            three: $($f)::+::<3 $(, $extra)*, SPLIT>,
            four: $($f)::+::<4 $(, $extra)*, SPLIT>,
            five: $($f)::+::<5 $(, $extra)*, SPLIT>,
            six: $($f)::+::<6 $(, $extra)*, SPLIT>,
            seven: $($f)::+::<7 $(, $extra)*, SPLIT>,
            eight: $($f)::+::<8 $(, $extra)*, SPLIT>,
        }
    };
}

/// The fewest activation rows for AVX2's unpacked tiles: with fewer, unpacking a pair of
/// groups costs about what the tiles then save (docs/kernels.md, item 9: on a Zen 4 at the
/// AVX2 tier with one activation pass, 32 rows took 0.94-1.06x the narrow tiles' time, 64
/// rows 0.91-0.96x, 512 rows 0.93-0.95x).
const AVX2_MIN_ROWS: usize = 64;

/// Whether the eight-row one-pass Q4_K and Q5_K tiles keep one integer sum per activation
/// row rather than two: on Intel's cores, where every 512-bit vector instruction issues on the
/// two ports `vpdpbusd` needs, the add joining two sums costs more than the latency they hide
/// (7-10 % faster products); on AMD's Zen 4 two sums per row measured faster (docs/kernels.md,
/// item 6). The same bits either way.
#[cfg(target_arch = "x86_64")]
fn one_sum_per_row() -> bool {
    use std::sync::OnceLock;
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        let vendor = std::arch::x86_64::__cpuid(0);
        [vendor.ebx, vendor.edx, vendor.ecx]
            == [b"Genu", b"ineI", b"ntel"].map(|w| u32::from_le_bytes(*w))
    })
}

impl WideKernels {
    /// The wide tiles of `ty` at `tier` for activations in `passes`, if it has them: on
    /// AVX-512 VNNI, the K-quants but Q2_K, IQ4's, Q8_0, and Q4_0, Q4_1, Q5_0, Q5_1; on AVX2,
    /// Q5_K, and Q6_K with one pass. One pass asks for zero `lo` rows, as
    /// [`super::TileKernels::new`] says.
    pub(crate) fn new(ty: GgmlType, tier: Tier, passes: ActPasses) -> Option<Self> {
        match passes {
            ActPasses::One => Self::select::<false>(ty, tier),
            ActPasses::Two => Self::select::<true>(ty, tier),
            // Q8_0's 16-bit tiles are narrow: `super::Q16Tiles`.
            ActPasses::Q16 => None,
        }
    }

    /// [`Self::new`], `SPLIT` for two passes.
    fn select<const SPLIT: bool>(ty: GgmlType, tier: Tier) -> Option<Self> {
        // The types with two scales per sub-block keep four sums per row and pass: with two
        // passes six rows' 24 sums spill out of the 32 registers, with one they do not.
        let half_scaled_tile = if SPLIT { 5 } else { WIDE_TILE };
        #[cfg(target_arch = "x86_64")]
        if tier == Tier::Avx512Vnni {
            return match ty {
                GgmlType::Q4_0 => Some(wide_kernels!(WIDE_TILE, None, x86::q4_0_wide)),
                GgmlType::Q4_1 => Some(wide_kernels!(WIDE_TILE, None, x86::q4_1_wide)),
                GgmlType::Q5_0 => Some(wide_kernels!(WIDE_TILE, None, x86::q5_0_wide)),
                GgmlType::Q5_1 => Some(wide_kernels!(WIDE_TILE, None, x86::q5_1_wide)),
                GgmlType::Q8_0 => Some(wide_kernels!(WIDE_TILE, None, x86::q8_0_wide)),
                GgmlType::Q4K | GgmlType::Q5K => {
                    let unpack: UnpackFn = if ty == GgmlType::Q4K {
                        x86::unpack_k::<false>
                    } else {
                        x86::unpack_k::<true>
                    };
                    Some(if one_sum_per_row() {
                        wide_kernels!(WIDE_TILE, Some(unpack), x86::k_wide, true)
                    } else {
                        wide_kernels!(WIDE_TILE, Some(unpack), x86::k_wide, false)
                    })
                }
                GgmlType::Q6K => Some(wide_kernels!(
                    half_scaled_tile,
                    Some(x86::unpack_half_scaled::<false>),
                    x86::half_scaled_wide,
                    false
                )),
                GgmlType::Q3K => Some(wide_kernels!(
                    half_scaled_tile,
                    Some(x86::unpack_half_scaled::<true>),
                    x86::half_scaled_wide,
                    true
                )),
                GgmlType::Iq4Nl => Some(wide_kernels!(WIDE_TILE, None, x86::iq4_nl_wide)),
                GgmlType::Iq4Xs => Some(wide_kernels!(WIDE_TILE, None, x86::iq4_xs_wide)),
                _ => None,
            };
        }
        #[cfg(target_arch = "x86_64")]
        if tier == Tier::Avx2 {
            // Q4_K runs the same code (`FIFTH` false) no faster than its narrow tiles: its
            // chunks cost four instructions to form where Q5_K's cost ten.
            return match ty {
                GgmlType::Q5K => Some(WideKernels {
                    min_rows: AVX2_MIN_ROWS,
                    ..wide_kernels!(
                        super::TILE,
                        Some(avx2::unpack_k::<true>),
                        avx2::k_wide,
                        true
                    )
                }),
                // One pass only: two run the shared narrow tile, as in `TileKernels`.
                GgmlType::Q6K if !SPLIT => Some(WideKernels {
                    min_rows: AVX2_MIN_ROWS,
                    ..wide_kernels!(WIDE_TILE, Some(avx2::unpack_q6_k), avx2::q6_k_wide)
                }),
                _ => None,
            };
        }
        let _ = (ty, tier, half_scaled_tile);
        None
    }

    /// The fewest activation rows a product should have to take these kernels.
    pub(crate) fn min_rows(&self) -> usize {
        self.min_rows
    }

    /// The products of the two groups `w` with `rows` (a pass of activation rows, each as its
    /// `(hi, lo)` passes), up to `self.tile` rows a call, handed to `out` as (index in
    /// `rows`, sixteen outputs). The K-quants' groups are unpacked first, once for the pass.
    ///
    /// # Safety
    /// As [`WideFn`] for every row, `w` the two groups as stored (this function unpacks).
    ///
    /// # Panics
    /// If `rows` is empty.
    pub(crate) unsafe fn run_pass(
        &self,
        w: &[u8],
        rows: &[(&[ActBlock], &[ActBlock])],
        mut out: impl FnMut(usize, [f32; WIDE_ROWS]),
    ) {
        assert!(!rows.is_empty(), "a pass of no activation rows");
        let mut tiles = |w: &[u8]| {
            for (k, tile) in rows.chunks(self.tile).enumerate() {
                let first = k * self.tile;
                // SAFETY: `tile` is one to `self.tile` of `rows`, under the `WideFn` contract
                // this function's caller vouches for, `w` as the kernels take it.
                unsafe { self.run(w, tile, |i, y| out(first + i, y)) };
            }
        };
        let Some(unpack) = self.unpack else {
            return tiles(w);
        };
        UNPACKED.with_borrow_mut(|buffer| {
            let blocks = rows[0].0.len();
            if buffer.len() < blocks {
                buffer.resize(blocks, UnpackedSub::ZERO);
            }
            let subs = &mut buffer[..blocks];
            // SAFETY: the caller's contract: a CPU of the kernels' tier, and `w` two groups of this
            // type, each of the block columns that `blocks` activation blocks cover.
            unsafe { unpack(w, subs) };
            // SAFETY: `UnpackedSub` is bytes and f32 without padding (640 bytes): its memory
            // may be read as bytes, which the tiles read back as `UnpackedSub`s.
            let bytes = unsafe {
                std::slice::from_raw_parts(subs.as_ptr().cast::<u8>(), size_of_val(subs))
            };
            tiles(bytes)
        })
    }

    /// One call of the kernel for `rows.len()` rows (one to `self.tile`).
    ///
    /// # Safety
    /// As [`WideFn`] for every row.
    ///
    /// # Panics
    /// If `rows` is empty or longer than `self.tile`.
    #[inline]
    unsafe fn run(
        &self,
        w: &[u8],
        rows: &[(&[ActBlock], &[ActBlock])],
        mut out: impl FnMut(usize, [f32; WIDE_ROWS]),
    ) {
        assert!(
            rows.len() <= self.tile,
            "a wide tile of {} rows: at most {}",
            rows.len(),
            self.tile
        );
        // SAFETY: each arm calls the kernel for exactly `rows.len()` rows, under the `WideFn`
        // contract this function's caller vouches for every row.
        unsafe {
            match rows.len() {
                1 => call_tile(self.one, w, rows, &mut out),
                2 => call_tile(self.two, w, rows, &mut out),
                3 => call_tile(self.three, w, rows, &mut out),
                4 => call_tile(self.four, w, rows, &mut out),
                5 => call_tile(self.five, w, rows, &mut out),
                6 => call_tile(self.six, w, rows, &mut out),
                7 => call_tile(self.seven, w, rows, &mut out),
                8 => call_tile(self.eight, w, rows, &mut out),
                n => panic!("a wide tile of {n} rows: 1 to {WIDE_TILE} expected"),
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::mem::offset_of;

    use super::{UnpackedSub, WIDE_ROWS, WIDE_TILE, unpacked};
    use crate::act::ActBlock;
    use crate::ggml::IQ4_VALUES;
    use crate::interleaved::x86::{blocks_at, d_sum};
    use crate::interleaved::{
        IQ4_XS_BYTES, IQ4_XS_QUANTS, K_QUANTS, Q6_K_QUANTS, half_scaled_sizes, k_sizes, q_offset,
        q4_sizes,
    };

    /// Four activation bytes `4j..4j + 4` of `a` in every lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn broadcast(a: &ActBlock, j: usize) -> __m512i {
        let word = i32::from_le_bytes([
            a.qs[4 * j] as u8,
            a.qs[4 * j + 1] as u8,
            a.qs[4 * j + 2] as u8,
            a.qs[4 * j + 3] as u8,
        ]);
        _mm512_set1_epi32(word)
    }

    /// 32 bytes at `p` in the low half, 32 at `q` in the high half.
    ///
    /// # Safety
    /// 32 bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pair(p: *const u8, q: *const u8) -> __m512i {
        // SAFETY: the caller's contract: 32 readable bytes at each, the loads' width.
        unsafe {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(p.cast())),
                _mm256_loadu_si256(q.cast()),
            )
        }
    }

    /// Eight f16 at `p`, then eight at `q`, as f32.
    ///
    /// # Safety
    /// 16 bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn halves(p: *const u8, q: *const u8) -> __m512 {
        // SAFETY: the caller's contract: 16 readable bytes at each, the loads' width.
        let (a, b) = unsafe { (_mm_loadu_si128(p.cast()), _mm_loadu_si128(q.cast())) };
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
    }

    /// Eight bytes at `p`, then eight at `q`, as f32 (`SIGNED`: as `i8`, else as `u8`).
    ///
    /// # Safety
    /// Eight bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn byte_lanes<const SIGNED: bool>(p: *const u8, q: *const u8) -> __m512 {
        // SAFETY: the caller's contract: eight readable bytes at each, what `vmovq` loads.
        let bytes =
            unsafe { _mm_unpacklo_epi64(_mm_loadl_epi64(p.cast()), _mm_loadl_epi64(q.cast())) };
        if SIGNED {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
        } else {
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))
        }
    }

    /// `v × a.d` in every lane, the scale broadcast by the multiply itself (`{1to16}`).
    ///
    /// The one-pass float steps take an activation block's scalars this way: written as
    /// `_mm512_set1_ps`, LLVM loads a block's `d` and `d_sum` as one 64-bit value and splits
    /// and broadcasts them in three more shuffles per row, as many instructions as the row's
    /// float step itself (docs/kernels.md, item 6). The offset in the instruction spares the
    /// address arithmetic an `&a.d` operand would take per row.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn mul_by_scale(v: __m512, a: &ActBlock) -> __m512 {
        let out;
        // SAFETY: reads the four bytes of `a.d` inside `*a`, a valid reference; writes only
        // `out`.
        unsafe {
            asm!(
                "vmulps {out}, {v}, dword ptr [{a} + {d}]{{1to16}}",
                out = lateout(zmm_reg) out,
                v = in(zmm_reg) v,
                a = in(reg) a,
                d = const offset_of!(ActBlock, d),
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        out
    }

    /// `a.q6_k_starts[HALF]` in every lane, by one `vpbroadcastd` from memory: a load, where
    /// `_mm512_set1_epi32` of the computed `−32 × Σ` broadcasts from a general register, a
    /// vector µop of its own (port 5 on Intel, beside the `vpdpbusd`s), two per activation
    /// row and sub-block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn q6_k_start<const HALF: usize>(a: &ActBlock) -> __m512i {
        const { assert!(HALF < 2) };
        let out;
        // SAFETY: reads the four bytes of `a.q6_k_starts[HALF]` (`HALF < 2`, asserted above)
        // inside `*a`, a valid reference; writes only `out`.
        unsafe {
            asm!(
                "vpbroadcastd {out}, dword ptr [{a} + {start}]",
                out = lateout(zmm_reg) out,
                a = in(reg) a,
                start = const offset_of!(ActBlock, q6_k_starts) + 4 * HALF,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        out
    }

    /// `acc − v × a.d_sum` in every lane, in one `vfnmadd231ps` that broadcasts `d_sum`
    /// itself as [`mul_by_scale`] does: the bits of `_mm512_fnmadd_ps(v, set1(d_sum), acc)`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sub_min_times_sum(acc: __m512, v: __m512, a: &ActBlock) -> __m512 {
        let mut acc = acc;
        // SAFETY: reads the four bytes of `a.d_sum` inside `*a`, a valid reference; writes
        // only `acc`.
        unsafe {
            asm!(
                "vfnmadd231ps {acc}, {v}, dword ptr [{a} + {d_sum}]{{1to16}}",
                acc = inout(zmm_reg) acc,
                v = in(zmm_reg) v,
                a = in(reg) a,
                d_sum = const offset_of!(ActBlock, d_sum),
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        acc
    }

    /// `acc + d_a × (scales[0] × first + scales[1] × second)` per row lane, in one
    /// `vfmadd231ps` that broadcasts `a.d` itself ([`mul_by_scale`]): the 256-bit tiles'
    /// `one_pass_halves`, operation for operation.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn one_pass_halves(
        acc: __m512,
        scales: [__m512; 2],
        first: __m512i,
        second: __m512i,
        a: &ActBlock,
    ) -> __m512 {
        let halves = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(second),
            scales[1],
            _mm512_mul_ps(_mm512_cvtepi32_ps(first), scales[0]),
        );
        let mut acc = acc;
        // SAFETY: reads the four bytes of `a.d` inside `*a`, a valid reference; writes only
        // `acc`.
        unsafe {
            asm!(
                "vfmadd231ps {acc}, {halves}, dword ptr [{a} + {d}]{{1to16}}",
                acc = inout(zmm_reg) acc,
                halves = in(zmm_reg) halves,
                a = in(reg) a,
                d = const offset_of!(ActBlock, d),
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        acc
    }

    /// `acc + d_w × (d_hi × sum_h + d_lo × sum_l)` per row lane (`SPLIT`; without it
    /// `acc + d_w × d_hi × sum_h`): the 256-bit tiles' `add_sums`, operation for operation.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn add_sums<const SPLIT: bool>(
        acc: __m512,
        d: __m512,
        sum_h: __m512i,
        sum_l: __m512i,
        h: &ActBlock,
        l: &ActBlock,
    ) -> __m512 {
        let high = _mm512_cvtepi32_ps(sum_h);
        let scaled = if SPLIT {
            _mm512_fmadd_ps(
                high,
                _mm512_set1_ps(h.d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(sum_l), _mm512_set1_ps(l.d)),
            )
        } else {
            mul_by_scale(high, h)
        };
        _mm512_fmadd_ps(d, scaled, acc)
    }

    /// The sixteen lanes of each activation row's sums: a tile's outputs.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store<const N: usize>(rows: [__m512; N]) -> [[f32; WIDE_ROWS]; N] {
        let mut out = [[0f32; WIDE_ROWS]; N];
        for (out, v) in out.iter_mut().zip(rows) {
            // SAFETY: `out` is sixteen f32, the unaligned store's width.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
        }
        out
    }

    /// The partial sums per activation row and pass: `vpdpbusd` takes four cycles and
    /// issues two a cycle, so a tile needs eight to ten independent sums in flight; with
    /// five or more rows in two passes one per row and pass is enough (and more would not
    /// fit the 32 registers), in one pass (`split` false) two per row.
    const fn parts(n: usize, split: bool) -> usize {
        match (n, split) {
            (1, _) => 4,
            (2..=4, _) | (_, false) => 2,
            _ => 1,
        }
    }

    /// The fifth bits of chunk `j` moved to bit 4 (the 256-bit tiles' `fifth_bits_at_4`),
    /// the other bits of each byte left as the shifts leave them: [`or_masked`] takes bit 4.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn fifth_bits_near_4(bits: __m512i, j: usize) -> (__m512i, __m512i) {
        match j {
            0 => (_mm512_slli_epi16(bits, 4), _mm512_slli_epi16(bits, 3)),
            1 => (_mm512_slli_epi16(bits, 2), _mm512_slli_epi16(bits, 1)),
            2 => (bits, _mm512_srli_epi16(bits, 1)),
            _ => (_mm512_srli_epi16(bits, 2), _mm512_srli_epi16(bits, 3)),
        }
    }

    /// `a | (b & mask)` in one `vpternlogd` (truth table 0xF8: `a`, or `b` and `mask`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn or_masked(a: __m512i, b: __m512i, mask: __m512i) -> __m512i {
        _mm512_ternarylogic_epi32::<0xF8>(a, b, mask)
    }

    /// Chunk `j` of a 32-value block added to each activation row's partial sums: `low`
    /// (sixteen weight rows' values `4 j .. 4 j + 4`) times the row's activation bytes
    /// `4 j .. 4 j + 4`, `high` (values `16 + 4 j ..`) times bytes `16 + 4 j ..`, into partial
    /// sums `2 j` and `2 j + 1` modulo `parts` (one to four: [`parts`], a constant once
    /// inlined); with `SPLIT` the `lo` pass's as well.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    fn add_chunk<const N: usize, const SPLIT: bool>(
        sh: &mut [[__m512i; 4]; N],
        sl: &mut [[__m512i; 4]; N],
        j: usize,
        low: __m512i,
        high: __m512i,
        h: [&ActBlock; N],
        l: [&ActBlock; N],
        parts: usize,
    ) {
        debug_assert!((1..=4).contains(&parts));
        let (k_low, k_high) = ((2 * j) % parts, (2 * j + 1) % parts);
        for i in 0..N {
            sh[i][k_low] = _mm512_dpbusd_epi32(sh[i][k_low], low, broadcast(h[i], j));
            sh[i][k_high] = _mm512_dpbusd_epi32(sh[i][k_high], high, broadcast(h[i], 4 + j));
            if SPLIT {
                sl[i][k_low] = _mm512_dpbusd_epi32(sl[i][k_low], low, broadcast(l[i], j));
                sl[i][k_high] = _mm512_dpbusd_epi32(sl[i][k_high], high, broadcast(l[i], 4 + j));
            }
        }
    }

    // The kernels below run under the `WideFn` contract: `w` is two groups of `w.len() / 2`
    // bytes, each holding exactly the block columns that `blocks = hi[0].len()` activation
    // blocks cover, so column `c < blocks / 8` of either group starts `bytes × c` into it and
    // ends inside it.

    /// The fifth bits of a Q5-ordered block of each group (the 32 bytes after the 128 of
    /// nibbles at `p` and `q`), for [`nibble_chunk`]; without `FIFTH`, zeros it ignores.
    ///
    /// # Safety
    /// With `FIFTH`, 160 bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fifth_bits<const FIFTH: bool>(p: *const u8, q: *const u8) -> __m512i {
        if FIFTH {
            // SAFETY: with `FIFTH` the caller vouches for 160 bytes: the fifth bits are the
            // last 32.
            unsafe { pair(p.add(128), q.add(128)) }
        } else {
            _mm512_setzero_si512()
        }
    }

    /// Chunk `j < 4` of a Q4_1-ordered block of nibbles of each group (at `p` and `q`: four
    /// chunks of 32 bytes), with `FIFTH` its fifth bits from `fifth_bits`, as the registers
    /// [`add_chunk`] multiplies: the values `4 j .. 4 j + 4` of the sixteen rows (the low
    /// nibbles), then values `16 + 4 j ..` (the high).
    ///
    /// # Safety
    /// 128 bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn nibble_chunk<const FIFTH: bool>(
        p: *const u8,
        q: *const u8,
        fifth_bits: __m512i,
        j: usize,
    ) -> [__m512i; 2] {
        debug_assert!(j < 4);
        let mask = _mm512_set1_epi8(0x0F);
        // SAFETY: `j < 4`: chunk `j` is bytes `32 j .. 32 j + 32` of the 128 at each.
        let raw = unsafe { pair(p.add(32 * j), q.add(32 * j)) };
        let low = _mm512_and_si512(raw, mask);
        let high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        if !FIFTH {
            return [low, high];
        }
        let (first, second) = fifth_bits_near_4(fifth_bits, j);
        let bit = _mm512_set1_epi8(0x10);
        [or_masked(low, first, bit), or_masked(high, second, bit)]
    }

    /// The integer sums of `N` two-pass activation rows with a Q4_1-ordered block of nibbles
    /// of each group (at `p` and `q`: four chunks of 32 bytes), with `FIFTH` the fifth bits
    /// after them: per row, the `hi` and the `lo` pass's, sixteen lanes. Each chunk pair is
    /// unpacked once for all the rows.
    ///
    /// # Safety
    /// 128 bytes at `p` and at `q` must be readable, 160 with `FIFTH`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn nibble_sums<const N: usize, const FIFTH: bool, const SPLIT: bool>(
        p: *const u8,
        q: *const u8,
        h: [&ActBlock; N],
        l: [&ActBlock; N],
    ) -> [(__m512i, __m512i); N] {
        // SAFETY: the caller vouches for the bytes both read.
        let fifth_bits = unsafe { fifth_bits::<FIFTH>(p, q) };
        let mut sh = [[_mm512_setzero_si512(); 4]; N];
        let mut sl = [[_mm512_setzero_si512(); 4]; N];
        for j in 0..4 {
            // SAFETY: as above; `j < 4`.
            let [low, high] = unsafe { nibble_chunk::<FIFTH>(p, q, fifth_bits, j) };
            add_chunk::<N, SPLIT>(&mut sh, &mut sl, j, low, high, h, l, parts(N, SPLIT));
        }
        std::array::from_fn(|i| (total(sh[i]), total(sl[i])))
    }

    /// Sixteen Q4_0 rows × `N` two-pass activation rows ([`super::WideFn`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q4_0_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        // SAFETY: this function's `WideFn` contract is `q4_wide`'s for Q4_0.
        unsafe { q4_wide::<N, false, false, SPLIT>(w, hi, lo) }
    }

    /// Sixteen Q4_1 rows × `N` two-pass activation rows ([`super::WideFn`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q4_1_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        // SAFETY: this function's `WideFn` contract is `q4_wide`'s for Q4_1.
        unsafe { q4_wide::<N, true, false, SPLIT>(w, hi, lo) }
    }

    /// Sixteen Q5_0 rows × `N` two-pass activation rows ([`super::WideFn`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q5_0_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        // SAFETY: this function's `WideFn` contract is `q4_wide`'s for Q5_0.
        unsafe { q4_wide::<N, false, true, SPLIT>(w, hi, lo) }
    }

    /// Sixteen Q5_1 rows × `N` two-pass activation rows ([`super::WideFn`]).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q5_1_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        // SAFETY: this function's `WideFn` contract is `q4_wide`'s for Q5_1.
        unsafe { q4_wide::<N, true, true, SPLIT>(w, hi, lo) }
    }

    /// Sixteen Q4_0 (`MIN` false: the minimum is `-8 d`), Q4_1, Q5_0 (`FIFTH`, minimum
    /// `-16 d`) or Q5_1 rows × `N` two-pass activation rows: the 256-bit tile's `q4_tile` on
    /// both groups at once.
    ///
    /// # Safety
    /// As [`super::WideFn`], for the type the parameters name.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q4_wide<const N: usize, const MIN: bool, const FIFTH: bool, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        let (bytes, quants) = q4_sizes(MIN, FIFTH);
        let group_bytes = w.len() / 2;
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(group_bytes, blocks * bytes);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut mins = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: column `b < blocks` of `bytes` lies in each group.
            let (p, q) = unsafe {
                let p = w.as_ptr().add(bytes * b);
                (p, p.add(group_bytes))
            };
            // SAFETY: `b < blocks`, every row's length (the `WideFn` contract).
            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
            // SAFETY: from `quants` to its end each column holds the 128 bytes of nibbles
            // (and with `FIFTH` the 32 of fifth bits) `nibble_sums` reads.
            let sums =
                unsafe { nibble_sums::<N, FIFTH, SPLIT>(p.add(quants), q.add(quants), h, l) };
            // SAFETY: each column's first 16 bytes are the eight f16 `d`.
            let d = unsafe { halves(p, q) };
            let m = if MIN {
                // SAFETY: with `MIN` bytes 16-31 of each column are the minimums.
                unsafe { halves(p.add(16), q.add(16)) }
            } else {
                _mm512_mul_ps(d, _mm512_set1_ps(-q_offset(FIFTH)))
            };
            for i in 0..N {
                let (sum_h, sum_l) = sums[i];
                acc[i] = add_sums::<SPLIT>(acc[i], d, sum_h, sum_l, h[i], l[i]);
                mins[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(d_sum::<SPLIT>(h[i], l[i])), mins[i]);
            }
        }
        store(std::array::from_fn(|i| _mm512_add_ps(acc[i], mins[i])))
    }

    /// IQ4's table values plus 128, as unsigned bytes (1 to 241): `vpdpbusd` multiplies an
    /// unsigned byte by a signed one, so the wide IQ4 tiles look indices up in this table
    /// and start each sum at `−128 × Σ a`, as Q8_0's do (the narrow tiles' sign trick would
    /// cost an instruction per row and chunk).
    const IQ4_PLUS_128: [u8; 16] = {
        let mut table = [0u8; 16];
        let mut e = 0;
        while e < 16 {
            table[e] = (IQ4_VALUES[e] as i16 + 128) as u8;
            e += 1;
        }
        table
    };

    /// The integer sums of `N` two-pass activation rows with a Q4_0-ordered block of IQ4
    /// indices of each group (at `p` and `q`: four chunks of 32 bytes), as
    /// [`nibble_sums`]' but with each index looked up in [`IQ4_PLUS_128`] (one `vpshufb` per
    /// half-chunk, once for all the rows) and each sum started at `−128 × Σ a`: the exact
    /// sums of the table values with the activations, as the narrow tiles form them.
    ///
    /// # Safety
    /// 128 bytes at `p` and at `q` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn iq4_sums<const N: usize, const SPLIT: bool>(
        p: *const u8,
        q: *const u8,
        h: [&ActBlock; N],
        l: [&ActBlock; N],
    ) -> [(__m512i, __m512i); N] {
        let mask = _mm512_set1_epi8(0x0F);
        // SAFETY: `IQ4_PLUS_128` is 16 bytes, the load's width.
        let table =
            _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(IQ4_PLUS_128.as_ptr().cast()) });
        let start = |a: &ActBlock| {
            let mut s = [_mm512_setzero_si512(); 4];
            s[0] = _mm512_set1_epi32(-(a.sum << 7));
            s
        };
        let mut sh: [[__m512i; 4]; N] = std::array::from_fn(|i| start(h[i]));
        let mut sl: [[__m512i; 4]; N] = std::array::from_fn(|i| {
            if SPLIT {
                start(l[i])
            } else {
                [_mm512_setzero_si512(); 4]
            }
        });
        for j in 0..4 {
            // SAFETY: `j < 4`: chunk `j` is bytes `32 j .. 32 j + 32` of the 128 at each.
            let raw = unsafe { pair(p.add(32 * j), q.add(32 * j)) };
            let low = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, mask));
            let high =
                _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
            add_chunk::<N, SPLIT>(&mut sh, &mut sl, j, low, high, h, l, parts(N, SPLIT));
        }
        std::array::from_fn(|i| (total(sh[i]), total(sl[i])))
    }

    /// Sixteen IQ4_NL rows × `N` two-pass activation rows ([`super::WideFn`]): Q4_0's layout,
    /// the indices looked up in [`IQ4_PLUS_128`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn iq4_nl_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        let (bytes, quants) = q4_sizes(false, false);
        let group_bytes = w.len() / 2;
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(group_bytes, blocks * bytes);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: column `b < blocks` of `bytes` lies in each group.
            let (p, q) = unsafe {
                let p = w.as_ptr().add(bytes * b);
                (p, p.add(group_bytes))
            };
            // SAFETY: `b < blocks`, every row's length (the `WideFn` contract).
            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
            // SAFETY: from `quants` to its end each column holds the 128 bytes of indices.
            let sums = unsafe { iq4_sums::<N, SPLIT>(p.add(quants), q.add(quants), h, l) };
            // SAFETY: each column's first 16 bytes are the eight f16 `d`.
            let d = unsafe { halves(p, q) };
            for i in 0..N {
                let (sum_h, sum_l) = sums[i];
                acc[i] = add_sums::<SPLIT>(acc[i], d, sum_h, sum_l, h[i], l[i]);
            }
        }
        store(acc)
    }

    /// Sixteen IQ4_XS rows × `N` two-pass activation rows ([`super::WideFn`]): IQ4_NL's
    /// integer work per sub-block, scaled by `d × scale` as the narrow tile does.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn iq4_xs_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        let group_bytes = w.len() / 2;
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(group_bytes, blocks / 8 * IQ4_XS_BYTES);
        let mut acc = [_mm512_setzero_ps(); N];
        for c in 0..blocks / 8 {
            // SAFETY: column `c < blocks / 8` lies in each group; its first 16 bytes are the
            // eight f16 `d`.
            let (p, q, d) = unsafe {
                let p = w.as_ptr().add(IQ4_XS_BYTES * c);
                let q = p.add(group_bytes);
                (p, q, halves(p, q))
            };
            for s in 0..8 {
                let b = 8 * c + s;
                // SAFETY: `b = 8 c + s < blocks`, every row's length (the `WideFn` contract).
                let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                // SAFETY: `s < 8`: sub-block `s`'s 128 bytes of indices at
                // `IQ4_XS_QUANTS + 128 s` end by the column's end in each group, and its
                // eight scales at `16 + 8 s` lie before `IQ4_XS_QUANTS` (16 + 64).
                let (sums, scales) = unsafe {
                    let offset = IQ4_XS_QUANTS + 128 * s;
                    (
                        iq4_sums::<N, SPLIT>(p.add(offset), q.add(offset), h, l),
                        byte_lanes::<true>(p.add(16 + 8 * s), q.add(16 + 8 * s)),
                    )
                };
                let scale = _mm512_mul_ps(d, scales);
                for i in 0..N {
                    let (sum_h, sum_l) = sums[i];
                    acc[i] = add_sums::<SPLIT>(acc[i], scale, sum_h, sum_l, h[i], l[i]);
                }
            }
        }
        store(acc)
    }

    /// Sixteen Q8_0 rows × `N` two-pass activation rows ([`super::WideFn`]): the 256-bit
    /// VNNI tile on both groups at once. The stored quants are `q + 128`; each row's sums
    /// start at `−128 × Σ a` instead of having it taken off after (integers: the same sums).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn q8_0_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        const BYTES: usize = 2 * 8 + 256;
        let parts = parts(N, SPLIT);
        let group_bytes = w.len() / 2;
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(group_bytes, blocks * BYTES);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            // SAFETY: column `b < blocks` (272 bytes: eight f16 `d`, eight chunks of 32
            // quants) lies in each group.
            let (p, q) = unsafe {
                let p = w.as_ptr().add(BYTES * b);
                (p, p.add(group_bytes))
            };
            // SAFETY: `b < blocks`, every row's length (the `WideFn` contract).
            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
            let start = |a: &ActBlock| _mm512_set1_epi32(-(a.sum << 7));
            let mut sh: [[__m512i; 4]; N] = std::array::from_fn(|i| {
                let mut s = [_mm512_setzero_si512(); 4];
                s[0] = start(h[i]);
                s
            });
            let mut sl: [[__m512i; 4]; N] = std::array::from_fn(|i| {
                let mut s = [_mm512_setzero_si512(); 4];
                s[0] = start(l[i]);
                s
            });
            for j in 0..8 {
                // SAFETY: `j < 8`: chunk `16 + 32 j ..` ends by byte 271 of each column.
                let quants = unsafe { pair(p.add(16 + 32 * j), q.add(16 + 32 * j)) };
                let k = j % parts;
                for i in 0..N {
                    sh[i][k] = _mm512_dpbusd_epi32(sh[i][k], quants, broadcast(h[i], j));
                    if SPLIT {
                        sl[i][k] = _mm512_dpbusd_epi32(sl[i][k], quants, broadcast(l[i], j));
                    }
                }
            }
            // SAFETY: each column's first 16 bytes are the eight f16 `d`.
            let d = unsafe { halves(p, q) };
            for i in 0..N {
                acc[i] = add_sums::<SPLIT>(acc[i], d, total(sh[i]), total(sl[i]), h[i], l[i]);
            }
        }
        store(acc)
    }

    /// The eight registers of one K-quant sub-block of each group ([`UnpackedSub::values`]'
    /// layout), loaded from an unpacked sub-block.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn values(sub: &UnpackedSub, j: usize) -> [__m512i; 2] {
        // SAFETY: each register is 64 bytes of `sub` at a multiple of 64 from its start, and
        // `UnpackedSub` is 64-aligned: the aligned load's width and alignment.
        [0, 1].map(|k| unsafe { _mm512_load_si512(sub.values[j][k].as_ptr().cast()) })
    }

    /// The two scale registers of an unpacked sub-block ([`UnpackedSub::scales`]).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn scale_lanes(sub: &UnpackedSub) -> [__m512; 2] {
        // SAFETY: as in `values`: 64 aligned bytes of `sub` each.
        [0, 1].map(|k| unsafe { _mm512_load_ps(sub.scales[k].as_ptr()) })
    }

    /// Stores one sub-block's registers and scales, unpacked.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store_unpacked(sub: &mut UnpackedSub, values: [[__m512i; 2]; 4], scales: [__m512; 2]) {
        for (out, registers) in sub.values.iter_mut().zip(values) {
            for (out, v) in out.iter_mut().zip(registers) {
                // SAFETY: 64 bytes of `sub` at a multiple of 64 from its 64-aligned start.
                unsafe { _mm512_store_si512(out.as_mut_ptr().cast(), v) };
            }
        }
        for (out, v) in sub.scales.iter_mut().zip(scales) {
            // SAFETY: as above: sixteen aligned f32.
            unsafe { _mm512_store_ps(out.as_mut_ptr(), v) };
        }
    }

    /// Two groups of Q4_K (`FIFTH` false) or Q5_K unpacked ([`super::UnpackFn`]): each
    /// sub-block's chunks as [`nibble_chunk`] forms them, its `d × scale` and `dmin × min`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn unpack_k<const FIFTH: bool>(w: &[u8], out: &mut [UnpackedSub]) {
        let (column_bytes, sub_bytes) = k_sizes(FIFTH);
        let group_bytes = w.len() / 2;
        debug_assert_eq!(group_bytes, out.len() / 8 * column_bytes);
        for (c, column) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: column `c < out.len() / 8` lies in each group (the `UnpackFn` contract);
            // its first 32 bytes are the eight f16 `d`, then the eight `dmin`.
            let (p, q, d, dmin) = unsafe {
                let p = w.as_ptr().add(column_bytes * c);
                let q = p.add(group_bytes);
                (p, q, halves(p, q), halves(p.add(16), q.add(16)))
            };
            for (s, sub) in column.iter_mut().enumerate() {
                // SAFETY: `s < 8`: sub-block `s` (`sub_bytes`: 128 of nibbles, with `FIFTH` 32
                // of fifth bits) at `K_QUANTS + sub_bytes s` ends by the column's end in each
                // group; the eight scales at `32 + 8 s` and minimums at `96 + 8 s` lie before
                // `K_QUANTS` (32 + 64 + 64).
                let (sp, sq, scales, mins) = unsafe {
                    let offset = K_QUANTS + sub_bytes * s;
                    (
                        p.add(offset),
                        q.add(offset),
                        byte_lanes::<false>(p.add(32 + 8 * s), q.add(32 + 8 * s)),
                        byte_lanes::<false>(p.add(96 + 8 * s), q.add(96 + 8 * s)),
                    )
                };
                // SAFETY: as above: the sub-block's bytes lie in each group.
                let fifth_bits = unsafe { fifth_bits::<FIFTH>(sp, sq) };
                // SAFETY: as above; `j < 4`.
                let values = std::array::from_fn(|j| unsafe {
                    nibble_chunk::<FIFTH>(sp, sq, fifth_bits, j)
                });
                let scales = [_mm512_mul_ps(d, scales), _mm512_mul_ps(dmin, mins)];
                store_unpacked(sub, values, scales);
            }
        }
    }

    /// Sixteen Q4_K or Q5_K rows, unpacked ([`unpack_k`]), × `N` two-pass activation rows
    /// ([`super::WideFn`]): the 256-bit tile's `k_tile` on both groups at once. With
    /// `ONE_SUM` eight one-pass rows keep one integer sum each, not two
    /// ([`super::one_sum_per_row`]); the sums are exact either way, so are the bits.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn k_wide<const N: usize, const ONE_SUM: bool, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        // SAFETY: the `WideFn` contract of an unpacked type: `w` is its sub-blocks' bytes.
        let subs = unsafe { unpacked(w) };
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(subs.len(), blocks);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut mins = [_mm512_setzero_ps(); N];
        for (b, sub) in subs.iter().enumerate() {
            // SAFETY: `b < subs.len() = blocks`, every row's length (the `WideFn` contract).
            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
            let mut sh = [[_mm512_setzero_si512(); 4]; N];
            let mut sl = [[_mm512_setzero_si512(); 4]; N];
            let parts = if ONE_SUM && N == WIDE_TILE && !SPLIT {
                1
            } else {
                parts(N, SPLIT)
            };
            for j in 0..4 {
                let [low, high] = values(sub, j);
                add_chunk::<N, SPLIT>(&mut sh, &mut sl, j, low, high, h, l, parts);
            }
            let [scale, min] = scale_lanes(sub);
            for i in 0..N {
                let (sum_h, sum_l) = (total(sh[i]), total(sl[i]));
                acc[i] = add_sums::<SPLIT>(acc[i], scale, sum_h, sum_l, h[i], l[i]);
                if SPLIT {
                    let d_sum = _mm512_set1_ps(d_sum::<SPLIT>(h[i], l[i]));
                    mins[i] = _mm512_fmadd_ps(min, d_sum, mins[i]);
                } else {
                    // The narrow tile's order: the minimums come off as they go.
                    acc[i] = sub_min_times_sum(acc[i], min, h[i]);
                }
            }
        }
        store(std::array::from_fn(|i| _mm512_sub_ps(acc[i], mins[i])))
    }

    /// The sum of a row's partial sums (the unused ones are zero, and vanish when compiled).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn total([a, b, c, d]: [__m512i; 4]) -> __m512i {
        _mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d))
    }

    /// Two groups of Q6_K (`Q3` false) or Q3_K unpacked ([`super::UnpackFn`]): each
    /// sub-block's chunks, the values of its first half then of its second, as `q + offset`
    /// (unsigned bytes), and `d ×` each half's scale.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn unpack_half_scaled<const Q3: bool>(w: &[u8], out: &mut [UnpackedSub]) {
        let (column_bytes, sub_bytes, _) = half_scaled_sizes(Q3);
        let group_bytes = w.len() / 2;
        debug_assert_eq!(group_bytes, out.len() / 8 * column_bytes);
        let mask = _mm512_set1_epi8(0x0F);
        let top = _mm512_set1_epi8(0x30);
        for (c, column) in out.chunks_exact_mut(8).enumerate() {
            // SAFETY: column `c < out.len() / 8` lies in each group (the `UnpackFn` contract);
            // its first 16 bytes are the eight f16 `d`.
            let (p, q, d) = unsafe {
                let p = w.as_ptr().add(column_bytes * c);
                let q = p.add(group_bytes);
                (p, q, halves(p, q))
            };
            for (s, sub) in column.iter_mut().enumerate() {
                // SAFETY: `s < 8`: sub-block `s` (`sub_bytes`) at `Q6_K_QUANTS + sub_bytes s`
                // ends by the column's end in each group.
                let (sp, sq) = unsafe {
                    (
                        p.add(Q6_K_QUANTS + sub_bytes * s),
                        q.add(Q6_K_QUANTS + sub_bytes * s),
                    )
                };
                let values = std::array::from_fn(|j| {
                    // SAFETY: `j < 4`: the chunk `32 j ..` lies in each sub-block's first 128
                    // bytes, its nibbles.
                    let raw = unsafe { pair(sp.add(32 * j), sq.add(32 * j)) };
                    let first = _mm512_and_si512(raw, mask);
                    let second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
                    if Q3 {
                        return [first, second];
                    }
                    // SAFETY: Q6_K's sub-block is 192 bytes; with `j < 4` the high bits
                    // `128 + 32 (j / 2) ..` end by its byte 191, in each group.
                    let bits =
                        unsafe { pair(sp.add(128 + 32 * (j / 2)), sq.add(128 + 32 * (j / 2))) };
                    // Bits 4k and 4k + 2 of `bits` (k = j % 2) moved to bit 4.
                    let (high_first, high_second) = if j % 2 == 0 {
                        (_mm512_slli_epi16(bits, 4), _mm512_slli_epi16(bits, 2))
                    } else {
                        (bits, _mm512_srli_epi16(bits, 2))
                    };
                    [
                        or_masked(first, high_first, top),
                        or_masked(second, high_second, top),
                    ]
                });
                let scales = [0, 1].map(|half| {
                    let at = 16 + 8 * (2 * s + half);
                    // SAFETY: `s < 8`: the scales of halves `2 s` and `2 s + 1` (eight bytes
                    // each at `16 + 8 (2 s + half)`) lie in bytes 16-143 of each group's
                    // column, before `Q6_K_QUANTS`.
                    _mm512_mul_ps(d, unsafe { byte_lanes::<true>(p.add(at), q.add(at)) })
                });
                store_unpacked(sub, values, scales);
            }
        }
    }

    /// Sixteen Q6_K (`Q3` false) or Q3_K rows, unpacked ([`unpack_half_scaled`]), × `N`
    /// two-pass activation rows ([`super::WideFn`]): the 256-bit tile's `half_scaled_tile` on
    /// both groups at once. Each half's sums start at `−offset × Σ a` over the half instead
    /// of having it taken off after (integers: the same sums).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn half_scaled_wide<const N: usize, const Q3: bool, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        const { assert!(N >= 1 && N <= WIDE_TILE) };
        let (_, _, offset) = half_scaled_sizes(Q3);
        // SAFETY: the `WideFn` contract of an unpacked type: `w` is its sub-blocks' bytes.
        let subs = unsafe { unpacked(w) };
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(subs.len(), blocks);
        let mut acc = [_mm512_setzero_ps(); N];
        for (b, sub) in subs.iter().enumerate() {
            // SAFETY: `b < subs.len() = blocks`, every row's length (the `WideFn` contract).
            let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
            // Each half's sum starts at `−offset × Σ a`: Q6_K's from memory, Q3_K's formed
            // here.
            let starts = |a: &ActBlock| {
                if Q3 {
                    [0, 1].map(|half| _mm512_set1_epi32(-offset * a.half_sum(half)))
                } else {
                    [q6_k_start::<0>(a), q6_k_start::<1>(a)]
                }
            };
            // Per row: [first half, second half] of the hi pass, then the lo's.
            let mut sums: [[__m512i; 4]; N] = std::array::from_fn(|i| {
                let ([first_h, second_h], [first_l, second_l]) = (starts(h[i]), starts(l[i]));
                [first_h, second_h, first_l, second_l]
            });
            for j in 0..4 {
                let [first, second] = values(sub, j);
                for i in 0..N {
                    let [f_h, s_h, f_l, s_l] = &mut sums[i];
                    *f_h = _mm512_dpbusd_epi32(*f_h, first, broadcast(h[i], j));
                    *s_h = _mm512_dpbusd_epi32(*s_h, second, broadcast(h[i], 4 + j));
                    if SPLIT {
                        *f_l = _mm512_dpbusd_epi32(*f_l, first, broadcast(l[i], j));
                        *s_l = _mm512_dpbusd_epi32(*s_l, second, broadcast(l[i], 4 + j));
                    }
                }
            }
            let scales = scale_lanes(sub);
            for i in 0..N {
                let [f_h, s_h, f_l, s_l] = sums[i];
                if SPLIT {
                    acc[i] = add_sums::<SPLIT>(acc[i], scales[0], f_h, f_l, h[i], l[i]);
                    acc[i] = add_sums::<SPLIT>(acc[i], scales[1], s_h, s_l, h[i], l[i]);
                } else {
                    acc[i] = one_pass_halves(acc[i], scales, f_h, s_h, h[i]);
                }
            }
        }
        store(acc)
    }
}

/// The AVX2 tier's wide tiles: Q5_K rows unpacked once per pass of activation rows into
/// [`UnpackedSub`]s (the layout the VNNI tiles read, each group in one half of a register's
/// bytes), and each group's eight rows then multiplied as the narrow tile does, its chunks
/// loaded instead of formed from nibbles and fifth bits. The AVX2 tiles issue about three
/// vector instructions a cycle whatever the mix, and forming a Q5_K chunk takes ten of them
/// for every tile of up to four activation rows; a load takes one, and the unpacking is paid
/// once for the pass's 32 rows (docs/kernels.md, item 9). The code takes Q4_K too (`FIFTH`
/// false), whose chunks cost four instructions to form; it measured no faster there.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{UnpackedSub, WIDE_ROWS, unpacked};
    use crate::act::ActBlock;
    use crate::interleaved::x86::{
        add_sums, avx2_parts, blocks_at, broadcast, d_sum_lanes, dot_avx2_i16, fifth_bits_at_4,
        halves, i16_fit, q6_k_one_pass, store, u8_lanes, widen_avx2,
    };
    use crate::interleaved::{GROUP, K_QUANTS, Q6_K_BYTES, k_sizes};

    // The steps below repeat the narrow AVX2 tile's (`nibble_sums` and the float steps of
    // `k_tile` in interleaved.rs) instruction for instruction, which is what makes the bits
    // the same. The narrow tile does not call them: written as shared functions, the narrow
    // one-pass Q5_K tile compiled to code 1-7 % slower (docs/kernels.md, item 9).

    /// Chunk `j`'s values of a Q4_1-ordered block of nibbles of eight rows at `p`, with
    /// `FIFTH` the Q5_K fifth bits `fifth_bits` joined as bit 4: the values that activation
    /// bytes `4 j .. 4 j + 4` multiply (the low nibbles), then those that bytes `16 + 4 j ..`
    /// multiply.
    ///
    /// # Safety
    /// The CPU must support AVX2; `j < 4`, and the 32 bytes at `p + 32 j` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibble_chunk<const FIFTH: bool>(
        p: *const u8,
        fifth_bits: __m256i,
        j: usize,
    ) -> [__m256i; 2] {
        let mask = _mm256_set1_epi8(0x0F);
        // SAFETY: the caller's contract: 32 readable bytes at `p + 32 j`.
        let raw = unsafe { _mm256_loadu_si256(p.add(32 * j).cast()) };
        let mut low = _mm256_and_si256(raw, mask);
        let mut high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        if FIFTH {
            let (first, second) = fifth_bits_at_4(fifth_bits, j);
            low = _mm256_or_si256(low, first);
            high = _mm256_or_si256(high, second);
        }
        [low, high]
    }

    /// The 16-bit partial sums per row and pass that a sub-block's eight chunk products
    /// take for Q4_K (`FIFTH` false) or Q5_K, as the narrow tile splits them.
    const fn k_parts<const FIFTH: bool>() -> usize {
        avx2_parts(0, i16_fit(if FIFTH { 31 } else { 15 }))
    }

    /// Adds chunk `j`'s products to `N` rows' sums: `low` times activation bytes `4 j ..` of
    /// each `hi` row (and of its `lo` row with `SPLIT`), `high` times bytes `16 + 4 j ..`,
    /// into partial sums `2 j % parts` and `(2 j + 1) % parts` of `parts` per row and pass.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn add_chunk<const N: usize, const SPLIT: bool>(
        sh: &mut [[__m256i; 4]; N],
        sl: &mut [[__m256i; 4]; N],
        j: usize,
        [low, high]: [__m256i; 2],
        h: [&ActBlock; N],
        l: [&ActBlock; N],
        parts: usize,
    ) {
        let (k_low, k_high) = ((2 * j) % parts, (2 * j + 1) % parts);
        // Each of the `parts` sums takes at most `8 / parts` products, which `k_parts` keeps
        // within what a 16-bit lane holds.
        for i in 0..N {
            sh[i][k_low] = dot_avx2_i16(sh[i][k_low], low, broadcast(h[i], j));
            sh[i][k_high] = dot_avx2_i16(sh[i][k_high], high, broadcast(h[i], 4 + j));
            if SPLIT {
                sl[i][k_low] = dot_avx2_i16(sl[i][k_low], low, broadcast(l[i], j));
                sl[i][k_high] = dot_avx2_i16(sl[i][k_high], high, broadcast(l[i], 4 + j));
            }
        }
    }

    /// The first `parts` of a row's partial sums from [`add_chunk`] as one sum of eight
    /// 32-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn join_parts(sums: [__m256i; 4], parts: usize) -> __m256i {
        let mut total = widen_avx2(sums[0]);
        for &sum in &sums[1..parts] {
            total = _mm256_add_epi32(total, widen_avx2(sum));
        }
        total
    }

    /// A sub-block's float steps for `N` rows, given its integer sums and its `d × scale`
    /// and `dmin × min` per row lane: `acc` gains the scaled sums and the minimums times
    /// `d × Σ a` go to `mins` (with `SPLIT`) or come off `acc` as they go (`mins` stays zero).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn add_k_sub<const N: usize, const SPLIT: bool>(
        acc: &mut [__m256; N],
        mins: &mut [__m256; N],
        sums: [(__m256i, __m256i); N],
        [scale, min]: [__m256; 2],
        h: [&ActBlock; N],
        l: [&ActBlock; N],
    ) {
        for i in 0..N {
            let (sum_h, sum_l) = sums[i];
            acc[i] = add_sums::<SPLIT>(acc[i], scale, sum_h, sum_l, h[i], l[i]);
            let d_sum = d_sum_lanes::<SPLIT>(h[i], l[i]);
            if SPLIT {
                mins[i] = _mm256_fmadd_ps(min, d_sum, mins[i]);
            } else {
                acc[i] = _mm256_fnmadd_ps(min, d_sum, acc[i]);
            }
        }
    }

    /// Two groups of Q4_K (`FIFTH` false) or Q5_K unpacked ([`super::UnpackFn`], on AVX2):
    /// each sub-block's chunks as the narrow tile forms them ([`nibble_chunk`]), the first
    /// group's in the low 32 bytes of each register and the second's in the high, and its
    /// `d × scale` and `dmin × min` as the narrow tile multiplies them.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must be two groups of the type, each
    /// holding exactly the block columns of `out.len()` sub-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn unpack_k<const FIFTH: bool>(w: &[u8], out: &mut [UnpackedSub]) {
        let (column_bytes, sub_bytes) = k_sizes(FIFTH);
        let group_bytes = w.len() / 2;
        debug_assert_eq!(group_bytes, out.len() / 8 * column_bytes);
        for (c, column) in out.chunks_exact_mut(8).enumerate() {
            for half in 0..2 {
                // SAFETY: column `c < out.len() / 8` lies in group `half` (the caller's
                // contract); its first 32 bytes are the eight f16 `d`, then the eight `dmin`.
                let (p, d, dmin) = unsafe {
                    let p = w.as_ptr().add(group_bytes * half + column_bytes * c);
                    (p, halves(p), halves(p.add(16)))
                };
                for (s, sub) in column.iter_mut().enumerate() {
                    // SAFETY: `s < 8`: sub-block `s` (`sub_bytes`: 128 of nibbles, with
                    // `FIFTH` 32 of fifth bits) at `K_QUANTS + sub_bytes s` ends by the
                    // column's end; its eight scales at `32 + 8 s` and minimums at `96 + 8 s`
                    // lie before `K_QUANTS` (32 + 64 + 64).
                    let (q, scales, mins) = unsafe {
                        (
                            p.add(K_QUANTS + sub_bytes * s),
                            u8_lanes(p.add(32 + 8 * s)),
                            u8_lanes(p.add(96 + 8 * s)),
                        )
                    };
                    let fifth_bits = if FIFTH {
                        // SAFETY: as above: the fifth bits are the sub-block's last 32 bytes.
                        unsafe { _mm256_loadu_si256(q.add(128).cast()) }
                    } else {
                        _mm256_setzero_si256()
                    };
                    for j in 0..4 {
                        // SAFETY: `j < 4`: chunk `j` lies in the sub-block's 128 bytes of
                        // nibbles.
                        let values = unsafe { nibble_chunk::<FIFTH>(q, fifth_bits, j) };
                        for (out, v) in sub.values[j].iter_mut().zip(values) {
                            // SAFETY: 32 bytes of `out` (64) at offset 0 or 32.
                            unsafe { _mm256_storeu_si256(out[32 * half..].as_mut_ptr().cast(), v) };
                        }
                    }
                    let scales = [_mm256_mul_ps(d, scales), _mm256_mul_ps(dmin, mins)];
                    for (out, v) in sub.scales.iter_mut().zip(scales) {
                        // SAFETY: eight f32 of `out` (sixteen) at offset 0 or 8.
                        unsafe { _mm256_storeu_ps(out[GROUP * half..].as_mut_ptr(), v) };
                    }
                }
            }
        }
    }

    /// Two groups of Q6_K unpacked ([`super::UnpackFn`], on AVX2, for one activation pass):
    /// each sub-block's eight registers and the `d × scale` of its halves as the narrow
    /// one-pass tile forms them (`q6_k_one_pass::sub_block`), the first group's in the low 32
    /// bytes of each register (the low eight lanes of each scale) and the second's in the high.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `w` must be two Q6_K groups, each holding
    /// exactly the block columns of `out.len()` sub-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn unpack_q6_k(w: &[u8], out: &mut [UnpackedSub]) {
        let group_bytes = w.len() / 2;
        debug_assert_eq!(group_bytes, out.len() / 8 * Q6_K_BYTES);
        for (c, column) in out.chunks_exact_mut(8).enumerate() {
            for half in 0..2 {
                // SAFETY: column `c < out.len() / 8` lies in group `half` (the caller's
                // contract); its first 16 bytes are the eight f16 `d`.
                let (p, d) = unsafe {
                    let p = w.as_ptr().add(group_bytes * half + Q6_K_BYTES * c);
                    (p, halves(p))
                };
                for (s, sub) in column.iter_mut().enumerate() {
                    // SAFETY: `p` is a whole column, `d` its scales, `s < 8`.
                    let (values, scales) = unsafe { q6_k_one_pass::sub_block(p, d, s) };
                    for (out, values) in sub.values.iter_mut().zip(values) {
                        for (out, v) in out.iter_mut().zip(values) {
                            // SAFETY: 32 bytes of `out` (64) at offset 0 or 32.
                            unsafe { _mm256_storeu_si256(out[32 * half..].as_mut_ptr().cast(), v) };
                        }
                    }
                    for (out, v) in sub.scales.iter_mut().zip(scales) {
                        // SAFETY: eight f32 of `out` (sixteen) at offset 0 or 8.
                        unsafe { _mm256_storeu_ps(out[GROUP * half..].as_mut_ptr(), v) };
                    }
                }
            }
        }
    }

    /// Sixteen Q6_K rows, unpacked ([`unpack_q6_k`]), × `N` activation rows in one pass
    /// ([`super::WideFn`], on AVX2; `lo` is not read, and `SPLIT` is not taken): one group
    /// after the other, each row through the narrow one-pass tile's `add_row`, so the same
    /// bits, the sub-block's registers loaded once per tile instead of formed.
    ///
    /// # Safety
    /// As [`super::WideFn`] for an unpacked type, on a CPU with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q6_k_wide<const N: usize, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        _lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        debug_assert!(!SPLIT, "AVX2's wide Q6_K tiles take one activation pass");
        // SAFETY: the `WideFn` contract of an unpacked type: `w` is its sub-blocks' bytes.
        let subs = unsafe { unpacked(w) };
        debug_assert!(hi.iter().all(|a| a.len() == subs.len()));
        let mut out = [[0f32; WIDE_ROWS]; N];
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, sub) in subs.iter().enumerate() {
                // SAFETY: `b < subs.len()`, every row's length (the `WideFn` contract).
                let h = unsafe { blocks_at(hi, b) };
                // Loops, not `array::from_fn` and `map`: those closures were compiled apart
                // (a call per load).
                let mut values = [[_mm256_setzero_si256(); 2]; 4];
                let mut scales = [_mm256_setzero_ps(); 2];
                for k in 0..2 {
                    for (j, v) in values.iter_mut().enumerate() {
                        // SAFETY: 32 bytes of a register's 64 at offset 0 or 32, 32-aligned
                        // since `UnpackedSub` is 64-aligned and each register a multiple of 64
                        // into it.
                        v[k] = unsafe {
                            _mm256_load_si256(sub.values[j][k][32 * half..].as_ptr().cast())
                        };
                    }
                    // SAFETY: eight f32 of sixteen at offset 0 or 8: 32 bytes, 32-aligned as
                    // above.
                    scales[k] = unsafe { _mm256_load_ps(sub.scales[k][GROUP * half..].as_ptr()) };
                }
                for i in 0..N {
                    q6_k_one_pass::add_row(&mut acc[i], &values, scales, h[i]);
                }
            }
            for i in 0..N {
                out[i][GROUP * half..GROUP * (half + 1)].copy_from_slice(&store(acc[i]));
            }
        }
        out
    }

    /// Sixteen Q4_K (`FIFTH` false) or Q5_K rows, unpacked ([`unpack_k`]), × `N` two-pass
    /// activation rows ([`super::WideFn`], on AVX2): one group after the other, each through
    /// the narrow tile's integer sums and float steps, so the same bits.
    ///
    /// # Safety
    /// As [`super::WideFn`] for an unpacked type, on a CPU with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn k_wide<const N: usize, const FIFTH: bool, const SPLIT: bool>(
        w: &[u8],
        hi: [&[ActBlock]; N],
        lo: [&[ActBlock]; N],
    ) -> [[f32; WIDE_ROWS]; N] {
        // SAFETY: the `WideFn` contract of an unpacked type: `w` is its sub-blocks' bytes.
        let subs = unsafe { unpacked(w) };
        let blocks = hi[0].len();
        debug_assert!(hi.iter().chain(&lo).all(|a| a.len() == blocks));
        debug_assert_eq!(subs.len(), blocks);
        let parts = const { k_parts::<FIFTH>() };
        let mut out = [[0f32; WIDE_ROWS]; N];
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); N];
            let mut mins = [_mm256_setzero_ps(); N];
            for (b, sub) in subs.iter().enumerate() {
                // SAFETY: `b < subs.len() = blocks`, every row's length (the `WideFn`
                // contract).
                let (h, l) = unsafe { (blocks_at(hi, b), blocks_at(lo, b)) };
                let mut sh = [[_mm256_setzero_si256(); 4]; N];
                let mut sl = [[_mm256_setzero_si256(); 4]; N];
                for j in 0..4 {
                    // SAFETY: 32 bytes of a register's 64 at offset 0 or 32, 32-aligned since
                    // `UnpackedSub` is 64-aligned and each register a multiple of 64 into it.
                    let values = [0, 1].map(|k| unsafe {
                        _mm256_load_si256(sub.values[j][k][32 * half..].as_ptr().cast())
                    });
                    add_chunk::<N, SPLIT>(&mut sh, &mut sl, j, values, h, l, parts);
                }
                let sums =
                    std::array::from_fn(|i| (join_parts(sh[i], parts), join_parts(sl[i], parts)));
                // SAFETY: eight f32 of sixteen at offset 0 or 8: 32 bytes, 32-aligned as above.
                let scales = [0, 1]
                    .map(|k| unsafe { _mm256_load_ps(sub.scales[k][GROUP * half..].as_ptr()) });
                add_k_sub::<N, SPLIT>(&mut acc, &mut mins, sums, scales, h, l);
            }
            for i in 0..N {
                let y = store(_mm256_sub_ps(acc[i], mins[i]));
                out[i][GROUP * half..GROUP * (half + 1)].copy_from_slice(&y);
            }
        }
        out
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use half::f16;

    use super::{UnpackedSub, WIDE_TILE, avx2, x86};
    use crate::act::ActBlock;
    use crate::interleaved::{GROUP, k_sizes};
    use crate::tier::Tier;

    /// A xorshift stream: the tests' weights and activations.
    fn stream() -> impl FnMut() -> u64 {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Two groups of `columns` random Q4_K (`fifth` false) or Q5_K block columns with finite
    /// scales.
    fn k_groups(fifth: bool, columns: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
        let (column_bytes, _) = k_sizes(fifth);
        let mut w: Vec<u8> = (0..2 * columns * column_bytes)
            .map(|_| next() as u8)
            .collect();
        // Each column's eight `d` and eight `dmin`.
        for column in w.chunks_exact_mut(column_bytes) {
            for scale in column[..32].chunks_exact_mut(2) {
                let value = f16::from_f32(0.001 + (next() % 100) as f32 * 1e-4);
                scale.copy_from_slice(&value.to_le_bytes());
            }
        }
        w
    }

    /// `n` rows of `blocks` random activation blocks.
    fn act_rows(n: usize, blocks: usize, next: &mut impl FnMut() -> u64) -> Vec<Vec<ActBlock>> {
        (0..n)
            .map(|_| {
                (0..blocks)
                    .map(|_| {
                        let x = std::array::from_fn(|_| (next() % 2001) as f32 / 1000.0 - 1.0);
                        ActBlock::quantize(&x)
                    })
                    .collect()
            })
            .collect()
    }

    /// The bytes of unpacked sub-blocks, as the wide tiles take them.
    fn bytes_of(subs: &[UnpackedSub]) -> &[u8] {
        // SAFETY: `UnpackedSub` is bytes and f32 without padding.
        unsafe { std::slice::from_raw_parts(subs.as_ptr().cast::<u8>(), size_of_val(subs)) }
    }

    /// The eight-row one-pass Q4_K and Q5_K tiles give the same bits with one integer sum per
    /// row as with two: a machine runs only its vendor's choice through the matrix tests.
    #[test]
    fn one_and_two_sums_per_row_give_the_same_bits() {
        if !Tier::Avx512Vnni.is_supported() {
            return;
        }
        let mut next = stream();
        let columns = 3;
        for fifth in [false, true] {
            let w = k_groups(fifth, columns, &mut next);
            let rows = act_rows(WIDE_TILE, 8 * columns, &mut next);
            let zeros = vec![ActBlock::ZERO; 8 * columns];
            let mut subs = vec![UnpackedSub::ZERO; 8 * columns];
            let hi = std::array::from_fn(|i| rows[i].as_slice());
            let lo = [zeros.as_slice(); WIDE_TILE];
            // SAFETY: AVX-512 VNNI is supported (checked above); `w` is two groups of
            // `columns` block columns of the type, `subs` and every row one block per
            // sub-block; the tiles take the unpacked sub-blocks' bytes.
            let (one, two) = unsafe {
                if fifth {
                    x86::unpack_k::<true>(&w, &mut subs);
                } else {
                    x86::unpack_k::<false>(&w, &mut subs);
                }
                let bytes = bytes_of(&subs);
                (
                    x86::k_wide::<WIDE_TILE, true, false>(bytes, hi, lo),
                    x86::k_wide::<WIDE_TILE, false, false>(bytes, hi, lo),
                )
            };
            let bits = |out: [[f32; 16]; WIDE_TILE]| out.map(|row| row.map(f32::to_bits));
            assert_eq!(bits(one), bits(two), "fifth bits: {fifth}");
            assert!(
                one.iter().flatten().any(|&v| v != 0.0),
                "a product of nothing"
            );
        }
    }

    /// AVX2's unpacked Q4_K and Q5_K tiles give each group the bits of AVX2's narrow tile
    /// on the packed group, with one activation pass and with two, for one to four rows
    /// (what the matrix tests see only through whole products).
    #[test]
    fn avx2_unpacked_k_tiles_give_the_narrow_tiles_bits() {
        if !Tier::Avx2.is_supported() {
            return;
        }
        use crate::interleaved::x86::avx2::{q4_k_tile, q5_k_tile};
        let mut next = stream();
        let columns = 3;
        for fifth in [false, true] {
            let w = k_groups(fifth, columns, &mut next);
            let group_bytes = w.len() / 2;
            let rows = act_rows(8, 8 * columns, &mut next);
            let zeros = vec![ActBlock::ZERO; 8 * columns];
            let mut subs = vec![UnpackedSub::ZERO; 8 * columns];
            // SAFETY: AVX2, FMA and F16C are supported (the AVX2 tier); `w` is two groups
            // of `columns` block columns of the type, `subs` one per sub-block.
            unsafe {
                if fifth {
                    avx2::unpack_k::<true>(&w, &mut subs);
                } else {
                    avx2::unpack_k::<false>(&w, &mut subs);
                }
            }
            let bytes = bytes_of(&subs);
            macro_rules! check {
                ($n:literal, $split:literal) => {{
                    let hi: [&[ActBlock]; $n] = std::array::from_fn(|i| rows[i].as_slice());
                    let lo: [&[ActBlock]; $n] = if $split {
                        std::array::from_fn(|i| rows[4 + i].as_slice())
                    } else {
                        [zeros.as_slice(); $n]
                    };
                    // SAFETY: the AVX2 tier is supported; `bytes` are the unpacked
                    // sub-blocks of `w`'s two groups, each group `columns` block columns of
                    // the type, and every row one block per sub-block.
                    let (wide, narrow) = unsafe {
                        let wide = if fifth {
                            avx2::k_wide::<$n, true, $split>(bytes, hi, lo)
                        } else {
                            avx2::k_wide::<$n, false, $split>(bytes, hi, lo)
                        };
                        let narrow: [[[f32; GROUP]; $n]; 2] = std::array::from_fn(|g| {
                            let group = &w[g * group_bytes..(g + 1) * group_bytes];
                            if fifth {
                                q5_k_tile::<$n, $split>(group, hi, lo)
                            } else {
                                q4_k_tile::<$n, $split>(group, hi, lo)
                            }
                        });
                        (wide, narrow)
                    };
                    for i in 0..$n {
                        let expected: Vec<u32> =
                            narrow.iter().flat_map(|g| g[i].map(f32::to_bits)).collect();
                        let got: Vec<u32> = wide[i].iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got, expected,
                            "fifth {fifth}, {} rows, split {}, row {i}",
                            $n, $split
                        );
                        assert!(wide[i].iter().any(|&v| v != 0.0), "a product of nothing");
                    }
                }};
            }
            check!(1, false);
            check!(4, false);
            check!(1, true);
            check!(3, true);
            check!(4, true);
        }
    }

    /// AVX2's wide Q6_K tiles on unpacked groups give the narrow one-pass tile's bits, for
    /// one to eight activation rows.
    #[test]
    fn avx2_unpacked_q6_k_tiles_give_the_narrow_tiles_bits() {
        if !Tier::Avx2.is_supported() {
            return;
        }
        use crate::interleaved::Q6_K_BYTES;
        use crate::interleaved::x86::q6_k_one_pass;
        let mut next = stream();
        let columns = 3;
        let mut w: Vec<u8> = (0..2 * columns * Q6_K_BYTES)
            .map(|_| next() as u8)
            .collect();
        // Each column's eight `d`.
        for column in w.chunks_exact_mut(Q6_K_BYTES) {
            for scale in column[..16].chunks_exact_mut(2) {
                let value = f16::from_f32(0.001 + (next() % 100) as f32 * 1e-4);
                scale.copy_from_slice(&value.to_le_bytes());
            }
        }
        let group_bytes = w.len() / 2;
        let rows = act_rows(8, 8 * columns, &mut next);
        let zeros = vec![ActBlock::ZERO; 8 * columns];
        let mut subs = vec![UnpackedSub::ZERO; 8 * columns];
        // SAFETY: AVX2, FMA and F16C are supported (the AVX2 tier); `w` is two Q6_K groups of
        // `columns` block columns, `subs` one per sub-block.
        unsafe { avx2::unpack_q6_k(&w, &mut subs) };
        let bytes = bytes_of(&subs);
        macro_rules! check {
            ($n:literal) => {{
                let hi: [&[ActBlock]; $n] = std::array::from_fn(|i| rows[i].as_slice());
                let lo: [&[ActBlock]; $n] = [zeros.as_slice(); $n];
                // SAFETY: the AVX2 tier is supported; `bytes` are the unpacked sub-blocks of
                // `w`'s two groups, each group `columns` block columns of Q6_K, and every row
                // one block per sub-block.
                let (wide, narrow) = unsafe {
                    let wide = avx2::q6_k_wide::<$n, false>(bytes, hi, lo);
                    let narrow: [[[f32; GROUP]; $n]; 2] = std::array::from_fn(|g| {
                        let group = &w[g * group_bytes..(g + 1) * group_bytes];
                        q6_k_one_pass::tile::<$n, false>(group, hi, lo)
                    });
                    (wide, narrow)
                };
                for i in 0..$n {
                    let expected: Vec<u32> =
                        narrow.iter().flat_map(|g| g[i].map(f32::to_bits)).collect();
                    let got: Vec<u32> = wide[i].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, expected, "{} rows, row {i}", $n);
                    assert!(wide[i].iter().any(|&v| v != 0.0), "a product of nothing");
                }
            }};
        }
        check!(1);
        check!(3);
        check!(6);
        check!(8);
    }
}
