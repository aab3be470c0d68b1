//! What a rank settles before it opens the checkpoint: each rank's expert read rate (a
//! short uncached read probe, or `--rank-read-gbps`), the placement the rates give, and the
//! shard files this rank then opens: those holding its experts, and on the head those
//! holding the dense weights too. A worker opens no other file and loads no dense weight,
//! so a host needs only its share of the snapshot.

use super::placement::Placement;
use crate::backend::Backend;
use crate::checkpoint::schema::parse_expert_name;
use crate::checkpoint::shards::{find_shard, SINGLE_FILE};
use crate::checkpoint::Checkpoint;
use crate::experts::io::shard_io::ShardIo;
use crate::experts::IoMode;
use crate::model::loader::LoadOptions;
use crate::model::{FormatPolicy, K3Model};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The longest a read probe runs.
pub const PROBE_TIME: Duration = Duration::from_millis(500);
/// The most bytes a read probe reads.
pub const PROBE_BYTES: u64 = 256 << 20;
/// Bytes of one probe read.
const PROBE_CHUNK: u64 = 8 << 20;

/// Where the placement's rates came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateSource {
    /// `--rank-read-gbps`.
    Flag,
    /// Each rank's read probe at start.
    Measured,
    /// A rank could not measure (it holds no expert shard): equal shares.
    Unmeasured,
}

/// What this rank settled before opening the checkpoint.
#[derive(Clone, Debug)]
pub struct RankPlan {
    /// Which rank owns which expert (the same on every rank).
    pub placement: Placement,
    /// Each rank's read rate in GB/s as given or measured (0: not measured).
    pub rates: Vec<f64>,
    /// Where the rates came from.
    pub source: RateSource,
    /// The shard files this rank opens; `None` for an unsharded snapshot (its one file).
    pub files: Option<BTreeSet<String>>,
}

impl RankPlan {
    /// The rates as the ranks start-up line shows them, e.g. `1.20, 0.95 GB/s (measured)`.
    pub fn rates_line(&self) -> String {
        let rates: Vec<String> = self.rates.iter().map(|r| format!("{r:.2}")).collect();
        let how = match self.source {
            RateSource::Flag => "--rank-read-gbps",
            RateSource::Measured => "measured at start",
            RateSource::Unmeasured => "not all measured: equal shares",
        };
        format!("{} GB/s ({how})", rates.join(", "))
    }
}

/// The shard files of `index` (canonical tensor name → file) rank `rank` of `placement`
/// opens: those holding a routed expert it owns and, for the head (rank 0), those holding
/// any other tensor.
pub fn files_of_rank(
    index: &BTreeMap<String, String>,
    placement: &Placement,
    rank: usize,
) -> BTreeSet<String> {
    index
        .iter()
        .filter(|(name, _)| match parse_expert_name(name) {
            Some((layer, expert, _)) => placement.owner(layer, expert as u32) == rank,
            None => rank == 0,
        })
        .map(|(_, file)| file.clone())
        .collect()
}

/// The placement for `rates` measured at start: equal shares when the rates are within 10%
/// of each other (identical disks give the even split whatever the noise), else shares in
/// proportion to the rates rounded to two significant digits, so that nearby measurements
/// give the same split.
pub fn measured_placement(experts: usize, rates: &[f64]) -> anyhow::Result<Placement> {
    let max = rates.iter().copied().fold(0.0f64, f64::max);
    let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    if min > 0.0 && max <= 1.1 * min {
        return Placement::balanced(experts, rates.len());
    }
    let rounded: Vec<f64> = rates.iter().map(|&r| two_digits(r)).collect();
    Placement::new(experts, &rounded)
}

/// `r` rounded to two significant digits.
fn two_digits(r: f64) -> f64 {
    if !r.is_finite() || r <= 0.0 {
        return r;
    }
    let scale = 10f64.powi(1 - r.log10().floor() as i32);
    (r * scale).round() / scale
}

