//! `k3 run`: prefill + decode from token ids, with the stats lines users parse.

use super::stream_args::StreamArgs;
use super::threads;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::select::{select, BackendKind, Selected};
use k3::backend::Backend;
use k3::checkpoint::Checkpoint;
use k3::generate::{generate, GenerateOptions};
use k3::model::trace::Trace;
use k3::model::{FormatPolicy, K3Model};
use k3::stats;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Which backend runs the ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// GPU when a real adapter exists (or K3_GPU/K3_METAL/K3_VK=1), else CPU.
    Auto,
    /// The GPU (any adapter, lavapipe included); exit if it cannot start.
    Gpu,
    /// The CPU oracle.
    Cpu,
}

/// Flags of `k3 run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Snapshot directory (config.json, index, shards). Not needed with --demo.
    #[arg(required_unless_present = "demo")]
    pub model: Option<PathBuf>,
    /// Synthesize the built-in `tiny` model into the cache directory (once) and run it.
    #[arg(long)]
    pub demo: bool,
    /// Prompt token ids, comma separated (e.g. "1,2,3"). Default with --demo: a short prompt.
    #[arg(long)]
    pub ids: Option<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub ngen: usize,
    /// Keep generating past an end-of-sequence id.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Write little-endian f32 logits [prompt positions × vocab] to this file.
    #[arg(long, env = "K3_LOGITS", value_name = "PATH")]
    pub dump_logits: Option<PathBuf>,
    /// Per-layer hidden-state dumps (layer_NNN.f32, [positions × hidden]) into this directory.
    #[arg(long, env = "K3_TRACE", value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Prefill chunk: tokens per pass through each layer (1..512).
    #[arg(long, env = "K3_CHUNK", default_value_t = 32)]
    pub chunk: usize,
    /// Sampling temperature; 0 = greedy (ties to the lowest id).
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// GPU adapter to use: a substring of its name (see `k3 devices`).
    #[arg(long, value_name = "NAME")]
    pub adapter: Option<String>,
    /// CPU threads [env: RAYON_NUM_THREADS, OMP_NUM_THREADS; default: physical cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Extra shard directories, ';' or ',' separated; earlier wins.
    #[arg(long, env = "K3_DIRS")]
    pub dirs: Option<String>,
    /// Load-time format of dense matrices: 4 (int4 g64), 8 (int8 row), 16 (bf16), 32 (f32).
    #[arg(long, env = "K3_BITS", default_value_t = 4)]
    pub bits: u32,
    /// Load-time format of the MLA projections (4, 8, 16, 32).
    #[arg(long, env = "K3_MLA_BITS", default_value_t = 8)]
    pub mla_bits: u32,
    /// Load-time format of lm_head (4, 8, 16, 32).
    #[arg(long, env = "K3_HEAD_BITS", default_value_t = 8)]
    pub head_bits: u32,
    /// Hide the loading progress bar and the per-token lines.
    #[arg(long)]
    pub quiet: bool,
    /// Write every counter of the run as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub stats_json: Option<PathBuf>,
    #[command(flatten)]
    pub stream: StreamArgs,
}

/// Parses `"1, 2,3"` into ids, naming the bad entry.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("--ids: {t:?} is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--ids is empty: give at least one token id, e.g. --ids \"1,2,3\"");
    }
    Ok(ids)
}

/// Where `--demo` keeps its synthesized model.
fn demo_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("k3").join(format!("demo-tiny-v{}", env!("CARGO_PKG_VERSION")))
}

fn ensure_demo() -> Result<PathBuf> {
    let dir = demo_dir();
    if !dir.join("model.safetensors.index.json").exists() {
        eprintln!("[K3] demo: synthesizing the tiny model into {}", dir.display());
        let opts = k3::synth::SynthOptions {
            preset: k3::synth::Preset::Tiny,
            layers: None,
            experts: None,
            seed: 0,
            progress: false,
        };
        k3::synth::synthesize(&opts, &dir)?;
    }
    Ok(dir)
}

