//! `k3 bench reader`: the engine's expert reads against plain parallel uncached reads of
//! the same sizes (the disk's ceiling), in alternating rounds. Two patterns: a sweep of one
//! layer's experts, and decode's shape, a token's misses in every MoE layer in layer order
//! with the compute between layers as a pause.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use k3::checkpoint::Checkpoint;
use k3::experts::io::expert_reader::DEFAULT_READ_PIECE;
use k3::experts::{ExpertReader, ExpertSource, IoMode, StreamConfig};
use k3::platform::aligned_buf::{round_up, AlignedBuf, IO_ALIGN};
use k3::platform::positional_read::read_at;
use k3::platform::uncached_read::{open_uncached, UNCACHED_MECHANISM};
use k3::stats::Stats;
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// What `k3 bench reader` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Pattern {
    /// Every expert of one MoE layer (or the first `--limit`), in disk order, at once.
    Sweep,
    /// `--tokens` decode steps: each reads `--per-layer` random experts of every MoE layer,
    /// layer by layer, with a `--gap-ms` pause between layers for the compute.
    Decode,
}

/// Flags of `k3 bench reader`.
#[derive(Args, Debug)]
pub(crate) struct ReaderArgs {
    /// Snapshot directory.
    model: PathBuf,
    /// What to read: `sweep` (one layer's experts at once) or `decode` (a token's misses
    /// in every MoE layer, layer by layer, with compute gaps).
    #[arg(long, value_enum, default_value_t = Pattern::Sweep)]
    pattern: Pattern,
    /// MoE layer whose experts the sweep reads (default: the first MoE layer).
    #[arg(long)]
    layer: Option<usize>,
    /// Loader threads (and the baseline's parallel readers).
    #[arg(long, env = "K3_LOAD_THREADS", default_value_t = 4)]
    load_threads: usize,
    /// Rounds; each round times every engine variant and the baseline once, alternating.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Sweep: read only the first N experts (in disk order) of the layer.
    #[arg(long)]
    limit: Option<usize>,
    /// Engine variants: the loader pool's read piece sizes to compare, KiB, comma separated
    /// (each a multiple of 4); 0 reads each expert in one read. Default: the engine's.
    #[arg(long, default_value_t = (DEFAULT_READ_PIECE / 1024).to_string())]
    piece_kib: String,
    /// Decode: tokens (decode steps) a variant reads per round.
    #[arg(long, default_value_t = 8)]
    tokens: usize,
    /// Decode: experts read per MoE layer and token (the step's misses; decode picks 16 a
    /// layer, of which the host cache holds a few).
    #[arg(long, default_value_t = 13)]
    per_layer: usize,
    /// Decode: pause between layers, ms (the compute a layer takes).
    #[arg(long, default_value_t = 20)]
    gap_ms: u64,
    /// Decode: seed of the expert picks (each round and variant draws its own).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Parses `--piece-kib`: byte sizes, each a whole number of [`IO_ALIGN`] blocks or 0.
fn piece_sizes(list: &str) -> Result<Vec<usize>> {
    let sizes = list
        .split(',')
        .map(|t| {
            let kib: usize = t.trim().parse().with_context(|| {
                format!("--piece-kib: {t:?} is not a whole number of KiB")
            })?;
            let bytes = kib
                .checked_mul(1024)
                .filter(|b| b % IO_ALIGN == 0)
                .with_context(|| {
                    format!(
                        "--piece-kib: {kib} is not a multiple of {} KiB (direct reads go in whole blocks)",
                        IO_ALIGN / 1024
                    )
                })?;
            Ok(bytes)
        })
        .collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() {
        bail!("--piece-kib: no sizes given");
    }
    Ok(sizes)
}

fn piece_name(bytes: usize) -> String {
    match bytes {
        0 => "whole".to_string(),
        b => format!("{} KiB", b / 1024),
    }
}

/// One expert read: the shard and the byte span.
type Span = (PathBuf, Range<u64>);

/// Runs `k3 bench reader`.
pub(crate) fn run(a: ReaderArgs) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let pieces = piece_sizes(&a.piece_kib)?;
    let ck = Checkpoint::open(&a.model, &[])?;
    match a.pattern {
        Pattern::Sweep => sweep(&a, &ck, &pieces),
        Pattern::Decode => decode(&a, &ck, &pieces),
    }
}

fn stream_config(a: &ReaderArgs) -> StreamConfig {
    StreamConfig {
        mode: IoMode::Direct,
        pipe: true,
        load_threads: a.load_threads,
        slots_per_layer: 0,
    }
}

