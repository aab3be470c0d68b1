//! The vector kernels of the KDA state update and the MLA attention (the portable bits on
//! every level), and the AVX-512 exact row kernels (relative L2 ≤ 1e-6), on every SIMD
//! level this CPU has, against the portable reference on random inputs of awkward shapes.

use crate::support;

use k3::quant::simd::vector::{self, MlaHead};
use k3::quant::simd::SimdLevel;
use k3::quant::{DenseFormat, DenseMatrix, Mxfp4View};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::rel_l2;

/// Row widths around every lane count (4, 8, 16) and block (4·W, 8·W), K3's own among them.
const WIDTHS: [usize; 12] = [1, 3, 4, 7, 15, 17, 31, 33, 64, 100, 128, 513];

fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The SIMD levels this CPU has, the portable reference excluded (printed, so a run says
/// what it checked).
fn simd_levels() -> Vec<SimdLevel> {
    let levels: Vec<SimdLevel> = SimdLevel::available()
        .into_iter()
        .filter(|&l| l != SimdLevel::Portable)
        .collect();
    eprintln!("SIMD levels checked against portable: {levels:?}");
    levels
}

/// The vector kernels perform the portable operations in the portable order: same bits.
fn assert_same(label: &str, level: SimdLevel, got: &[f32], want: &[f32]) {
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        differ == 0,
        "{label} on {}: {differ} of {} values differ from portable (rel L2 {})",
        level.name(),
        want.len(),
        rel_l2(got, want)
    );
}

fn assert_close(label: &str, level: SimdLevel, got: &[f32], want: &[f32]) {
    let err = rel_l2(got, want);
    assert!(
        err <= 1e-6,
        "{label} on {}: rel L2 {err} vs portable",
        level.name()
    );
}

#[test]
fn dot_and_axpy_rows_give_the_portable_bits_on_awkward_shapes() {
    let mut rng = StdRng::seed_from_u64(31);
    for level in simd_levels() {
        for n in WIDTHS {
            for rows in [1, 2, 5, 19] {
                let m = random(&mut rng, rows * n, 1.0);
                let x = random(&mut rng, n, 1.0);
                let (mut want, mut got) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                vector::dot_rows(SimdLevel::Portable, &m, &x, &mut want);
                vector::dot_rows(level, &m, &x, &mut got);
                assert_same(&format!("dot_rows [{rows}, {n}]"), level, &got, &want);

                let coef = random(&mut rng, rows, 1.0);
                let start = random(&mut rng, n, 1.0);
                let (mut want, mut got) = (start.clone(), start);
                vector::axpy_rows(SimdLevel::Portable, &m, &coef, &mut want);
                vector::axpy_rows(level, &m, &coef, &mut got);
                assert_same(&format!("axpy_rows [{rows}, {n}]"), level, &got, &want);
            }
        }
    }
}

#[test]
fn delta_rule_passes_give_the_portable_bits_on_awkward_shapes() {
    let mut rng = StdRng::seed_from_u64(37);
    for level in simd_levels() {
        for n in WIDTHS {
            for rows in [1, 3, 17, n] {
                let s0 = random(&mut rng, rows * n, 1.0);
                let alpha: Vec<f32> = (0..rows).map(|_| rng.random_range(0.5..1.0)).collect();
                let k = random(&mut rng, rows, 1.0);
                let (mut sw, mut sg) = (s0.clone(), s0);
                let u0 = random(&mut rng, n, 1.0);
                let (mut uw, mut ug) = (u0.clone(), u0);
                vector::decay_project(SimdLevel::Portable, &mut sw, &alpha, &k, &mut uw);
                vector::decay_project(level, &mut sg, &alpha, &k, &mut ug);
                let label = format!("decay_project [{rows}, {n}]");
                assert_same(&format!("{label} state"), level, &sg, &sw);
                assert_same(&format!("{label} u"), level, &ug, &uw);

                let (delta, q) = (random(&mut rng, n, 1.0), random(&mut rng, rows, 1.0));
                let (mut ow, mut og) = (vec![0.0; n], vec![0.0; n]);
                vector::update_project(SimdLevel::Portable, &mut sw, &k, &delta, &q, &mut ow);
                vector::update_project(level, &mut sg, &k, &delta, &q, &mut og);
                let label = format!("update_project [{rows}, {n}]");
                assert_same(&format!("{label} state"), level, &sg, &sw);
                assert_same(&format!("{label} o"), level, &og, &ow);
            }
        }
    }
}

/// Unit-norm random vector, as the KDA step feeds its keys and queries.
fn unit(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let v = random(rng, n, 1.0);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.iter().map(|x| x / norm).collect()
}

#[test]
fn kda_delta_steps_give_the_portable_bits_over_many_tokens() {
    let mut rng = StdRng::seed_from_u64(41);
    for level in simd_levels() {
        for dk in [5, 16, 33, 128] {
            let (mut sw, mut sg) = (vec![0.0f32; dk * dk], vec![0.0f32; dk * dk]);
            let (mut ow, mut og) = (vec![0.0f32; dk], vec![0.0f32; dk]);
            for token in 0..24 {
                let alpha: Vec<f32> = (0..dk).map(|_| rng.random_range(0.8..1.0)).collect();
                let (k, q) = (unit(&mut rng, dk), unit(&mut rng, dk));
                let v = random(&mut rng, dk, 1.0);
                let beta = rng.random_range(0.0..1.0);
                vector::kda_delta_step(
                    SimdLevel::Portable,
                    &mut sw,
                    &alpha,
                    &k,
                    &q,
                    &v,
                    beta,
                    &mut ow,
                );
                vector::kda_delta_step(level, &mut sg, &alpha, &k, &q, &v, beta, &mut og);
                let label = format!("kda_delta_step dk={dk} token {token}");
                assert_same(&format!("{label} o"), level, &og, &ow);
                assert_same(&format!("{label} state"), level, &sg, &sw);
            }
        }
    }
}

