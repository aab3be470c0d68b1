//! The RAM plan's unit tests (slots, context, window, the printed line).

use super::*;

fn inputs() -> BudgetInputs {
    BudgetInputs {
        ram_gb: None,
        resident_gb: 20.0,
        available_gb: 100.0,
        // 0.5 GB of MLA cache: 1M tokens x 1 layer x 125 values x 4 B.
        context: ContextAsk::Asked(1_000_000),
        sequences: 1,
        kv: KvShape {
            mla_layers: 1,
            values_per_token: 125,
        },
        kda_gb: 0.3,
        snapshots_gb: 0.0,
        prompt_cache_gb: 0.0,
        state_in_ram: true,
        window: None,
        request_gb: 64.0,
        slot_bytes: 17_547_264,
        moe_layers: 92,
        experts: 896,
        overcommit: false,
        pool: false,
        ceiling_gb: None,
    }
}

#[test]
fn request_floors_and_clamps() {
    // 64e9 / (17547264 · 92) = 39.6 -> 39
    assert_eq!(requested_slots(64.0, 17_547_264, 92, 896), 39);
    assert_eq!(
        requested_slots(0.0, 17_547_264, 92, 896),
        1,
        "at least one slot"
    );
    assert_eq!(
        requested_slots(1e6, 17_547_264, 92, 896),
        896,
        "at most every expert"
    );
}

#[test]
fn clamp_only_shrinks() {
    let p = plan(&inputs()).unwrap();
    // budget 20 + 88 = 108; reserve 2.5 + 1.2 + 0.5 + 0.3 = 4.5; experts 83.5 GB -> 51 fit
    assert!((p.budget_gb - 108.0).abs() < 1e-9);
    assert!((p.reserve_gb - 4.5).abs() < 1e-9);
    assert_eq!(p.requested_slots, 39);
    assert_eq!(p.slots, 39, "the request fits, so it is granted unchanged");
    let small = plan(&BudgetInputs {
        available_gb: 30.0,
        ..inputs()
    })
    .unwrap();
    // budget 46.4; experts 46.4 - 20 - 4.5 = 21.9 GB -> floor(21.9 / 1.6143) = 13
    assert_eq!(small.slots, 13);
    let s = small.to_string();
    assert!(
        s.starts_with("[K3][RAM_GB=46.4] resident 20.0 + reserve 4.5 ("),
        "{s}"
    );
    assert!(
        s.contains("-> 21.9 GB for experts; cache 39->13/layer (projected peak"),
        "{s}"
    );
}

#[test]
fn ram_gb_overrides_and_too_small_fails_unless_overcommit() {
    let p = plan(&BudgetInputs {
        ram_gb: Some(30.0),
        ..inputs()
    })
    .unwrap();
    assert_eq!(p.slots, 3); // (30 - 24.5) / 1.614 = 3.4
    let e = plan(&BudgetInputs {
        ram_gb: Some(25.0),
        ..inputs()
    })
    .unwrap_err();
    assert!(e.to_string().contains("K3_RAM_OVERCOMMIT=1"), "{e}");
    let p = plan(&BudgetInputs {
        ram_gb: Some(25.0),
        overcommit: true,
        ..inputs()
    })
    .unwrap();
    assert_eq!(p.slots, 1);
}

