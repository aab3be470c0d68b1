//! Tokenizer throughput: encode and decode of ~2 MB of mixed prose, code and CJK, in MB/s.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use k3::tokenizer::Tokenizer;
use std::path::Path;

fn bench(c: &mut Criterion) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tok = Tokenizer::from_dir(&root.join("tests/fixtures/tokenizer/synthetic"))
        .expect("fixture tokenizer");
    let unit =
        std::fs::read_to_string(root.join("src/tokenizer/synthetic_corpus.txt")).expect("corpus");
    let text = unit.repeat((2 << 20) / unit.len() + 1);
    let ids = tok.encode(&text);
    let mut g = c.benchmark_group("tokenizer");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("encode", |b| b.iter(|| tok.encode(&text)));
    g.bench_function("decode", |b| b.iter(|| tok.decode(&ids, false)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
