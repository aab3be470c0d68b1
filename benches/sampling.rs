//! One row's pick over K3's vocabulary (163,840 logits, a row of a decode step): the greedy
//! `argmax_lowest` against the plain compare-and-branch loop it replaced, in one run; and the
//! sampler's draw at a temperature, alone and with the usual top-k and top-p cuts.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use k3::sampling::{argmax_lowest, Sampler, SamplerConfig};
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
    let mut g = c.benchmark_group("sample");
    g.throughput(Throughput::Elements(VOCAB as u64));
    for (name, top_k, top_p) in [
        ("temperature 1", 0, 1.0),
        ("temperature 1, top-k 40", 40, 1.0),
        ("temperature 1, top-p 0.95", 0, 0.95),
    ] {
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k,
            top_p,
            ..SamplerConfig::default()
        };
        let mut s = Sampler::new(cfg).expect("a valid sampler configuration");
        g.bench_function(format!("{name} 163840"), |b| {
            b.iter(|| s.sample(black_box(&logits), &[]))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
