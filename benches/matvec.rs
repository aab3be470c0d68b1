//! Decode matvec (n = 1) of every weight format against a plain parallel read of the same
//! number of bytes: the read is the memory-bandwidth roofline the matvec is judged by.

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use k3::quant::{DenseFormat, DenseMatrix, Mxfp4View};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::hint::black_box;

/// The widest dense projection shape of K3 (`[out, in]`).
const DENSE: (usize, usize) = (4096, 7168);
/// One routed expert matrix.
const EXPERT: (usize, usize) = (3072, 3584);
/// Words per rayon task of the read kernel (512 KiB).
const READ_CHUNK: usize = 1 << 16;

/// Sums every word of `buf` in parallel: touches each byte once, like a matvec must.
fn read_sum(buf: &[u64]) -> u64 {
    buf.par_chunks(READ_CHUNK)
        .map(|c| {
            let mut acc = [0u64; 4];
            for w in c.chunks_exact(4) {
                for i in 0..4 {
                    acc[i] = acc[i].wrapping_add(w[i]);
                }
            }
            acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// Benchmarks `matvec` and the read kernel over the same byte count in one group.
fn pair(c: &mut Criterion, name: &str, bytes: usize, mut matvec: impl FnMut()) {
    let buf: Vec<u64> = (0..bytes.div_ceil(8) as u64).collect();
    let mut g: BenchmarkGroup<_> = c.benchmark_group(name);
    g.throughput(Throughput::BytesDecimal(bytes as u64));
    g.sample_size(10);
    g.bench_function("matvec", |b| b.iter(&mut matvec));
    g.bench_function("read", |b| b.iter(|| black_box(read_sum(black_box(&buf)))));
    g.finish();
}

fn dense(c: &mut Criterion) {
    let (rows, cols) = DENSE;
    let mut rng = StdRng::seed_from_u64(1);
    let values: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut y = vec![0f32; rows];
    for fmt in [
        DenseFormat::F32,
        DenseFormat::Bf16,
        DenseFormat::Int8,
        DenseFormat::Int4,
    ] {
        let m = DenseMatrix::from_f32(rows, cols, values.clone(), fmt).unwrap();
        let name = format!("{fmt:?}_{rows}x{cols}");
        pair(c, &name, m.byte_size(), || {
            m.matmul(black_box(&x), 1, &mut y);
            black_box(&y);
        });
    }
}

fn mxfp4(c: &mut Criterion) {
    let (rows, cols) = EXPERT;
    let mut rng = StdRng::seed_from_u64(2);
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| rng.random_range(120..=130))
        .collect();
    let view = Mxfp4View::new(rows, cols, &packed, &scales).unwrap();
    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut y = vec![0f32; rows];
    let name = format!("Mxfp4_{rows}x{cols}");
    pair(c, &name, packed.len() + scales.len(), || {
        view.matmul(black_box(&x), 1, &mut y);
        black_box(&y);
    });
}

criterion_group!(benches, dense, mxfp4);
criterion_main!(benches);