#[test]
fn the_macos_ceiling_holds_a_measured_budget_but_not_ram_gb() {
    // Measured budget 108 GB; a 100 GB ceiling lowers it and the line says so.
    let p = plan(&BudgetInputs {
        ceiling_gb: Some(100.0),
        ..inputs()
    })
    .unwrap();
    assert!((p.budget_gb - 100.0).abs() < 1e-9);
    assert_eq!(p.capped_at_gb, Some(100.0));
    assert!(
        p.to_string()
            .ends_with("; budget held to the macOS compression ceiling 100.0 GB (78% of RAM)"),
        "{p}"
    );
    // A ceiling above the measured budget changes nothing.
    let p = plan(&BudgetInputs {
        ceiling_gb: Some(200.0),
        ..inputs()
    })
    .unwrap();
    assert_eq!(p.capped_at_gb, None);
    assert!((p.budget_gb - 108.0).abs() < 1e-9);
    // RAM_GB is the user's own budget: the ceiling does not apply to it.
    let p = plan(&BudgetInputs {
        ram_gb: Some(120.0),
        ceiling_gb: Some(100.0),
        ..inputs()
    })
    .unwrap();
    assert!((p.budget_gb - 120.0).abs() < 1e-9);
    assert_eq!(p.capped_at_gb, None);
}

#[test]
fn a_pool_is_clamped_once_in_slots_of_one_expert() {
    let pool = BudgetInputs {
        pool: true,
        ..inputs()
    };
    // 64e9 / 17547264 = 3647.3 -> 3647 slots in all; 83.5 GB left for experts fits 4758.
    let p = plan(&pool).unwrap();
    assert_eq!((p.requested_slots, p.pool_slots, p.slots), (3647, 3647, 0));
    let peak = 20.0 + 4.5 + 3647.0 * 17_547_264.0 / 1e9;
    assert!((p.projected_peak_gb - peak).abs() < 1e-9);
    let s = p.to_string();
    assert!(
        s.contains("GB for experts; unified pool 3647->3647 slots (projected peak"),
        "{s}"
    );
    // Clamped by RAM as one pool: floor(21.9e9 / 17547264) = 1248, not 13 x 92 = 1196.
    let small = plan(&BudgetInputs {
        available_gb: 30.0,
        ..pool.clone()
    })
    .unwrap();
    assert_eq!((small.pool_slots, small.slots), (1248, 0));
    // The floor is one slot a layer, the ceiling every expert.
    assert_eq!(requested_pool_slots(0.0, 17_547_264, 92, 896), 92);
    assert_eq!(requested_pool_slots(1e6, 17_547_264, 92, 896), 92 * 896);
    // Less than a slot a layer left: refused, or one a layer when overcommitted.
    let e = plan(&BudgetInputs {
        ram_gb: Some(25.0),
        ..pool.clone()
    })
    .unwrap_err();
    assert!(
        (e.needed_gb - 92.0 * 17_547_264.0 / 1e9).abs() < 1e-9,
        "{e}"
    );
    let p = plan(&BudgetInputs {
        ram_gb: Some(25.0),
        overcommit: true,
        ..pool
    })
    .unwrap();
    assert_eq!(p.pool_slots, 92);
}

/// K3's own MLA cache: 24 layers of 576 values, 55,296 B a token.
const K3_KV: KvShape = KvShape {
    mla_layers: 24,
    values_per_token: 576,
};

fn default_context(limit: usize) -> ContextAsk {
    ContextAsk::Default {
        limit,
        why: "the checkpoint's max_position_embeddings".into(),
    }
}

#[test]
fn the_default_context_is_the_limit_when_it_fits() {
    let p = plan(&BudgetInputs {
        context: default_context(262_144),
        kv: K3_KV,
        ..inputs()
    })
    .unwrap();
    assert_eq!(p.context, 262_144);
    let kv = 262_144.0 * 55_296.0 / 1e9;
    assert!((p.kv_gb - kv).abs() < 1e-9, "{}", p.kv_gb);
    assert!((p.reserve_gb - (4.0 + kv)).abs() < 1e-9);
    let line = p.context_line();
    assert!(
        line.starts_with("[K3] context: 262144 tokens (the checkpoint's max_position_embeddings)")
            && line.contains(
                "576 values x 24 layers x 4 B = 55.3 KB a token, 14.50 GB at the full context"
            ),
        "{line}"
    );
}

