//! The RAM clamp: how many expert slots per layer fit beside the dense weights, the page
//! cache, activations, the MLA cache and the KDA state. `K3_EXPERT_GB` is a request; this
//! decides what is granted. On a unified-memory GPU the request (with `K3_GPU_GB`) is one
//! pool of slots shared by every MoE layer, clamped here once as the RAM it is.

use anyhow::Result;
use std::fmt;

/// Page cache kept free for the OS and buffered reads, in GB.
pub const PAGE_CACHE_GB: f64 = 2.5;
/// Activations and scratch, in GB.
pub const ACTIVATIONS_GB: f64 = 1.2;
/// Share of the OS-reported available memory the engine may take.
pub const AVAILABLE_SHARE: f64 = 0.88;
/// Share of physical RAM the footprint stays under on macOS: past it the memory
/// compressor starts and every phase slows 3-5x, compute included (the C engine measured
/// the edge near 100 GB of an M5 Max's 128, docs/platforms.md).
pub const MACOS_FOOTPRINT_SHARE: f64 = 100.0 / 128.0;

/// The footprint ceiling of this machine, GB: [`MACOS_FOOTPRINT_SHARE`] of its RAM on
/// macOS, none elsewhere (or where the RAM cannot be read).
pub fn os_footprint_ceiling_gb() -> Option<f64> {
    if !cfg!(target_os = "macos") {
        return None;
    }
    crate::platform::available_memory::total_bytes().map(|b| b as f64 / 1e9 * MACOS_FOOTPRINT_SHARE)
}

/// Everything the clamp needs, injected so the arithmetic is testable.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetInputs {
    /// `RAM_GB`: an explicit budget that replaces the measurement.
    pub ram_gb: Option<f64>,
    /// Resident memory after the dense weights are loaded, GB.
    pub resident_gb: f64,
    /// Memory the OS can still give, GB.
    pub available_gb: f64,
    /// MLA latent cache at `K3_MAXT` positions, GB.
    pub kv_gb: f64,
    /// KDA recurrent state, GB.
    pub kda_gb: f64,
    /// `K3_EXPERT_GB`, in GB (1e9 bytes).
    pub request_gb: f64,
    /// Bytes of one cache slot (one expert).
    pub slot_bytes: u64,
    /// MoE layers sharing the cache.
    pub moe_layers: usize,
    /// Experts per layer (the most slots a layer can use).
    pub experts: usize,
    /// `K3_RAM_OVERCOMMIT=1`: keep one slot per layer even when it does not fit.
    pub overcommit: bool,
    /// The request is one pool of slots shared by every MoE layer (the GPU tier of a
    /// unified-memory adapter), not a host cache of slots per layer.
    pub pool: bool,
    /// The footprint the OS tolerates before it compresses memory, GB
    /// ([`os_footprint_ceiling_gb`]); a measured budget stays under it, `RAM_GB` does not.
    pub ceiling_gb: Option<f64>,
}

/// The granted cache size and the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetPlan {
    /// Total budget, GB.
    pub budget_gb: f64,
    /// Resident memory, GB.
    pub resident_gb: f64,
    /// Reserve, GB (page cache + activations + KV + KDA).
    pub reserve_gb: f64,
    /// KV part of the reserve, GB.
    pub kv_gb: f64,
    /// KDA part of the reserve, GB.
    pub kda_gb: f64,
    /// Left for experts, GB.
    pub for_experts_gb: f64,
    /// Slots per layer that `K3_EXPERT_GB` asked for (in a pool: slots in all).
    pub requested_slots: usize,
    /// Slots per layer granted to the host cache (0 in a pool: it keeps nothing).
    pub slots: usize,
    /// Slots granted to the unified pool, shared by every MoE layer (0 without one).
    pub pool_slots: usize,
    /// Resident + reserve + granted cache, GB.
    pub projected_peak_gb: f64,
    /// The footprint ceiling when it lowered the budget, GB.
    pub capped_at_gb: Option<f64>,
}

/// Even one slot per layer does not fit: the run must stop (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "not enough memory for one expert per layer: budget {budget_gb:.1} GB = resident {resident_gb:.1} + \
     reserve {reserve_gb:.1} + experts {needed_gb:.1} needed ({moe_layers} layers x {slot_mb:.1} MB). \
     Free memory, set RAM_GB to a larger budget, or K3_RAM_OVERCOMMIT=1 to run anyway (it may swap)"
)]
pub struct RamBudgetError {
    /// Total budget, GB.
    pub budget_gb: f64,
    /// Resident memory, GB.
    pub resident_gb: f64,
    /// Reserve, GB.
    pub reserve_gb: f64,
    /// One slot per layer, GB.
    pub needed_gb: f64,
    /// MoE layers.
    pub moe_layers: usize,
    /// One slot, MB.
    pub slot_mb: f64,
}

