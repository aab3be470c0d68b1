//! The memory plan of a machine that is not this one (`k3 inspect --plan --ram-gb N`): the
//! dense weights from the config's shapes, the conversation state, the reserve, what the
//! OS keeps, the macOS compression ceiling, and the expert cache the RAM clamp would grant
//! — the same arithmetic as a run's `[K3][RAM_GB=...]` line, with the measurements
//! replaced by the machine's size.

use crate::backend::gpu::LimitsProfile;
use crate::checkpoint::schema::TensorClass;
use crate::config::Config;
use crate::experts::cache::ram_budget::{
    self, BudgetInputs, BudgetPlan, ContextAsk, RamBudgetError, MACOS_FOOTPRINT_SHARE,
};
use crate::model::context::{checkpoint_context, kv_shape};
use crate::model::dense_footprint::dense_footprint;
use crate::model::state_size::{state_size, StateSize};
use crate::model::FormatPolicy;
use std::fmt;

/// What the OS and other programs keep on a Mac the plan assumes, GB: an idle macOS with a
/// terminal and a browser open.
pub const MACOS_OS_GB: f64 = 8.0;
/// The same on Linux (as docs/tuning.md's table assumes).
pub const LINUX_OS_GB: f64 = 2.0;

/// The machine `k3 inspect --plan` plans for, as its flags describe it (not measured: the
/// engine's own plan measures a `engine::plan::Machine`).
#[derive(Clone, Debug)]
pub struct MachineSpec {
    /// Physical RAM, GB.
    pub ram_gb: f64,
    /// What the OS and other programs hold, GB.
    pub os_gb: f64,
    /// An Apple profile plans a Mac (unified pool, compression ceiling); native plans a
    /// machine with a discrete GPU or none (host cache per layer).
    pub profile: LimitsProfile,
    /// The context in tokens (`K3_MAXT`), or `None` for a run's default (the checkpoint's
    /// limit, lowered to what half the memory left for experts holds).
    pub context_tokens: Option<usize>,
    /// `K3_EXPERT_GB`, or `None` for the largest cache that fits.
    pub request_gb: Option<f64>,
    /// Load-time formats.
    pub policy: FormatPolicy,
}

/// The plan for one machine.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    /// The machine.
    pub machine: MachineSpec,
    /// Dense weights by class, bytes.
    pub dense: Vec<(TensorClass, u64)>,
    /// Their sum, GB.
    pub dense_gb: f64,
    /// KV and KDA state at the plan's context (`budget.context`).
    pub state: StateSize,
    /// What the OS could still give once the dense weights are resident, GB.
    pub available_gb: f64,
    /// The macOS compression ceiling, GB (none off a Mac).
    pub ceiling_gb: Option<f64>,
    /// What the clamp grants.
    pub budget: BudgetPlan,
    /// Bytes of one expert.
    pub slot_bytes: u64,
    /// MoE layers.
    pub moe_layers: usize,
    /// Routed experts a layer.
    pub experts: usize,
    /// Layers in all.
    pub layers: usize,
}

/// The plan for `machine` running the model of `cfg`.
pub fn plan_machine(cfg: &Config, machine: &MachineSpec) -> Result<MemoryPlan, RamBudgetError> {
    let dense = dense_footprint(cfg, &machine.policy);
    let dense_gb = dense.iter().map(|&(_, b)| b).sum::<u64>() as f64 / 1e9;
    let context = match machine.context_tokens {
        Some(n) => ContextAsk::Asked(n),
        None => {
            let (limit, why) = checkpoint_context(cfg);
            ContextAsk::Default { limit, why }
        }
    };
    let mac = machine.profile.device().is_some();
    let available_gb = (machine.ram_gb - machine.os_gb - dense_gb).max(0.0);
    let ceiling_gb = mac.then_some(machine.ram_gb * MACOS_FOOTPRINT_SHARE);
    let slot_bytes = cfg.expert_bytes() as u64;
    let moe_layers = cfg.moe_layer_count();
    let all_gb = (slot_bytes * (moe_layers * cfg.num_experts) as u64) as f64 / 1e9;
    let budget = ram_budget::plan(&BudgetInputs {
        ram_gb: None,
        resident_gb: dense_gb,
        available_gb,
        context,
        sequences: 1,
        kv: kv_shape(cfg),
        kda_gb: state_size(cfg, 0).kda_gb,
        snapshots_gb: 0.0,
        prompt_cache_gb: 0.0,
        state_in_ram: true,
        window: None,
        request_gb: machine.request_gb.unwrap_or(all_gb),
        slot_bytes,
        moe_layers,
        experts: cfg.num_experts,
        overcommit: false,
        pool: mac,
        ceiling_gb,
    })?;
    let state = state_size(cfg, budget.context);
    Ok(MemoryPlan {
        machine: machine.clone(),
        dense,
        dense_gb,
        state,
        available_gb,
        ceiling_gb,
        budget,
        slot_bytes,
        moe_layers,
        experts: cfg.num_experts,
        layers: cfg.num_hidden_layers,
    })
}

