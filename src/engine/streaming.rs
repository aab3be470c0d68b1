//! Sizing a loaded model's expert cache, context and prefill window against measured memory
//! (the RAM clamp, the VRAM split) and installing the streaming settings, the cache policy,
//! the expert selection and the memory-pressure guard, with the start-up lines that say how.

use super::config::{EngineConfig, Prefetch, MAX_CONTEXT};
use super::tiers::{
    configure_gpu_tier, configure_pool, size_expert_tier, unmeasured_tier, vram_split,
    vram_window_tokens, VramFree, TIER_MARGIN_MIN_BYTES,
};
use crate::backend::{Backend, FreeDeviceMemory};
use crate::experts::cache::cache_policy::PolicyKind;
use crate::experts::cache::pressure_guard::{CacheSize, PressureGuard};
use crate::experts::cache::ram_budget::{self, BudgetInputs, BudgetPlan, ContextAsk, WindowAsk};
use crate::experts::cache::usage_history::PinMode;
use crate::experts::{IoMode, StreamConfig};
use crate::model::prefill_window::bytes_per_token;
use crate::model::state_size::{state_size, StateSize};
use crate::model::K3Model;
use crate::platform::memory_pressure;
use crate::session::SnapshotLimits;
use anyhow::{bail, Result};

/// What [`configure_streaming`] decided: the RAM plan, the streaming settings and the
/// prefill window.
#[derive(Clone, Debug)]
pub struct StreamPlan {
    /// The RAM plan: cache slots, context, window.
    pub budget: BudgetPlan,
    /// How experts are read.
    pub stream: StreamConfig,
    /// Tokens a prefill pass takes.
    pub prefill_window: usize,
}

