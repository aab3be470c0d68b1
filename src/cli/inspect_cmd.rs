//! `k3 inspect`: what a snapshot holds and what it lacks, or (`--plan`) the memory plan of
//! a machine of a given size for the snapshot's config.

use anyhow::{bail, Context, Result};
use clap::Args;
use k3::backend::gpu::LimitsProfile;
use k3::config::Config;
use k3::engine::memory_plan::{plan_machine, Machine, LINUX_OS_GB, MACOS_OS_GB};
use k3::experts::IoMode;
use k3::model::FormatPolicy;
use std::path::{Path, PathBuf};

/// Flags of `k3 inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Snapshot directory (with `--plan`, a `config.json` alone is enough).
    pub model: PathBuf,
    /// Extra shard directories, ";" or "," separated, searched after the snapshot directory: a
    /// shard is read from the first directory that holds it (the snapshot, then these in order).
    #[arg(long, env = "K3_DIRS")]
    pub dirs: Option<String>,
    /// Print the memory plan of a machine of `--ram-gb` for this config instead of checking
    /// the tensors: dense weights, KV, reserve, OS, the macOS compression ceiling and the
    /// expert cache the RAM clamp grants. Reads only config.json.
    #[arg(long, env = "K3_INSPECT_PLAN", value_parser = clap::builder::FalseyValueParser::new())]
    pub plan: bool,
    /// With `--plan`: the machine's RAM in GB (default: this machine's).
    #[arg(long = "ram-gb", env = "RAM_GB", requires = "plan")]
    pub ram_gb: Option<f64>,
    /// With `--plan`: GB the OS and other programs hold (default: 8 on a Mac, 2 elsewhere).
    #[arg(long = "os-gb", env = "K3_PLAN_OS_GB", requires = "plan")]
    pub os_gb: Option<f64>,
    /// With `--plan`: an Apple profile (apple-m1, apple-m3, apple-m5) plans a Mac (one
    /// unified expert pool, the compression ceiling); native a machine with a host cache.
    #[arg(
        long = "gpu-limits",
        env = "K3_GPU_LIMITS",
        value_name = "PROFILE",
        default_value = "native"
    )]
    pub gpu_limits: LimitsProfile,
    /// With `--plan`: the expert cache request in GB (default: the largest that fits).
    #[arg(long = "expert-gb", env = "K3_EXPERT_GB", requires = "plan")]
    pub expert_gb: Option<f64>,
    /// With `--plan`: the context the MLA cache is budgeted for, in tokens [default: as a
    /// run decides it: the checkpoint's max_position_embeddings, else 131072, lowered to
    /// what half the memory left for experts holds].
    #[arg(long = "max-tokens", env = "K3_MAXT")]
    pub context_tokens: Option<usize>,
    /// With `--plan`: load-time format of dense matrices (4, 8, 16, 32).
    #[arg(long, env = "K3_BITS", default_value_t = 4)]
    pub bits: u32,
    /// With `--plan`: load-time format of the MLA projections (4, 8, 16, 32).
    #[arg(long, env = "K3_MLA_BITS", default_value_t = 8)]
    pub mla_bits: u32,
    /// With `--plan`: load-time format of lm_head (4, 8, 16, 32).
    #[arg(long, env = "K3_HEAD_BITS", default_value_t = 8)]
    pub head_bits: u32,
}

/// Runs `k3 inspect`; exits non-zero when a tensor is missing or mis-shaped.
pub fn run(a: InspectArgs) -> Result<()> {
    if a.plan {
        return plan(&a);
    }
    let extra = a.dirs.as_deref().map(super::split_dirs).unwrap_or_default();
    let mut report = k3::checkpoint::inspect(&a.model, &extra)?;
    report.expert_reads = Some(expert_reads(report.first_shard.as_deref()));
    println!("{report}");
    if !report.is_ok() {
        bail!(
            "{}: the snapshot is incomplete or mis-shaped (see the list above)",
            a.model.display()
        );
    }
    Ok(())
}

/// How expert reads will go on the disk of `first_shard`: direct when the OS accepts an
/// uncached read of it, else buffered and why.
fn expert_reads(first_shard: Option<&Path>) -> String {
    let Some(first) = first_shard else {
        return "no shards".to_string();
    };
    match k3::experts::io::shard_io::probe_direct(first) {
        Ok(()) => format!(
            "{} (K3_DIRECT=1, the default), accepted by {}",
            IoMode::Direct.describe(),
            first.display()
        ),
        Err(why) => format!(
            "{} refused by {} ({why}): runs read {}",
            IoMode::Direct.describe(),
            first.display(),
            IoMode::Buffered.describe()
        ),
    }
}

/// `k3 inspect --plan`.
fn plan(a: &InspectArgs) -> Result<()> {
    let cfg = Config::from_file(&a.model.join("config.json"))?;
    let ram_gb = match a.ram_gb {
        Some(gb) => gb,
        None => k3::platform::available_memory::total_bytes()
            .map(|b| b as f64 / 1e9)
            .context("this OS does not report its RAM: give --ram-gb (or RAM_GB)")?,
    };
    if !(ram_gb.is_finite() && ram_gb > 0.0) {
        bail!("--ram-gb / RAM_GB must be a number of GB > 0, got {ram_gb}");
    }
    let mac = a.gpu_limits.device().is_some();
    let os_gb = a
        .os_gb
        .unwrap_or(if mac { MACOS_OS_GB } else { LINUX_OS_GB });
    if !(os_gb.is_finite() && (0.0..ram_gb).contains(&os_gb)) {
        bail!("--os-gb / K3_PLAN_OS_GB must be between 0 and the RAM ({ram_gb} GB), got {os_gb}");
    }
    if let Some(e) = a.expert_gb {
        if !(e.is_finite() && e >= 0.0) {
            bail!("--expert-gb / K3_EXPERT_GB must be a number of GB >= 0, got {e}");
        }
    }
    if let Some(n) = a.context_tokens {
        if n == 0 || n > k3::engine::config::MAX_CONTEXT {
            bail!(
                "--max-tokens / K3_MAXT must be between 1 and {} tokens, got {n}",
                k3::engine::config::MAX_CONTEXT,
            );
        }
    }
    let machine = Machine {
        ram_gb,
        os_gb,
        profile: a.gpu_limits,
        context_tokens: a.context_tokens,
        request_gb: a.expert_gb,
        policy: FormatPolicy::from_bits(a.bits, a.mla_bits, a.head_bits)?,
    };
    let p = plan_machine(&cfg, &machine)?;
    println!("{p}");
    Ok(())
}
