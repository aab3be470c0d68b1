//! Weight formats and their CPU kernels against hand-computed values and a naive f64
//! reference.

use crate::support;

use k3::quant::mxfp4::{e2m1, e8m0};
use k3::quant::simd::SimdLevel;
use k3::quant::{DenseData, DenseFormat, DenseMatrix, Mxfp4View};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::rel_l2;

const FORMATS: [DenseFormat; 4] = [
    DenseFormat::F32,
    DenseFormat::Bf16,
    DenseFormat::Int8,
    DenseFormat::Int4,
];

/// E2M1 magnitudes by code, written out by hand from the OCP MX spec.
const E2M1_HAND: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

fn random_values(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// Naive `y[t, r] = Σ_c w[r, c] x[t, c]` in f64.
fn reference(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f64> {
    let mut y = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            y[t * rows + r] = (0..cols)
                .map(|c| f64::from(w[r * cols + c]) * f64::from(x[t * cols + c]))
                .sum();
        }
    }
    y
}

fn same(a: f32, b: f32) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

#[test]
fn e2m1_codes_match_hand_table() {
    for (code, &want) in E2M1_HAND.iter().enumerate() {
        let got = e2m1(code as u8);
        assert_eq!(got.to_bits(), want.to_bits(), "code {code}");
        // Bits 4-7 are not part of the nibble.
        assert_eq!(e2m1(code as u8 | 0xA0).to_bits(), want.to_bits());
    }
}

#[test]
fn e8m0_edges() {
    assert_eq!(e8m0(0).to_bits(), 0);
    assert_eq!(e8m0(1), f32::MIN_POSITIVE);
    assert_eq!(e8m0(127), 1.0);
    assert_eq!(e8m0(128), 2.0);
    assert_eq!(e8m0(254), 2f32.powi(127));
    assert_eq!(e8m0(255), f32::INFINITY);
}

#[test]
fn mxfp4_all_codes_times_edge_scales() {
    // Columns 0..16 and 16..32 each hold the codes 0..15 in order.
    let packed: Vec<u8> = (0..16u8)
        .map(|i| (2 * i % 16) | (((2 * i + 1) % 16) << 4))
        .collect();
    for s in [0u8, 1, 127, 254, 255] {
        let scales = [s];
        let got = Mxfp4View::new(1, 32, &packed, &scales)
            .unwrap()
            .dequantize();
        for (col, &g) in got.iter().enumerate() {
            let mag = E2M1_HAND[col % 16];
            let want = match s {
                0 => 0.0 * mag,
                255 => mag * f32::INFINITY, // 0·inf = NaN by definition
                // Exact in f64; the cast to f32 saturates to inf where 2^127·(≥2) overflows.
                _ => (f64::from(mag) * 2f64.powi(i32::from(s) - 127)) as f32,
            };
            assert!(
                same(g, want),
                "scale {s}, code {}: got {g}, want {want}",
                col % 16
            );
        }
    }
    // Spot values written out by hand.
    let view = Mxfp4View::new(1, 32, &packed, &[254]).unwrap().dequantize();
    assert_eq!(view[3], 1.5 * 2f32.powi(127));
    assert_eq!(view[4], f32::INFINITY);
    let view = Mxfp4View::new(1, 32, &packed, &[1]).unwrap().dequantize();
    assert_eq!(view[1], 2f32.powi(-127));
    assert_eq!(view[15], -6.0 * 2f32.powi(-126));
}

#[test]
fn mxfp4_low_nibble_is_even_column() {
    let mut packed = vec![0u8; 16];
    packed[0] = 0x72; // low 2 → 1.0 (column 0), high 7 → 6.0 (column 1)
    packed[15] = 0xB5; // low 5 → 3.0 (column 30), high 0xB → -1.5 (column 31)
    let w = Mxfp4View::new(1, 32, &packed, &[128]).unwrap().dequantize();
    assert_eq!((w[0], w[1]), (2.0, 12.0));
    assert_eq!((w[30], w[31]), (6.0, -3.0));
    assert!(w[2..30].iter().all(|&v| v == 0.0));
}

