//! Expert streaming, memory and context flags (`K3_EXPERT_GB`, `K3_DIRECT`, `K3_PIPE`,
//! `K3_MAXT`, ...), mapped onto the [`EngineConfig`] the engine is sized from.

use clap::Args;
use k3::engine::config::{ExpertConfig, MemoryConfig, Prefetch, StreamingConfig, TierGb};
use k3::engine::EngineConfig;
use k3::session::SnapshotLimits;

/// Flags that decide how experts are read and cached.
#[derive(Args, Debug, Clone)]
pub(crate) struct StreamArgs {
    /// Expert cache request in GB (1e9 bytes) for all MoE layers together; clamped to RAM.
    /// On a GPU that shares memory with the CPU (Apple Silicon) it sizes the single expert
    /// pool instead, with `--gpu-expert-gb`.
    #[arg(long, env = "K3_EXPERT_GB", default_value_t = k3::engine::config::DEFAULT_EXPERT_GB)]
    pub expert_gb: f64,
    /// 1: uncached expert reads (O_DIRECT on Linux, F_NOCACHE on macOS,
    /// FILE_FLAG_NO_BUFFERING on Windows); 0: buffered + read-ahead hints.
    #[arg(long, env = "K3_DIRECT", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub direct: u8,
    /// 1: overlap expert loads with compute; 0: read all of a layer's misses first.
    #[arg(long, env = "K3_PIPE", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub pipe: u8,
    /// on: once a MoE layer has routed, score the next MoE layer's router on the current
    /// hidden state and read the experts it picks ahead, while this layer computes (needs
    /// the pipe), for each layer only while its guesses save more disk time than they cost
    /// (re-tested every 16 passes; docs/tuning.md, "Prefetch"); always: guess on every pass
    /// even where it does not pay; off: read a layer's experts only once it routes. The
    /// logits are the same.
    #[arg(long, env = "K3_PREFETCH", default_value = "on", value_parser = ["on", "always", "off"])]
    pub prefetch: String,
    /// Loader threads for the pipe (1..16).
    #[arg(long, env = "K3_LOAD_THREADS", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub load_threads: u64,
    /// Memory budget in GB instead of resident + 0.88 x available.
    #[arg(long = "ram-gb", env = "RAM_GB")]
    pub ram_gb: Option<f64>,
    /// 1: keep one expert slot per layer even when the budget says it does not fit.
    #[arg(long, env = "K3_RAM_OVERCOMMIT", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub ram_overcommit: u8,
    /// VRAM expert tier in GB (1e9 bytes) on the GPU backend; 0 turns it off. Default: the
    /// free VRAM after loading minus max(2 GB, 10%), or off where the adapter cannot report
    /// free VRAM (DX12, Vulkan without VK_EXT_memory_budget) or its memory is host RAM
    /// (CPU-type, integrated GPUs, Apple Silicon). There the tier is the single expert pool
    /// and this adds to `--expert-gb`. `K3_VK_GB` is read when `K3_GPU_GB` is unset. The CPU
    /// backend ignores it.
    #[arg(long = "gpu-expert-gb", env = "K3_GPU_GB")]
    pub gpu_expert_gb: Option<f64>,
    /// Keep each token's heaviest routed experts until they hold this share of its routing
    /// weight, the rest left unread (0 or 1: every expert, the exact default). Changes the
    /// output: see docs/tuning.md for its divergence.
    #[arg(
        long = "expert-top-p",
        env = "K3_TOPP",
        default_value_t = 0.0,
        value_name = "P"
    )]
    pub expert_top_p: f32,
    /// Skip a routed expert that no cache holds when every token gave it a routing weight
    /// below W (off by default: exact). Saves its read; changes the output (docs/tuning.md).
    #[arg(long = "skip-uncached-below", value_name = "W")]
    pub skip_uncached_below: Option<f32>,
    /// on: when the OS reports memory pressure (macOS's memory-pressure dispatch source,
    /// Linux PSI in /proc/pressure/memory), shrink the expert cache (a warning keeps 3/4,
    /// critical half) instead of letting the machine compress or swap; off: keep its size.
    #[arg(long = "memory-pressure", env = "K3_MEMORY_PRESSURE", default_value = "on", value_parser = ["on", "off"])]
    pub memory_pressure: String,
    /// Context in tokens (prompt plus answer) [default: the checkpoint's
    /// max_position_embeddings, else 131072, lowered when its MLA cache would take more than
    /// half the memory left for experts (on a GPU with its own memory, half the free VRAM
    /// beside the margin); the start-up `[K3] context:` line says which]. The MLA cache
    /// grows as it is used; the memory plan (RAM, or that VRAM) reserves it whole. A prompt
    /// longer than the context is refused; `k3 serve` clamps a request's max_tokens to what
    /// the prompt leaves of it.
    #[arg(long = "max-tokens", env = "K3_MAXT")]
    pub context_tokens: Option<usize>,
    /// In-RAM state snapshots the command keeps (set by `k3 serve`), reserved by the plan.
    #[arg(skip)]
    pub snapshots: SnapshotLimits,
    #[command(flatten)]
    pub cache: super::cache_args::CacheArgs,
    #[command(flatten)]
    pub prompt_cache: super::prompt_cache_args::PromptCacheArgs,
}

impl StreamArgs {
    /// Maps these flags onto `cfg`: memory, experts, streaming, cache policy, prompt
    /// cache, context and snapshots. `K3_VK_GB` is read here when `K3_GPU_GB` is unset; a
    /// value that is not a number is reported when a tier is sized, as before.
    pub(crate) fn apply(&self, cfg: &mut EngineConfig) {
        cfg.memory = MemoryConfig {
            ram_gb: self.ram_gb,
            overcommit: self.ram_overcommit == 1,
            memory_pressure: self.memory_pressure != "off",
        };
        cfg.experts = ExpertConfig {
            expert_gb: self.expert_gb,
            gpu_expert_gb: match self.gpu_expert_gb {
                Some(gb) => TierGb::Asked(gb),
                None => match std::env::var("K3_VK_GB") {
                    Ok(v) => match v.trim().parse() {
                        Ok(gb) => TierGb::Asked(gb),
                        Err(_) => TierGb::Invalid(format!(
                            "K3_VK_GB must be a number of GB >= 0, got {v:?}"
                        )),
                    },
                    Err(_) => TierGb::Default,
                },
            },
            top_p: self.expert_top_p,
            skip_uncached_below: self.skip_uncached_below,
        };
        cfg.streaming = StreamingConfig {
            direct: self.direct == 1,
            pipe: self.pipe == 1,
            prefetch: match self.prefetch.as_str() {
                "always" => Prefetch::Always,
                "off" => Prefetch::Off,
                _ => Prefetch::On,
            },
            load_threads: self.load_threads as usize,
        };
        cfg.cache = self.cache.config();
        let in_use = cfg.prompt_cache.in_use;
        cfg.prompt_cache = self.prompt_cache.settings(in_use);
        cfg.context_tokens = self.context_tokens;
        cfg.snapshots = self.snapshots;
    }
}
