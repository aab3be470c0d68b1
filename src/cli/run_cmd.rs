//! `k3 run`: prefill + decode from token ids or text, with the stats lines users parse.

use super::sampling_args::SamplingArgs;
use super::stream_args::StreamArgs;
use super::threads;
use super::token_output::TokenOutput;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use k3::backend::cpu::CpuBackend;
use k3::backend::gpu::lab_switches::LabSwitches;
use k3::backend::gpu::select::{select, BackendKind, Selected};
use k3::backend::gpu::GpuOptions;
use k3::backend::Backend;
use k3::checkpoint::Checkpoint;
use k3::generate::{generate, GenerateOptions};
use k3::model::trace::Trace;
use k3::model::{FormatPolicy, K3Model};
use k3::stats;
use k3::tokenizer::{ChatOptions, ChatSplitter, Message, StreamDecoder, Tokenizer};
use std::path::{Path, PathBuf};

/// Which backend runs the ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The GPU when a non-CPU adapter exists (or K3_GPU/K3_METAL/K3_VK=1), else the CPU.
    Auto,
    /// The GPU; exit with the reason when it cannot start.
    Gpu,
    /// The CPU oracle.
    Cpu,
}

/// Work to run on a loaded model, whatever backend was chosen.
pub trait ModelJob {
    /// What the job returns.
    type Out;
    /// Runs the job on `model`.
    fn run<B: Backend>(self, model: &mut K3Model<B>) -> Result<Self::Out>;
}

/// Flags that load a model, shared by `run` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// GPU adapter to use: a substring of its name (see `k3 devices`).
    #[arg(long, value_name = "NAME")]
    pub adapter: Option<String>,
    /// GPU: 1 = time every kernel on the GPU (timestamp queries) and print the time per
    /// kernel at the end. Each submission then waits for the GPU, so the run itself is slower.
    #[arg(long, env = "K3_GPU_PROFILE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub gpu_profile: u8,
    /// CPU threads [env: RAYON_NUM_THREADS, OMP_NUM_THREADS; default: physical cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Extra shard directories, ";" or "," separated, searched after the snapshot directory: a
    /// shard is read from the first directory that holds it (the snapshot, then these in order).
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
    /// Prefill chunk: tokens per pass through each layer (1..512).
    #[arg(long, env = "K3_CHUNK", default_value_t = 32)]
    pub chunk: usize,
    /// Hide the loading progress bar and the per-token lines.
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
}

/// Flags of `k3 run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Snapshot directory (config.json, index, shards). Not needed with --demo.
    #[arg(required_unless_present = "demo")]
    pub model: Option<PathBuf>,
    /// Prompt text (or use --ids for token ids).
    #[arg(conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Synthesize the built-in `tiny` model into the cache directory (once) and run it.
    #[arg(long)]
    pub demo: bool,
    /// Prompt token ids, comma separated (e.g. "1,2,3"); generated ids are printed likewise.
    #[arg(long)]
    pub ids: Option<String>,
    /// Prompt text, as an option (same as the positional PROMPT).
    #[arg(short = 'p', long = "prompt", conflicts_with_all = ["ids", "prompt"])]
    pub prompt_flag: Option<String>,
    /// Wrap the prompt in the chat format and print the think/response streams.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Thinking in --chat: 1 opens the think channel, 0 answers directly.
    #[arg(long, env = "K3_THINK", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub think: u8,
    /// Same as --think 0.
    #[arg(long)]
    pub no_think: bool,
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
    /// Write every counter of the run as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub stats_json: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub load: ModelArgs,
}

/// Parses `"1, 2,3"` into ids, naming the bad entry.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("--ids: {t:?} is not a token id"))
        })
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
    base.join("k3")
        .join(format!("demo-tiny-v{}", env!("CARGO_PKG_VERSION")))
}

/// The demo model, synthesized on first use.
pub fn ensure_demo() -> Result<PathBuf> {
    let dir = demo_dir();
    if !dir.join("tiktoken.model").exists() {
        eprintln!(
            "[K3] demo: synthesizing the tiny model into {}",
            dir.display()
        );
        let opts = k3::synth::SynthOptions {
            preset: k3::synth::Preset::Tiny,
            layers: None,
            experts: None,
            seed: 0,
            progress: false,
        };
        // The directory is k3's own; a run interrupted while writing it left only files of
        // its own there (or temporary ones), which this run replaces.
        k3::synth::synthesize_over(&opts, &dir)?;
    }
    Ok(dir)
}

