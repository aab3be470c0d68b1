//! [`EngineConfig`]: everything [`super::EngineBuilder`] assembles an engine from, typed,
//! with defaults equal to the command line's (`k3 run --help`). The command line maps its
//! flags and environment variables onto it; the library reads none itself.

use crate::backend::gpu::{GpuOptions, LimitsProfile};
use crate::backend::select::BackendKind;
use crate::experts::cache::cache_policy::PolicyKind;
use crate::experts::cache::usage_history::PinMode;
use crate::experts::plan::expert_selection::ExpertSelection;
use crate::session::SnapshotLimits;
use anyhow::{bail, Result};
use std::path::PathBuf;

/// The host expert cache asked for when `--expert-gb` / `K3_EXPERT_GB` is not given, GB.
pub const DEFAULT_EXPERT_GB: f64 = 8.0;

/// Longest context accepted: K3's published context is 256K tokens; beyond a few million
/// the MLA cache alone outgrows any machine's memory.
pub const MAX_CONTEXT: usize = 1 << 22;

/// How an engine is assembled: backend, formats, memory plan, tiers or pool, streaming,
/// cache policy and context.
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    /// Which backend runs the ops, and how it starts.
    pub backend: BackendConfig,
    /// Load-time formats of the dense weights.
    pub formats: Formats,
    /// Where the shards are and how loading shows itself.
    pub load: LoadConfig,
    /// The RAM plan's inputs.
    pub memory: MemoryConfig,
    /// The expert cache's and tier's sizes, and which experts a token reads.
    pub experts: ExpertConfig,
    /// How experts are read.
    pub streaming: StreamingConfig,
    /// The expert cache's eviction policy, pins and routing trace.
    pub cache: CacheConfig,
    /// The on-disk prompt cache.
    pub prompt_cache: PromptCacheSettings,
    /// Context in tokens (prompt plus answer); `None`: the checkpoint's limit, lowered to
    /// what memory holds.
    pub context_tokens: Option<usize>,
    /// Bound on the prefill window in tokens; `None`: the whole prompt, as far as memory
    /// and the GPU's limits allow.
    pub max_window: Option<usize>,
    /// In-RAM state snapshots the engine's user keeps (`k3 serve`), reserved by the plan.
    pub snapshots: SnapshotLimits,
    /// Sequences run at once (`k3 serve --parallel`; 0 counts as 1), each with a
    /// full-context state the plan reserves as far as memory allows.
    pub parallel: usize,
    /// The ranks of an expert-parallel job (`mpirun`; used only with the `mpi` feature).
    pub ranks: RankConfig,
}

/// How an expert-parallel job splits and waits (`--rank-read-gbps`, `--rank-timeout`).
#[derive(Clone, Debug, PartialEq)]
pub struct RankConfig {
    /// Each rank's read rate in GB/s, one per rank; empty: equal rates.
    pub read_gbps: Vec<f64>,
    /// Seconds the head waits for a rank's start-up report or answer before it ends the job.
    pub timeout_s: u64,
}

impl Default for RankConfig {
    fn default() -> Self {
        Self {
            read_gbps: Vec::new(),
            timeout_s: 300,
        }
    }
}

impl EngineConfig {
    /// Checks every setting that needs no loaded model, so that a bad flag is named before
    /// a load that can take minutes. The VRAM tier's size is checked only where a tier is
    /// sized (the CPU backend ignores it).
    pub fn check_before_load(&self) -> Result<()> {
        if let Some(w) = self.max_window {
            crate::session::check_window(w)?;
        }
        self.experts.check_expert_gb()?;
        self.experts.selection()?;
        if self.prompt_cache.in_use {
            self.prompt_cache.plan_gb()?;
        }
        Ok(())
    }
}

