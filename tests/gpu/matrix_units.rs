//! The few-row int4 and int8 matmuls on the matrix units (matmul_coop.wgsl) against the
//! CPU: 2 to 8 rows of x, widths that leave a partial 64-column step, row counts that leave
//! a partial workgroup, at each subgroup count, alone and sharing x's f16 parts in one
//! `matmul_many` call. Only an adapter with 16x16x16 f16 matrix units runs them (Mesa's
//! lavapipe, in CI, has none); elsewhere the test shows the device was opened without them.

use crate::support::rel_l2;
use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::kernels::matrix_units::SUBGROUP_COUNTS;
use k3::backend::gpu::{GpuBackend, GpuOptions};
use k3::backend::Backend;
use k3::quant::{DenseFormat, DenseMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// x reaches the matrix units with 22 bits an entry; the matrix units sum in f32 at their
/// own precision (an int8 row is one product chain): the GPU tests' f32 tolerance.
const TOL: f64 = 1e-5;

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite values"
    );
    let e = rel_l2(got, want);
    assert!(e <= TOL, "{what}: rel L2 {e:e} > {TOL:e}");
}

fn passes_of(g: &GpuBackend, entry: &str) -> u64 {
    g.ctx
        .profile_by_entry()
        .and_then(|p| p.get(entry).map(|e| e.0))
        .unwrap_or(0)
}

#[test]
fn few_row_matmuls_on_the_matrix_units_match_cpu() {
    let mut rng = StdRng::seed_from_u64(71);
    let c = CpuBackend::new();
    for sgs in SUBGROUP_COUNTS {
        let opts = GpuOptions {
            allow_cpu_adapter: true,
            profile: true,
            matrix_units: Some(sgs),
            ..Default::default()
        };
        let g = match GpuBackend::new(&opts) {
            Ok(g) => g,
            Err(e) => {
                assert!(
                    std::env::var("CI").map_or(true, |v| v != "true"),
                    "no adapter opens with matrix units asked: {e:#}"
                );
                return;
            }
        };
        if g.ctx.matrix_units.is_none() {
            let names = g.ctx.adapter.get_info().name;
            assert!(
                !k3::backend::gpu::device::adapters::has_matrix_units(&g.ctx.adapter),
                "{names} has matrix units, yet the device was opened without them"
            );
            eprintln!("{names}: no matrix units, nothing to run");
            return;
        }
        assert_eq!(g.ctx.matrix_units, Some(sgs));
        for fmt in [DenseFormat::Int8, DenseFormat::Int4] {
            for (n, rows, cols) in [
                (2, 77, 70),
                (3, 1000, 1000),
                (5, 4100, 5100),
                (8, 300, 2000),
            ] {
                let w =
                    DenseMatrix::from_f32(rows, cols, rand_vec(&mut rng, rows * cols, 0.5), fmt)
                        .unwrap();
                let x = rand_vec(&mut rng, n * cols, 1.0);
                let gm = g.load_matrix(w.clone()).unwrap();
                let got = g
                    .download(&g.matmul(&gm, &g.upload(&x, n, cols).unwrap()).unwrap())
                    .unwrap();
                let want = c.matmul(&w, &c.upload(&x, n, cols).unwrap()).unwrap().data;
                check(
                    &format!("{fmt:?} SGS {sgs} n={n} {rows}x{cols}"),
                    &got,
                    &want,
                );
            }
        }
        // Two widths in one call: each gets its own f16 parts of x.
        let n = 4;
        let ws: Vec<DenseMatrix> = [(DenseFormat::Int4, 500), (DenseFormat::Int8, 260)]
            .into_iter()
            .map(|(fmt, rows)| {
                DenseMatrix::from_f32(rows, 900, rand_vec(&mut rng, rows * 900, 0.5), fmt).unwrap()
            })
            .collect();
        let x = rand_vec(&mut rng, n * 900, 3.0);
        let gms: Vec<_> = ws
            .iter()
            .map(|w| g.load_matrix(w.clone()).unwrap())
            .collect();
        let refs: Vec<_> = gms.iter().collect();
        let outs = g
            .matmul_many(&refs, &g.upload(&x, n, 900).unwrap())
            .unwrap();
        for (w, out) in ws.iter().zip(&outs) {
            let want = c.matmul(w, &c.upload(&x, n, 900).unwrap()).unwrap().data;
            check(
                &format!("matmul_many {:?} SGS {sgs}", w.format()),
                &g.download(out).unwrap(),
                &want,
            );
        }
        if g.ctx.has_timestamps() {
            assert!(passes_of(&g, "coop_int4") > 0 && passes_of(&g, "coop_int8") > 0);
            assert!(passes_of(&g, "x_halves") > 0);
            assert_eq!(passes_of(&g, "dense_few"), 0);
        }
    }
}