#[test]
fn mxfp4_view_rejects_wrong_lengths() {
    let packed = vec![0u8; 2 * 32];
    let scales = vec![127u8; 2 * 2];
    assert!(Mxfp4View::new(2, 64, &packed, &scales).is_ok());
    let e = Mxfp4View::new(2, 48, &packed[..48], &scales[..3]).unwrap_err();
    assert!(e.to_string().contains("multiple of 32"), "{e}");
    let e = Mxfp4View::new(2, 64, &packed[..63], &scales).unwrap_err();
    assert!(e.to_string().contains("weight_packed has 63"), "{e}");
    let e = Mxfp4View::new(2, 64, &packed, &scales[..3]).unwrap_err();
    assert!(e.to_string().contains("weight_scale has 3"), "{e}");
    let e = Mxfp4View::new(usize::MAX, 64, &packed, &scales).unwrap_err();
    assert!(e.to_string().contains("weight_packed"), "{e}");
}

#[test]
fn mxfp4_matmul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    for (rows, cols) in [(37, 96), (1, 32), (9, 320)] {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random::<u8>()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.random_range(120..=132))
            .collect();
        let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
        let w = view.dequantize();
        let mut row = vec![0f32; cols];
        view.dequantize_row(rows - 1, &mut row);
        assert_eq!(row, w[(rows - 1) * cols..]);
        for n in [1, 3, 10] {
            let x = random_values(&mut rng, n * cols);
            let mut y = vec![f32::NAN; n * rows];
            view.matmul(&x, n, &mut y);
            let err = rel_l2(&y, &reference(&w, rows, cols, &x, n));
            assert!(err <= 1e-6, "[{rows}, {cols}] n={n}: rel L2 {err}");
        }
    }
}

#[test]
fn dense_matmul_matches_reference_every_format() {
    let mut rng = StdRng::seed_from_u64(11);
    for (rows, cols) in [(37, 96), (13, 67), (5, 1), (1, 131), (17, 200)] {
        let values = random_values(&mut rng, rows * cols);
        for fmt in FORMATS {
            let m = DenseMatrix::from_f32(rows, cols, values.clone(), fmt).unwrap();
            assert_eq!(m.format(), fmt);
            let w = m.dequantize();
            for n in [1, 3, 9] {
                let x = random_values(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                m.matmul(&x, n, &mut y);
                let err = rel_l2(&y, &reference(&w, rows, cols, &x, n));
                assert!(err <= 1e-6, "{fmt:?} [{rows}, {cols}] n={n}: rel L2 {err}");
            }
        }
    }
}

#[test]
fn int8_round_trip_within_half_step() {
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols) = (6, 77);
    let mut values = random_values(&mut rng, rows * cols);
    values[2 * cols..3 * cols].fill(0.0); // an all-zero row
    let m = DenseMatrix::from_f32(rows, cols, values.clone(), DenseFormat::Int8).unwrap();
    let DenseData::Int8 { q, scale } = &m.data else {
        panic!("not int8")
    };
    assert_eq!(scale[2], 0.0);
    assert!(q.iter().all(|v| (-127..=127).contains(v)));
    let back = m.dequantize();
    for r in 0..rows {
        let row = &values[r * cols..(r + 1) * cols];
        let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(scale[r], max / 127.0);
        for c in 0..cols {
            let err = (back[r * cols + c] - row[c]).abs();
            assert!(err <= scale[r] * (0.5 + 1e-5), "row {r} col {c}: err {err}");
        }
    }
    assert_eq!(m.byte_size(), rows * cols + rows * 4);
}