fn spans(ck: &Checkpoint, layer: usize, ids: &[u32]) -> Result<Vec<Span>> {
    ids.iter()
        .map(|&e| {
            let loc = ExpertReader::locate(ck, layer, e)?;
            Ok((ck.shard_path(loc.shard).to_path_buf(), loc.span()))
        })
        .collect()
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

fn sweep(a: &ReaderArgs, ck: &Checkpoint, pieces: &[usize]) -> Result<()> {
    let cfg = &ck.config;
    let layer = match a.layer {
        Some(l) if cfg.is_moe_layer(l) => l,
        Some(l) => bail!("--layer {l} is not a MoE layer of {}", a.model.display()),
        None => (0..cfg.num_hidden_layers)
            .find(|&l| cfg.is_moe_layer(l))
            .context("the model has no MoE layer")?,
    };
    let mut ids: Vec<u32> = (0..cfg.num_experts as u32).collect();
    ExpertSource::canonical_order(ck, layer, &mut ids)?;
    ids.truncate(a.limit.unwrap_or(ids.len()).max(1));
    let ranges = spans(ck, layer, &ids)?;
    let total: u64 = ranges.iter().map(|(_, r)| r.end - r.start).sum();
    eprintln!(
        "[K3] bench reader: sweep of layer {layer}, {} experts, {:.2} GB, {} threads, {} rounds",
        ids.len(),
        gb(total),
        a.load_threads,
        a.rounds
    );
    let mut best_engine = vec![f64::INFINITY; pieces.len()];
    let mut best_plain = f64::INFINITY;
    for round in 0..a.rounds {
        for (v, &piece) in pieces.iter().enumerate() {
            let src = ExpertSource::new(stream_config(a))?;
            src.set_read_piece(piece);
            let t = Instant::now();
            let mut stats = Stats::default();
            stream_all(&src, ck, layer, &ids, &mut stats)?;
            let secs = t.elapsed().as_secs_f64();
            best_engine[v] = best_engine[v].min(secs);
            eprintln!(
                "  round {round}: engine, piece {}: {:.2} GB/s ({secs:.2}s, mode {:?})",
                piece_name(piece),
                gb(total) / secs,
                src.io_mode()
            );
        }
        let plain = plain_direct_reads(&ranges, a.load_threads)?;
        best_plain = best_plain.min(plain);
        eprintln!(
            "  round {round}: plain {UNCACHED_MECHANISM} {:.2} GB/s ({plain:.2}s)",
            gb(total) / plain
        );
    }
    for (v, &piece) in pieces.iter().enumerate() {
        println!(
            "[K3] reader: engine (piece {}) {:.2} GB/s vs plain {UNCACHED_MECHANISM} {:.2} GB/s = {:.3} of the ceiling (best of {})",
            piece_name(piece),
            gb(total) / best_engine[v],
            gb(total) / best_plain,
            best_plain / best_engine[v],
            a.rounds
        );
    }
    Ok(())
}

/// One decode step's reads: each MoE layer's experts, in canonical order.
type Step = Vec<(usize, Vec<u32>)>;

/// `tokens` steps of `per_layer` distinct random experts in every MoE layer.
fn decode_steps(ck: &Checkpoint, a: &ReaderArgs, seed: u64) -> Result<Vec<Step>> {
    let cfg = &ck.config;
    let n = cfg.num_experts;
    if a.per_layer == 0 || a.per_layer > n {
        bail!(
            "--per-layer must be 1..={n} (the experts of a layer of {}), got {}",
            a.model.display(),
            a.per_layer
        );
    }
    let layers: Vec<usize> = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    if layers.is_empty() {
        bail!("{} has no MoE layer", a.model.display());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..a.tokens)
        .map(|_| {
            layers
                .iter()
                .map(|&l| {
                    let mut ids: Vec<u32> = sample(&mut rng, n, a.per_layer)
                        .into_iter()
                        .map(|e| e as u32)
                        .collect();
                    ExpertSource::canonical_order(ck, l, &mut ids)?;
                    Ok((l, ids))
                })
                .collect()
        })
        .collect()
}

/// What one decode-shaped run of the engine took.
struct DecodeRun {
    bytes: u64,
    busy: Duration,
    wall: Duration,
}

fn engine_decode(
    a: &ReaderArgs,
    ck: &Checkpoint,
    piece: usize,
    steps: &[Step],
) -> Result<DecodeRun> {
    let src = ExpertSource::new(stream_config(a))?;
    src.set_read_piece(piece);
    let gap = Duration::from_millis(a.gap_ms);
    let mut stats = Stats::default();
    let t = Instant::now();
    for step in steps {
        for (layer, ids) in step {
            stream_all(&src, ck, *layer, ids, &mut stats)?;
            std::thread::sleep(gap);
        }
    }
    let wall = t.elapsed();
    let (busy, bytes) = src.disk_totals();
    if src.io_mode() != IoMode::Direct {
        bail!(
            "the engine fell back to buffered reads on {}: the comparison needs {UNCACHED_MECHANISM}",
            a.model.display()
        );
    }
    Ok(DecodeRun { bytes, busy, wall })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The same shape read plainly, as an engine without a loader pool's queues would: each
/// layer's experts whole, `threads` at a time, then the pause.
fn plain_decode(a: &ReaderArgs, ck: &Checkpoint, steps: &[Step]) -> Result<DecodeRun> {
    let gap = Duration::from_millis(a.gap_ms);
    let (mut bytes, mut busy) = (0u64, Duration::ZERO);
    let t = Instant::now();
    for (layer, ids) in steps.iter().flatten() {
        let ranges = spans(ck, *layer, ids)?;
        bytes += ranges.iter().map(|(_, r)| r.end - r.start).sum::<u64>();
        busy += Duration::from_secs_f64(plain_direct_reads(&ranges, a.load_threads)?);
        std::thread::sleep(gap);
    }
    Ok(DecodeRun {
        bytes,
        busy,
        wall: t.elapsed(),
    })
}

/// One row of the decode report: its name and each round's busy and wall GB/s.
struct Row {
    name: String,
    busy: Vec<f64>,
    wall: Vec<f64>,
}

impl Row {
    fn add(&mut self, round: usize, r: &DecodeRun) {
        let busy = gb(r.bytes) / r.busy.as_secs_f64();
        let wall = gb(r.bytes) / r.wall.as_secs_f64();
        eprintln!(
            "  round {round}: {}: {:.2} GB, busy {:.2}s ({busy:.2} GB/s), wall {:.2}s ({wall:.2} GB/s)",
            self.name,
            gb(r.bytes),
            r.busy.as_secs_f64(),
            r.wall.as_secs_f64()
        );
        self.busy.push(busy);
        self.wall.push(wall);
    }
}

fn decode(a: &ReaderArgs, ck: &Checkpoint, pieces: &[usize]) -> Result<()> {
    if a.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let first = decode_steps(ck, a, a.seed)?;
    let reads: usize = first.iter().flatten().map(|(_, ids)| ids.len()).sum();
    eprintln!(
        "[K3] bench reader: decode, {} tokens x {} MoE layers x {} experts ({reads} reads), {} ms between layers, {} threads, {} rounds",
        a.tokens,
        first[0].len(),
        a.per_layer,
        a.gap_ms,
        a.load_threads,
        a.rounds
    );
    let row = |name: String| Row {
        name,
        busy: Vec::new(),
        wall: Vec::new(),
    };
    let mut rows: Vec<Row> = pieces
        .iter()
        .map(|&p| row(format!("engine, read piece {}", piece_name(p))))
        .collect();
    rows.push(row(format!(
        "plain {UNCACHED_MECHANISM}, decode shape, whole experts"
    )));
    rows.push(row(format!(
        "plain {UNCACHED_MECHANISM}, back to back (ceiling)"
    )));
    let n = rows.len();
    for round in 0..a.rounds {
        for (v, r) in rows.iter_mut().enumerate() {
            // Every run reads its own draw of the same size, so none re-reads what the one
            // before just read (a virtual disk's host may cache it).
            let steps = decode_steps(ck, a, a.seed + (round * n + v) as u64)?;
            let run = if v < pieces.len() {
                engine_decode(a, ck, pieces[v], &steps)?
            } else if v == pieces.len() {
                plain_decode(a, ck, &steps)?
            } else {
                let mut ranges = Vec::new();
                for (layer, ids) in steps.iter().flatten() {
                    ranges.extend(spans(ck, *layer, ids)?);
                }
                let secs = Duration::from_secs_f64(plain_direct_reads(&ranges, a.load_threads)?);
                DecodeRun {
                    bytes: ranges.iter().map(|(_, r)| r.end - r.start).sum(),
                    busy: secs,
                    wall: secs,
                }
            };
            r.add(round, &run);
        }
    }
    let ceiling = median(&mut rows[n - 1].busy);
    println!("| reads | busy GB/s | wall GB/s | busy / ceiling |");
    println!("|---|---|---|---|");
    for r in &mut rows {
        let busy = median(&mut r.busy);
        println!(
            "| {} | {busy:.2} | {:.2} | {:.3} |",
            r.name,
            median(&mut r.wall),
            busy / ceiling
        );
    }
    println!(
        "(medians of {} rounds; busy: the time reads were in flight; wall: with the {} ms pauses)",
        a.rounds, a.gap_ms
    );
    Ok(())
}

/// The disk's ceiling: `threads` readers pulling the same ranges with aligned uncached
/// reads, one read per range. Returns the seconds it took.
fn plain_direct_reads(ranges: &[Span], threads: usize) -> Result<f64> {
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

/// Streams `ids` of `layer` through the engine's source, none resident, and checks that
/// every expert was delivered.
fn stream_all(
    src: &ExpertSource,
    ck: &Checkpoint,
    layer: usize,
    ids: &[u32],
    stats: &mut Stats,
) -> Result<()> {
    let mut seen = 0usize;
    src.stream(
        ck,
        layer,
        ids,
        &vec![false; ids.len()],
        stats,
        &mut || Ok(()),
        &mut |batch| {
            seen += batch.len();
            Ok(())
        },
    )?;
    if seen != ids.len() {
        bail!("engine delivered {seen} of {} experts", ids.len());
    }
    Ok(())
}
