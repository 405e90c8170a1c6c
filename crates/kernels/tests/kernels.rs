//! Every tier this CPU supports against the scalar reference, and the scalar reference against
//! plain f64 arithmetic on the dequantized weights and activations, over odd shapes.

use half::f16;
use kiln_kernels::act::{
    Act16Block, ActBlock, quantize_row, quantize_row_16, quantize_rows, quantize_split,
    quantize_split_row,
};
use kiln_kernels::dense::{matmul_in_out_with, matmul_out_in_with};
use kiln_kernels::gemm::gemm_in_out_with;
use kiln_kernels::ggml::dequantize;
use kiln_kernels::quant::DotKernel;
use kiln_kernels::{ActPasses, GgmlType, QuantMatrix, ThreadPool, Tier};
use proptest::prelude::*;

const TYPES: [GgmlType; 12] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Iq4Nl,
    GgmlType::Iq4Xs,
];

/// xorshift64*: reproducible test data from a proptest seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn scale(&mut self) -> [u8; 2] {
        f16::from_f32(0.002 + 0.05 * self.unit().abs()).to_le_bytes()
    }
}

/// One random block of `ty`: random quants, positive f16 scales of a realistic size.
fn random_block(ty: GgmlType, rng: &mut Rng) -> Vec<u8> {
    let mut b: Vec<u8> = (0..ty.type_size()).map(|_| rng.byte()).collect();
    for &at in scale_offsets(ty) {
        b[at..at + 2].copy_from_slice(&rng.scale());
    }
    b
}

/// Where a block of `ty` keeps its f16 scales (`d`, and `dmin` where there is one).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Iq4Nl | GgmlType::Iq4Xs => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        other => panic!("no random blocks of {}", other.name()),
    }
}

fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> QuantMatrix {
    let blocks = rows * cols / ty.block_size();
    let data = (0..blocks).flat_map(|_| random_block(ty, rng)).collect();
    QuantMatrix::new(ty, rows, cols, data).expect("valid matrix")
}

fn random_acts(len: usize, rng: &mut Rng) -> Vec<f32> {
    (0..len).map(|_| rng.unit() * 3.0).collect()
}

/// Σ w x in f64 over the dequantized weights and the dequantized activation blocks: what the
/// integer kernels compute exactly, up to f32 rounding of the scales and the sums.
fn reference_dot(ty: GgmlType, w: &[u8], acts: &[ActBlock]) -> (f64, f64) {
    let mut wf = vec![0f32; acts.len() * 32];
    dequantize(ty, w, &mut wf);
    let (mut sum, mut magnitude) = (0f64, 0f64);
    for (block, ws) in acts.iter().zip(wf.chunks_exact(32)) {
        for (q, w) in block.qs.iter().zip(ws) {
            let term = f64::from(*w) * f64::from(block.d) * f64::from(*q);
            sum += term;
            magnitude += term.abs();
        }
    }
    (sum, magnitude)
}

