//! Decode matvec (n = 1) of every weight format at K3 shapes on ONE core, against a plain
//! read of the same bytes in the same run (the memory roofline a matvec is judged by), on
//! every SIMD level this CPU has; the chunk matmul (n = 8) of the same matrices; and a
//! prefill-shaped matmul (n = [`PREFILL_TOKENS`]) on every core, the shape a prompt
//! window's dense layers and a busy expert run.
//!
//! Each case cycles through enough copies of its matrix to exceed the last-level cache, so
//! both the kernel and the read stream from memory; each figure is the best of its rounds.
//! MXFP4 cases also run the `K3_IDOT=1` integer-dot kernels (`idot-*` rows, x quantized
//! to int8 groups inside each call, as the MoE does).
//! `cargo bench --bench matvec [-- FILTER]` (FILTER: a substring of the case names).

use k3::quant::idot::{self, IdotKernel, QuantizedActs};
use k3::quant::simd::SimdLevel;
use k3::quant::{DenseData, DenseMatrix, Mxfp4View};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

/// Bytes the copies of one case span together (beyond any last-level cache here).
const SPAN: usize = 512 << 20;
/// Timed passes over all copies; the best pass is reported.
const ROUNDS: usize = 5;
/// Tokens of the prefill-shaped column: a 256-token window through a dense matrix.
const PREFILL_TOKENS: usize = 256;
/// K3's hidden width, the columns of most dense matrices and of the experts' gate/up.
const HIDDEN: usize = 7168;