#[test]
fn int4_round_trip_within_half_step_with_tails() {
    let mut rng = StdRng::seed_from_u64(5);
    // 131 columns: two full groups, a 3-column tail group, an odd last column.
    let (rows, cols) = (4, 131);
    let mut values = random_values(&mut rng, rows * cols);
    values[cols..cols + 64].fill(0.0); // a zero group
    let m = DenseMatrix::from_f32(rows, cols, values.clone(), DenseFormat::Int4).unwrap();
    let DenseData::Int4 { q, scale } = &m.data else {
        panic!("not int4")
    };
    assert_eq!(q.len(), rows * 66);
    assert_eq!(scale.len(), rows * 3);
    assert_eq!(scale[3], 0.0);
    // The pad nibble of each odd-width row is zero.
    assert!((0..rows).all(|r| q[r * 66 + 65] >> 4 == 0));
    let back = m.dequantize();
    for r in 0..rows {
        for c in 0..cols {
            let s = scale[r * 3 + c / 64];
            let err = (back[r * cols + c] - values[r * cols + c]).abs();
            assert!(
                err <= s * (0.5 + 1e-5),
                "row {r} col {c}: err {err}, scale {s}"
            );
        }
    }
    assert_eq!(m.byte_size(), rows * 66 + rows * 3 * 4);
}

#[test]
fn int4_nibble_layout() {
    // Scale 1 (max 7): q = [1, -7, 3] → bytes 0x91, 0x03 (pad nibble 0).
    let m = DenseMatrix::from_f32(1, 3, vec![1.0, -7.0, 3.0], DenseFormat::Int4).unwrap();
    let DenseData::Int4 { q, scale } = &m.data else {
        panic!("not int4")
    };
    assert_eq!(q, &[0x91, 0x03]);
    assert_eq!(scale, &[1.0]);
    assert_eq!(m.dequantize(), vec![1.0, -7.0, 3.0]);
}