#[test]
fn the_default_context_shrinks_to_half_the_room_and_an_asked_one_does_not() {
    // Room beside the fixed reserve: 20 + 8.8 - 20 - 4.0 = 4.8 GB; half of it holds
    // floor(2.4e9 / 55296) = 43402 tokens -> 43008 (a multiple of 1024).
    let small = BudgetInputs {
        available_gb: 10.0,
        overcommit: true,
        kv: K3_KV,
        ..inputs()
    };
    let p = plan(&BudgetInputs {
        context: default_context(131_072),
        ..small.clone()
    })
    .unwrap();
    assert_eq!(p.context, 43_008);
    assert!(
        p.context_why.contains("what fits in 50%"),
        "{}",
        p.context_why
    );
    assert!(p.context_why.contains("--max-tokens"), "{}", p.context_why);
    // Never below the floor, however small the room.
    let tiny = plan(&BudgetInputs {
        ram_gb: Some(21.0),
        context: default_context(131_072),
        ..small.clone()
    })
    .unwrap();
    assert_eq!(tiny.context, MIN_DEFAULT_CONTEXT);
    // A smaller limit than the floor stays the limit.
    let short = plan(&BudgetInputs {
        ram_gb: Some(21.0),
        context: default_context(2048),
        ..small.clone()
    })
    .unwrap();
    assert_eq!(short.context, 2048);
    // Asked is taken as asked, whatever it costs.
    let asked = plan(&BudgetInputs {
        context: ContextAsk::Asked(131_072),
        ..small
    })
    .unwrap();
    assert_eq!(asked.context, 131_072);
    assert_eq!(asked.context_why, "--max-tokens / K3_MAXT");
}

#[test]
fn snapshots_and_the_prompt_cache_are_reserved_and_printed() {
    let base = plan(&inputs()).unwrap();
    let p = plan(&BudgetInputs {
        snapshots_gb: 1.0,
        prompt_cache_gb: 0.5,
        ..inputs()
    })
    .unwrap();
    assert!((p.reserve_gb - base.reserve_gb - 1.5).abs() < 1e-9);
    assert!((base.for_experts_gb - p.for_experts_gb - 1.5).abs() < 1e-9);
    let s = p.to_string();
    assert!(
        s.contains("KV 0.5 + KDA 0.3 + snapshots 1.0 + prompt cache 0.5) ->"),
        "{s}"
    );
    assert!(!base.to_string().contains("snapshots"), "{base}");
    // The working set is one state at the full context (KV 0.5 + KDA 0.3), at most.
    let big = plan(&BudgetInputs {
        prompt_cache_gb: 16.0,
        ..inputs()
    })
    .unwrap();
    assert!(
        (big.prompt_cache_gb - 0.8).abs() < 1e-9,
        "{}",
        big.prompt_cache_gb
    );
}

