//! Expert streaming flags (`K3_EXPERT_GB`, `K3_DIRECT`, `K3_PIPE`, ...) and the RAM clamp
//! that turns the cache request into slots once the dense weights are resident.

use anyhow::{bail, Result};
use clap::Args;
use k3::backend::{Backend, FreeDeviceMemory};
use k3::experts::cache_policy::PolicyKind;
use k3::experts::pressure_guard::{CacheSize, PressureGuard};
use k3::experts::ram_budget::{self, BudgetInputs, ContextAsk, WindowAsk};
use k3::experts::usage_history::PinMode;
use k3::experts::{IoMode, StreamConfig};
use k3::model::expert_selection::ExpertSelection;
use k3::model::prefill_window::bytes_per_token;
use k3::model::state_size::{state_size, StateSize};
use k3::model::K3Model;
use k3::platform::memory_pressure;
use k3::session::SnapshotLimits;

/// Longest context accepted: K3's published context is 256K tokens; beyond a few million
/// the MLA cache alone outgrows any machine's memory.
pub const MAX_CONTEXT: usize = 1 << 22;

/// Flags that decide how experts are read and cached.
#[derive(Args, Debug, Clone)]
pub struct StreamArgs {
    /// Expert cache request in GB (1e9 bytes) for all MoE layers together; clamped to RAM.
    /// On a GPU that shares memory with the CPU (Apple Silicon) it sizes the single expert
    /// pool instead, with `--gpu-expert-gb`.
    #[arg(long, env = "K3_EXPERT_GB", default_value_t = 8.0)]
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
    pub max_tokens: Option<usize>,
    /// In-RAM state snapshots the command keeps (set by `k3 serve`), reserved by the plan.
    #[arg(skip)]
    pub snapshots: SnapshotLimits,
    #[command(flatten)]
    pub cache: super::cache_args::CacheArgs,
    #[command(flatten)]
    pub prompt_cache: super::prompt_cache_args::PromptCacheArgs,
}