#[test]
fn bf16_is_exact() {
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, cols) = (3, 45);
    // Finite bf16 patterns: any sign and mantissa, exponent below 0xFF.
    let bits: Vec<u16> = (0..rows * cols)
        .map(|_| (rng.random::<u16>() & 0x807F) | (rng.random_range(0..0xFFu16) << 7))
        .collect();
    let widened: Vec<f32> = bits
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    let m = DenseMatrix::from_bf16(rows, cols, bits.clone(), DenseFormat::Bf16).unwrap();
    let DenseData::Bf16(kept) = &m.data else {
        panic!("not bf16")
    };
    assert_eq!(kept, &bits);
    assert_eq!(m.byte_size(), rows * cols * 2);
    let back = m.dequantize();
    assert!(back
        .iter()
        .zip(&widened)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let f = DenseMatrix::from_bf16(rows, cols, bits, DenseFormat::F32).unwrap();
    let DenseData::F32(v) = &f.data else {
        panic!("not f32")
    };
    assert!(v
        .iter()
        .zip(&widened)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!(f.byte_size(), rows * cols * 4);
}

#[test]
fn bf16_rounds_to_nearest_even() {
    let one = 1.0f32;
    let cases = [
        (one + 2f32.powi(-8), 0x3F80),                  // tie → even (down)
        (one + 3.0 * 2f32.powi(-8), 0x3F82),            // tie → even (up)
        (one + 2f32.powi(-8) + 2f32.powi(-20), 0x3F81), // above the tie → up
        (-(one + 2f32.powi(-9)), 0xBF80),               // below the tie → down
    ];
    let values: Vec<f32> = cases.iter().map(|c| c.0).collect();
    let m = DenseMatrix::from_f32(1, 4, values, DenseFormat::Bf16).unwrap();
    let DenseData::Bf16(bits) = &m.data else {
        panic!("not bf16")
    };
    let want: Vec<u16> = cases.iter().map(|c| c.1).collect();
    assert_eq!(bits, &want);
}

#[test]
fn from_bf16_quantizes_widened_values() {
    let bits = vec![0x3F80u16, 0xC0E0, 0x0000, 0x4000]; // 1, -7, 0, 2
    let m = DenseMatrix::from_bf16(1, 4, bits, DenseFormat::Int4).unwrap();
    assert_eq!(m.dequantize(), vec![1.0, -7.0, 0.0, 2.0]);
    let m = DenseMatrix::from_bf16(2, 2, vec![0x3F80, 0, 0, 0x42FE], DenseFormat::Int8).unwrap();
    assert_eq!(m.dequantize(), vec![1.0, 0.0, 0.0, 127.0]);
}

#[test]
fn bits_round_trip_and_errors() {
    for (bits, fmt) in [
        (4, DenseFormat::Int4),
        (8, DenseFormat::Int8),
        (16, DenseFormat::Bf16),
        (32, DenseFormat::F32),
    ] {
        assert_eq!(DenseFormat::from_bits(bits).unwrap(), fmt);
        assert_eq!(fmt.bits(), bits);
    }
    for bad in [0, 2, 5, 64] {
        let msg = DenseFormat::from_bits(bad).unwrap_err().to_string();
        assert!(msg.contains(&format!("bits {bad}")), "{msg}");
        for allowed in ["4", "8", "16", "32"] {
            assert!(msg.contains(allowed), "{msg}");
        }
    }
}

#[test]
fn constructors_reject_bad_input() {
    for fmt in FORMATS {
        let e = DenseMatrix::from_f32(3, 4, vec![0.0; 11], fmt).unwrap_err();
        assert!(e.to_string().contains("11 values"), "{e}");
        let e = DenseMatrix::from_bf16(3, 4, vec![0; 13], fmt).unwrap_err();
        assert!(e.to_string().contains("13 values"), "{e}");
    }
    for fmt in [DenseFormat::Int8, DenseFormat::Int4] {
        let e = DenseMatrix::from_f32(1, 3, vec![0.0, f32::NAN, 1.0], fmt).unwrap_err();
        assert!(e.to_string().contains("column 1"), "{e}");
    }
}

#[test]
fn dequantize_row_matches_dequantize() {
    let mut rng = StdRng::seed_from_u64(13);
    let values = random_values(&mut rng, 7 * 70);
    for fmt in FORMATS {
        let m = DenseMatrix::from_f32(7, 70, values.clone(), fmt).unwrap();
        let all = m.dequantize();
        let mut row = vec![0f32; 70];
        m.dequantize_row(4, &mut row);
        assert_eq!(row, all[4 * 70..5 * 70]);
    }
}

/// Shapes that leave every kind of tail: odd rows, columns short of a vector, of a 64-wide
/// block and of a group, one column, and K3's widest rows.
const AWKWARD: [(usize, usize); 9] = [
    (1, 1),
    (3, 7),
    (5, 63),
    (7, 64),
    (9, 65),
    (13, 131),
    (17, 200),
    (4, 1000),
    (33, 7168),
];

/// Runs `matmul` on every level this CPU has for token counts around the kernels' token
/// group of four and past the driver's token tile of sixteen; checks each SIMD level against the portable reference (relative L2 and
/// the float64 reference) and that a row's output does not depend on the token count.
fn check_levels(
    label: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    rng: &mut StdRng,
    matmul: impl Fn(SimdLevel, &[f32], usize, &mut [f32]),
) {
    for n in [1, 2, 3, 4, 5, 9, 37] {
        let x = random_values(rng, n * cols);
        let exact = reference(w, rows, cols, &x, n);
        let mut want = vec![f32::NAN; n * rows];
        matmul(SimdLevel::Portable, &x, n, &mut want);
        let want64: Vec<f64> = want.iter().map(|&v| f64::from(v)).collect();
        for level in SimdLevel::available() {
            let mut got = vec![f32::NAN; n * rows];
            matmul(level, &x, n, &mut got);
            let vs_portable = rel_l2(&got, &want64);
            assert!(
                vs_portable <= 1e-6,
                "{label} [{rows}, {cols}] n={n} {level:?}: rel L2 {vs_portable} vs portable"
            );
            let vs_exact = rel_l2(&got, &exact);
            assert!(
                vs_exact <= 1e-6,
                "{label} [{rows}, {cols}] n={n} {level:?}: rel L2 {vs_exact} vs float64"
            );
            // Token t alone gives the same bits as token t within the chunk.
            for t in 0..n {
                let mut one = vec![f32::NAN; rows];
                matmul(level, &x[t * cols..(t + 1) * cols], 1, &mut one);
                let chunk = &got[t * rows..(t + 1) * rows];
                assert!(
                    one.iter()
                        .zip(chunk)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{label} [{rows}, {cols}] n={n} {level:?}: token {t} differs alone"
                );
            }
        }
    }
}

#[test]
fn simd_dense_kernels_match_portable_on_awkward_shapes() {
    let mut rng = StdRng::seed_from_u64(17);
    for (rows, cols) in AWKWARD {
        let values = random_values(&mut rng, rows * cols);
        for fmt in FORMATS {
            let m = DenseMatrix::from_f32(rows, cols, values.clone(), fmt).unwrap();
            let w = m.dequantize();
            check_levels(
                &format!("{fmt:?}"),
                &w,
                rows,
                cols,
                &mut rng,
                |l, x, n, y| m.matmul_with(l, x, n, y),
            );
        }
    }
}

#[test]
fn simd_mxfp4_kernels_match_portable_on_awkward_shapes() {
    let mut rng = StdRng::seed_from_u64(19);
    for (rows, cols) in [(1, 32), (3, 96), (7, 64), (11, 320), (5, 3584), (9, 7168)] {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random::<u8>()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.random_range(110..=140))
            .collect();
        let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
        let w = view.dequantize();
        check_levels("Mxfp4", &w, rows, cols, &mut rng, |l, x, n, y| {
            view.matmul_with(l, x, n, y)
        });
    }
}

