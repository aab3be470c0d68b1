//! `k3 bench`: measurements that compare the engine with a plain baseline in the same run.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use k3::checkpoint::Checkpoint;
use k3::experts::{ExpertSource, IoMode, StreamConfig};
use k3::generate::{generate, GenerateOptions};
use k3::platform::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use k3::platform::positional_read::read_at;
use k3::platform::uncached_read::{open_uncached, UNCACHED_MECHANISM};
use k3::stats::{self, Stats};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Flags of `k3 bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchKind,
}

#[derive(Subcommand, Debug)]
enum BenchKind {
    /// Read every expert of one MoE layer through the engine's reader, and the same bytes
    /// with plain parallel uncached reads (O_DIRECT, F_NOCACHE, FILE_FLAG_NO_BUFFERING) of
    /// the same size and depth (the disk's ceiling).
    Reader(ReaderArgs),
    /// Decode with K3_EXPERT_GB swept and K3_PIPE on/off, the model loaded once: hit %,
    /// GB read, eload, disk busy and s/token per run, as a table and as JSON files.
    Decode(Box<DecodeArgs>),
    /// Replay a routing trace (`--route-trace`, or a calibrated synthetic one) through every
    /// cache policy at each budget: hit % and GB read per token (a `--features lab` build).
    #[cfg(feature = "lab")]
    Cache(super::bench_cache::CacheArgs),
    /// Prefill a long prompt with the default window (the whole prompt) and with
    /// `--chunk 32`, each from empty caches: time, expert GB read, GB read ÷ the GB of the
    /// distinct experts routed per layer (summed), tok/s.
    Prefill(Box<super::bench_prefill::PrefillArgs>),
}

#[derive(Args, Debug)]
struct DecodeArgs {
    /// Snapshot directory.
    model: PathBuf,
    /// Cache requests to sweep, GB, comma separated.
    #[arg(long, default_value = "0,4,16")]
    expert_gb_list: String,
    /// Runs per point (the report keeps the fastest).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 6)]
    ngen: usize,
    /// Prompt ids.
    #[arg(long, default_value = "163584,1000,2000,3000,4000,5000,6000,7000")]
    ids: String,
    /// Directory to write one JSON file of each run's stats into.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    load: super::model_args::ModelArgs,
}

#[derive(Args, Debug)]
struct ReaderArgs {
    /// Snapshot directory.
    model: PathBuf,
    /// MoE layer whose experts are read (default: the first MoE layer).
    #[arg(long)]
    layer: Option<usize>,
    /// Loader threads (and the baseline's parallel readers).
    #[arg(long, env = "K3_LOAD_THREADS", default_value_t = 4)]
    load_threads: usize,
    /// Rounds; each round times the engine and the baseline once, alternating.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Read only the first N experts (in disk order) of the layer.
    #[arg(long)]
    limit: Option<usize>,
}

/// Runs `k3 bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        BenchKind::Reader(r) => reader(r),
        BenchKind::Decode(d) => decode(*d),
        #[cfg(feature = "lab")]
        BenchKind::Cache(c) => super::bench_cache::run(c),
        BenchKind::Prefill(p) => super::bench_prefill::run(*p),
    }
}

fn reader(a: ReaderArgs) -> Result<()> {
    let ck = Checkpoint::open(&a.model, &[])?;
    let cfg = &ck.config;
    let layer = match a.layer {
        Some(l) if cfg.is_moe_layer(l) => l,
        Some(l) => bail!("--layer {l} is not a MoE layer of {}", a.model.display()),
        None => (0..cfg.num_hidden_layers)
            .find(|&l| cfg.is_moe_layer(l))
            .context("the model has no MoE layer")?,
    };
    let mut ids: Vec<u32> = (0..cfg.num_experts as u32).collect();
    ExpertSource::canonical_order(&ck, layer, &mut ids)?;
    ids.truncate(a.limit.unwrap_or(ids.len()).max(1));
    let ranges: Vec<(PathBuf, std::ops::Range<u64>)> = ids
        .iter()
        .map(|&e| {
            let loc = k3::experts::ExpertReader::locate(&ck, layer, e)?;
            Ok((ck.shard_path(loc.shard).to_path_buf(), loc.span()))
        })
        .collect::<Result<_>>()?;
    let total: u64 = ranges.iter().map(|(_, r)| r.end - r.start).sum();
    eprintln!(
        "[K3] bench reader: layer {layer}, {} experts, {:.2} GB, {} threads, {} rounds",
        ids.len(),
        total as f64 / 1e9,
        a.load_threads,
        a.rounds
    );
    let sc = StreamConfig {
        mode: IoMode::Direct,
        pipe: true,
        load_threads: a.load_threads,
        slots_per_layer: 0,
    };
    let (mut best_engine, mut best_plain) = (f64::INFINITY, f64::INFINITY);
    for round in 0..a.rounds {
        let src = ExpertSource::new(sc)?;
        let t = Instant::now();
        let mut stats = Stats::default();
        let mut seen = 0usize;
        src.stream(
            &ck,
            layer,
            &ids,
            &vec![false; ids.len()],
            &mut stats,
            &mut || Ok(()),
            &mut |batch| {
                seen += batch.len();
                Ok(())
            },
        )?;
        let engine = t.elapsed().as_secs_f64();
        if seen != ids.len() {
            bail!("engine delivered {seen} of {} experts", ids.len());
        }
        let plain = plain_direct_reads(&ranges, a.load_threads)?;
        best_engine = best_engine.min(engine);
        best_plain = best_plain.min(plain);
        eprintln!(
            "  round {round}: engine {:.2} GB/s ({engine:.2}s, mode {:?}) | plain {UNCACHED_MECHANISM} {:.2} GB/s ({plain:.2}s)",
            total as f64 / 1e9 / engine,
            src.io_mode(),
            total as f64 / 1e9 / plain
        );
    }
    println!(
        "[K3] reader: engine {:.2} GB/s vs plain {UNCACHED_MECHANISM} {:.2} GB/s = {:.3} of the ceiling (best of {})",
        total as f64 / 1e9 / best_engine,
        total as f64 / 1e9 / best_plain,
        best_plain / best_engine,
        a.rounds
    );
    Ok(())
}