impl ModelArgs {
    /// Opens the checkpoint at `dir`, loads it onto the chosen backend, sizes the expert
    /// cache, then runs `job` on it.
    pub fn with_model<J: ModelJob>(&self, dir: &Path, job: J) -> Result<J::Out> {
        let policy = FormatPolicy::from_bits(self.bits, self.mla_bits, self.head_bits)?;
        k3::session::check_chunk(self.chunk)?;
        let extra = self
            .dirs
            .as_deref()
            .map(super::split_dirs)
            .unwrap_or_default();
        let ckpt = Checkpoint::open(dir, &extra)?;
        let kind = match self.backend {
            BackendChoice::Auto => BackendKind::Auto,
            BackendChoice::Gpu => BackendKind::Gpu,
            BackendChoice::Cpu => BackendKind::Cpu,
        };
        // Experiment switches (`K3_LAB_*`) over the user's settings.
        let gpu = LabSwitches::from_env()?.apply(GpuOptions {
            adapter: self.adapter.clone(),
            profile: self.gpu_profile == 1,
            ..GpuOptions::default()
        });
        match select(kind, &gpu)? {
            Selected::Gpu(g) => {
                eprintln!("[K3] backend: {}", g.name());
                let mut model = K3Model::load(ckpt, *g, policy, !self.quiet)?;
                self.stream.configure(&mut model)?;
                job.run(&mut model)
            }
            Selected::Cpu { fallback } => {
                if let Some(line) = fallback {
                    eprintln!("{line}");
                }
                eprintln!(
                    "[K3] backend: cpu ({} threads)",
                    rayon::current_num_threads()
                );
                let mut model = K3Model::load(ckpt, CpuBackend::new(), policy, !self.quiet)?;
                self.stream.configure(&mut model)?;
                job.run(&mut model)
            }
        }
    }
}

/// Runs `k3 run`.
pub fn run(a: RunArgs) -> Result<()> {
    threads::init(a.load.threads)?;
    let dir = match &a.model {
        Some(d) => d.clone(),
        None => ensure_demo()?,
    };
    a.load.with_model(&dir, RunJob { a: &a, dir: &dir })
}

struct RunJob<'a> {
    a: &'a RunArgs,
    dir: &'a Path,
}

impl ModelJob for RunJob<'_> {
    type Out = ();
    fn run<B: Backend>(self, model: &mut K3Model<B>) -> Result<()> {
        run_model(model, self.a, self.dir)
    }
}

fn run_model<B: Backend>(model: &K3Model<B>, a: &RunArgs, dir: &Path) -> Result<()> {
    let cfg = &model.ckpt.config;
    let text = a.prompt.clone().or_else(|| a.prompt_flag.clone());
    let tok = if a.ids.is_some() {
        None
    } else {
        Some(Tokenizer::from_dir(dir)?)
    };
    let thinking = a.think == 1 && !a.no_think;
    let ids = match (&a.ids, &text, &tok) {
        (Some(s), _, _) => parse_ids(s)?,
        (None, Some(t), Some(tk)) if a.chat => {
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(Message::system(s.clone()));
            }
            msgs.push(Message::user(t.clone()));
            tk.encode_chat(&msgs, &ChatOptions::generation(thinking))?
        }
        (None, Some(t), Some(tk)) => tk.try_encode(t)?,
        (None, None, Some(tk)) if a.demo => tk.try_encode("Once upon a time")?,
        _ => bail!("give a prompt: text (k3 run MODEL \"text\") or token ids (--ids \"1,2,3\")"),
    };
    let mut output = match &tok {
        None => TokenOutput::Ids { first: true },
        Some(tk) if a.chat => TokenOutput::Chat {
            splitter: ChatSplitter::new(tk, thinking, &cfg.eos_token_ids)?,
            shown: None,
        },
        Some(tk) => TokenOutput::Text(StreamDecoder::new(tk, false)),
    };
    let mut stop: Vec<u32> = if a.ignore_eos {
        Vec::new()
    } else {
        cfg.eos_token_ids.clone()
    };
    if let (Some(tk), false) = (&tok, a.ignore_eos) {
        stop.extend(tk.special_id("<|end_of_msg|>"));
    }
    let trace = a.trace.as_deref().map(Trace::create).transpose()?;
    eprintln!("{}", stats::prompt_line(ids.len(), a.ngen, a.sampling.temp));
    let opts = GenerateOptions {
        ngen: a.ngen,
        chunk: a.load.chunk,
        all_logits: a.dump_logits.is_some(),
        stop_ids: &stop,
        trace: trace.as_ref(),
    };
    let mut sampler = k3::sampling::Sampler::new(a.sampling.config())?;
    let mut pick = |logits: &[f32], hist: &[u32]| sampler.sample(logits, hist);
    let quiet = a.load.quiet;
    let mut on_token = |ev: &k3::generate::TokenEvent| -> Result<()> {
        output.push(ev.id)?;
        if !quiet && ev.index > 0 {
            eprintln!("{}", stats::token_line(ev.index, ev.secs, &ev.stats));
        }
        Ok(())
    };
    let g = generate(model, &ids, &opts, &mut pick, &mut on_token)?;
    output.finish()?;
    eprintln!("{}", stats::prefill_line(ids.len(), g.prefill_secs));
    eprintln!(
        "{}",
        stats::decode_line(g.tokens.len(), g.decode_secs, &g.decode_stats)
    );
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
        eprintln!(
            "[K3] logits: {} positions x {} -> {}",
            ids.len(),
            model.vocab_size(),
            path.display()
        );
    }
    Ok(())
}

fn write_logits(path: &Path, logits: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing logits to {}", path.display()))
}
