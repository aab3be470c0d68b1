//! The plan on synthetic machines: no model, no backend, no I/O.

use super::*;

/// The full K3 config: k3-slice's dimensions with 93 layers.
fn full_k3() -> Config {
    crate::synth::preset_config_for_tests(crate::synth::Preset::K3Slice, Some(93))
}

/// A CPU machine with `available_gb` free after a load of `resident_gb`.
fn cpu(resident_gb: f64, available_gb: f64) -> Machine {
    Machine {
        resident_gb,
        available_gb,
        ceiling_gb: None,
        state_in_ram: true,
        unified_pool: false,
        vram: Vram::Host,
        mla_cache_max_positions: None,
        max_window: usize::MAX,
    }
}

/// A discrete GPU with `free` bytes of VRAM and a tier.
fn gpu(free: u64) -> Machine {
    Machine {
        state_in_ram: false,
        vram: Vram::Free {
            free,
            has_tier: true,
        },
        max_window: 65_536,
        ..cpu(40.0, 200.0)
    }
}

fn lines(p: &Plan) -> Vec<String> {
    p.to_string().lines().map(str::to_string).collect()
}

#[test]
fn a_cpu_plan_prints_the_start_up_lines_in_order() {
    let p = Plan::new(&Config::tiny(), &cpu(0.5, 16.0), &EngineConfig::default()).unwrap();
    let l = lines(&p);
    let starts = [
        "[K3][RAM_GB=",
        "[K3] context: 131072 tokens (default; the checkpoint's config states no max_position_embeddings)",
        "[K3] state: one sequence at the full context: 1 x ",
        "[K3] expert reads: ",
        "[K3] prefill window: ",
    ];
    assert_eq!(l.len(), starts.len(), "{p}");
    for (line, start) in l.iter().zip(starts) {
        assert!(line.starts_with(start), "{line:?} does not start {start:?}");
    }
    assert_eq!(p.state.sequences, 1);
    assert_eq!(
        p.state.total_bytes(),
        sequence_bytes(&Config::tiny(), 131_072)
    );
    assert_eq!(p.tier, TierPlan::None);
    assert!(p.prefetch && !p.prefetch_always);
    assert_eq!(p.stream.slots_per_layer, p.budget.slots);
    assert_eq!(
        p.pressure,
        Some((CacheSize::PerLayer(p.budget.slots), 1)),
        "the guard watches the host cache"
    );
    // The whole prompt in one window: the context bounds it.
    assert_eq!(p.prefill_window, 131_072);
    assert!(p.window_line().ends_with("bound: the context"), "{p}");
}

#[test]
fn parallel_sequences_each_get_a_full_context_state_when_ram_allows() {
    let cfg = Config::tiny();
    let engine = |parallel| EngineConfig {
        parallel,
        context_tokens: Some(4096),
        ..EngineConfig::default()
    };
    let one = Plan::new(&cfg, &cpu(0.5, 16.0), &engine(1)).unwrap();
    let two = Plan::new(&cfg, &cpu(0.5, 16.0), &engine(2)).unwrap();
    assert_eq!((two.state.parallel, two.state.sequences), (2, 2));
    assert_eq!(two.state.total_bytes(), 2 * one.state.total_bytes());
    assert!(
        two.state_line()
            .starts_with("[K3] state: 2 sequences at the full context (--parallel): 2 x "),
        "{}",
        two.state_line()
    );
    // The RAM reserve holds the second state too.
    assert!(two.budget.reserve_gb > one.budget.reserve_gb, "{two}");
    // 0 asks for one, as a job that runs one sequence does.
    assert_eq!(
        Plan::new(&cfg, &cpu(0.5, 16.0), &engine(0))
            .unwrap()
            .state
            .sequences,
        1
    );
}

