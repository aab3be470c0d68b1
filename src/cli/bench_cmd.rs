//! `k3 bench`: measurements that compare the engine with a plain baseline in the same run.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use k3::generate::{generate, GenerateOptions};
use k3::stats;
use std::path::PathBuf;

/// Flags of `k3 bench`.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    what: BenchKind,
}

#[derive(Subcommand, Debug)]
enum BenchKind {
    /// Read experts through the engine's reader, and the same sizes with plain parallel
    /// uncached reads (O_DIRECT, F_NOCACHE, FILE_FLAG_NO_BUFFERING) at the same depth (the
    /// disk's ceiling): every expert of one MoE layer (`--pattern sweep`, the default), or
    /// decode's shape, a token's misses in every MoE layer with compute gaps
    /// (`--pattern decode`).
    Reader(super::bench_reader::ReaderArgs),
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
    /// Decode N greedy streams together, one forward pass a step, for each N of
    /// `--streams`, against the same streams one at a time: aggregate and per-stream tok/s,
    /// expert GB read per step and its ratio to one stream's; fails if a stream's tokens
    /// differ from its tokens alone.
    Streams(Box<super::bench_streams::StreamsArgs>),
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

/// Runs `k3 bench`.
pub(crate) fn run(a: BenchArgs) -> Result<()> {
    match a.what {
        BenchKind::Reader(r) => super::bench_reader::run(r),
        BenchKind::Decode(d) => decode(*d),
        #[cfg(feature = "lab")]
        BenchKind::Cache(c) => super::bench_cache::run(c),
        BenchKind::Prefill(p) => super::bench_prefill::run(*p),
        BenchKind::Streams(s) => super::bench_streams::run(*s),
    }
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
    fn run<B: k3::backend::Backend>(
        self,
        model: &mut k3::model::Runner<B>,
        _plan: &k3::engine::Plan,
    ) -> Result<()> {
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
                        k3::engine::streaming::replan(model, &cfg, |_| {})?;
                        let opts = GenerateOptions {
                            ngen: a.ngen,
                            max_window: None,
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