#[test]
fn the_window_takes_the_activation_reserve_and_half_of_what_the_cache_leaves() {
    // 83.5 GB left for experts, the 39-slot request takes 39 x 92 x 17.5 MB = 62.96 GB:
    // the window may take 1.2 + (83.5 - 62.96) / 2 = 11.47 GB, 11_470 tokens of 1 MB.
    let ask = |bound| BudgetInputs {
        window: Some(WindowAsk {
            bound,
            bytes_per_token: 1_000_000,
        }),
        ..inputs()
    };
    let base = plan(&inputs()).unwrap();
    let cache_gb = 39.0 * 92.0 * 17_547_264.0 / 1e9;
    let p = plan(&ask(1 << 22)).unwrap();
    let w = p.window.unwrap();
    let want = ((1.2 + (83.5 - cache_gb) / 2.0) * 1e3) as usize;
    assert_eq!((w.tokens, w.by_memory), (want, want));
    assert_eq!(
        p.slots, base.slots,
        "the window does not shrink the granted cache"
    );
    // Its bytes beyond the activation reserve are in the projected peak.
    let extra = want as f64 / 1e3 - 1.2;
    assert!(
        (p.projected_peak_gb - base.projected_peak_gb - extra).abs() < 1e-9,
        "{p}"
    );
    assert!(
        p.to_string().contains(&format!(
            "; prefill window {want} tokens {:.1} GB (projected peak",
            w.gb
        )),
        "{p}"
    );
    // A bound below what memory allows wins, and costs nothing beyond the reserve.
    let p = plan(&ask(1000)).unwrap();
    assert_eq!(p.window.unwrap().tokens, 1000);
    assert!((p.projected_peak_gb - base.projected_peak_gb).abs() < 1e-9);
    // The context bounds it too.
    let p = plan(&BudgetInputs {
        context: ContextAsk::Asked(512),
        ..ask(1 << 22)
    })
    .unwrap();
    assert_eq!(p.window.unwrap().tokens, 512);
    // A cache that takes what fits leaves less than a slot row to spare (1.61 GB): the
    // window keeps the activation reserve (1200 tokens) and half of that at most.
    let p = plan(&BudgetInputs {
        request_gb: 1e6,
        ..ask(1 << 22)
    })
    .unwrap();
    let by_memory = p.window.unwrap().by_memory;
    assert!((1200..1200 + 808).contains(&by_memory), "{by_memory}");
}

#[test]
fn a_state_in_vram_is_not_reserved_in_ram_nor_bounds_the_default_context() {
    let vram = BudgetInputs {
        state_in_ram: false,
        snapshots_gb: 1.0,
        prompt_cache_gb: 16.0,
        ..inputs()
    };
    let p = plan(&vram).unwrap();
    // Page cache and activations, and the prompt cache's host copy of one state
    // (KV 0.5 + KDA 0.3): the MLA cache, KDA state and snapshots live in VRAM.
    assert!((p.reserve_gb - (3.7 + 0.8)).abs() < 1e-9, "{p}");
    let s = p.to_string();
    assert!(
        s.contains(
            "(page cache 2.5 + act 1.2 + prompt cache 0.8; KV, KDA and snapshots in VRAM) ->"
        ),
        "{s}"
    );
    // RAM does not shrink a default context whose cache lives in VRAM.
    let p = plan(&BudgetInputs {
        ram_gb: Some(30.0),
        context: default_context(1 << 30),
        kv: K3_KV,
        prompt_cache_gb: 0.0,
        ..vram
    })
    .unwrap();
    assert_eq!(p.context, 1 << 30);
}

#[test]
fn several_sequences_reserve_a_state_each_as_far_as_memory_allows() {
    let one = plan(&inputs()).unwrap();
    assert_eq!(one.sequences, 1);
    // Room is plenty: two full states (0.5 GB KV + 0.3 GB KDA each), one more than alone.
    let two = plan(&BudgetInputs {
        sequences: 2,
        ..inputs()
    })
    .unwrap();
    assert_eq!(two.sequences, 2);
    assert!(
        (two.reserve_gb - one.reserve_gb - 0.8).abs() < 1e-9,
        "{two}"
    );
    assert!(two.to_string().contains("+ KV 1.0 + KDA 0.6"), "{two}");
    // budget 20 + 0.88 x 10 = 28.8; room beside the fixed 4.0 GB is 4.8; half of it holds
    // three states of 0.8 GB, not four.
    let short = plan(&BudgetInputs {
        sequences: 4,
        available_gb: 10.0,
        ..inputs()
    })
    .unwrap();
    assert_eq!(short.sequences, 3, "{short}");
    // Even with no room the first sequence is reserved.
    assert_eq!(fit_sequences(8, 0.8, -3.0), 1);
    // State in VRAM: the count is taken as given.
    let vram = plan(&BudgetInputs {
        sequences: 5,
        state_in_ram: false,
        ..inputs()
    });
    assert_eq!(vram.map(|p| p.sequences).ok(), Some(5));
}
