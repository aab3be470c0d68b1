//! The machine measured ([`measure`]) and the memory plan ([`super::plan::Plan`]) turned
//! into a loaded model's runtime settings ([`plan_runtime`]): the streaming settings,
//! the cache policy, the expert selection, the memory-pressure guard, the expert tier or
//! unified pool, the context and the prefill window, with the start-up lines that say how.

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
use crate::model::{K3Model, Runner, Runtime, RuntimeSettings};
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

/// Measures the machine, plans, prints the plan's start-up lines and settles what the
/// backend and the OS answer (the tier or pool's slots, the pressure signal, the cache
/// policy and pins), returning the plan and the settings of `model`'s runtime (the prompt
/// cache and the other ranks are the caller's to add). A loaded model may be planned again
/// (benchmarks change the cache size between runs and build a new runtime).
pub fn plan_runtime<B: Backend>(
    model: &K3Model<B>,
    engine: &EngineConfig,
) -> Result<(Plan, RuntimeSettings)> {
    let machine = measure(model)?;
    let plan = Plan::new(&model.ckpt.config, &machine, engine)?;
    for line in plan.to_string().lines() {
        tracing::info!("{line}");
    }
    let (cache, route_tap) = engine.cache.setup(model, plan.budget.slots);
    let pressure = pressure_guard(&plan);
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
    let settings = RuntimeSettings {
        stream: plan.stream,
        cache,
        route_tap,
        prefetch: plan.prefetch,
        prefetch_always: plan.prefetch_always,
        selection: plan.selection,
        context: Some(plan.budget.context),
        window: Some(plan.prefill_window),
        pressure,
        prompt_cache: None,
        remote: None,
    };
    Ok((plan, settings))
}

/// The memory-pressure guard over the cache the plan granted, when `--memory-pressure on`
/// and the OS has a signal; the start-up line says which.
fn pressure_guard(plan: &Plan) -> Option<PressureGuard> {
    match plan.pressure {
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
    }
}

/// Plans `runner`'s model again under `engine` and gives it a runtime built from the new
/// plan, after `edit` (benchmarks change the cache size or the window between runs, each
/// from empty caches). The prompt cache and the other ranks are not carried over: a
/// benchmark uses neither.
pub fn replan<B: Backend>(
    runner: &mut Runner<B>,
    engine: &EngineConfig,
    edit: impl FnOnce(&mut RuntimeSettings),
) -> Result<Plan> {
    let (plan, mut settings) = plan_runtime(&runner.model, engine)?;
    edit(&mut settings);
    runner.rt = Runtime::new(&runner.ckpt.config, &runner.backend, settings)?;
    runner.rt.progress().set_print(!engine.load.quiet);
    Ok(plan)
}