/// The backend and how it starts.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Auto, GPU or CPU.
    pub kind: BackendKind,
    /// The GPU's adapter, limits profile, profiling and tuning.
    pub gpu: GpuOptions,
    /// CPU: routed experts on int8 activations with integer dots (faster, not exact).
    pub idot: bool,
    /// A GPU variable (`K3_GPU`, `K3_METAL`, `K3_VK`) asks for the GPU: `Auto` then accepts
    /// CPU-type adapters, as an explicit request.
    pub gpu_variable_set: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Auto,
            gpu: GpuOptions {
                limits: Some(LimitsProfile::Native),
                ..GpuOptions::default()
            },
            idot: false,
            gpu_variable_set: false,
        }
    }
}

/// Load-time formats in bits: 4 (int4 g64), 8 (int8 row), 16 (bf16), 32 (f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Formats {
    /// Dense matrices.
    pub bits: u32,
    /// The MLA projections.
    pub mla_bits: u32,
    /// lm_head.
    pub head_bits: u32,
}

impl Default for Formats {
    fn default() -> Self {
        Formats {
            bits: 4,
            mla_bits: 8,
            head_bits: 8,
        }
    }
}

/// Where the shards are and how loading shows itself.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Extra shard directories, searched after the snapshot directory in order.
    pub extra_dirs: Vec<PathBuf>,
    /// Hide the loading progress bar and the per-token lines.
    pub quiet: bool,
    /// Keep the quantized dense weights in the weight cache.
    pub weight_cache: bool,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            extra_dirs: Vec::new(),
            quiet: false,
            weight_cache: true,
        }
    }
}

/// The RAM plan's inputs beside what is measured.
#[derive(Clone, Copy, Debug)]
pub struct MemoryConfig {
    /// Memory budget in GB instead of resident + 0.88 x available.
    pub ram_gb: Option<f64>,
    /// Keep one expert slot per layer even when the budget says it does not fit.
    pub overcommit: bool,
    /// Shrink the expert cache when the OS reports memory pressure.
    pub memory_pressure: bool,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            ram_gb: None,
            overcommit: false,
            memory_pressure: true,
        }
    }
}

/// The VRAM expert tier's size as asked.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum TierGb {
    /// Sized from free VRAM (or off where it cannot be measured).
    #[default]
    Default,
    /// This many GB (0: off).
    Asked(f64),
    /// A value that is not a number: the error, reported when the tier is sized (the CPU
    /// backend never sizes one, so there it is ignored).
    Invalid(String),
}

/// The expert cache's and tier's sizes, and which experts a token reads.
#[derive(Clone, Debug)]
pub struct ExpertConfig {
    /// Expert cache request in GB for all MoE layers together; clamped to RAM.
    pub expert_gb: f64,
    /// The VRAM expert tier (on unified memory: added to `expert_gb` for the pool).
    pub gpu_expert_gb: TierGb,
    /// Keep each token's heaviest experts up to this share of its routing weight (0 or 1:
    /// all).
    pub top_p: f32,
    /// Skip an uncached expert every token weighs below this.
    pub skip_uncached_below: Option<f32>,
}

impl Default for ExpertConfig {
    fn default() -> Self {
        ExpertConfig {
            expert_gb: DEFAULT_EXPERT_GB,
            gpu_expert_gb: TierGb::Default,
            top_p: 0.0,
            skip_uncached_below: None,
        }
    }
}

impl ExpertConfig {
    /// Refuses an expert cache request that is not a number of GB >= 0, naming the flag.
    pub fn check_expert_gb(&self) -> Result<()> {
        let gb = self.expert_gb;
        if !(gb.is_finite() && gb >= 0.0) {
            bail!("K3_EXPERT_GB / --expert-gb must be a number of GB >= 0, got {gb}");
        }
        Ok(())
    }

    /// The expert selection asked for: a top-p of 0 or >= 1 is off, as in the C engine.
    pub fn selection(&self) -> Result<ExpertSelection> {
        let p = self.top_p;
        if !(0.0..=1.0).contains(&p) {
            bail!("--expert-top-p / K3_TOPP must be a share between 0 and 1, got {p}");
        }
        ExpertSelection {
            top_p: (p > 0.0 && p < 1.0).then_some(p),
            skip_uncached_below: self.skip_uncached_below,
        }
        .validated()
    }

