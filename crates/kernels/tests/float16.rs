//! 16-bit float weights (F16, BF16) kept in their rows: every tier's products against f64
//! arithmetic on the widened values, the prefill walk bit for bit against the f32 product on
//! the widened matrix, and the matrix operations the loaders use.

use half::{bf16, f16};
use kiln_kernels::float16::DOT_MAX_ROWS;
use kiln_kernels::gemm::gemm_in_out_with;
use kiln_kernels::{GgmlType, QuantMatrix, ThreadPool, Tier};
use proptest::prelude::*;

/// xorshift64*: reproducible test data from a proptest seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A random `[rows, cols]` matrix of `ty` (its little-endian words) and its values widened.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::with_capacity(2 * rows * cols);
    let mut values = Vec::with_capacity(rows * cols);
    for _ in 0..rows * cols {
        let v = rng.unit() * 2.0;
        let (word, widened) = match ty {
            GgmlType::F16 => (f16::from_f32(v).to_bits(), f16::from_f32(v).to_f32()),
            _ => (bf16::from_f32(v).to_bits(), bf16::from_f32(v).to_f32()),
        };
        bytes.extend_from_slice(&word.to_le_bytes());
        values.push(widened);
    }
    (bytes, values)
}

fn random_acts(len: usize, rng: &mut Rng) -> Vec<f32> {
    (0..len).map(|_| rng.unit()).collect()
}

fn types() -> impl Strategy<Value = GgmlType> {
    prop_oneof![Just(GgmlType::F16), Just(GgmlType::Bf16)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Decode-sized and prefill-sized products, on every tier, within f32 rounding of the f64
    /// sum of the widened weights times the activations (odd widths: tails of the eight-lane
    /// loops; odd heights: partial steps of four rows and partial panels).
    #[test]
    fn products_match_f64_on_the_widened_values_on_every_tier(
        ty in types(),
        k in 1usize..90,
        n in 1usize..150,
        m in prop_oneof![1usize..=DOT_MAX_ROWS, (DOT_MAX_ROWS + 1)..60],
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed | 1);
        let (bytes, w) = random_matrix(ty, n, k, &mut rng);
        let x = random_acts(m * k, &mut rng);
        let matrix = QuantMatrix::new(ty, n, k, bytes).expect("a valid matrix");
        let pool = ThreadPool::new(threads);
        for tier in Tier::supported() {
            let mut out = vec![f32::NAN; m * n];
            matrix.matmul_with(&x, m, &mut out, tier, &pool);
            for t in 0..m {
                for r in 0..n {
                    let (sum, magnitude) = (0..k).fold((0f64, 0f64), |(s, a), i| {
                        let p = f64::from(x[t * k + i]) * f64::from(w[r * k + i]);
                        (s + p, a + p.abs())
                    });
                    let got = out[t * n + r];
                    prop_assert!((f64::from(got) - sum).abs() <= 1e-6 * magnitude + 1e-7,
                        "{} {tier} [{t}, {r}]: {got} vs {sum}", ty.name());
                }
            }
        }
    }

    /// Prefill-sized products are the f32 walk's bits on the widened matrix (`[k, n]`), on
    /// every tier: widening as the panels are packed changes nothing else.
    #[test]
    fn prefill_products_are_the_f32_walks_bits(
        ty in types(),
        k in 1usize..70,
        n in prop_oneof![1usize..100, 1500usize..1560],
        m in (DOT_MAX_ROWS + 1)..50,
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng(seed | 1);
        let (bytes, w) = random_matrix(ty, n, k, &mut rng);
        let x = random_acts(m * k, &mut rng);
        let matrix = QuantMatrix::new(ty, n, k, bytes).expect("a valid matrix");
        let in_out: Vec<f32> = (0..k).flat_map(|i| (0..n).map(move |c| (i, c))).map(|(i, c)| w[c * k + i]).collect();
        let pool = ThreadPool::new(threads);
        for tier in Tier::supported() {
            let mut want = vec![f32::NAN; m * n];
            gemm_in_out_with(&in_out, k, n, &x, m, &mut want, tier, &pool);
            let mut got = vec![f32::NAN; m * n];
            matrix.matmul_with(&x, m, &mut got, tier, &pool);
            for (o, (g, w)) in got.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), w.to_bits(), "{} {} [{}, {}]", ty.name(), tier, o / n, o % n);
            }
        }
    }
}

/// Rows read back, dequantize, permute and stack as the loaders use them (a tied head reads
/// the embedding's rows; Q and K are permuted; projections are stacked).
#[test]
fn rows_read_back_permute_and_stack() {
    let mut rng = Rng(7);
    for ty in [GgmlType::F16, GgmlType::Bf16] {
        let (bytes, values) = random_matrix(ty, 12, 40, &mut rng);
        let matrix = QuantMatrix::new(ty, 12, 40, bytes.clone()).expect("a valid matrix");
        assert!(!matrix.is_interleaved());
        assert_eq!(matrix.bytes(), bytes.len());
        let mut row = vec![0f32; 40];
        for r in 0..12 {
            assert_eq!(&*matrix.row(r), &bytes[r * 80..(r + 1) * 80]);
            matrix.dequantize_row(r, &mut row);
            assert_eq!(row, values[r * 40..(r + 1) * 40]);
        }
        let order: Vec<usize> = (0..12).rev().collect();
        let permuted = matrix.permute_rows(&order);
        assert_eq!(&*permuted.row(0), &*matrix.row(11));
        let stacked = QuantMatrix::concat_rows(&[&matrix, &permuted]).expect("one type, one width");
        assert_eq!(stacked.rows(), 24);
        assert_eq!(&*stacked.row(12), &*matrix.row(11));
        let x = random_acts(40, &mut rng);
        let pool = ThreadPool::new(2);
        let (mut parts, mut whole) = (vec![0f32; 24], vec![0f32; 24]);
        matrix.matmul_with(&x, 1, &mut parts[..12], Tier::best(), &pool);
        permuted.matmul_with(&x, 1, &mut parts[12..], Tier::best(), &pool);
        stacked.matmul_with(&x, 1, &mut whole, Tier::best(), &pool);
        assert_eq!(parts, whole, "{}", ty.name());
    }
}