/// The disk's ceiling: `threads` readers pulling the same ranges with aligned uncached reads.
fn plain_direct_reads(ranges: &[(PathBuf, std::ops::Range<u64>)], threads: usize) -> Result<f64> {
    let next = AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((path, r)) = ranges.get(i) else {
                            return Ok(());
                        };
                        let f = open_uncached(path).with_context(|| {
                            format!("opening {} with {UNCACHED_MECHANISM}", path.display())
                        })?;
                        let a0 = r.start & !(IO_ALIGN as u64 - 1);
                        let mut buf = AlignedBuf::new(round_up((r.end - a0) as usize));
                        let region = buf.block_region_mut();
                        let mut got = 0;
                        while got < (r.end - a0) as usize {
                            let n = read_at(&f, &mut region[got..], a0 + got as u64)?;
                            if n == 0 {
                                break;
                            }
                            got += n;
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("baseline reader panicked"))??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

fn decode(a: DecodeArgs) -> Result<()> {
    super::threads::init(a.load.threads)?;
    let ids = super::run_cmd::parse_ids(&a.ids)?;
    let gbs: Vec<f64> = a
        .expert_gb_list
        .split(',')
        .map(|t| {
            t.trim()
                .parse::<f64>()
                .with_context(|| format!("--expert-gb-list: {t:?} is not a number"))
        })
        .collect::<Result<_>>()?;
    if let Some(o) = &a.out {
        std::fs::create_dir_all(o).with_context(|| format!("creating {}", o.display()))?;
    }
    a.load.with_model(
        &a.model,
        DecodeJob {
            a: &a,
            ids: &ids,
            gbs: &gbs,
        },
    )
}

struct DecodeJob<'a> {
    a: &'a DecodeArgs,
    ids: &'a [u32],
    gbs: &'a [f64],
}

impl super::model_args::ModelJob for DecodeJob<'_> {
    type Out = ();
    fn run<B: k3::backend::Backend>(self, model: &mut k3::model::K3Model<B>) -> Result<()> {
        let DecodeJob { a, ids, gbs } = self;
        {
            println!("| K3_EXPERT_GB | pipe | run | s/token | hit % | GB read/token | eload s/token | disk busy s/token |");
            println!("|---|---|---|---|---|---|---|---|");
            for &gb in gbs {
                for pipe in [1u8, 0] {
                    for run in 0..a.runs {
                        let mut cfg = a.load.config()?;
                        cfg.experts.expert_gb = gb;
                        cfg.streaming.pipe = pipe == 1;
                        k3::engine::streaming::configure_streaming(model, &cfg)?;
                        let opts = GenerateOptions {
                            ngen: a.ngen,
                            chunk: a.load.chunk_bound(),
                            all_logits: false,
                            stop_ids: &[],
                            trace: None,
                        };
                        let mut greedy = |l: &[f32], _: &[u32]| k3::sampling::argmax_lowest(l);
                        let g = generate(model, ids, &opts, &mut greedy, &mut |_| Ok(()))?;
                        let steps = g.tokens.len().saturating_sub(1).max(1) as f64;
                        let d = &g.decode_stats;
                        println!(
                            "| {gb} | {pipe} | {run} | {:.3} | {:.1} | {:.2} | {:.3} | {:.3} |",
                            g.decode_secs / steps,
                            d.hit_percent(),
                            d.bytes_streamed as f64 / 1e9 / steps,
                            d.eload.as_secs_f64() / steps,
                            d.disk_busy.as_secs_f64() / steps
                        );
                        if let Some(o) = &a.out {
                            let total = g.prefill_stats.plus(&g.decode_stats);
                            let json = stats::run_json(ids.len(), &g, &total);
                            let path = o.join(format!("run-{gb}-{pipe}-{run}.json"));
                            k3::atomic_file::write_atomically(
                                &path,
                                serde_json::to_string_pretty(&json)?.as_bytes(),
                            )
                            .with_context(|| format!("writing {}", path.display()))?;
                        }
                    }
                }
            }
            Ok(())
        }
    }
}