    /// The tier request in GB, `None` for the default (sized from free VRAM).
    pub fn gpu_tier_gb(&self) -> Result<Option<f64>> {
        let gb = match &self.gpu_expert_gb {
            TierGb::Default => return Ok(None),
            TierGb::Asked(gb) => *gb,
            TierGb::Invalid(e) => bail!("{e}"),
        };
        if !(gb.is_finite() && gb >= 0.0) {
            bail!("K3_GPU_GB / K3_VK_GB / --gpu-expert-gb must be a number of GB >= 0, got {gb}");
        }
        Ok(Some(gb))
    }
}

/// Guessing the next layer's experts and reading them ahead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Prefetch {
    /// For each layer while its guesses pay.
    #[default]
    On,
    /// On every pass, even where it does not pay.
    Always,
    /// Never.
    Off,
}

impl Prefetch {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Prefetch::On => "on",
            Prefetch::Always => "always",
            Prefetch::Off => "off",
        }
    }
}

/// How experts are read.
#[derive(Clone, Copy, Debug)]
pub struct StreamingConfig {
    /// Uncached reads (O_DIRECT, F_NOCACHE, FILE_FLAG_NO_BUFFERING); else buffered.
    pub direct: bool,
    /// Overlap expert loads with compute.
    pub pipe: bool,
    /// Read the next layer's guessed experts ahead (needs the pipe).
    pub prefetch: Prefetch,
    /// Loader threads for the pipe (1..16).
    pub load_threads: usize,
}

impl Default for StreamingConfig {
    fn default() -> Self {
        StreamingConfig {
            direct: true,
            pipe: true,
            prefetch: Prefetch::On,
            load_threads: 4,
        }
    }
}

/// The expert cache's eviction policy, pins and routing trace.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Which expert a full layer cache gives up.
    pub policy: PolicyKind,
    /// Pins from the usage history of earlier runs.
    pub usage_pins: PinMode,
    /// The usage history file (`None`: `.k3_usage` in the snapshot directory).
    pub usage_file: Option<PathBuf>,
    /// Where the routing trace is written at the end of the run.
    pub route_trace: Option<PathBuf>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            policy: PolicyKind::default(),
            usage_pins: PinMode::Off,
            usage_file: None,
            route_trace: None,
        }
    }
}

/// The on-disk prompt cache.
#[derive(Clone, Debug)]
pub struct PromptCacheSettings {
    /// Whether the engine's sessions use it (`run`, `chat`, `serve`; a benchmark measures
    /// the prefill a cached prompt would skip): it is opened and its working set reserved.
    pub in_use: bool,
    /// Its directory (`None`: `prompts` under the user's cache directory).
    pub dir: Option<PathBuf>,
    /// Bytes it may take on disk, in GB; 0 turns it off.
    pub gb: f64,
    /// Neither load nor store prompt states.
    pub off: bool,
}

impl Default for PromptCacheSettings {
    fn default() -> Self {
        PromptCacheSettings {
            in_use: false,
            dir: None,
            gb: 16.0,
            off: false,
        }
    }
}

impl PromptCacheSettings {
    /// The bound in GB the RAM plan reserves a working set under (0 when off); a bad
    /// number is refused naming the flag.
    pub fn plan_gb(&self) -> Result<f64> {
        if !(self.gb.is_finite() && self.gb >= 0.0) {
            bail!(
                "--prompt-cache-gb / K3_PROMPT_CACHE_GB must be a number of GB >= 0, got {}",
                self.gb
            );
        }
        Ok(if self.off { 0.0 } else { self.gb })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_runs_the_cache_policy_a_bare_setup_runs() {
        assert_eq!(CacheConfig::default().policy, PolicyKind::default());
    }
}