/// Slots per layer a request of `request_gb` buys: at least 1, at most `experts`.
pub fn requested_slots(
    request_gb: f64,
    slot_bytes: u64,
    moe_layers: usize,
    experts: usize,
) -> usize {
    let per_slot_all_layers = slot_bytes as f64 * moe_layers.max(1) as f64;
    let slots = (request_gb.max(0.0) * 1e9 / per_slot_all_layers).floor() as usize;
    slots.clamp(1, experts.max(1))
}

/// Slots in all a unified pool of `request_gb` buys: at least one per layer (as the host
/// cache's floor), at most every routed expert.
pub fn requested_pool_slots(
    request_gb: f64,
    slot_bytes: u64,
    moe_layers: usize,
    experts: usize,
) -> usize {
    let slots = (request_gb.max(0.0) * 1e9 / slot_bytes.max(1) as f64).floor() as usize;
    let layers = moe_layers.max(1);
    slots.clamp(layers, experts.max(1) * layers)
}

/// Applies the clamp: the cache may only shrink to fit.
pub fn plan(i: &BudgetInputs) -> Result<BudgetPlan, RamBudgetError> {
    let measured = i.resident_gb + AVAILABLE_SHARE * i.available_gb;
    let capped_at_gb = match (i.ram_gb, i.ceiling_gb) {
        (None, Some(c)) if c < measured => Some(c),
        _ => None,
    };
    let budget_gb = i.ram_gb.or(capped_at_gb).unwrap_or(measured);
    let reserve_gb = PAGE_CACHE_GB + ACTIVATIONS_GB + i.kv_gb + i.kda_gb;
    let for_experts_gb = budget_gb - i.resident_gb - reserve_gb;
    // A host cache grows by a slot in every layer at once, a pool by one slot.
    let (per_slot_gb, requested, least) = if i.pool {
        let layers = i.moe_layers.max(1);
        let r = requested_pool_slots(i.request_gb, i.slot_bytes, i.moe_layers, i.experts);
        (i.slot_bytes as f64 / 1e9, r, layers)
    } else {
        let r = requested_slots(i.request_gb, i.slot_bytes, i.moe_layers, i.experts);
        (i.slot_bytes as f64 * i.moe_layers as f64 / 1e9, r, 1)
    };
    let fit = if per_slot_gb > 0.0 {
        (for_experts_gb / per_slot_gb).floor().max(0.0) as usize
    } else {
        requested
    };
    let slots = if fit >= least {
        requested.min(fit)
    } else if i.overcommit {
        least
    } else {
        return Err(RamBudgetError {
            budget_gb,
            resident_gb: i.resident_gb,
            reserve_gb,
            needed_gb: per_slot_gb * least as f64,
            moe_layers: i.moe_layers,
            slot_mb: i.slot_bytes as f64 / 1e6,
        });
    };
    Ok(BudgetPlan {
        budget_gb,
        resident_gb: i.resident_gb,
        reserve_gb,
        kv_gb: i.kv_gb,
        kda_gb: i.kda_gb,
        for_experts_gb,
        requested_slots: requested,
        slots: if i.pool { 0 } else { slots },
        pool_slots: if i.pool { slots } else { 0 },
        projected_peak_gb: i.resident_gb + reserve_gb + slots as f64 * per_slot_gb,
        capped_at_gb,
    })
}

impl fmt::Display for BudgetPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[K3][RAM_GB={:.1}] resident {:.1} + reserve {:.1} (page cache {PAGE_CACHE_GB:.1} + act {ACTIVATIONS_GB:.1} + KV {:.1} + KDA {:.1}) -> {:.1} GB for experts; ",
            self.budget_gb,
            self.resident_gb,
            self.reserve_gb,
            self.kv_gb,
            self.kda_gb,
            self.for_experts_gb.max(0.0),
        )?;
        if self.pool_slots > 0 {
            write!(
                f,
                "unified pool {}->{} slots",
                self.requested_slots, self.pool_slots
            )?;
        } else {
            write!(f, "cache {}->{}/layer", self.requested_slots, self.slots)?;
        }
        write!(f, " (projected peak {:.1} GB)", self.projected_peak_gb)?;
        if let Some(c) = self.capped_at_gb {
            write!(
                f,
                "; budget held to the macOS compression ceiling {c:.1} GB ({:.0}% of RAM)",
                MACOS_FOOTPRINT_SHARE * 100.0
            )?;
        }
        Ok(())
    }
}

/// Resident and available memory of this process and machine, in GB.
#[derive(Clone, Copy, Debug)]
pub struct MemoryProbe {
    /// Resident set of this process.
    pub resident_gb: f64,
    /// What the OS can still give (see [`crate::platform::available_memory`]).
    pub available_gb: f64,
}

/// Measures resident and available memory now.
pub fn probe() -> Result<MemoryProbe> {
    Ok(MemoryProbe {
        resident_gb: crate::stats::rss_gb(),
        available_gb: crate::platform::available_memory::available_bytes()? as f64 / 1e9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> BudgetInputs {
        BudgetInputs {
            ram_gb: None,
            resident_gb: 20.0,
            available_gb: 100.0,
            kv_gb: 0.5,
            kda_gb: 0.3,
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
}