impl StreamArgs {
    /// Sizes the cache, the context and the prefill window against measured memory, prints
    /// the `[K3][RAM_GB=...]`, `[K3] context:` and `[K3] prefill window` lines, and installs
    /// the streaming settings, the context and the window in the model; `prompt_cache` says
    /// whether the job uses the prompt cache (its working set is then reserved), `chunk` is
    /// `--chunk` (the window's bound; `None`: the whole prompt).
    pub fn configure<B: Backend>(
        &self,
        model: &mut K3Model<B>,
        prompt_cache: bool,
        chunk: Option<usize>,
    ) -> Result<StreamConfig> {
        if !(self.expert_gb.is_finite() && self.expert_gb >= 0.0) {
            bail!(
                "K3_EXPERT_GB / --expert-gb must be a number of GB >= 0, got {}",
                self.expert_gb
            );
        }
        // On a discrete GPU the state, the snapshots, the prefill window and the tier share
        // the free VRAM; an earlier tier (bench reconfigures a loaded model) is handed back
        // before it is measured.
        let state_in_ram = model.backend.state_in_host_ram();
        let device = if state_in_ram {
            None
        } else {
            let has_tier = self.set_tier(model, 0)?.is_some();
            Some((has_tier, model.backend.free_device_memory()?))
        };
        let vram = match device {
            Some((has_tier, FreeDeviceMemory::Bytes(free))) => Some(VramFree { free, has_tier }),
            _ => None,
        };
        let context = match self.max_tokens {
            Some(n) if n == 0 || n > MAX_CONTEXT => {
                bail!("K3_MAXT / --max-tokens must be between 1 and {MAX_CONTEXT} tokens, got {n}")
            }
            Some(n) => ContextAsk::Asked(n),
            None => {
                let (limit, why) = self.vram_context_limit(model, vram)?;
                ContextAsk::Default {
                    limit: limit.min(MAX_CONTEXT),
                    why,
                }
            }
        };
        let cfg = &model.ckpt.config;
        let mem = ram_budget::probe()?;
        let StateSize { kda_gb, .. } = state_size(cfg, 0);
        // Snapshots live where the state does: in device memory on a discrete GPU, where
        // the VRAM budget counts them (`configure_gpu_tier`).
        let snapshots_gb = if model.backend.state_in_host_ram() {
            self.snapshot_reserve_gb(model)
        } else {
            0.0
        };
        // On unified memory both budgets are one pool of RAM, clamped as such.
        let pool = model.backend.unified_pool();
        let request_gb = if pool {
            self.expert_gb + self.gpu_tier_gb()?.unwrap_or(0.0)
        } else {
            self.expert_gb
        };
        let window_bound = chunk
            .unwrap_or(k3::session::MAX_CHUNK)
            .min(model.max_window());
        let per_token = bytes_per_token(cfg);
        let plan = ram_budget::plan(&BudgetInputs {
            ram_gb: self.ram_gb,
            resident_gb: mem.resident_gb,
            available_gb: mem.available_gb,
            context,
            kv: k3::model::context::kv_shape(cfg),
            kda_gb,
            snapshots_gb,
            prompt_cache_gb: if prompt_cache {
                self.prompt_cache.plan_gb()?
            } else {
                0.0
            },
            state_in_ram,
            // With free VRAM measured the window's activations live there, sized below.
            window: vram.is_none().then_some(WindowAsk {
                bound: window_bound,
                bytes_per_token: per_token,
            }),
            request_gb,
            slot_bytes: cfg.expert_bytes() as u64,
            moe_layers: cfg.moe_layer_count(),
            experts: cfg.num_experts,
            overcommit: self.ram_overcommit == 1,
            pool,
            ceiling_gb: ram_budget::os_footprint_ceiling_gb(),
        })?;
        eprintln!("{plan}");
        eprintln!("{}", plan.context_line());
        model.set_context(plan.context);
        let sc = StreamConfig {
            mode: if self.direct == 1 {
                IoMode::Direct
            } else {
                IoMode::Buffered
            },
            pipe: self.pipe == 1,
            load_threads: self.load_threads as usize,
            slots_per_layer: plan.slots,
        };
        let prefetch = sc.pipe && self.prefetch != "off";
        eprintln!(
            "[K3] expert reads: {} | pipe {} | {} loader threads | prefetch {}",
            sc.mode.describe(),
            if sc.pipe { "on" } else { "off" },
            sc.load_threads,
            if prefetch {
                self.prefetch.as_str()
            } else {
                "off"
            }
        );
        model.set_streaming(sc)?;
        self.cache.configure(model, plan.slots)?;
        model.set_prefetch(prefetch);
        model
            .experts_mut()
            .set_prefetch_always(self.prefetch == "always");
        let sel = self.expert_selection()?;
        if !sel.is_exact() {
            eprintln!(
                "[K3] fewer experts (not exact): top-p {} | skip uncached below {}",
                sel.top_p.map_or("off".into(), |p| format!("{p:.2}")),
                sel.skip_uncached_below
                    .map_or("off".into(), |w| format!("{w}"))
            );
        }
        model.set_expert_selection(sel)?;
        self.install_pressure_guard(model, pool, &plan);
        if pool {
            self.configure_pool(model, plan.pool_slots)?;
            if self.cache.cache_policy != PolicyKind::LfuDecay
                || self.cache.usage_pins != PinMode::Off
            {
                eprintln!(
                    "[K3] --cache-policy and --usage-pins choose for the host cache, which the unified pool replaces: the pool evicts the least recently used expert and pins none"
                );
            }
        }
        let bound = window_bound.min(plan.context);
        let (tokens, by_memory, place) = match (vram, plan.window) {
            (Some(v), _) => {
                let reserve_tokens = vram_window_tokens(bound, chunk.is_some());
                // The conversation's state and its snapshots take VRAM on a discrete GPU.
                let state_gb = plan.kv_gb + plan.kda_gb + self.snapshot_reserve_gb(model);
                let split = vram_split(
                    if v.has_tier {
                        self.gpu_tier_gb()?
                    } else {
                        Some(0.0)
                    },
                    v.free,
                    (state_gb * 1e9) as u64,
                    reserve_tokens as u64 * per_token,
                );
                if v.has_tier {
                    self.configure_gpu_tier(model, plan.slots, &split.tier)?;
                }
                let by_memory = (split.window_bytes / per_token.max(1)).max(1) as usize;
                let place = format!(
                    "{:.1} GB of VRAM: at most {} tokens' worth unless --chunk asks for more, and at most half of what the margin and the state leave",
                    split.window_bytes as f64 / 1e9,
                    reserve_tokens
                );
                (bound.min(by_memory), by_memory, place)
            }
            (None, Some(w)) => {
                // A discrete GPU that cannot report its free VRAM: the tier is as asked, or
                // off; the window is sized in RAM as on the CPU.
                if let Some((true, FreeDeviceMemory::Unknown(reason))) = device {
                    let size = unmeasured_tier(self.gpu_tier_gb()?, reason);
                    self.configure_gpu_tier(model, plan.slots, &size)?;
                }
                (
                w.tokens,
                w.by_memory,
                format!(
                    "{:.1} GB of RAM: the activation reserve and half of what the expert cache leaves",
                    w.by_memory as f64 * per_token as f64 / 1e9
                ),
                )
            }
            (None, None) => bail!("internal: the RAM plan sized no prefill window"),
        };
        let w = model.set_prefill_window(tokens);
        let why = if chunk.is_some_and(|c| c <= w) {
            "--chunk / K3_CHUNK".to_string()
        } else if w < by_memory.min(bound) || (w < by_memory && w == model.max_window()) {
            format!(
                "the adapter's limits on one dispatch or binding ({} tokens)",
                model.max_window()
            )
        } else if w == plan.context && plan.context < by_memory {
            "the context".to_string()
        } else {
            format!("memory: {place}")
        };
        eprintln!(
            "[K3] prefill window: {w} tokens a pass (each routed expert read once a layer per pass) | {:.2} MB of activations a token, {:.1} GB at the full window | bound: {why}",
            per_token as f64 / 1e6,
            (w as u64 * per_token) as f64 / 1e9,
        );
        Ok(sc)
    }