/// This rank's expert read rate in GB/s: uncached reads of the expert shard files it holds
/// (those `index` names for routed experts, or the unsharded snapshot's one file), 8 MB at
/// a time over the files in turn, for [`PROBE_TIME`] or [`PROBE_BYTES`], whichever comes
/// first. `None` when it holds none of them or none could be read.
pub fn probe_read_gbps(
    dir: &Path,
    extra_dirs: &[PathBuf],
    index: Option<&BTreeMap<String, String>>,
) -> Option<f64> {
    let names: BTreeSet<String> = match index {
        Some(m) => m
            .iter()
            .filter(|(name, _)| parse_expert_name(name).is_some())
            .map(|(_, f)| f.clone())
            .collect(),
        None => std::iter::once(SINGLE_FILE.to_string()).collect(),
    };
    let files: Vec<(PathBuf, u64)> = names
        .iter()
        .filter_map(|n| find_shard(n, dir, extra_dirs).ok())
        .filter_map(|p| std::fs::metadata(&p).ok().map(|m| (p, m.len())))
        .filter(|(_, len)| *len > 0)
        .collect();
    if files.is_empty() {
        return None;
    }
    let io = ShardIo::new(IoMode::Direct);
    let start = Instant::now();
    let (mut bytes, mut round) = (0u64, 0u64);
    while bytes < PROBE_BYTES && start.elapsed() < PROBE_TIME {
        let mut read_any = false;
        for (path, len) in &files {
            let at = round * PROBE_CHUNK;
            if at >= *len {
                continue;
            }
            let end = (at + PROBE_CHUNK).min(*len);
            if io.read(path, &(at..end)).is_ok() {
                bytes += end - at;
                read_any = true;
            }
            if bytes >= PROBE_BYTES || start.elapsed() >= PROBE_TIME {
                break;
            }
        }
        if !read_any {
            break;
        }
        round += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    (bytes > 0 && secs > 0.0).then(|| bytes as f64 / 1e9 / secs)
}

/// Settles the placement and this rank's files when this process is a rank of a job of
/// several (`None` otherwise): every rank probes its read rate unless `flag_rates`
/// (`--rank-read-gbps`) gives them, the ranks exchange the rates (every rank takes part in
/// the exchange before anything here can fail, so a rank's error reaches the head in its
/// start-up report instead of leaving the others waiting), and each computes the same
/// placement from them.
pub fn plan(
    dir: &Path,
    extra_dirs: &[PathBuf],
    flag_rates: &[f64],
) -> anyhow::Result<Option<RankPlan>> {
    #[cfg(feature = "mpi")]
    if let Some(i) = super::world::info().filter(|i| i.size > 1) {
        let index = crate::checkpoint::shards::index_map(dir);
        let own = if flag_rates.is_empty() {
            probe_read_gbps(
                dir,
                extra_dirs,
                index.as_ref().ok().and_then(Option::as_ref),
            )
        } else {
            None
        };
        let measured = super::world::all_gather_f64(own.unwrap_or(0.0));
        let index = index?;
        let config = crate::config::Config::from_file(&dir.join(crate::checkpoint::CONFIG_FILE))?;
        let experts = config.num_experts;
        let (placement, rates, source) = if !flag_rates.is_empty() {
            anyhow::ensure!(
                flag_rates.len() == i.size,
                "--rank-read-gbps gives {} rates for {} ranks: give one per rank, the head's first",
                flag_rates.len(),
                i.size
            );
            (
                Placement::new(experts, flag_rates)?,
                flag_rates.to_vec(),
                RateSource::Flag,
            )
        } else if measured.iter().all(|&r| r > 0.0) {
            (
                measured_placement(experts, &measured)?,
                measured,
                RateSource::Measured,
            )
        } else {
            (
                Placement::balanced(experts, i.size)?,
                measured,
                RateSource::Unmeasured,
            )
        };
        let files = index.map(|m| files_of_rank(&m, &placement, i.rank));
        return Ok(Some(RankPlan {
            placement,
            rates,
            source,
            files,
        }));
    }
    let _ = (dir, extra_dirs, flag_rates);
    Ok(None)
}

/// Loads the model a rank runs: on a rank other than the head of a job of several, the
/// routed experts only ([`K3Model::experts_only`]: no dense weight is read); elsewhere every
/// dense weight ([`K3Model::load_with`]).
pub fn load<B: Backend>(
    ckpt: Checkpoint,
    backend: B,
    policy: FormatPolicy,
    opts: &LoadOptions,
) -> anyhow::Result<K3Model<B>> {
    #[cfg(feature = "mpi")]
    if super::world::is_worker() {
        tracing::info!(
            "[K3] rank {}: routed experts only, from {} shard file(s); no dense weights",
            super::world::info().map_or(0, |i| i.rank),
            ckpt.shard_count()
        );
        return K3Model::experts_only(ckpt, backend);
    }
    K3Model::load_with(ckpt, backend, policy, opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_rates_split_in_proportion_and_near_ones_evenly() {
        // Within 10%: the even split, as identical disks measured with noise.
        let p = measured_placement(256, &[3.1, 2.9]).unwrap();
        assert_eq!(p.counts(0), vec![128, 128]);
        // Twice as fast owns twice as many.
        let p = measured_placement(300, &[2.0, 4.0]).unwrap();
        assert_eq!(p.counts(0), vec![100, 200]);
        // Rounded to two digits: measurements that differ past the third give one split.
        let a = measured_placement(256, &[1.0, 2.0409]).unwrap();
        let b = measured_placement(256, &[1.0, 2.0351]).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a.counts(1),
            measured_placement(256, &[1.0, 2.0]).unwrap().counts(1)
        );
        assert_eq!(two_digits(0.01234), 0.012);
        assert_eq!(two_digits(123.0), 120.0);
    }

    #[test]
    fn the_probe_reads_the_expert_files_a_rank_holds() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = BTreeMap::new();
        let e = crate::checkpoint::schema::expert_tensor_name(1, 0, 0);
        index.insert(e, "x.safetensors".to_string());
        // A rank holding none of its expert files measures nothing.
        assert_eq!(probe_read_gbps(dir.path(), &[], Some(&index)), None);
        std::fs::write(dir.path().join("x.safetensors"), vec![7u8; 3 << 20]).unwrap();
        let r = probe_read_gbps(dir.path(), &[], Some(&index)).unwrap();
        assert!(r.is_finite() && r > 0.0, "{r}");
        // Files that hold no routed expert are not read.
        let mut dense = BTreeMap::new();
        dense.insert("model.norm.weight".to_string(), "x.safetensors".to_string());
        assert_eq!(probe_read_gbps(dir.path(), &[], Some(&dense)), None);
    }

    #[test]
    fn each_rank_opens_its_experts_files_and_the_head_the_dense_ones() {
        let mut index = BTreeMap::new();
        let e = |l: usize, x: usize| crate::checkpoint::schema::expert_tensor_name(l, x, 0);
        index.insert("model.embed_tokens.weight".to_string(), "d.st".to_string());
        index.insert(e(1, 0), "a.st".to_string());
        index.insert(e(1, 1), "a.st".to_string());
        index.insert(e(1, 2), "b.st".to_string());
        index.insert(e(1, 3), "c.st".to_string());
        let p = Placement::balanced(4, 2).unwrap();
        let names = |s: BTreeSet<String>| s.into_iter().collect::<Vec<_>>();
        assert_eq!(names(files_of_rank(&index, &p, 0)), ["a.st", "d.st"]);
        assert_eq!(names(files_of_rank(&index, &p, 1)), ["b.st", "c.st"]);
    }
}
