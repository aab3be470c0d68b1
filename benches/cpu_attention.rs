//! The CPU vector kernels of the KDA state update and the MLA attention at K3 shapes, on
//! ONE core, on every SIMD level this CPU has, against the portable kernels in the same
//! run (`speedup` = portable time / level time; every level gives the portable bits).
//!
//! Cases: the delta-rule step of all 96 KDA heads of one layer for one token (head width
//! 128, states 6 MiB together); one MLA head over a latent cache of 512, 4096 and 16384
//! positions (kv_lora 512, nope 128, rope 64, v 128); and the two primitives the scores
//! and the context use, over a 4096-position cache. Each figure is the best of its rounds.
//! `cargo bench --bench cpu_attention [-- FILTER]` (FILTER: a substring of the case names).

use k3::quant::simd::vector::{self, MlaHead};
use k3::quant::simd::SimdLevel;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

/// Timed rounds per case and level; the best is reported.
const ROUNDS: usize = 7;
/// K3's KDA heads and head width.
const KDA_HEADS: usize = 96;
const KDA_DIM: usize = 128;
/// K3's MLA latent, query and value widths.
const KV_LORA: usize = 512;
const NOPE: usize = 128;
const ROPE: usize = 64;
const V: usize = 128;

fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Best seconds of `ROUNDS` calls of `f` (after one warm-up call), `f` repeated `reps`
/// times per round.
fn best_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

/// A case: its name and, for a level, one timed call.
type Case = (String, Box<dyn FnMut(SimdLevel)>);

fn kda_case(rng: &mut StdRng) -> Case {
    let mut states = random(rng, KDA_HEADS * KDA_DIM * KDA_DIM, 0.1);
    let alpha: Vec<f32> = (0..KDA_DIM).map(|_| rng.random_range(0.9..1.0)).collect();
    let (k, q, v) = (
        random(rng, KDA_DIM, 0.1),
        random(rng, KDA_DIM, 0.1),
        random(rng, KDA_DIM, 1.0),
    );
    let mut o = vec![0.0f32; KDA_DIM];
    let name = format!("kda_step_{KDA_HEADS}x{KDA_DIM}");
    (
        name,
        Box::new(move |level| {
            for s in states.chunks_exact_mut(KDA_DIM * KDA_DIM) {
                vector::kda_delta_step(level, s, &alpha, &k, &q, &v, 0.5, &mut o);
                black_box(&o);
            }
        }),
    )
}

fn mla_case(rng: &mut StdRng, positions: usize) -> Case {
    let (q_nope, q_rope) = (random(rng, NOPE, 1.0), random(rng, ROPE, 1.0));
    let (wk, wv) = (
        random(rng, NOPE * KV_LORA, 0.1),
        random(rng, V * KV_LORA, 0.1),
    );
    let latent = random(rng, positions * KV_LORA, 1.0);
    let rope = random(rng, positions * ROPE, 1.0);
    let mut out = vec![0.0f32; V];
    (
        format!("mla_head_{positions}"),
        Box::new(move |level| {
            let head = MlaHead {
                q_nope: &q_nope,
                q_rope: &q_rope,
                wk: &wk,
                wv: &wv,
                latent: &latent,
                rope: &rope,
                positions,
                kv_lora: KV_LORA,
                scale: 1.0 / ((NOPE + ROPE) as f32).sqrt(),
            };
            vector::mla_head(level, &head, &mut out);
            black_box(&out);
        }),
    )
}

fn primitive_cases(rng: &mut StdRng, positions: usize) -> [Case; 2] {
    let latent = random(rng, positions * KV_LORA, 1.0);
    let x = random(rng, KV_LORA, 1.0);
    let probs = random(rng, positions, 1.0 / positions as f32);
    let shared = std::sync::Arc::new(latent);
    let (l1, l2) = (shared.clone(), shared);
    let mut scores = vec![0.0f32; positions];
    let mut ctx = vec![0.0f32; KV_LORA];
    [
        (
            format!("dot_rows_{positions}x{KV_LORA}"),
            Box::new(move |level| {
                vector::dot_rows(level, &l1, &x, &mut scores);
                black_box(&scores);
            }),
        ),
        (
            format!("axpy_rows_{positions}x{KV_LORA}"),
            Box::new(move |level| {
                ctx.fill(0.0);
                vector::axpy_rows(level, &l2, &probs, &mut ctx);
                black_box(&ctx);
            }),
        ),
    ]
}

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut rng = StdRng::seed_from_u64(3);
    let mut cases = vec![kda_case(&mut rng)];
    for positions in [512, 4096, 16384] {
        cases.push(mla_case(&mut rng, positions));
    }
    cases.extend(primitive_cases(&mut rng, 4096));
    println!("one core; microseconds per call, best of {ROUNDS}; speedup = portable / level");
    println!(
        "{:<22} {:>10} {:>12} {:>8}",
        "case", "level", "us", "speedup"
    );
    for (name, mut run) in cases {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let mut portable = None;
        for level in SimdLevel::available() {
            // About 50 ms per round whatever the case's size.
            let once = best_secs(1, || run(level));
            let reps = ((0.05 / once) as usize).clamp(1, 10_000);
            let secs = best_secs(reps, || run(level));
            let base = *portable.get_or_insert(secs);
            println!(
                "{name:<22} {:>10} {:>12.2} {:>8.2}",
                level.name(),
                secs * 1e6,
                base / secs
            );
        }
    }
}
