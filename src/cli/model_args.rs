//! The flags that choose the snapshot's formats, the backend and the streaming settings,
//! mapped onto an [`EngineConfig`] for [`EngineBuilder`], and the built-in demo model.

use super::stream_args::StreamArgs;
use anyhow::Result;
use clap::{Args, ValueEnum};
#[cfg(feature = "lab")]
use k3::backend::gpu::device::lab_switches::LabSwitches;
use k3::backend::gpu::{GpuOptions, LimitsProfile};
use k3::backend::select::{gpu_variable, BackendKind};
use k3::engine::config::{BackendConfig, Formats, LoadConfig};
pub(crate) use k3::engine::ModelJob;
use k3::engine::{EngineBuilder, EngineConfig};
use std::path::{Path, PathBuf};

/// Which backend runs the ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendChoice {
    /// The GPU when a non-CPU adapter exists (or K3_GPU/K3_METAL/K3_VK=1), else the CPU.
    Auto,
    /// The GPU; exit with the reason when it cannot start.
    Gpu,
    /// The CPU oracle.
    Cpu,
}

/// Flags that load a model, shared by `run` and `chat`.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// GPU adapter to use: a substring of its name (see `k3 devices`).
    #[arg(long, value_name = "NAME")]
    pub adapter: Option<String>,
    /// GPU limits profile: request and plan with the limits and features wgpu's Metal
    /// backend reports for that Apple GPU family (apple-m1, apple-m3, apple-m5), each limit
    /// the lower of the profile's and the adapter's, on whatever adapter is present;
    /// native = the adapter's own (see `k3 devices --gpu-limits`).
    #[arg(
        long = "gpu-limits",
        env = "K3_GPU_LIMITS",
        value_name = "PROFILE",
        default_value = "native"
    )]
    pub gpu_limits: LimitsProfile,
    /// GPU: 1 = time every kernel on the GPU (timestamp queries) and print the time per
    /// kernel at the end (`bench streams`: a table for each case). Each submission then
    /// waits for the GPU, so the run itself is slower.
    #[arg(long, env = "K3_GPU_PROFILE", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub gpu_profile: u8,
    /// CPU backend: 1 = routed experts on int8-quantized activations with integer dots
    /// (faster, NOT exact; the C engine's default), 0 = exact f32 (k3's default).
    #[arg(long, env = "K3_IDOT", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub idot: u8,
    /// CPU threads [env: RAYON_NUM_THREADS, OMP_NUM_THREADS; default: physical cores]; 1
    /// also keeps a batch of several streams on one thread (no partner thread).
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
    /// Prefill window bound: at most this many prompt tokens per pass through each layer
    /// (each routed expert is read once a layer per pass). Unset: the whole prompt, as far
    /// as memory and the GPU's limits allow (the `[K3] prefill window` line says how far).
    #[arg(long = "chunk", env = "K3_CHUNK", value_name = "TOKENS")]
    pub max_window: Option<usize>,
    /// Hide the loading progress bar and the per-token lines.
    #[arg(long)]
    pub quiet: bool,
    /// Quantize the dense weights at every start instead of keeping them in the
    /// quantized-weight cache (a file next to the snapshot when writable, else under the
    /// user's cache directory, rebuilt when the snapshot or the K3_*BITS choices change).
    #[arg(long, env = "K3_NO_WEIGHT_CACHE", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_weight_cache: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub ranks: super::rank_args::RankArgs,
}

/// Where `--demo` keeps its synthesized model: k3's directory under the user's cache
/// directory, the same place as the weight cache's fallback.
fn demo_dir() -> PathBuf {
    k3::platform::cache_dir::user_cache_dir()
        .unwrap_or_else(|| std::env::temp_dir().join("k3"))
        .join(format!("demo-tiny-v{}", env!("CARGO_PKG_VERSION")))
}

/// The demo model, synthesized on first use.
pub(crate) fn ensure_demo() -> Result<PathBuf> {
    let dir = demo_dir();
    if !k3::platform::input_file::is_present(&dir.join("tiktoken.model")) {
        eprintln!(
            "[K3] demo: synthesizing the tiny model into {}",
            dir.display()
        );
        let opts = k3::synth::SynthOptions {
            preset: k3::synth::Preset::Tiny,
            layers: None,
            experts: None,
            top_k: None,
            routing: k3::synth::Routing::Random,
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
    /// The engine config these flags and their environment variables ask for; the
    /// prompt cache's `in_use` is left to the job ([`EngineBuilder::run`]).
    pub(crate) fn config(&self) -> Result<EngineConfig> {
        let kind = match self.backend {
            BackendChoice::Auto => BackendKind::Auto,
            BackendChoice::Gpu => BackendKind::Gpu,
            BackendChoice::Cpu => BackendKind::Cpu,
        };
        let gpu = GpuOptions {
            adapter: self.adapter.clone(),
            limits: Some(self.gpu_limits),
            profile: self.gpu_profile == 1,
            ..GpuOptions::default()
        };
        // A lab build takes the experiment switches (`K3_LAB_*`) over the user's settings;
        // the product keeps every tuning default.
        #[cfg(feature = "lab")]
        let gpu = LabSwitches::from_env()?.apply(gpu);
        let mut cfg = EngineConfig {
            backend: BackendConfig {
                kind,
                gpu,
                idot: self.idot == 1,
                gpu_variable_set: gpu_variable(|v| std::env::var(v).ok()).is_some(),
            },
            formats: Formats {
                bits: self.bits,
                mla_bits: self.mla_bits,
                head_bits: self.head_bits,
            },
            load: LoadConfig {
                extra_dirs: self
                    .dirs
                    .as_deref()
                    .map(super::split_dirs)
                    .unwrap_or_default(),
                quiet: self.quiet,
                weight_cache: !self.no_weight_cache,
            },
            max_window: self.max_window,
            ranks: self.ranks.config()?,
            ..EngineConfig::default()
        };
        self.stream.apply(&mut cfg);
        Ok(cfg)
    }

    /// Assembles the engine for the checkpoint at `dir` from these flags, then runs `job`
    /// on it.
    /// In an expert-parallel job a rank other than the head serves the head's experts
    /// instead, and ends with [`k3::ranks::WorkerDone`].
    pub(crate) fn with_model<J: ModelJob>(&self, dir: &Path, job: J) -> Result<J::Out> {
        #[cfg(feature = "mpi")]
        if k3::ranks::world::is_worker() {
            EngineBuilder::new(self.config()?).run_rank_worker(dir)?;
            return Err(k3::ranks::WorkerDone.into());
        }
        EngineBuilder::new(self.config()?).run(dir, job)
    }
}