/// Runs `k3 run`.
pub fn run(a: RunArgs) -> Result<()> {
    let n_threads = threads::init(a.threads)?;
    let policy = FormatPolicy::from_bits(a.bits, a.mla_bits, a.head_bits)?;
    let dir = match (&a.model, a.demo) {
        (Some(d), _) => d.clone(),
        (None, _) => ensure_demo()?,
    };
    let extra = a.dirs.as_deref().map(super::split_dirs).unwrap_or_default();
    let ckpt = Checkpoint::open(&dir, &extra)?;
    let ids = match &a.ids {
        Some(s) => parse_ids(s)?,
        None if a.demo => vec![ckpt.config.bos_token_id.unwrap_or(1), 72, 101, 108, 108, 111],
        None => bail!("--ids is required: the prompt as comma-separated token ids"),
    };
    let kind = match a.backend {
        BackendChoice::Auto => BackendKind::Auto,
        BackendChoice::Gpu => BackendKind::Gpu,
        BackendChoice::Cpu => BackendKind::Cpu,
    };
    match select(kind, a.adapter.as_deref())? {
        Selected::Gpu(g) => {
            eprintln!("[K3] backend: {}", g.name());
            let mut model = K3Model::load(ckpt, *g, policy, !a.quiet)?;
            a.stream.configure(&mut model)?;
            run_model(&model, &a, &ids)
        }
        Selected::Cpu { fallback } => {
            if let Some(line) = fallback {
                eprintln!("{line}");
            }
            eprintln!("[K3] backend: cpu ({n_threads} threads)");
            let mut model = K3Model::load(ckpt, CpuBackend::new(), policy, !a.quiet)?;
            a.stream.configure(&mut model)?;
            run_model(&model, &a, &ids)
        }
    }
}

fn run_model<B: Backend>(model: &K3Model<B>, a: &RunArgs, ids: &[u32]) -> Result<()> {
    let trace = a.trace.as_deref().map(Trace::create).transpose()?;
    let stop: Vec<u32> = if a.ignore_eos { Vec::new() } else { model.ckpt.config.eos_token_ids.clone() };
    eprintln!("{}", stats::prompt_line(ids.len(), a.ngen, a.temp));
    let opts = GenerateOptions {
        ngen: a.ngen,
        chunk: a.chunk,
        all_logits: a.dump_logits.is_some(),
        stop_ids: &stop,
        trace: trace.as_ref(),
    };
    let mut sampler = k3::sampling::Sampler::new(k3::sampling::SamplerConfig {
        temperature: a.temp,
        seed: a.seed,
        ..Default::default()
    });
    let mut pick = |logits: &[f32], hist: &[u32]| sampler.sample(logits, hist);
    let mut out = std::io::stdout().lock();
    let quiet = a.quiet;
    let mut on_token = |ev: &k3::generate::TokenEvent| -> Result<()> {
        write!(out, "{}{}", if ev.index == 0 { "" } else { "," }, ev.id)?;
        out.flush()?;
        if !quiet && ev.index > 0 {
            eprintln!("{}", stats::token_line(ev.index, ev.secs, &ev.stats));
        }
        Ok(())
    };
    let g = generate(model, ids, &opts, &mut pick, &mut on_token)?;
    writeln!(std::io::stdout())?;
    eprintln!("{}", stats::prefill_line(ids.len(), g.prefill_secs));
    eprintln!("{}", stats::decode_line(g.tokens.len(), g.decode_secs, &g.decode_stats));
    let total = g.prefill_stats.plus(&g.decode_stats);
    eprintln!("{}", stats::time_line(&total, stats::rss_gb()));
    eprintln!("{}", stats::disk_line(&total));
    if let Some(path) = &a.stats_json {
        let json = stats::run_json(ids.len(), &g, &total);
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing --stats-json {}", path.display()))?;
    }
    if let Some(path) = &a.dump_logits {
        write_logits(path, &g.prompt_logits)?;
        eprintln!("[K3] logits: {} positions x {} -> {}", ids.len(), model.vocab_size(), path.display());
    }
    Ok(())
}

fn write_logits(path: &Path, logits: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing logits to {}", path.display()))
}