    /// Sizes the backend's expert tier to `bytes`; `None` when it has none.
    fn set_tier<B: Backend>(&self, model: &K3Model<B>, bytes: u64) -> Result<Option<usize>> {
        let cfg = &model.ckpt.config;
        model.backend.configure_expert_tier(
            bytes,
            cfg.num_experts * cfg.moe_layer_count(),
            cfg.moe_intermediate_size,
            cfg.routed_expert_hidden_size,
        )
    }

    /// Installs the memory-pressure guard over the cache `plan` granted, when
    /// `--memory-pressure on` and the OS has a signal; the start-up line says which.
    fn install_pressure_guard<B: Backend>(
        &self,
        model: &mut K3Model<B>,
        pool: bool,
        plan: &ram_budget::BudgetPlan,
    ) {
        let (size, floor) = if pool {
            (
                CacheSize::Pool(plan.pool_slots),
                model.ckpt.config.moe_layer_count(),
            )
        } else {
            (CacheSize::PerLayer(plan.slots), 1)
        };
        let guard = if self.memory_pressure == "off" {
            eprintln!("[K3] memory pressure: ignored (--memory-pressure off)");
            None
        } else {
            match memory_pressure::os_source() {
                Ok(source) => Some(PressureGuard::new(source, size, floor)),
                Err(why) => {
                    eprintln!("[K3] memory pressure: no signal ({why}); the cache keeps its size");
                    None
                }
            }
        };
        model.set_pressure_guard(guard);
    }

    /// The default context's limit ([`K3Model::context_limit`]), lowered on a discrete GPU
    /// that reports its free VRAM to what [`ram_budget::CONTEXT_SHARE`] of it holds beside
    /// the tier's margin.
    fn vram_context_limit<B: Backend>(
        &self,
        model: &K3Model<B>,
        vram: Option<VramFree>,
    ) -> Result<(usize, String)> {
        let (limit, why) = model.context_limit();
        let Some(VramFree { free, .. }) = vram else {
            return Ok((limit, why));
        };
        let room = free.saturating_sub(TIER_MARGIN_MIN_BYTES.max(free / 10)) as f64;
        let per_token = k3::model::context::kv_shape(&model.ckpt.config).bytes_per_token();
        let fit = (ram_budget::CONTEXT_SHARE * room / per_token.max(1.0)) as usize
            / ram_budget::CONTEXT_STEP
            * ram_budget::CONTEXT_STEP;
        let fit = fit.max(ram_budget::MIN_DEFAULT_CONTEXT);
        Ok(if fit < limit {
            (
                fit,
                format!(
                    "what fits in half the free VRAM ({:.1} GB) beside the margin; {why} is {limit}",
                    free as f64 / 1e9
                ),
            )
        } else {
            (limit, why)
        })
    }

