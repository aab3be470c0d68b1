//! The machine measured ([`measure`]) and the memory plan ([`super::plan::Plan`]) applied to
//! a loaded model: the streaming settings, the cache policy, the expert selection, the
//! memory-pressure guard, the expert tier or unified pool, the context and the prefill
//! window, with the start-up lines that say how.

use super::config::EngineConfig;
use super::plan::{Machine, Plan, TierPlan, Vram};
use super::tiers::{configure_gpu_tier, configure_pool, size_expert_tier};
use crate::backend::{Backend, FreeDeviceMemory};
use crate::experts::cache::cache_policy::PolicyKind;
use crate::experts::cache::pressure_guard::PressureGuard;
use crate::experts::cache::ram_budget;
use crate::experts::cache::usage_history::PinMode;
use crate::model::mla::Mla;
use crate::model::prefill_window::moe_row_bytes;
use crate::model::K3Model;
use crate::platform::memory_pressure;
use anyhow::Result;

/// Measures what the plan needs of this machine and `model`'s backend: memory now, the
/// GPU's free memory with no expert tier held (an earlier tier is handed back first, as a
/// benchmark reconfigures a loaded model), and the backend's bounds.
pub fn measure<B: Backend>(model: &K3Model<B>) -> Result<Machine> {
    let cfg = &model.ckpt.config;
    let state_in_ram = model.backend.state_in_host_ram();
    let vram = if state_in_ram {
        Vram::Host
    } else {
        let has_tier = size_expert_tier(model, 0)?.is_some();
        match model.backend.free_device_memory()? {
            FreeDeviceMemory::Bytes(free) => Vram::Free { free, has_tier },
            FreeDeviceMemory::Unknown(reason) => Vram::Unknown {
                has_tier,
                reason: reason.to_string(),
            },
        }
    };
    let mem = ram_budget::probe()?;
    Ok(Machine {
        resident_gb: mem.resident_gb,
        available_gb: mem.available_gb,
        ceiling_gb: ram_budget::os_footprint_ceiling_gb(),
        state_in_ram,
        unified_pool: model.backend.unified_pool(),
        vram,
        mla_cache_max_positions: model.backend.mla_cache_max_positions(&Mla::<B>::dims(cfg)),
        max_window: model.backend.max_rows(moe_row_bytes(cfg)),
    })
}

/// Measures the machine, plans, prints the plan's start-up lines and applies the plan to
/// `model`: the streaming settings, the cache policy, the selection, the pressure guard,
/// the tier or pool, the context and the window. A loaded model may be configured again
/// (benchmarks change the cache size between runs).
pub fn configure_streaming<B: Backend>(
    model: &mut K3Model<B>,
    engine: &EngineConfig,
) -> Result<Plan> {
    // Settings the plan refuses are named before the machine is measured.
    engine.experts.check_expert_gb()?;
    let machine = measure(model)?;
    let plan = Plan::new(&model.ckpt.config, &machine, engine)?;
    for line in plan.to_string().lines() {
        tracing::info!("{line}");
    }
    apply(model, engine, &plan)?;
    Ok(plan)
}

/// Installs `plan` in `model`, printing the lines of what the backend and the OS answer
/// (the tier's slots, the pressure signal, the cache policy and pins).
fn apply<B: Backend>(model: &mut K3Model<B>, engine: &EngineConfig, plan: &Plan) -> Result<()> {
    model.set_context(plan.budget.context);
    model.set_streaming(plan.stream.clone())?;
    engine.cache.configure(model, plan.budget.slots)?;
    model.set_prefetch(plan.prefetch);
    model
        .experts_mut()
        .set_prefetch_always(plan.prefetch_always);
    model.set_expert_selection(plan.selection)?;
    install_pressure_guard(model, plan);
    match &plan.tier {
        TierPlan::None => {}
        TierPlan::Pool { slots } => {
            configure_pool(model, &engine.experts, *slots)?;
            if engine.cache.policy != PolicyKind::default()
                || engine.cache.usage_pins != PinMode::Off
            {
                tracing::warn!(
                    "[K3] --cache-policy and --usage-pins choose for the host cache, which the unified pool replaces: the pool evicts the least recently used expert and pins none"
                );
            }
        }
        TierPlan::Vram(size) => configure_gpu_tier(model, plan.budget.slots, size)?,
    }
    model.set_prefill_window(plan.prefill_window);
    Ok(())
}

/// Installs the memory-pressure guard over the cache the plan granted, when
/// `--memory-pressure on` and the OS has a signal; the start-up line says which.
fn install_pressure_guard<B: Backend>(model: &mut K3Model<B>, plan: &Plan) {
    let guard = match plan.pressure {
        None => {
            tracing::info!("[K3] memory pressure: ignored (--memory-pressure off)");
            None
        }
        Some((size, floor)) => match memory_pressure::os_source() {
            Ok(source) => Some(PressureGuard::new(source, size, floor)),
            Err(why) => {
                tracing::warn!("[K3] memory pressure: no signal ({why}); the cache keeps its size");
                None
            }
        },
    };
    model.set_pressure_guard(guard);
}
