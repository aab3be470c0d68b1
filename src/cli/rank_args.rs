//! The flags of an expert-parallel job (`mpirun -np N k3 run|chat|serve …`, a build with
//! the `mpi` feature); a run without `mpirun` ignores them.

use anyhow::{bail, Result};
use clap::Args;
use k3::engine::config::RankConfig;

/// How the ranks of an expert-parallel job split the experts and wait for each other.
#[derive(Args, Debug, Clone)]
pub(crate) struct RankArgs {
    /// Each rank's expert read rate in GB/s, comma-separated, the head's first: each MoE
    /// layer's experts are split in proportion (a rank twice as fast owns twice as many).
    /// Unset: each rank measures its disk at start (an uncached read of at most 0.5 s or
    /// 256 MB) and rates within 10% of each other give equal shares. Give it when hosts
    /// hold only their share of the snapshot, as `k3 inspect --ranks` chose it.
    #[arg(
        long = "rank-read-gbps",
        env = "K3_RANK_READ_GBPS",
        value_name = "GBPS,GBPS,..."
    )]
    pub read_gbps: Option<String>,
    /// Seconds the head waits for a rank's start-up report or for its answer to one MoE
    /// layer before it ends the job naming the rank.
    #[arg(
        long = "rank-timeout",
        env = "K3_RANK_TIMEOUT",
        default_value_t = 300,
        value_name = "SECS"
    )]
    pub timeout: u64,
}

impl RankArgs {
    /// The engine's rank settings.
    pub(crate) fn config(&self) -> Result<RankConfig> {
        if self.timeout == 0 {
            bail!("--rank-timeout 0: give the seconds the head may wait for a rank (at least 1)");
        }
        Ok(RankConfig {
            read_gbps: match &self.read_gbps {
                Some(s) => parse_rates(s)?,
                None => Vec::new(),
            },
            timeout_s: self.timeout,
        })
    }
}

/// Parses `--rank-read-gbps`: positive numbers separated by commas.
pub(super) fn parse_rates(s: &str) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for (i, part) in s.split(',').enumerate() {
        let v: f64 = match part.trim().parse() {
            Ok(v) => v,
            Err(_) => bail!(
                "--rank-read-gbps: `{}` (rank {i}) is not a number; give GB/s per rank, e.g. 6.5,3.2",
                part.trim()
            ),
        };
        if !v.is_finite() || v <= 0.0 {
            bail!("--rank-read-gbps: rank {i}'s rate {v} must be a positive number of GB/s");
        }
        out.push(v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_and_bad_ones_are_named() {
        assert_eq!(parse_rates("6.5, 3").unwrap(), vec![6.5, 3.0]);
        let e = parse_rates("6.5,fast").unwrap_err().to_string();
        assert!(e.contains("`fast`") && e.contains("rank 1"), "{e}");
        assert!(parse_rates("1,0")
            .unwrap_err()
            .to_string()
            .contains("rank 1"));
    }
}