    /// What the state snapshots take at their limits, in GB: as many as fit in the byte
    /// limit, at most the count, each one KDA state and a row of logits.
    fn snapshot_reserve_gb<B: Backend>(&self, model: &K3Model<B>) -> f64 {
        let each = model.snapshot_bytes() + 4 * model.ckpt.config.vocab_size;
        let l = self.snapshots;
        let n = l.count.min(l.bytes / each.max(1));
        (n * each) as f64 / 1e9
    }

    /// The expert selection the flags ask for: `K3_TOPP` 0 or >= 1 is off, as in the C
    /// engine.
    pub(super) fn expert_selection(&self) -> Result<ExpertSelection> {
        let p = self.expert_top_p;
        if !(0.0..=1.0).contains(&p) {
            bail!("--expert-top-p / K3_TOPP must be a share between 0 and 1, got {p}");
        }
        ExpertSelection {
            top_p: (p > 0.0 && p < 1.0).then_some(p),
            skip_uncached_below: self.skip_uncached_below,
        }
        .validated()
    }

    /// The tier request in GB: the flag / `K3_GPU_GB`, else `K3_VK_GB`, else `None` (the
    /// default: sized from free VRAM).
    fn gpu_tier_gb(&self) -> Result<Option<f64>> {
        let gb = match self.gpu_expert_gb {
            Some(gb) => gb,
            None => match std::env::var("K3_VK_GB") {
                Ok(v) => v.trim().parse().map_err(|_| {
                    anyhow::anyhow!("K3_VK_GB must be a number of GB >= 0, got {v:?}")
                })?,
                Err(_) => return Ok(None),
            },
        };
        if !(gb.is_finite() && gb >= 0.0) {
            bail!("K3_GPU_GB / K3_VK_GB / --gpu-expert-gb must be a number of GB >= 0, got {gb}");
        }
        Ok(Some(gb))
    }

    /// Sizes the unified pool to `slots` (granted by the RAM clamp from `K3_EXPERT_GB` plus
    /// `K3_GPU_GB`) and prints `[K3-GPU] expert tier: unified pool ...`.
    fn configure_pool<B: Backend>(&self, model: &K3Model<B>, slots: usize) -> Result<()> {
        let cfg = &model.ckpt.config;
        let eb = cfg.expert_bytes() as u64;
        let n = model
            .backend
            .configure_expert_tier(
                slots as u64 * eb,
                cfg.num_experts * cfg.moe_layer_count(),
                cfg.moe_intermediate_size,
                cfg.routed_expert_hidden_size,
            )?
            .unwrap_or(0);
        eprintln!(
            "[K3-GPU] expert tier: unified pool of {n} slots ({:.1} GB; --expert-gb {} + --gpu-expert-gb {}, clamped to RAM) | the only expert cache: no host copies, evicted experts dropped",
            n as f64 * eb as f64 / 1e9,
            self.expert_gb,
            self.gpu_tier_gb()?.unwrap_or(0.0)
        );
        Ok(())
    }

    /// Sizes the backend's VRAM expert tier to `size` (see [`vram_split`]) and prints
    /// `[K3-GPU] expert tier: ...`, with what it and the host cache of `host_slots` a layer
    /// keep together (they are exclusive: an expert lives in one of them).
    fn configure_gpu_tier<B: Backend>(
        &self,
        model: &K3Model<B>,
        host_slots: usize,
        size: &TierSize,
    ) -> Result<()> {
        let cfg = &model.ckpt.config;
        let n = self.set_tier(model, size.bytes)?.unwrap_or(0);
        let host = host_slots * cfg.moe_layer_count();
        let kept = if n > 0 {
            format!(
                " | with the host cache's {host}: {} experts, each in one",
                host + n
            )
        } else {
            String::new()
        };
        eprintln!(
            "[K3-GPU] expert tier: {n} slots ({:.1} GB; {}){kept}",
            n as f64 * cfg.expert_bytes() as f64 / 1e9,
            size.why
        );
        Ok(())
    }
}