/// Sizes the cache, the context and the prefill window against measured memory, prints
/// the `[K3][RAM_GB=...]`, `[K3] context:` and `[K3] prefill window` lines, and installs
/// the streaming settings, the context and the window in `model`; `engine.prompt_cache.in_use`
/// reserves the prompt cache's working set, `engine.max_window` bounds the window. A loaded model
/// may be configured again (benchmarks change the cache size between runs).
pub fn configure_streaming<B: Backend>(
    model: &mut K3Model<B>,
    engine: &EngineConfig,
) -> Result<StreamPlan> {
    // Checked again here: a benchmark reconfigures a loaded model with other sizes.
    engine.experts.check_expert_gb()?;
    // On a discrete GPU the state, the snapshots, the prefill window and the tier share
    // the free VRAM; an earlier tier (bench reconfigures a loaded model) is handed back
    // before it is measured.
    let state_in_ram = model.backend.state_in_host_ram();
    let device = if state_in_ram {
        None
    } else {
        let has_tier = size_expert_tier(model, 0)?.is_some();
        Some((has_tier, model.backend.free_device_memory()?))
    };
    let vram = match device {
        Some((has_tier, FreeDeviceMemory::Bytes(free))) => Some(VramFree { free, has_tier }),
        _ => None,
    };
    let context = match engine.context_tokens {
        Some(n) if n == 0 || n > MAX_CONTEXT => {
            bail!("K3_MAXT / --max-tokens must be between 1 and {MAX_CONTEXT} tokens, got {n}")
        }
        Some(n) => ContextAsk::Asked(n),
        None => {
            let (limit, why) = vram_context_limit(model, vram)?;
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
        snapshot_reserve_gb(model, engine.snapshots)
    } else {
        0.0
    };
    // On unified memory both budgets are one pool of RAM, clamped as such.
    let pool = model.backend.unified_pool();
    let request_gb = if pool {
        engine.experts.expert_gb + engine.experts.gpu_tier_gb()?.unwrap_or(0.0)
    } else {
        engine.experts.expert_gb
    };
    let window_bound = engine
        .max_window
        .unwrap_or(crate::session::MAX_WINDOW)
        .min(model.max_window());
    let per_token = bytes_per_token(cfg);
    let plan = ram_budget::plan(&BudgetInputs {
        ram_gb: engine.memory.ram_gb,
        resident_gb: mem.resident_gb,
        available_gb: mem.available_gb,
        context,
        kv: crate::model::context::kv_shape(cfg),
        kda_gb,
        snapshots_gb,
        prompt_cache_gb: if engine.prompt_cache.in_use {
            engine.prompt_cache.plan_gb()?
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
        overcommit: engine.memory.overcommit,
        pool,
        ceiling_gb: ram_budget::os_footprint_ceiling_gb(),
    })?;
    tracing::info!("{plan}");
    tracing::info!("{}", plan.context_line());
    model.set_context(plan.context);
    let sc = StreamConfig {
        mode: if engine.streaming.direct {
            IoMode::Direct
        } else {
            IoMode::Buffered
        },
        pipe: engine.streaming.pipe,
        load_threads: engine.streaming.load_threads,
        slots_per_layer: plan.slots,
    };
    let prefetch = sc.pipe && engine.streaming.prefetch != Prefetch::Off;
    tracing::info!(
        "[K3] expert reads: {} | pipe {} | {} loader threads | prefetch {}",
        sc.mode.describe(),
        if sc.pipe { "on" } else { "off" },
        sc.load_threads,
        if prefetch {
            engine.streaming.prefetch.as_str()
        } else {
            "off"
        }
    );
    model.set_streaming(sc)?;
    engine.cache.configure(model, plan.slots)?;
    model.set_prefetch(prefetch);
    model
        .experts_mut()
        .set_prefetch_always(engine.streaming.prefetch == Prefetch::Always);
    let sel = engine.experts.selection()?;
    if !sel.is_exact() {
        tracing::info!(
            "[K3] fewer experts (not exact): top-p {} | skip uncached below {}",
            sel.top_p.map_or("off".into(), |p| format!("{p:.2}")),
            sel.skip_uncached_below
                .map_or("off".into(), |w| format!("{w}"))
        );
    }
    model.set_expert_selection(sel)?;
    install_pressure_guard(model, engine.memory.memory_pressure, pool, &plan);
    if pool {
        configure_pool(model, &engine.experts, plan.pool_slots)?;
        if engine.cache.policy != PolicyKind::default() || engine.cache.usage_pins != PinMode::Off {
            tracing::warn!(
                    "[K3] --cache-policy and --usage-pins choose for the host cache, which the unified pool replaces: the pool evicts the least recently used expert and pins none"
                );
        }
    }
    let bound = window_bound.min(plan.context);
    let (tokens, by_memory, place) = match (vram, plan.window) {
        (Some(v), _) => {
            let reserve_tokens = vram_window_tokens(bound, engine.max_window.is_some());
            // The conversation's state and its snapshots take VRAM on a discrete GPU.
            let state_gb = plan.kv_gb + plan.kda_gb + snapshot_reserve_gb(model, engine.snapshots);
            let split = vram_split(
                if v.has_tier {
                    engine.experts.gpu_tier_gb()?
                } else {
                    Some(0.0)
                },
                v.free,
                (state_gb * 1e9) as u64,
                reserve_tokens as u64 * per_token,
            );
            if v.has_tier {
                configure_gpu_tier(model, plan.slots, &split.tier)?;
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
                let size = unmeasured_tier(engine.experts.gpu_tier_gb()?, reason);
                configure_gpu_tier(model, plan.slots, &size)?;
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
    let why = if engine.max_window.is_some_and(|c| c <= w) {
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
    tracing::info!(
            "[K3] prefill window: {w} tokens a pass (each routed expert read once a layer per pass) | {:.2} MB of activations a token, {:.1} GB at the full window | bound: {why}",
            per_token as f64 / 1e6,
            (w as u64 * per_token) as f64 / 1e9,
        );
    Ok(StreamPlan {
        budget: plan,
        stream: sc,
        prefill_window: w,
    })
}

/// Installs the memory-pressure guard over the cache `plan` granted, when
/// `--memory-pressure on` and the OS has a signal; the start-up line says which.
fn install_pressure_guard<B: Backend>(
    model: &mut K3Model<B>,
    enabled: bool,
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
    let guard = if !enabled {
        tracing::info!("[K3] memory pressure: ignored (--memory-pressure off)");
        None
    } else {
        match memory_pressure::os_source() {
            Ok(source) => Some(PressureGuard::new(source, size, floor)),
            Err(why) => {
                tracing::warn!("[K3] memory pressure: no signal ({why}); the cache keeps its size");
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
    model: &K3Model<B>,
    vram: Option<VramFree>,
) -> Result<(usize, String)> {
    let (limit, why) = model.context_limit();
    let Some(VramFree { free, .. }) = vram else {
        return Ok((limit, why));
    };
    let room = free.saturating_sub(TIER_MARGIN_MIN_BYTES.max(free / 10)) as f64;
    let per_token = crate::model::context::kv_shape(&model.ckpt.config).bytes_per_token();
    let fit = (ram_budget::CONTEXT_SHARE * room / per_token.max(1.0)) as usize
        / ram_budget::CONTEXT_STEP
        * ram_budget::CONTEXT_STEP;
    let fit = fit.max(ram_budget::MIN_DEFAULT_CONTEXT);
    Ok(if fit < limit {
        (
            fit,
            format!(
                "what fits in half the free VRAM ({:.1} GB) beside the margin, under {limit} ({why})",
                free as f64 / 1e9
            ),
        )
    } else {
        (limit, why)
    })
}

/// What the state snapshots take at their limits, in GB: as many as fit in the byte
/// limit, at most the count, each one KDA state and a row of logits.
fn snapshot_reserve_gb<B: Backend>(model: &K3Model<B>, l: SnapshotLimits) -> f64 {
    let each = model.snapshot_bytes() + 4 * model.ckpt.config.vocab_size;
    let n = l.count.min(l.bytes / each.max(1));
    (n * each) as f64 / 1e9
}
