//! Expert streaming flags (`K3_EXPERT_GB`, `K3_DIRECT`, `K3_PIPE`, ...) and the RAM clamp
//! that turns the cache request into slots once the dense weights are resident.

use anyhow::{bail, Result};
use clap::Args;
use k3::backend::Backend;
use k3::config::{AttnKind, Config};
use k3::experts::ram_budget::{self, BudgetInputs};
use k3::experts::{IoMode, StreamConfig};
use k3::model::K3Model;

/// Flags that decide how experts are read and cached.
#[derive(Args, Debug, Clone)]
pub struct StreamArgs {
    /// Expert cache request in GB (1e9 bytes) for all MoE layers together; clamped to RAM.
    #[arg(long, env = "K3_EXPERT_GB", default_value_t = 8.0)]
    pub expert_gb: f64,
    /// 1: O_DIRECT (Linux) / F_NOCACHE (macOS) expert reads; 0: buffered + read-ahead hints.
    #[arg(long, env = "K3_DIRECT", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub direct: u8,
    /// 1: overlap expert loads with compute; 0: read all of a layer's misses first.
    #[arg(long, env = "K3_PIPE", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub pipe: u8,
    /// Loader threads for the pipe (1..16).
    #[arg(long, env = "K3_LOAD_THREADS", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub load_threads: u64,
    /// Memory budget in GB instead of resident + 0.88 x available.
    #[arg(long = "ram-gb", env = "RAM_GB")]
    pub ram_gb: Option<f64>,
    /// 1: keep one expert slot per layer even when the budget says it does not fit.
    #[arg(long, env = "K3_RAM_OVERCOMMIT", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub ram_overcommit: u8,
    /// VRAM expert tier in GB (1e9 bytes) on the GPU backend; 0 (the default) keeps it off.
    /// `K3_VK_GB` is read when `K3_GPU_GB` is unset. The CPU backend ignores it.
    #[arg(long = "gpu-expert-gb", env = "K3_GPU_GB")]
    pub gpu_expert_gb: Option<f64>,
    /// Longest context the MLA cache is budgeted for, in tokens.
    #[arg(long = "max-tokens", env = "K3_MAXT", default_value_t = 4096)]
    pub max_tokens: usize,
}

fn state_gb(cfg: &Config, max_tokens: usize) -> (f64, f64) {
    let mla = cfg
        .layer_kinds
        .iter()
        .filter(|k| **k == AttnKind::Mla)
        .count();
    let kda = cfg.layer_kinds.len() - mla;
    let kv =
        mla as f64 * max_tokens as f64 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) as f64 * 4.0;
    let p = cfg.kda_width() as f64;
    let per_kda = cfg.kda.num_heads as f64 * (cfg.kda.head_dim * cfg.kda.head_dim) as f64 * 4.0
        + 3.0 * (cfg.kda.conv_kernel.saturating_sub(1)) as f64 * p * 4.0;
    (kv / 1e9, kda as f64 * per_kda / 1e9)
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
        let cfg = &model.ckpt.config;
        let mem = ram_budget::probe()?;
        let (kv_gb, kda_gb) = state_gb(cfg, self.max_tokens);
        let plan = ram_budget::plan(&BudgetInputs {
            ram_gb: self.ram_gb,
            resident_gb: mem.resident_gb,
            available_gb: mem.available_gb,
            kv_gb,
            kda_gb,
            request_gb: self.expert_gb,
            slot_bytes: cfg.expert_bytes() as u64,
            moe_layers: cfg.moe_layer_count(),
            experts: cfg.num_experts,
            overcommit: self.ram_overcommit == 1,
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
        model.set_streaming(sc)?;
        self.configure_gpu_tier(model)?;
        Ok(sc)
    }

    /// The tier request in GB: the flag / `K3_GPU_GB`, else `K3_VK_GB`, else 0.
    fn gpu_tier_gb(&self) -> Result<f64> {
        let gb = match self.gpu_expert_gb {
            Some(gb) => gb,
            None => match std::env::var("K3_VK_GB") {
                Ok(v) => v.trim().parse().map_err(|_| {
                    anyhow::anyhow!("K3_VK_GB must be a number of GB >= 0, got {v:?}")
                })?,
                Err(_) => 0.0,
            },
        };
        if !(gb.is_finite() && gb >= 0.0) {
            bail!("K3_GPU_GB / K3_VK_GB / --gpu-expert-gb must be a number of GB >= 0, got {gb}");
        }
        Ok(gb)
    }

    /// Sizes the backend's VRAM expert tier and prints `[K3-GPU] expert tier: ...` when
    /// the backend has one. wgpu cannot report free VRAM, so the tier is only what is asked.
    fn configure_gpu_tier<B: Backend>(&self, model: &K3Model<B>) -> Result<()> {
        let gb = self.gpu_tier_gb()?;
        let cfg = &model.ckpt.config;
        let slots = model.backend.configure_expert_tier(
            (gb * 1e9) as u64,
            cfg.num_experts * cfg.moe_layer_count(),
            cfg.moe_intermediate_size,
            cfg.routed_expert_hidden_size,
        )?;
        if let Some(n) = slots {
            eprintln!(
                "[K3-GPU] expert tier: {n} slots ({:.1} GB){}",
                n as f64 * cfg.expert_bytes() as f64 / 1e9,
                if n == 0 {
                    " — set K3_GPU_GB to keep experts in VRAM"
                } else {
                    ""
                }
            );
        }
        Ok(())
    }
}
