//! Runs the vector kernels of `src/quant/simd/vector.rs` on every SIMD level this CPU has
//! against their portable forms on awkward shapes and exits non-zero on any differing bit:
//! a dependency-free build of that one file, cheap to cross-compile and run under
//! qemu-aarch64. The dot product is a copy of `kernel::dot` (the portable reference).

/// The part of `k3::quant` that `vector.rs` names besides the level.
mod quant {
    pub mod kernel {
        const LANES: usize = 16;

        /// Copy of `k3::quant::kernel::dot` (sixteen lanes, sequential tail, pairwise fold).
        pub fn dot(a: &[f32], b: &[f32]) -> f32 {
            let mut acc = [0f32; LANES];
            let ca = a.chunks_exact(LANES);
            let cb = b.chunks_exact(LANES);
            let (ta, tb) = (ca.remainder(), cb.remainder());
            for (x, y) in ca.zip(cb) {
                for i in 0..LANES {
                    acc[i] += x[i] * y[i];
                }
            }
            let mut tail = 0f32;
            for (x, y) in ta.iter().zip(tb) {
                tail += x * y;
            }
            let mut width = LANES / 2;
            while width > 0 {
                for i in 0..width {
                    acc[i] += acc[i + width];
                }
                width /= 2;
            }
            acc[0] + tail
        }
    }
}

/// The levels of `k3::quant::simd::SimdLevel`, detected the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Portable,
    Avx2Fma,
    Avx512,
    Neon,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2Fma => "avx2+fma",
            Self::Avx512 => "avx512",
            Self::Neon => "neon",
        }
    }

    pub fn is_supported(self) -> bool {
        match self {
            Self::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                Self::Avx2Fma.is_supported() && std::arch::is_x86_feature_detected!("avx512f")
            }
            #[cfg(target_arch = "aarch64")]
            Self::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

#[path = "../../../src/quant/simd/vector.rs"]
#[allow(dead_code)]
mod vector;

/// A small xorshift generator: values in `[-scale, scale)`.
struct Rng(u64);

impl Rng {
    fn next(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.next(scale)).collect()
    }
}

fn same(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn main() {
    let levels: Vec<SimdLevel> = [SimdLevel::Avx2Fma, SimdLevel::Avx512, SimdLevel::Neon]
        .into_iter()
        .filter(|l| l.is_supported())
        .collect();
    println!("levels checked: {levels:?}");
    if levels.is_empty() {
        println!("no SIMD level on this CPU: nothing checked");
        std::process::exit(1);
    }
    let (mut rng, mut failures, mut checks) = (Rng(0x9E37_79B9_7F4A_7C15), 0, 0);
    let widths = [1, 3, 4, 7, 15, 17, 31, 33, 64, 100, 128, 513];
    let port = SimdLevel::Portable;
    for &level in &levels {
        let mut check = |what: String, ok: bool| {
            checks += 1;
            if !ok {
                failures += 1;
                println!("DIFFERS: {what} on {}", level.name());
            }
        };
        for n in widths {
            for rows in [1, 2, 5, 19] {
                let m = rng.vec(rows * n, 1.0);
                let x = rng.vec(n, 1.0);
                let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
                vector::dot_rows(port, &m, &x, &mut a);
                vector::dot_rows(level, &m, &x, &mut b);
                check(format!("dot_rows [{rows}, {n}]"), same(&a, &b));
                let coef = rng.vec(rows, 1.0);
                let (mut a, mut b) = (x.clone(), x.clone());
                vector::axpy_rows(port, &m, &coef, &mut a);
                vector::axpy_rows(level, &m, &coef, &mut b);
                check(format!("axpy_rows [{rows}, {n}]"), same(&a, &b));
            }
            for rows in [1, 3, 17, n] {
                let s0 = rng.vec(rows * n, 1.0);
                let alpha: Vec<f32> = (0..rows).map(|_| 0.75 + rng.next(0.25)).collect();
                let (k, q) = (rng.vec(rows, 1.0), rng.vec(rows, 1.0));
                let (mut sa, mut sb) = (s0.clone(), s0);
                let u0 = rng.vec(n, 1.0);
                let (mut ua, mut ub) = (u0.clone(), u0);
                vector::decay_project(port, &mut sa, &alpha, &k, &mut ua);
                vector::decay_project(level, &mut sb, &alpha, &k, &mut ub);
                check(
                    format!("decay_project [{rows}, {n}]"),
                    same(&sa, &sb) && same(&ua, &ub),
                );
                let delta = rng.vec(n, 1.0);
                let (mut oa, mut ob) = (vec![0.0; n], vec![0.0; n]);
                vector::update_project(port, &mut sa, &k, &delta, &q, &mut oa);
                vector::update_project(level, &mut sb, &k, &delta, &q, &mut ob);
                check(
                    format!("update_project [{rows}, {n}]"),
                    same(&sa, &sb) && same(&oa, &ob),
                );
            }
        }
        for (kv, nope, rope, v, positions) in [
            (7, 3, 1, 5, 1),
            (33, 9, 0, 17, 4),
            (100, 31, 13, 7, 130),
            (512, 128, 64, 128, 40),
        ] {
            let (qn, qr) = (rng.vec(nope, 1.0), rng.vec(rope, 1.0));
            let (wk, wv) = (rng.vec(nope * kv, 0.2), rng.vec(v * kv, 0.2));
            let (latent, rc) = (rng.vec(positions * kv, 1.0), rng.vec(positions * rope, 1.0));
            let head = vector::MlaHead {
                q_nope: &qn,
                q_rope: &qr,
                wk: &wk,
                wv: &wv,
                latent: &latent,
                rope: &rc,
                positions,
                kv_lora: kv,
                scale: 0.1,
            };
            let (mut a, mut b) = (vec![0.0; v], vec![0.0; v]);
            vector::mla_head(port, &head, &mut a);
            vector::mla_head(level, &head, &mut b);
            check(format!("mla_head kv={kv} len={positions}"), same(&a, &b));
        }
    }
    println!("{checks} checks, {failures} differ from portable");
    if failures > 0 {
        std::process::exit(1);
    }
}