/// Free VRAM the default tier leaves to everything else, at least: activations, the MLA
/// cache and KDA state allocated after the measurement, and other programs on the GPU.
const TIER_MARGIN_MIN_BYTES: u64 = 2_000_000_000;

/// The VRAM expert tier's size and how it was decided.
#[derive(Clone, Debug, PartialEq)]
struct TierSize {
    /// Bytes for the tier (0 = off).
    bytes: u64,
    /// The decision, for the start-up line.
    why: String,
}

/// What was measured of a discrete GPU's memory before the plan.
#[derive(Clone, Copy, Debug)]
struct VramFree {
    /// Free VRAM after the dense weights, with no tier, bytes.
    free: u64,
    /// Whether the backend keeps a VRAM expert tier.
    has_tier: bool,
}

/// A discrete GPU's free VRAM shared out: the expert tier and the prefill window.
#[derive(Clone, Debug, PartialEq)]
struct VramSplit {
    /// The tier.
    tier: TierSize,
    /// Bytes the prefill window's activations may take.
    window_bytes: u64,
}

/// The VRAM budget of a discrete GPU with `free` bytes free after the dense weights: a
/// margin of max(2 GB, 10% of free) for other programs and scratch, then `state_bytes` (the
/// MLA caches at the full context, the KDA state and the snapshots), then the tier and the
/// prefill window. A tier size asked for always wins (0 turns it off) and the window gets
/// half of what it leaves; by default the window takes half of the room, at most
/// `window_max` bytes (its bound), and the tier the rest.
fn vram_split(asked_gb: Option<f64>, free: u64, state_bytes: u64, window_max: u64) -> VramSplit {
    let gb = |b: u64| b as f64 / 1e9;
    let margin = TIER_MARGIN_MIN_BYTES.max(free / 10);
    let room = free.saturating_sub(margin).saturating_sub(state_bytes);
    let half = |b: u64| (b as f64 * ram_budget::WINDOW_SHARE) as u64;
    if let Some(a) = asked_gb {
        let tier = asked_tier(a);
        let window_bytes = window_max.min(half(room.saturating_sub(tier.bytes)));
        return VramSplit { tier, window_bytes };
    }
    let window_bytes = window_max.min(half(room));
    let bytes = room - window_bytes;
    let state = if state_bytes > 0 {
        format!(" - state and snapshots {:.1} GB", gb(state_bytes))
    } else {
        String::new()
    };
    VramSplit {
        tier: TierSize {
            bytes,
            why: format!(
                "default = free VRAM {:.1} GB - margin {:.1} GB{state} - prefill window {:.1} GB{}",
                gb(free),
                gb(margin),
                gb(window_bytes),
                if bytes == 0 { ": nothing left" } else { "" }
            ),
        },
        window_bytes,
    }
}

/// Most prompt tokens the default prefill window reserves VRAM for on a GPU with its own
/// memory (`--chunk` asks for more): an agent's preamble of up to 16k tokens reads each
/// routed expert once, and the expert tier keeps the rest of the room for decode.
pub const DEFAULT_VRAM_WINDOW_TOKENS: usize = 16_384;

/// Prompt tokens the window reserves VRAM for on a GPU with its own memory: its `bound`
/// when `--chunk` set it, else at most [`DEFAULT_VRAM_WINDOW_TOKENS`], so the tier, which
/// every decoded token reads from, keeps the rest and a longer prompt runs in several
/// windows.
fn vram_window_tokens(bound: usize, chunk_set: bool) -> usize {
    if chunk_set {
        bound
    } else {
        bound.min(DEFAULT_VRAM_WINDOW_TOKENS)
    }
}

/// A tier of `gb` GB asked for (0: off).
fn asked_tier(gb: f64) -> TierSize {
    TierSize {
        bytes: (gb * 1e9) as u64,
        why: if gb == 0.0 {
            "asked 0 = off".into()
        } else {
            format!("asked {gb} GB")
        },
    }
}

/// The tier where free VRAM cannot be measured (`reason`): as asked, else off.
fn unmeasured_tier(asked_gb: Option<f64>, reason: &str) -> TierSize {
    match asked_gb {
        Some(a) => asked_tier(a),
        None => TierSize {
            bytes: 0,
            why: format!("default off: {reason}; set K3_GPU_GB to keep experts in VRAM"),
        },
    }
}

#[cfg(test)]
mod tests;
