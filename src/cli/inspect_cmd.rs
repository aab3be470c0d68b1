//! `k3 inspect`: what a snapshot holds and what it lacks, or (`--plan`) the memory plan of
//! a machine of a given size for the snapshot's config.

use anyhow::{bail, Context, Result};
use clap::Args;
use k3::backend::gpu::LimitsProfile;
use k3::config::Config;
use k3::engine::memory_plan::{plan_machine, MachineSpec, LINUX_OS_GB, MACOS_OS_GB};
use k3::experts::IoMode;
use k3::model::FormatPolicy;
use std::path::{Path, PathBuf};

/// Flags of `k3 inspect`.
#[derive(Args, Debug)]
pub(crate) struct InspectArgs {
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
    /// Print which shard files each of N ranks of an expert-parallel job (`mpirun -np N`)
    /// reads: the shards holding the routed experts it owns, and the head's dense weights.
    #[arg(long, value_name = "N", conflicts_with = "plan")]
    pub ranks: Option<usize>,
    /// With `--ranks`: each rank's read rate in GB/s, comma-separated, as `k3 run` takes it.
    #[arg(long = "rank-read-gbps", env = "K3_RANK_READ_GBPS", requires = "ranks")]
    pub rank_read_gbps: Option<String>,
}

/// Runs `k3 inspect`; exits non-zero when a tensor is missing or mis-shaped.
pub(crate) fn run(a: InspectArgs) -> Result<()> {
    if a.plan {
        return plan(&a);
    }
    let extra = a.dirs.as_deref().map(super::split_dirs).unwrap_or_default();
    if let Some(n) = a.ranks {
        return ranks(&a, n, &extra);
    }
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

/// `k3 inspect --ranks N`: each rank's shard files and the bytes of its experts in them.
fn ranks(a: &InspectArgs, n: usize, extra: &[PathBuf]) -> Result<()> {
    if n == 0 {
        bail!("--ranks 0: give the number of ranks of the job (mpirun -np N), at least 1");
    }
    let ck = k3::checkpoint::Checkpoint::open(&a.model, extra)?;
    let experts = ck.config.num_experts;
    let placement = match &a.rank_read_gbps {
        Some(s) => {
            let rates = super::rank_args::parse_rates(s)?;
            if rates.len() != n {
                bail!(
                    "--rank-read-gbps gives {} rates for --ranks {n}: give one per rank, the head's first",
                    rates.len()
                );
            }
            k3::ranks::placement::Placement::new(experts, &rates)?
        }
        None => k3::ranks::placement::Placement::balanced(experts, n)?,
    };
    let dense = ck.dense_shards();
    let size = |b: u64| {
        if b >= 1_000_000_000 {
            format!("{:.2} GB", b as f64 / 1e9)
        } else {
            format!("{:.1} MB", b as f64 / 1e6)
        }
    };
    for r in 0..n {
        let mut bytes = vec![0u64; ck.shard_count()];
        let mut owned = 0usize;
        for (layer, id, loc) in ck.experts().iter() {
            if placement.owner(layer, id as u32) == r {
                owned += 1;
                if let Some(b) = bytes.get_mut(loc.shard) {
                    *b += loc.byte_len();
                }
            }
        }
        let files = k3::ranks::shards_of_rank(&ck, &placement, r);
        let role = if r == 0 { " (head)" } else { "" };
        println!(
            "rank {r}{role}: {owned} routed experts ({}) in {} shard file(s)",
            size(bytes.iter().sum()),
            files.len()
        );
        for f in files {
            let name = ck.shard_path(f).file_name().map_or_else(
                || ck.shard_path(f).display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            let what = if r == 0 && dense.contains(&f) {
                " + dense weights"
            } else {
                ""
            };
            println!("  {name}: {} of its experts{what}", size(bytes[f]));
        }
        let index = if ck.dir.join(k3::checkpoint::shards::INDEX_FILE).exists() {
            format!(", {}", k3::checkpoint::shards::INDEX_FILE)
        } else {
            String::new()
        };
        let tokenizer = if r == 0 {
            " and the tokenizer files"
        } else {
            ""
        };
        println!("  with {}{index}{tokenizer}", k3::checkpoint::CONFIG_FILE);
    }
    println!(
        "a rank opens only the files listed for it (a worker loads no dense weights): copy each host the files of its rank(s). This split is {}; a job run without --rank-read-gbps splits by each rank's read rate measured at start (the even split when the rates are within 10%), so give a job on partial copies the --rank-read-gbps given here",
        if a.rank_read_gbps.is_some() {
            "--rank-read-gbps's"
        } else {
            "the even one"
        }
    );
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
    let machine = MachineSpec {
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