/// Sums every word: touches each byte once, as a matvec must.
fn read_sum(buf: &[u64]) -> u64 {
    let mut acc = [0u64; 4];
    for w in buf.chunks_exact(4) {
        for i in 0..4 {
            acc[i] = acc[i].wrapping_add(w[i]);
        }
    }
    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// Best GB/s of `ROUNDS` passes of `f` over `copies` items of `bytes` each.
fn best_gbs(bytes: usize, copies: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for i in 0..copies {
            f(i);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (bytes * copies) as f64 / best / 1e9
}

/// `matmul(copy, level, x, n, y)` of one case.
type CopyMatmul = Box<dyn Fn(usize, SimdLevel, &[f32], usize, &mut [f32]) + Send + Sync>;

/// The `K3_IDOT=1` matmul of copy `i` of an MXFP4 case (x quantized inside, as in the MoE).
type CopyIdot = Box<dyn Fn(usize, IdotKernel, &[f32], usize, &mut [f32]) + Send + Sync>;

/// One bench case: its payload size and the matmul of copy `i` for each level.
struct Case {
    name: String,
    bytes: usize,
    copies: usize,
    rows: usize,
    cols: usize,
    matmul: CopyMatmul,
    /// MXFP4 cases only.
    idot: Option<CopyIdot>,
}

fn dense_case(rng: &mut StdRng, name: &str, rows: usize, cols: usize, int4: bool) -> Case {
    let make = |rng: &mut StdRng| {
        let data = if int4 {
            let q = (0..rows * cols.div_ceil(2)).map(|_| rng.random()).collect();
            let scale = (0..rows * cols.div_ceil(64))
                .map(|_| rng.random())
                .collect();
            DenseData::Int4 { q, scale }
        } else {
            let q = (0..rows * cols)
                .map(|_| rng.random_range(-127..=127))
                .collect();
            let scale = (0..rows).map(|_| rng.random()).collect();
            DenseData::Int8 { q, scale }
        };
        DenseMatrix { rows, cols, data }
    };
    let first = make(rng);
    let bytes = first.byte_size();
    let copies = SPAN.div_ceil(bytes);
    let mut ms = vec![first];
    ms.extend((1..copies).map(|_| make(rng)));
    Case {
        name: format!("{name}_{rows}x{cols}"),
        bytes,
        copies,
        rows,
        cols,
        matmul: Box::new(move |i, l, x, n, y| ms[i].matmul_with(l, x, n, y)),
        idot: None,
    }
}

fn mxfp4_case(rng: &mut StdRng, rows: usize, cols: usize) -> Case {
    let bytes = rows * cols / 2 + rows * cols / 32;
    let copies = SPAN.div_ceil(bytes);
    let data: std::sync::Arc<Vec<(Vec<u8>, Vec<u8>)>> = (0..copies)
        .map(|_| {
            let packed = (0..rows * cols / 2).map(|_| rng.random()).collect();
            let scales = (0..rows * cols / 32)
                .map(|_| rng.random_range(118..=124))
                .collect();
            (packed, scales)
        })
        .collect::<Vec<_>>()
        .into();
    let shared = data.clone();
    Case {
        name: format!("Mxfp4_{rows}x{cols}"),
        bytes,
        copies,
        rows,
        cols,
        matmul: Box::new(move |i, l, x, n, y| {
            let (p, s) = &data[i];
            let view = Mxfp4View::new(rows, cols, p, s).expect("bench shape");
            view.matmul_with(l, x, n, y);
        }),
        idot: Some(Box::new(move |i, k, x, n, y| {
            let (p, s) = &shared[i];
            let view = Mxfp4View::new(rows, cols, p, s).expect("bench shape");
            idot::matmul(k, &view, &QuantizedActs::new(x, n, cols), y);
        })),
    }
}

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let all_cores = rayon::ThreadPoolBuilder::new()
        .build()
        .expect("a pool of every core");
    let mut rng = StdRng::seed_from_u64(1);
    let shapes: [(&str, usize, usize); 7] = [
        ("Int4", 2048, HIDDEN),
        ("Int4", 12288, HIDDEN),
        ("Int8", 2048, HIDDEN),
        ("Int8", 12288, HIDDEN),
        ("Mxfp4", 2048, HIDDEN),
        ("Mxfp4", 12288, HIDDEN),
        ("Mxfp4", HIDDEN, 2048),
    ];
    println!(
        "one core; GB/s of payload (weights + scales), best of {ROUNDS}; ratio = matvec / read"
    );
    println!(
        "{:<20} {:>8} {:>8} {:>10} {:>8} {:>14} {:>18}",
        "case",
        "read",
        "level",
        "matvec",
        "ratio",
        "n=8 Gflop/s",
        format!("n={PREFILL_TOKENS} all cores")
    );
    for (fmt, rows, cols) in shapes {
        let label = format!("{fmt}_{rows}x{cols}");
        if filter.as_ref().is_some_and(|f| !label.contains(f.as_str())) {
            continue;
        }
        let case = match fmt {
            "Mxfp4" => mxfp4_case(&mut rng, rows, cols),
            f => dense_case(&mut rng, f, rows, cols, f == "Int4"),
        };
        let read_buf: Vec<u64> = (0..(case.bytes * case.copies).div_ceil(8) as u64).collect();
        let words = case.bytes.div_ceil(8);
        pool.install(|| {
            let read = best_gbs(case.bytes, case.copies, |i| {
                let end = ((i + 1) * words).min(read_buf.len());
                black_box(read_sum(black_box(&read_buf[i * words..end])));
            });
            let x: Vec<f32> = (0..8 * case.cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let mut y = vec![0f32; 8 * case.rows];
            let xp: Vec<f32> = (0..PREFILL_TOKENS * case.cols)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let mut yp = vec![0f32; PREFILL_TOKENS * case.rows];
            // Flops per payload byte of one n-token matmul over one copy.
            let per_byte = |n: usize| 2.0 * (n * case.rows * case.cols) as f64 / case.bytes as f64;
            for level in SimdLevel::available() {
                let mv = best_gbs(case.bytes, case.copies, |i| {
                    (case.matmul)(i, level, &x[..case.cols], 1, &mut y[..case.rows]);
                    black_box(&y);
                });
                // Flops per payload byte, so best_gbs's figure converts to Gflop/s.
                let gflops = per_byte(8)
                    * best_gbs(case.bytes, 1, |_| {
                        (case.matmul)(0, level, &x, 8, &mut y);
                        black_box(&y);
                    });
                let prefill = per_byte(PREFILL_TOKENS)
                    * all_cores.install(|| {
                        best_gbs(case.bytes, 1, |_| {
                            (case.matmul)(0, level, &xp, PREFILL_TOKENS, &mut yp);
                            black_box(&yp);
                        })
                    });
                println!(
                    "{:<20} {read:>8.2} {:>8} {mv:>10.2} {:>8.3} {gflops:>14.2} {prefill:>18.2}",
                    case.name,
                    level.name(),
                    mv / read
                );
            }
            let Some(idot) = &case.idot else { return };
            for kernel in IdotKernel::available() {
                let mv = best_gbs(case.bytes, case.copies, |i| {
                    idot(i, kernel, &x[..case.cols], 1, &mut y[..case.rows]);
                    black_box(&y);
                });
                let gflops = per_byte(8)
                    * best_gbs(case.bytes, 1, |_| {
                        idot(0, kernel, &x, 8, &mut y);
                        black_box(&y);
                    });
                let prefill = per_byte(PREFILL_TOKENS)
                    * all_cores.install(|| {
                        best_gbs(case.bytes, 1, |_| {
                            idot(0, kernel, &xp, PREFILL_TOKENS, &mut yp);
                            black_box(&yp);
                        })
                    });
                println!(
                    "{:<20} {read:>8.2} {:>8} {mv:>10.2} {:>8.3} {gflops:>14.2} {prefill:>18.2}",
                    case.name,
                    format!("idot-{}", kernel.name()),
                    mv / read
                );
            }
        });
    }
}