#[test]
fn mla_heads_give_the_portable_bits_on_awkward_shapes() {
    let mut rng = StdRng::seed_from_u64(43);
    // (kv_lora, nope, rope, v, positions), K3's own last.
    let shapes = [
        (7, 3, 1, 5, 1),
        (33, 9, 0, 17, 4),
        (64, 16, 8, 16, 37),
        (100, 31, 13, 7, 130),
        (512, 128, 64, 128, 300),
    ];
    for level in simd_levels() {
        for (kv, nope, rope, v, positions) in shapes {
            let (q_nope, q_rope) = (random(&mut rng, nope, 1.0), random(&mut rng, rope, 1.0));
            let wk = random(&mut rng, nope * kv, 0.2);
            let wv = random(&mut rng, v * kv, 0.2);
            let latent = random(&mut rng, positions * kv, 1.0);
            let rope_cache = random(&mut rng, positions * rope, 1.0);
            let head = MlaHead {
                q_nope: &q_nope,
                q_rope: &q_rope,
                wk: &wk,
                wv: &wv,
                latent: &latent,
                rope: &rope_cache,
                positions,
                kv_lora: kv,
                scale: 1.0 / ((nope + rope) as f32).sqrt(),
            };
            let (mut want, mut got) = (vec![f32::NAN; v], vec![f32::NAN; v]);
            vector::mla_head(SimdLevel::Portable, &head, &mut want);
            vector::mla_head(level, &head, &mut got);
            let label = format!("mla_head kv={kv} nope={nope} rope={rope} v={v} len={positions}");
            assert_same(&label, level, &got, &want);
        }
    }
}

#[test]
#[should_panic(expected = "dot_rows: m must be")]
fn dot_rows_refuses_a_matrix_of_the_wrong_shape() {
    let mut out = [0.0f32; 3];
    vector::dot_rows(SimdLevel::detect(), &[0.0; 10], &[0.0; 4], &mut out);
}

#[test]
fn avx512_exact_kernels_match_portable_where_the_cpu_has_them() {
    if !SimdLevel::Avx512.is_supported() {
        eprintln!("SKIPPED: this CPU has no AVX-512F (the avx512 level is not available)");
        return;
    }
    let mut rng = StdRng::seed_from_u64(47);
    let formats = [
        DenseFormat::F32,
        DenseFormat::Bf16,
        DenseFormat::Int8,
        DenseFormat::Int4,
    ];
    for (rows, cols) in [
        (1, 1),
        (3, 17),
        (5, 63),
        (2, 65),
        (7, 129),
        (9, 300),
        (33, 7168),
    ] {
        let values = random(&mut rng, rows * cols, 2.0);
        for fmt in formats {
            let m = DenseMatrix::from_f32(rows, cols, values.clone(), fmt).unwrap();
            for n in [1, 2, 3, 4, 5, 9] {
                let x = random(&mut rng, n * cols, 2.0);
                let (mut want, mut got) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
                m.matmul_with(SimdLevel::Portable, &x, n, &mut want);
                m.matmul_with(SimdLevel::Avx512, &x, n, &mut got);
                let label = format!("{fmt:?} [{rows}, {cols}] n={n}");
                assert_close(&label, SimdLevel::Avx512, &got, &want);
            }
        }
    }
    for (rows, cols) in [(1, 32), (3, 96), (7, 64), (11, 320), (5, 3584), (9, 7168)] {
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random::<u8>()).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| rng.random_range(110..=140))
            .collect();
        let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
        for n in [1, 2, 3, 4, 5, 9] {
            let x = random(&mut rng, n * cols, 2.0);
            let (mut want, mut got) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
            view.matmul_with(SimdLevel::Portable, &x, n, &mut want);
            view.matmul_with(SimdLevel::Avx512, &x, n, &mut got);
            let label = format!("Mxfp4 [{rows}, {cols}] n={n}");
            assert_close(&label, SimdLevel::Avx512, &got, &want);
        }
    }
    eprintln!("avx512 exact kernels checked against portable: f32, bf16, int8, int4, MXFP4");
}

#[test]
fn k3_simd_avx512_is_parsed_and_refused_where_the_cpu_lacks_it() {
    match SimdLevel::from_name("avx512") {
        Ok(level) => {
            assert_eq!(level, SimdLevel::Avx512);
            assert!(level.is_supported());
            assert_eq!(level.name(), "avx512");
        }
        Err(e) => {
            let e = e.to_string();
            assert!(!SimdLevel::Avx512.is_supported(), "{e}");
            assert!(
                e.contains("K3_SIMD=avx512") && e.contains("cannot run"),
                "{e}"
            );
        }
    }
    let e = SimdLevel::from_name("avx1024").unwrap_err().to_string();
    assert!(e.contains("avx512") && e.contains("K3_SIMD"), "{e}");
    // The fastest level is the one chosen by default: AVX-512 wherever the CPU has it.
    if SimdLevel::Avx512.is_supported() {
        assert_eq!(SimdLevel::detect(), SimdLevel::Avx512);
    }
}
