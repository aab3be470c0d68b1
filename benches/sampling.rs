//! The greedy pick over K3's vocabulary (163,840 logits, one row of a decode step): the
//! library's `argmax_lowest` against the plain compare-and-branch loop it replaced, in one run.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use k3::sampling::argmax_lowest;
use std::hint::black_box;

/// K3's vocabulary.
const VOCAB: usize = 163_840;

/// The plain loop: the lowest index of the largest value.
fn argmax_by_loop(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

fn bench(c: &mut Criterion) {
    // Logits-like values with the maximum two thirds of the way in.
    let mut logits: Vec<f32> = (0..VOCAB)
        .map(|i| ((i * 7919) % 1000) as f32 * 0.01)
        .collect();
    logits[VOCAB * 2 / 3] = 20.0;
    let mut g = c.benchmark_group("argmax");
    g.throughput(Throughput::Elements(VOCAB as u64));
    g.bench_function("argmax_lowest 163840", |b| {
        b.iter(|| argmax_lowest(black_box(&logits)))
    });
    g.bench_function("plain loop 163840", |b| {
        b.iter(|| argmax_by_loop(black_box(&logits)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