fn blocks_strategy() -> impl Strategy<Value = (usize, usize, u64)> {
    (0..TYPES.len(), 1usize..6, any::<u64>())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn dot_products_match_the_dequantized_reference_on_every_tier((t, blocks, seed) in blocks_strategy()) {
        let ty = TYPES[t];
        let mut rng = Rng(seed | 1);
        let cols = blocks * ty.block_size();
        let w = random_matrix(ty, 1, cols, &mut rng);
        let mut acts = Vec::new();
        quantize_rows(&random_acts(cols, &mut rng), cols, &mut acts);
        let (expected, magnitude) = reference_dot(ty, &w.row(0), &acts);
        let scalar = DotKernel::new(ty, Tier::Scalar).expect("scalar always runs").dot(&w.row(0), &acts);
        let tolerance = 1e-5 * magnitude + 1e-6;
        prop_assert!((f64::from(scalar) - expected).abs() <= tolerance,
            "{} scalar {scalar} vs reference {expected}", ty.name());
        for tier in Tier::supported() {
            let got = DotKernel::new(ty, tier).expect("supported").dot(&w.row(0), &acts);
            prop_assert!((f64::from(got) - f64::from(scalar)).abs() <= tolerance,
                "{} {tier} {got} vs scalar {scalar}", ty.name());
        }
    }

    /// Every tier's two-pass row quantization gives the scalar bits, blocks of zeros and of a
    /// single value and tiny and large scales included, and the scalar row is `quantize_split`
    /// block by block.
    #[test]
    fn every_tier_quantizes_activations_to_the_scalar_bits(
        blocks in 1usize..40,
        seed in any::<u64>(),
        scale in prop_oneof![Just(1e-30f32), Just(1.0f32), Just(3e4f32)],
    ) {
        let mut rng = Rng(seed | 1);
        let mut x: Vec<f32> = random_acts(blocks * 32, &mut rng).iter().map(|v| v * scale).collect();
        // An all-zero block and one holding a single nonzero value, the edge cases of the scale.
        x[..32].fill(0.0);
        if blocks > 1 {
            x[32..64].fill(0.0);
            x[40] = -scale;
        }
        let empty = ActBlock::ZERO;
        let (mut hi, mut lo) = (vec![empty; blocks], vec![empty; blocks]);
        quantize_split_row(&x, &mut hi, &mut lo, Tier::Scalar);
        for (i, chunk) in x.chunks_exact(32).enumerate() {
            prop_assert_eq!((hi[i], lo[i]), quantize_split(chunk.try_into().unwrap()));
        }
        // Every field, the floats as bits.
        type BlockBits = (Vec<i8>, u32, u32, i32, i32, [i32; 2], [i16; 2]);
        let bits = |b: &[ActBlock]| -> Vec<BlockBits> {
            b.iter().map(|b| (b.qs.to_vec(), b.d.to_bits(), b.d_sum.to_bits(), b.sum, b.sum_first_half, b.q6_k_starts, b.half_sums)).collect()
        };
        for tier in Tier::supported() {
            let (mut th, mut tl) = (vec![empty; blocks], vec![empty; blocks]);
            quantize_split_row(&x, &mut th, &mut tl, tier);
            prop_assert_eq!(bits(&th), bits(&hi), "{} hi", tier);
            prop_assert_eq!(bits(&tl), bits(&lo), "{} lo", tier);
            // The one-pass row is the two-pass row's first pass.
            let mut first = vec![empty; blocks];
            quantize_row(&x, &mut first, tier);
            prop_assert_eq!(bits(&first), bits(&hi), "{} one pass", tier);
            // The 16-bit blocks: every tier the scalar bits, the scalar row the block function's.
            let bits_16 = |b: &[Act16Block]| -> Vec<(Vec<i16>, u32, i32)> {
                b.iter().map(|b| (b.qs.to_vec(), b.d.to_bits(), b.q8_0_start)).collect()
            };
            let mut sixteen = vec![Act16Block::ZERO; blocks];
            quantize_row_16(&x, &mut sixteen, tier);
            let expected: Vec<Act16Block> = x
                .chunks_exact(32)
                .map(|c| Act16Block::quantize(c.try_into().unwrap()))
                .collect();
            prop_assert_eq!(bits_16(&sixteen), bits_16(&expected), "{} 16-bit", tier);
        }
    }

    /// Every tier's product (interleaved groups when the rows come in eights, rows otherwise)
    /// with the activations in two passes equals the scalar per-row dots with both passes,
    /// and the f64 product of the dequantized weights with the unquantized activations to
    /// 16-bit activation precision; with one pass (`ActPasses::One`) it equals the scalar dots
    /// with the first pass alone. Either way the SIMD tiers agree bit for bit and a row's
    /// products are the same bits alone as in a batch.
    #[test]
    fn quantized_matmul_matches_per_row_dots_for_odd_shapes(
        (t, blocks, seed) in blocks_strategy(),
        rows in prop_oneof![1usize..70, (1usize..9).prop_map(|g| 8 * g)],
        m in prop_oneof![1usize..12, 30usize..70],
        threads in 1usize..4,
    ) {
        let ty = TYPES[t];
        let mut rng = Rng(seed | 1);
        let cols = blocks * ty.block_size();
        let two = random_matrix(ty, rows, cols, &mut rng);
        let x = random_acts(m * cols, &mut rng);
        let pool = ThreadPool::new(threads);
        let (hi, lo): (Vec<ActBlock>, Vec<ActBlock>) = x
            .chunks_exact(32)
            .map(|c| quantize_split(c.try_into().unwrap()))
            .unzip();
        let scalar = DotKernel::new(ty, Tier::Scalar).expect("scalar");
        let mut dequantized = vec![0f32; rows * cols];
        for r in 0..rows {
            two.dequantize_row(r, &mut dequantized[r * cols..(r + 1) * cols]);
        }
        let one = two.clone().with_activation_passes(ActPasses::One);
        prop_assert_eq!(one.activation_passes(), ActPasses::One);
        // 16-bit activations where they have kernels (interleaved Q8_0), two passes elsewhere.
        let sixteen = two.clone().with_activation_passes(ActPasses::Q16);
        let has_q16 = ty == GgmlType::Q8_0 && two.is_interleaved();
        prop_assert_eq!(sixteen.activation_passes(),
            if has_q16 { ActPasses::Q16 } else { ActPasses::Two });
        for w in [&two, &one, &sixteen] {
            let passes = w.activation_passes();
            let mut simd_bits: Option<(Tier, Vec<u32>)> = None;
            for tier in Tier::supported() {
                let mut out = vec![f32::NAN; m * rows];
                w.matmul_with(&x, m, &mut out, tier, &pool);
                // The SIMD tiers differ only in how they form exact integer sums (VNNI's Q8_0
                // even without the sign trick), so their outputs are the same bits; with 16-bit
                // activations the scalar reference rounds as they do (one FMA a block and row).
                if tier != Tier::Scalar || passes == ActPasses::Q16 {
                    let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                    match &simd_bits {
                        Some((first, expected)) => prop_assert!(*expected == bits,
                            "{} {passes:?} {tier} differs from {first} in some bits", ty.name()),
                        None => simd_bits = Some((tier, bits)),
                    }
                }
                for t in 0..m {
                    // A row's products are the same bits alone as in a batch (tiles of several
                    // activation rows included): batches equal single runs.
                    let mut alone = vec![f32::NAN; rows];
                    w.matmul_with(&x[t * cols..(t + 1) * cols], 1, &mut alone, tier, &pool);
                    prop_assert!(alone.iter().zip(&out[t * rows..(t + 1) * rows])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{} {passes:?} {tier}: row {t} of {m} differs from the row alone",
                        ty.name());
                    let span = t * cols / 32..(t + 1) * cols / 32;
                    let (h, l) = (&hi[span.clone()], &lo[span]);
                    for r in 0..rows {
                        let row = w.row(r);
                        let (_, magnitude) = reference_dot(ty, &row, h);
                        let expected = match passes {
                            ActPasses::Two => Some(scalar.dot(&row, h) + scalar.dot(&row, l)),
                            ActPasses::One => Some(scalar.dot(&row, h)),
                            // No row kernel: the bits above and the exact product below.
                            ActPasses::Q16 => None,
                        };
                        let got = out[t * rows + r];
                        if let Some(expected) = expected {
                            prop_assert!((got - expected).abs() as f64 <= 2e-5 * magnitude + 1e-6,
                                "{} {passes:?} {tier} [{t}, {r}]: {got} vs {expected}", ty.name());
                        }
                        if passes != ActPasses::One {
                            let exact: f64 = (0..cols)
                                .map(|i| {
                                    f64::from(dequantized[r * cols + i]) * f64::from(x[t * cols + i])
                                })
                                .sum();
                            prop_assert!((f64::from(got) - exact).abs() <= 1e-4 * magnitude + 1e-6,
                                "{} {passes:?} {tier} [{t}, {r}]: {got} vs exact {exact}", ty.name());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn dense_matmul_matches_f64_for_odd_shapes(
        k in 1usize..80,
        // Both splits of the [k, n] layout: by weight rows up to 8192 columns, by columns above.
        n in prop_oneof![9 => 1usize..1100, 1 => 8180usize..8300],
        m in 1usize..10, threads in 1usize..4, seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed | 1);
        let w = random_acts(k * n, &mut rng);
        let x = random_acts(m * k, &mut rng);
        let pool = ThreadPool::new(threads);
        for tier in Tier::supported() {
            // The same matrix read as [k, n] and, transposed, as [n, k].
            let transposed: Vec<f32> = (0..n).flat_map(|c| (0..k).map(move |i| (i, c))).map(|(i, c)| w[i * n + c]).collect();
            let mut out = vec![f32::NAN; m * n];
            let mut out_t = vec![f32::NAN; m * n];
            matmul_in_out_with(&w, k, n, &x, m, &mut out, tier, &pool);
            matmul_out_in_with(&transposed, k, n, &x, m, &mut out_t, tier, &pool);
            for t in 0..m {
                for c in 0..n {
                    let (sum, magnitude) = (0..k).fold((0f64, 0f64), |(s, a), i| {
                        let p = f64::from(x[t * k + i]) * f64::from(w[i * n + c]);
                        (s + p, a + p.abs())
                    });
                    for got in [out[t * n + c], out_t[t * n + c]] {
                        prop_assert!((f64::from(got) - sum).abs() <= 1e-6 * magnitude + 1e-7,
                            "{tier} [{t}, {c}]: {got} vs {sum}");
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_equals_the_in_order_fused_sum_on_every_tier(
        // Past 256: the AVX2 walk's blocks of k, whose sums wait in memory between blocks.
        k in prop_oneof![3 => 1usize..100, 1 => 250usize..600],
        // Partial panels (n % 32) in one-panel blocks, and above 8 × 64 × threads columns
        // two-panel blocks with partial ones (n % 64).
        n in prop_oneof![1usize..200, 1500usize..1600],
        // Partial tiles of every height (m % 12, m % 3), and row blocks where the columns
        // alone make fewer than four tasks per thread.
        m in 1usize..230, threads in 1usize..4, seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed | 1);
        let w = random_acts(k * n, &mut rng);
        let x = random_acts(m * k, &mut rng);
        let pool = ThreadPool::new(threads);
        // The scalar reference written out: one fused multiply-add per term, in order of k.
        let expected: Vec<f32> = (0..m * n)
            .map(|o| (0..k).fold(0f32, |s, i| x[(o / n) * k + i].mul_add(w[i * n + o % n], s)))
            .collect();
        for tier in Tier::supported() {
            let mut out = vec![f32::NAN; m * n];
            gemm_in_out_with(&w, k, n, &x, m, &mut out, tier, &pool);
            for (o, (got, want)) in out.iter().zip(&expected).enumerate() {
                prop_assert_eq!(got.to_bits(), want.to_bits(), "{} [{}, {}]", tier, o / n, o % n);
            }
        }
    }
}

/// The largest products fit every tier's integer sums: weights whose quants are all ones
/// (every value and scale at its type's maximum) against activations that quantize to ±127
/// everywhere, so that a narrow sum holding more products than its width allows (the AVX2
/// tiles add `vpmaddubsw`'s 16-bit pair sums before widening them) saturates and shows.
#[test]
fn products_of_the_largest_values_do_not_saturate_on_any_tier() {
    // 65 activation rows: at least what every tier's wide tiles need (AVX2's 64), the last
    // pass of one row on the wide tile of one.
    let (rows, cols, m) = (16, 512, 65);
    let pool = ThreadPool::new(2);
    let scalar_bits = |w: &QuantMatrix, x: &[f32]| {
        let mut out = vec![f32::NAN; m * rows];
        w.matmul_with(x, m, &mut out, Tier::Scalar, &pool);
        out
    };
    for ty in TYPES {
        let mut block = vec![0xFFu8; ty.type_size()];
        for &at in scale_offsets(ty) {
            block[at..at + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        }
        let data = block.repeat(rows * cols / ty.block_size());
        let two = QuantMatrix::new(ty, rows, cols, data).expect("valid matrix");
        let one = two.clone().with_activation_passes(ActPasses::One);
        let sixteen = two.clone().with_activation_passes(ActPasses::Q16);
        // Rows of +1, -1, and (what quantizes to ±127 with a remainder) 0.7 and -0.9 beside a
        // 1 in each block.
        let x: Vec<f32> = (0..m * cols)
            .map(|i| match (i / cols, i % 32) {
                (0, _) => 1.0,
                (1, _) => -1.0,
                (_, 0) => 1.0,
                (2 | 4, _) => 0.7,
                _ => -0.9,
            })
            .collect();
        for w in [&two, &one, &sixteen] {
            let expected = scalar_bits(w, &x);
            for tier in Tier::supported() {
                let mut out = vec![f32::NAN; m * rows];
                w.matmul_with(&x, m, &mut out, tier, &pool);
                for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{} {:?} {tier} output {i}: {got} vs the scalar tier's {want}",
                        ty.name(),
                        w.activation_passes()
                    );
                }
            }
        }
    }
}

#[test]
fn row_permutation_and_dequantization_agree() {
    let mut rng = Rng(7);
    let w = random_matrix(GgmlType::Q4_1, 4, 64, &mut rng);
    let p = w.permute_rows(&[2, 0, 3, 1]);
    let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
    w.dequantize_row(3, &mut a);
    p.dequantize_row(2, &mut b);
    assert_eq!(a, b);
}

/// Interleaving is invisible from outside: each row reads back as the blocks it was given
/// (the types without an interleaved layout keep GGUF's rows).
#[test]
fn interleaved_rows_read_back_as_given() {
    let mut rng = Rng(11);
    for ty in TYPES {
        let (rows, cols) = (16, 3 * ty.block_size());
        let plain = random_matrix(ty, 1, cols, &mut rng);
        let mut data = Vec::new();
        let mut given = Vec::new();
        for _ in 0..rows {
            let row: Vec<u8> = (0..cols / ty.block_size())
                .flat_map(|_| random_block(ty, &mut rng))
                .collect();
            data.extend_from_slice(&row);
            given.push(row);
        }
        let w = QuantMatrix::new(ty, rows, cols, data).unwrap();
        let has_layout = kiln_kernels::interleaved::group_block_bytes(ty).is_some();
        assert_eq!(w.is_interleaved(), has_layout, "{}", ty.name());
        assert!(!plain.is_interleaved());
        for (r, row) in given.iter().enumerate() {
            assert_eq!(&*w.row(r), row.as_slice(), "{} row {r}", ty.name());
        }
    }
}

/// A matrix built from borrowed blocks (a mapped file's) equals one built from owned blocks,
/// and reports every byte of its input consumed, in order, in spans: for a matrix larger than
/// one repacking chunk, several of them (the loader drops each span's mapped pages at once).
#[test]
fn matrices_from_slices_hand_back_their_input_in_order() {
    let mut rng = Rng(17);
    // Q8_0 [4224, 2048]: 9.3 MB, over one 8 MiB chunk; Q4_K [16, 512] (one chunk); Q2_K of
    // 5 rows (not whole groups: copied whole).
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 4224, 2048),
        (GgmlType::Q4K, 16, 512),
        (GgmlType::Q2K, 5, 256),
    ] {
        let data: Vec<u8> = (0..rows * cols / ty.block_size())
            .flat_map(|_| random_block(ty, &mut rng))
            .collect();
        let mut spans = Vec::new();
        let borrowed =
            QuantMatrix::from_slice(ty, rows, cols, &data, &mut |span| spans.push(span)).unwrap();
        let owned = QuantMatrix::new(ty, rows, cols, data.clone()).unwrap();
        assert!(borrowed == owned, "{}: the two builds differ", ty.name());
        let mut at = 0;
        for span in &spans {
            assert_eq!(span.start, at, "{}: spans {spans:?}", ty.name());
            assert!(span.end > span.start);
            at = span.end;
        }
        assert_eq!(at, data.len(), "{}: spans {spans:?}", ty.name());
        if data.len() > 8 << 20 {
            assert!(
                spans.len() > 1,
                "{}: one span for {} bytes",
                ty.name(),
                data.len()
            );
        }
    }
}

/// A stack repacked once from its parts' borrowed blocks (`from_slices`, the loader's fused
/// projections) equals the parts repacked one by one and then stacked, reads back as the
/// blocks it was given, and hands back every byte of each part in order; parts that are not
/// whole groups of eight rows, or no parts at all, are refused.
#[test]
fn stacks_from_slices_equal_their_parts_stacked() {
    let mut rng = Rng(19);
    for (ty, heights, cols) in [
        (GgmlType::Q4K, vec![16, 8, 8], 512),
        (GgmlType::Q6K, vec![8, 24], 256),
        (GgmlType::Q5K, vec![8], 256),
        (GgmlType::Q2K, vec![8, 16], 512),
        // Over one 8 MiB repacking chunk.
        (GgmlType::Q8_0, vec![4224, 64], 2048),
    ] {
        let blocks: Vec<Vec<u8>> = heights
            .iter()
            .map(|&rows| {
                (0..rows * cols / ty.block_size())
                    .flat_map(|_| random_block(ty, &mut rng))
                    .collect()
            })
            .collect();
        let slices: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let mut spans = vec![Vec::new(); slices.len()];
        let stack =
            QuantMatrix::from_slices(ty, cols, &slices, &mut |part, span| spans[part].push(span))
                .unwrap();
        let parts: Vec<QuantMatrix> = (0..slices.len())
            .map(|i| QuantMatrix::new(ty, heights[i], cols, blocks[i].clone()).unwrap())
            .collect();
        let stacked = QuantMatrix::concat_rows(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert!(stack == stacked, "{}: the two stacks differ", ty.name());
        let row_bytes = ty.bytes_for(cols).unwrap();
        let given: Vec<&[u8]> = slices
            .iter()
            .flat_map(|p| p.chunks_exact(row_bytes))
            .collect();
        for (r, row) in given.iter().enumerate() {
            assert_eq!(&*stack.row(r), *row, "{} row {r}", ty.name());
        }
        for (part, spans) in spans.iter().enumerate() {
            let mut at = 0;
            for span in spans {
                assert_eq!(span.start, at, "{} part {part}: {spans:?}", ty.name());
                at = span.end;
            }
            assert_eq!(
                at,
                slices[part].len(),
                "{} part {part}: {spans:?}",
                ty.name()
            );
        }
    }
    let q4k = |rows: usize| vec![0u8; rows * GgmlType::Q4K.type_size()];
    let (whole, partial) = (q4k(8), q4k(4));
    for parts in [vec![&whole[..], &partial[..]], vec![]] {
        assert!(QuantMatrix::from_slices(GgmlType::Q4K, 256, &parts, &mut |_, _| {}).is_err());
    }
}

/// Stacked matrices (fused projections) give each part's outputs with the same bits, whether
/// the parts are interleaved (rows a multiple of 8) or not; a stack that would change a
/// part's kernel is refused.
#[test]
fn stacked_matrices_multiply_like_their_parts() {
    let mut rng = Rng(13);
    for (ty, heights) in [
        (GgmlType::Q4_1, [16, 8, 24]),
        (GgmlType::Q8_0, [8, 16, 8]),
        (GgmlType::Q4K, [3, 2, 4]),
    ] {
        let cols = 256;
        let parts: Vec<QuantMatrix> = heights
            .iter()
            .map(|&rows| random_matrix(ty, rows, cols, &mut rng))
            .collect();
        let stacked = QuantMatrix::concat_rows(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(stacked.rows(), heights.iter().sum::<usize>());
        let m = 3;
        let x = random_acts(m * cols, &mut rng);
        let mut whole = vec![0f32; m * stacked.rows()];
        stacked.matmul(&x, m, &mut whole);
        let mut offset = 0;
        for part in &parts {
            let mut y = vec![0f32; m * part.rows()];
            part.matmul(&x, m, &mut y);
            for t in 0..m {
                let row = &whole[t * stacked.rows() + offset..][..part.rows()];
                assert_eq!(
                    row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    y[t * part.rows()..(t + 1) * part.rows()]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{} part at {offset}",
                    ty.name()
                );
            }
            offset += part.rows();
        }
    }
    let a = random_matrix(GgmlType::Q4_1, 8, 64, &mut rng);
    let b = random_matrix(GgmlType::Q8_0, 8, 64, &mut rng);
    assert!(QuantMatrix::concat_rows(&[&a, &b]).is_err());
    // Eight interleaved rows over five plain ones would move them to the row kernel.
    let c = random_matrix(GgmlType::Q4_1, 5, 64, &mut rng);
    assert!(QuantMatrix::concat_rows(&[&a, &c]).is_err());
    assert!(QuantMatrix::concat_rows(&[]).is_err());
}

#[test]
fn matrices_of_the_wrong_size_or_type_are_refused() {
    assert!(QuantMatrix::new(GgmlType::Q8_0, 2, 32, vec![0; 67]).is_err());
    assert!(QuantMatrix::new(GgmlType::Q4K, 1, 32, vec![0; 144]).is_err());
    assert!(QuantMatrix::new(GgmlType::Q5_0, 1, 32, vec![0; 21]).is_err());
    assert!(QuantMatrix::new(GgmlType::F32, 1, 32, vec![0; 128]).is_err());
    assert!(QuantMatrix::new(GgmlType::F16, 2, 32, vec![0; 64]).is_err());
}

/// A decode-sized product (one activation row, a 1536 × 576 matrix like SmolLM2's MLP) runs
/// on more than one thread when the pool has more than one.
#[test]
fn decode_sized_products_use_more_than_one_thread() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(3);
    let w = random_matrix(GgmlType::Q4_1, 1536, 576, &mut rng);
    let x = random_acts(576, &mut rng);
    let mut out = vec![0f32; 1536];
    let before = pool.worker_tasks();
    for _ in 0..50 {
        w.matmul_with(&x, 1, &mut out, Tier::best(), &pool);
    }
    assert!(
        pool.worker_tasks() > before,
        "the worker thread never took a task"
    );
    let mut dense_out = vec![0f32; 1536];
    let dense = random_acts(576 * 1536, &mut rng);
    let before = pool.worker_tasks();
    for _ in 0..50 {
        matmul_in_out_with(
            &dense,
            576,
            1536,
            &x,
            1,
            &mut dense_out,
            Tier::best(),
            &pool,
        );
    }
    assert!(
        pool.worker_tasks() > before,
        "the dense product never reached the worker"
    );
}