#[test]
fn short_ram_reserves_fewer_sequences_than_asked_and_says_so() {
    let cfg = full_k3();
    // 128K tokens of full K3 state each; 60 GB free holds the first and a few more.
    let p = Plan::new(
        &cfg,
        &cpu(36.0, 60.0),
        &EngineConfig {
            parallel: 64,
            context_tokens: Some(131_072),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    assert!(p.state.sequences < 64 && p.state.sequences >= 1, "{p}");
    assert!(
        p.state_line().contains(&format!(
            "{} of the 64 sequences asked (--parallel) fit at the full context",
            p.state.sequences
        )),
        "{}",
        p.state_line()
    );
}

#[test]
fn a_huge_context_on_a_small_machine_is_refused_and_the_default_shrinks() {
    let cfg = full_k3();
    let huge = EngineConfig {
        context_tokens: Some(MAX_CONTEXT),
        ..EngineConfig::default()
    };
    let e = Plan::new(&cfg, &cpu(36.0, 60.0), &huge).unwrap_err();
    assert!(e.to_string().contains("not enough memory"), "{e}");
    let over = EngineConfig {
        context_tokens: Some(MAX_CONTEXT + 1),
        ..EngineConfig::default()
    };
    let e = Plan::new(&cfg, &cpu(36.0, 60.0), &over).unwrap_err();
    assert!(e.to_string().contains("--max-tokens"), "{e}");
    // Unasked, the context shrinks to what half the memory left for experts holds.
    let p = Plan::new(&cfg, &cpu(36.0, 20.0), &EngineConfig::default()).unwrap();
    assert!(p.budget.context < 131_072, "{p}");
    assert!(
        p.budget.context_why.starts_with("default: what fits"),
        "{p}"
    );
}

#[test]
fn a_discrete_gpu_splits_its_vram_between_tier_window_and_state() {
    let cfg = full_k3();
    let p = Plan::new(&cfg, &gpu(80_000_000_000), &EngineConfig::default()).unwrap();
    let TierPlan::Vram(tier) = &p.tier else {
        panic!("no VRAM tier: {p:?}")
    };
    assert!(
        tier.bytes > 0 && tier.why.starts_with("default = free VRAM 80.0 GB"),
        "{tier:?}"
    );
    assert!(tier.why.contains("state and snapshots"), "{tier:?}");
    assert!(
        p.prefill_window <= crate::engine::tiers::DEFAULT_VRAM_WINDOW_TOKENS,
        "{p}"
    );
    assert!(p.window_line().contains("GB of VRAM"), "{p}");
    assert!(
        p.budget
            .to_string()
            .contains("KV, KDA and snapshots in VRAM"),
        "{p}"
    );
    assert!(p.state_line().ends_with("reserved in VRAM"), "{p}");
    // A GPU that cannot report its free memory: the tier is off unless asked.
    let unknown = Machine {
        vram: Vram::Unknown {
            has_tier: true,
            reason: "no budget extension".into(),
        },
        ..gpu(0)
    };
    let p = Plan::new(&cfg, &unknown, &EngineConfig::default()).unwrap();
    assert!(
        matches!(&p.tier, TierPlan::Vram(t) if t.bytes == 0 && t.why.starts_with("default off: no budget extension")),
        "{:?}",
        p.tier
    );
    assert!(p.window_line().contains("GB of RAM"), "{p}");
}

#[test]
fn unified_memory_plans_one_pool_and_the_guard_watches_it() {
    let cfg = full_k3();
    let mac = Machine {
        unified_pool: true,
        ceiling_gb: Some(100.0),
        ..cpu(36.0, 80.0)
    };
    let p = Plan::new(&cfg, &mac, &EngineConfig::default()).unwrap();
    let TierPlan::Pool { slots } = p.tier else {
        panic!("no pool: {p:?}")
    };
    assert!(slots >= cfg.moe_layer_count() && p.budget.slots == 0, "{p}");
    assert_eq!(
        p.pressure,
        Some((CacheSize::Pool(slots), cfg.moe_layer_count()))
    );
    assert_eq!(p.stream.slots_per_layer, 0, "the pool is the only cache");
}

#[test]
fn the_adapters_limits_and_chunk_bound_the_window() {
    let cfg = Config::tiny();
    let small = Machine {
        max_window: 100,
        ..cpu(0.5, 16.0)
    };
    let p = Plan::new(&cfg, &small, &EngineConfig::default()).unwrap();
    assert_eq!(p.prefill_window, 100);
    assert!(
        p.window_line()
            .contains("the adapter's limits on one dispatch or binding (100 tokens)"),
        "{p}"
    );
    let chunk = EngineConfig {
        max_window: Some(64),
        ..EngineConfig::default()
    };
    let p = Plan::new(&cfg, &small, &chunk).unwrap();
    assert_eq!(p.prefill_window, 64);
    assert!(
        p.window_line().ends_with("bound: --chunk / K3_CHUNK"),
        "{p}"
    );
}
