//! Expert streaming flags (`K3_EXPERT_GB`, `K3_DIRECT`, `K3_PIPE`, ...) and the RAM clamp
//! that turns the cache request into slots once the dense weights are resident.

use anyhow::{bail, Result};
use clap::Args;
use k3::backend::{Backend, FreeDeviceMemory};
use k3::experts::cache_policy::PolicyKind;
use k3::experts::pressure_guard::{CacheSize, PressureGuard};
use k3::experts::ram_budget::{self, BudgetInputs};
use k3::experts::usage_history::PinMode;
use k3::experts::{IoMode, StreamConfig};
use k3::model::expert_selection::ExpertSelection;
use k3::model::state_size::{state_size, StateSize};
use k3::model::K3Model;
use k3::platform::memory_pressure;

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
    /// Longest context the MLA cache is budgeted for, in tokens.
    #[arg(long = "max-tokens", env = "K3_MAXT", default_value_t = 4096)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub cache: super::cache_args::CacheArgs,
}

impl StreamArgs {
    /// Sizes the cache against measured memory, prints the `[K3][RAM_GB=...]` line, and
    /// installs the streaming settings in the model.
    pub fn configure<B: Backend>(&self, model: &mut K3Model<B>) -> Result<StreamConfig> {
        if !(self.expert_gb.is_finite() && self.expert_gb >= 0.0) {
            bail!(
                "K3_EXPERT_GB / --expert-gb must be a number of GB >= 0, got {}",
                self.expert_gb
            );
        }
        if self.max_tokens == 0 || self.max_tokens > MAX_CONTEXT {
            bail!(
                "K3_MAXT / --max-tokens must be between 1 and {MAX_CONTEXT} tokens, got {}",
                self.max_tokens
            );
        }
        let cfg = &model.ckpt.config;
        let mem = ram_budget::probe()?;
        let StateSize { kv_gb, kda_gb } = state_size(cfg, self.max_tokens);
        // On unified memory both budgets are one pool of RAM, clamped as such.
        let pool = model.backend.unified_pool();
        let request_gb = if pool {
            self.expert_gb + self.gpu_tier_gb()?.unwrap_or(0.0)
        } else {
            self.expert_gb
        };
        let plan = ram_budget::plan(&BudgetInputs {
            ram_gb: self.ram_gb,
            resident_gb: mem.resident_gb,
            available_gb: mem.available_gb,
            kv_gb,
            kda_gb,
            request_gb,
            slot_bytes: cfg.expert_bytes() as u64,
            moe_layers: cfg.moe_layer_count(),
            experts: cfg.num_experts,
            overcommit: self.ram_overcommit == 1,
            pool,
            ceiling_gb: ram_budget::os_footprint_ceiling_gb(),
        })?;
        eprintln!("{plan}");
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
        } else {
            self.configure_gpu_tier(model, plan.slots)?;
        }
        Ok(sc)
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

    /// The expert selection the flags ask for: `K3_TOPP` 0 or >= 1 is off, as in the C
    /// engine.
    fn expert_selection(&self) -> Result<ExpertSelection> {
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

    /// Sizes the backend's VRAM expert tier (see [`tier_size`]) and prints `[K3-GPU] expert
    /// tier: ...` when the backend has one, with what it and the host cache of `host_slots` a
    /// layer keep together (they are exclusive: an expert lives in one of them).
    fn configure_gpu_tier<B: Backend>(&self, model: &K3Model<B>, host_slots: usize) -> Result<()> {
        let asked = self.gpu_tier_gb()?;
        let cfg = &model.ckpt.config;
        let tier = |bytes: u64| {
            model.backend.configure_expert_tier(
                bytes,
                cfg.num_experts * cfg.moe_layer_count(),
                cfg.moe_intermediate_size,
                cfg.routed_expert_hidden_size,
            )
        };
        // Emptying the tier first tells whether the backend has one, and hands an earlier
        // tier's VRAM back before free memory is measured (bench reconfigures a loaded model).
        if tier(0)?.is_none() {
            return Ok(());
        }
        let size = tier_size(asked, || model.backend.free_device_memory())?;
        let n = tier(size.bytes)?.unwrap_or(0);
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

/// The tier policy: a size asked for always wins (0 turns the tier off); otherwise
/// `free - margin`, margin = max(2 GB, 10% of free), with free measured by `measure` after
/// the dense weights are loaded; no measurement keeps the tier off.
fn tier_size(
    asked_gb: Option<f64>,
    measure: impl FnOnce() -> Result<FreeDeviceMemory>,
) -> Result<TierSize> {
    let gb = |b: u64| b as f64 / 1e9;
    if let Some(a) = asked_gb {
        return Ok(TierSize {
            bytes: (a * 1e9) as u64,
            why: if a == 0.0 {
                "asked 0 = off".into()
            } else {
                format!("asked {a} GB")
            },
        });
    }
    Ok(match measure()? {
        FreeDeviceMemory::Bytes(free) => {
            let margin = TIER_MARGIN_MIN_BYTES.max(free / 10);
            let bytes = free.saturating_sub(margin);
            TierSize {
                bytes,
                why: format!(
                    "default = free VRAM {:.1} GB - margin {:.1} GB{}",
                    gb(free),
                    gb(margin),
                    if bytes == 0 { ": nothing left" } else { "" }
                ),
            }
        }
        FreeDeviceMemory::Unknown(reason) => TierSize {
            bytes: 0,
            why: format!("default off: {reason}; set K3_GPU_GB to keep experts in VRAM"),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1_000_000_000;

    fn free(bytes: u64) -> impl FnOnce() -> Result<FreeDeviceMemory> {
        move || Ok(FreeDeviceMemory::Bytes(bytes))
    }

    #[test]
    fn vram_default_is_free_minus_the_larger_margin() {
        // Large: 10% of 100 GB beats 2 GB.
        let s = tier_size(None, free(100 * G)).unwrap();
        assert_eq!(s.bytes, 90 * G);
        assert!(
            s.why.contains("free VRAM 100.0 GB - margin 10.0 GB"),
            "{}",
            s.why
        );
        // Small: the 2 GB floor beats 10% of 8 GB.
        assert_eq!(tier_size(None, free(8 * G)).unwrap().bytes, 6 * G);
        // Below the margin: off, and the line says so.
        let s = tier_size(None, free(G)).unwrap();
        assert_eq!(s.bytes, 0);
        assert!(s.why.contains("nothing left"), "{}", s.why);
    }

    #[test]
    fn vram_unknown_keeps_the_tier_off_and_says_why() {
        let s = tier_size(None, || Ok(FreeDeviceMemory::Unknown("no budget ext"))).unwrap();
        assert_eq!(s.bytes, 0);
        assert!(
            s.why.contains("no budget ext") && s.why.contains("K3_GPU_GB"),
            "{}",
            s.why
        );
        // A failing measurement is an error, not a silent 0.
        assert!(tier_size(None, || anyhow::bail!("device lost")).is_err());
    }

    #[test]
    fn vram_asked_size_wins_and_zero_turns_the_tier_off() {
        let never = || -> Result<FreeDeviceMemory> { panic!("an asked size must not measure") };
        let s = tier_size(Some(1.5), never).unwrap();
        assert_eq!(s.bytes, 1_500_000_000);
        let s = tier_size(Some(0.0), never).unwrap();
        assert_eq!(s.bytes, 0);
        assert!(s.why.contains("off"), "{}", s.why);
    }
}