#[test]
fn simd_level_names_parse_and_unsupported_levels_are_refused() {
    for level in SimdLevel::available() {
        assert_eq!(SimdLevel::from_name(level.name()).unwrap(), level);
    }
    assert_eq!(SimdLevel::from_name("auto").unwrap(), SimdLevel::detect());
    let e = SimdLevel::from_name("sse9").unwrap_err().to_string();
    assert!(e.contains("K3_SIMD") && e.contains("portable"), "{e}");
    for level in [SimdLevel::Avx2Fma, SimdLevel::Neon] {
        if !level.is_supported() {
            let e = SimdLevel::from_name(level.name()).unwrap_err().to_string();
            assert!(e.contains("cannot run"), "{e}");
        }
    }
}

#[test]
fn quantizing_bf16_rows_equals_quantizing_their_widened_values() {
    let mut rng = StdRng::seed_from_u64(23);
    let (rows, cols) = (37, 131);
    let bits: Vec<u16> = (0..rows * cols)
        .map(|_| (rng.random::<u16>() & 0x807F) | (rng.random_range(0x70..0x88u16) << 7))
        .collect();
    let widened: Vec<f32> = bits
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    for fmt in [DenseFormat::Int8, DenseFormat::Int4] {
        let a = DenseMatrix::from_bf16(rows, cols, bits.clone(), fmt).unwrap();
        let b = DenseMatrix::from_f32(rows, cols, widened.clone(), fmt).unwrap();
        assert_eq!(format!("{:?}", a.data), format!("{:?}", b.data), "{fmt:?}");
    }
    let mut bad = bits;
    bad[5 * cols + 9] = 0x7FC0; // NaN
    let e = DenseMatrix::from_bf16(rows, cols, bad, DenseFormat::Int4).unwrap_err();
    assert!(e.to_string().contains("row 5, column 9"), "{e}");
}