impl MemoryPlan {
    /// The expert cache granted, GB.
    pub fn cache_gb(&self) -> f64 {
        let slots = if self.budget.pool_slots > 0 {
            self.budget.pool_slots
        } else {
            self.budget.slots * self.moe_layers
        };
        (slots as u64 * self.slot_bytes) as f64 / 1e9
    }
}

fn class_name(c: TensorClass) -> &'static str {
    match c {
        TensorClass::Embedding => "embedding",
        TensorClass::Head => "head",
        TensorClass::Norm => "norms",
        TensorClass::AttnRes => "attention residuals",
        TensorClass::Kda => "KDA",
        TensorClass::Mla => "MLA",
        TensorClass::DenseMlp => "dense MLP",
        TensorClass::Router => "router",
        TensorClass::LatentProj => "latent projections",
        TensorClass::SharedExpert => "shared experts",
        TensorClass::RoutedExpert => "routed experts",
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        let gb = |b: u64| b as f64 / 1e9;
        let mac = m.profile.device().is_some();
        let bits = |fmt: crate::quant::DenseFormat| fmt.bits();
        writeln!(
            f,
            "plan for a {:.0} GB {} ({}): {} layers, {} MoE x {} experts of {:.1} MB",
            m.ram_gb,
            if mac { "Mac" } else { "machine" },
            if mac {
                format!(
                    "{} limits profile, unified memory: one expert pool",
                    m.profile
                )
            } else {
                "native limits: a host cache per layer".to_string()
            },
            self.layers,
            self.moe_layers,
            self.experts,
            self.slot_bytes as f64 / 1e6
        )?;
        let classes: Vec<String> = self
            .dense
            .iter()
            .map(|&(c, b)| format!("{} {:.2}", class_name(c), gb(b)))
            .collect();
        writeln!(
            f,
            "  dense weights        {:7.1} GB  (K3_BITS={} K3_MLA_BITS={} K3_HEAD_BITS={}; embeddings read per token): {}",
            self.dense_gb,
            bits(m.policy.dense),
            bits(m.policy.mla),
            bits(m.policy.head),
            classes.join(", ")
        )?;
        writeln!(
            f,
            "  KV (MLA cache)       {:7.2} GB  at {} tokens ({})",
            self.state.kv_gb, self.budget.context, self.budget.context_why
        )?;
        writeln!(f, "  KDA state            {:7.2} GB", self.state.kda_gb)?;
        writeln!(
            f,
            "  page cache + act.    {:7.1} GB  (kept free for buffered reads and scratch)",
            ram_budget::PAGE_CACHE_GB + ram_budget::ACTIVATIONS_GB
        )?;
        writeln!(
            f,
            "  OS and programs      {:7.1} GB  (assumed; --os-gb)",
            m.os_gb
        )?;
        writeln!(
            f,
            "  available after load {:7.1} GB; the clamp takes {:.0}% of it: budget {:.1} GB",
            self.available_gb,
            ram_budget::AVAILABLE_SHARE * 100.0,
            self.dense_gb + ram_budget::AVAILABLE_SHARE * self.available_gb
        )?;
        if let Some(c) = self.ceiling_gb {
            writeln!(
                f,
                "  macOS compression ceiling {:.1} GB ({:.0}% of RAM): {}",
                c,
                MACOS_FOOTPRINT_SHARE * 100.0,
                if self.budget.capped_at_gb.is_some() {
                    format!("budget held to {:.1} GB", self.budget.budget_gb)
                } else {
                    "above the budget, no effect".to_string()
                }
            )?;
        }
        if self.budget.pool_slots > 0 {
            writeln!(
                f,
                "  unified pool         {:7.1} GB  {} slots ({:.1} a MoE layer on average)",
                self.cache_gb(),
                self.budget.pool_slots,
                self.budget.pool_slots as f64 / self.moe_layers.max(1) as f64
            )?;
        } else {
            writeln!(
                f,
                "  host expert cache    {:7.1} GB  {} slots a MoE layer",
                self.cache_gb(),
                self.budget.slots
            )?;
        }
        writeln!(
            f,
            "  footprint            {:7.1} GB  of {:.0}: {:.1} GB left to the OS and programs",
            self.budget.projected_peak_gb,
            m.ram_gb,
            m.ram_gb - self.budget.projected_peak_gb
        )?;
        writeln!(
            f,
            "  start from           K3_EXPERT_GB={:.0}{}",
            self.cache_gb().floor(),
            if mac {
                " (the pool; K3_GPU_GB unset)"
            } else {
                ""
            }
        )?;
        write!(f, "  the run's clamp line: {}", self.budget)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full K3 config: k3-slice's dimensions with 93 layers.
    fn full_k3() -> Config {
        crate::synth::preset_config_for_tests(crate::synth::Preset::K3Slice, Some(93))
    }

    fn mac(ram_gb: f64) -> MachineSpec {
        MachineSpec {
            ram_gb,
            os_gb: MACOS_OS_GB,
            profile: LimitsProfile::AppleM1,
            context_tokens: Some(4096),
            request_gb: None,
            policy: FormatPolicy::default(),
        }
    }

    #[test]
    fn a_128_gb_mac_stays_under_the_compression_ceiling() {
        let cfg = full_k3();
        let p = plan_machine(&cfg, &mac(128.0)).unwrap();
        assert_eq!((p.layers, p.moe_layers, p.experts), (93, 92, 896));
        // The dense estimate of docs/tuning.md: about 36 GB.
        assert!((30.0..42.0).contains(&p.dense_gb), "{}", p.dense_gb);
        assert_eq!(p.budget.capped_at_gb, Some(100.0));
        assert!(p.budget.projected_peak_gb <= 100.0 + 1e-6, "{p}");
        assert!(p.budget.pool_slots > 92 && p.budget.slots == 0);
        let text = p.to_string();
        assert!(
            text.starts_with("plan for a 128 GB Mac (apple-m1 limits profile"),
            "{text}"
        );
        assert!(
            text.contains(
                "macOS compression ceiling 100.0 GB (78% of RAM): budget held to 100.0 GB"
            ),
            "{text}"
        );
        assert!(text.contains("unified pool "), "{text}");
    }

    #[test]
    fn a_64_gb_mac_gets_a_smaller_pool_and_a_linux_box_a_host_cache() {
        let cfg = full_k3();
        let big = plan_machine(&cfg, &mac(128.0)).unwrap();
        let small = plan_machine(&cfg, &mac(64.0)).unwrap();
        assert!(small.budget.pool_slots < big.budget.pool_slots);
        assert!(small.budget.projected_peak_gb <= 64.0 * MACOS_FOOTPRINT_SHARE + 1e-6);
        let linux = plan_machine(
            &cfg,
            &MachineSpec {
                profile: LimitsProfile::Native,
                os_gb: LINUX_OS_GB,
                ..mac(128.0)
            },
        )
        .unwrap();
        assert_eq!(linux.ceiling_gb, None);
        assert!(linux.budget.slots > 0 && linux.budget.pool_slots == 0);
        assert!(linux.to_string().contains("host expert cache"));
        // A request below what fits is granted as asked.
        let asked = plan_machine(
            &cfg,
            &MachineSpec {
                request_gb: Some(8.0),
                ..mac(128.0)
            },
        )
        .unwrap();
        assert!(
            (asked.cache_gb() - 8.0).abs() < 0.02,
            "{}",
            asked.cache_gb()
        );
    }

    #[test]
    fn a_machine_too_small_for_the_dense_weights_is_refused() {
        let e = plan_machine(&full_k3(), &mac(32.0)).unwrap_err();
        assert!(e.to_string().contains("not enough memory"), "{e}");
    }
}
