//! Expert parallel over MPI ranks (docs/architecture.md, "Ranks"): `mpirun -np N k3 …` runs
//! one model over N processes. Rank 0, the head, runs everything but the routed experts it
//! does not own; every rank owns a share of each MoE layer's experts ([`placement`]) and
//! runs them from its own disk, caches and backend. The head's MoE layer hands rows to the
//! owners through `RemoteExperts` (`experts/remote.rs`) and sums what comes back in
//! the canonical order. The placement, the messages ([`wire`]) and the start-up report
//! ([`hello`]) build without MPI; the transport needs the `mpi` feature.

pub mod hello;
pub mod placement;
pub mod setup;
pub mod wire;

#[cfg(feature = "mpi")]
pub(crate) mod head;
#[cfg(feature = "mpi")]
pub(crate) mod worker;
#[cfg(feature = "mpi")]
pub mod world;

/// The tag of a rank's start-up report.
pub const TAG_HELLO: i32 = 1;
/// The tag of the head's requests (work, stop).
pub const TAG_WORK: i32 = 2;
/// The tag of a rank's answers.
pub const TAG_REPLY: i32 = 3;

/// The shard files rank `rank` of `placement` reads: those holding any routed expert it
/// owns, and for the head (rank 0) every shard holding a tensor that is not a routed
/// expert. In file order.
pub fn shards_of_rank(
    ck: &crate::checkpoint::Checkpoint,
    placement: &placement::Placement,
    rank: usize,
) -> Vec<usize> {
    let mut used = vec![false; ck.shard_count()];
    for (layer, id, loc) in ck.experts().iter() {
        if placement.owner(layer, id as u32) == rank {
            if let Some(u) = used.get_mut(loc.shard) {
                *u = true;
            }
        }
    }
    if rank == 0 {
        for s in ck.dense_shards() {
            if let Some(u) = used.get_mut(s) {
                *u = true;
            }
        }
    }
    (0..used.len()).filter(|&i| used[i]).collect()
}

/// What the backend line adds for rank `rank`, the `local_rank`-th of `local_size` ranks on
/// `host`: the adapter `--adapter` chose, or which of the host's `gpus` equal GPUs it took
/// (its local rank modulo their count, so ranks beyond the count share them).
pub fn gpu_note(
    rank: usize,
    local_rank: usize,
    local_size: usize,
    host: &str,
    adapter: bool,
    gpus: usize,
) -> String {
    if adapter {
        return format!(
            " | rank {rank} (local {local_rank} of {local_size} on {host}): --adapter chose it"
        );
    }
    let at = crate::backend::gpu::device::adapters::pick_index(local_rank, gpus);
    let shared = if local_size > gpus {
        format!("; {local_size} ranks share its {gpus} GPU(s)")
    } else {
        String::new()
    };
    format!(
        " | rank {rank}: GPU {at} of this host's {gpus} (local rank {local_rank} of {local_size} on {host}{shared}; --adapter overrides)"
    )
}

/// Returned by a command run as a rank other than the head once it served the job: the
/// command's own output is the head's, so the process only ends.
#[derive(Debug, thiserror::Error)]
#[error("this rank served the job's experts; the head prints its results")]
pub struct WorkerDone;

/// One rank's expert figures over a run (or a server's life).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RankFigures {
    /// The rank (0: the head).
    pub rank: usize,
    /// Its host.
    pub host: String,
    /// Experts it looked up.
    pub lookups: u64,
    /// Of them, found in one of its caches.
    pub hits: u64,
    /// Expert bytes it read from disk.
    pub bytes: u64,
    /// Seconds its disk had a read in flight.
    pub busy_s: f64,
}

impl RankFigures {
    /// Hit rate in percent (0 when nothing was looked up).
    pub fn hit_percent(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            100.0 * self.hits as f64 / self.lookups as f64
        }
    }

    /// Bytes read per second of disk busy time, in GB/s.
    pub fn gb_per_s(&self) -> f64 {
        if self.busy_s > 0.0 {
            self.bytes as f64 / 1e9 / self.busy_s
        } else {
            0.0
        }
    }
}

/// Each rank's figures when this process heads a job of several ranks (empty otherwise):
/// the other ranks' as they reported them, the head's from `total` (which holds the whole
/// job's lookups and hits, less the others', and the head's own disk bytes and time).
pub fn figures(total: &crate::stats::Stats) -> Vec<RankFigures> {
    #[cfg(feature = "mpi")]
    if let Some(h) = head::current() {
        let others = h.totals();
        let sum = |f: fn(&wire::ReadCounts) -> u64| -> u64 {
            others.iter().skip(1).map(|t| f(&t.counts)).sum()
        };
        let mut out = vec![RankFigures {
            rank: 0,
            host: others.first().map(|t| t.host.clone()).unwrap_or_default(),
            lookups: total.expert_lookups.saturating_sub(sum(|c| c.lookups)),
            hits: total.expert_hits.saturating_sub(sum(|c| c.hits)),
            bytes: total.bytes_streamed,
            busy_s: total.disk_busy.as_secs_f64(),
        }];
        out.extend(others.into_iter().skip(1).map(|t| RankFigures {
            rank: t.rank,
            host: t.host,
            lookups: t.counts.lookups,
            hits: t.counts.hits,
            bytes: t.counts.bytes,
            busy_s: t.counts.busy_ns as f64 / 1e9,
        }));
        return out;
    }
    let _ = total;
    Vec::new()
}

/// The stats line of the ranks: each rank's hit %, GB read, disk busy and GB/s, then the
/// job's totals; `None` without ranks.
pub fn ranks_line(f: &[RankFigures]) -> Option<String> {
    if f.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = f
        .iter()
        .map(|r| {
            format!(
                "rank {} ({}) hit {:.1}% {:.2} GB read {:.2}s busy {:.2} GB/s",
                r.rank,
                r.host,
                r.hit_percent(),
                r.bytes as f64 / 1e9,
                r.busy_s,
                r.gb_per_s()
            )
        })
        .collect();
    let (lookups, hits, bytes) = f.iter().fold((0, 0, 0), |(l, h, b), r| {
        (l + r.lookups, h + r.hits, b + r.bytes)
    });
    let hit = if lookups == 0 {
        0.0
    } else {
        100.0 * hits as f64 / lookups as f64
    };
    parts.push(format!(
        "all {} ranks hit {hit:.1}% {:.2} GB read",
        f.len(),
        bytes as f64 / 1e9
    ));
    Some(format!("[K3] ranks: {}", parts.join(" | ")))
}

/// The ranks for `--stats-json`, `/health` and `/metrics`: each rank's figures with its hit
/// percent and GB/s.
pub fn ranks_json(f: &[RankFigures]) -> serde_json::Value {
    serde_json::Value::Array(
        f.iter()
            .map(|r| {
                serde_json::json!({
                    "rank": r.rank,
                    "host": r.host,
                    "expert_lookups": r.lookups,
                    "expert_hits": r.hits,
                    "expert_hit_percent": r.hit_percent(),
                    "gb_read": r.bytes as f64 / 1e9,
                    "disk_busy_s": r.busy_s,
                    "disk_gb_per_s": r.gb_per_s(),
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod figure_tests {
    use super::*;

    #[test]
    fn the_backend_line_names_the_gpu_a_rank_wraps_to() {
        // Three ranks on a host with two GPUs: the third takes GPU 0 again.
        let n = gpu_note(2, 2, 3, "h", false, 2);
        assert!(n.contains("GPU 0 of this host's 2"), "{n}");
        assert!(n.contains("local rank 2 of 3 on h"), "{n}");
        assert!(n.contains("3 ranks share its 2 GPU(s)"), "{n}");
        let n = gpu_note(1, 1, 2, "h", false, 2);
        assert!(
            n.contains("GPU 1 of this host's 2") && !n.contains("share"),
            "{n}"
        );
        let n = gpu_note(5, 1, 2, "h", true, 0);
        assert!(n.contains("--adapter chose it"), "{n}");
    }

    #[test]
    fn the_ranks_line_shows_each_rank_and_the_totals() {
        let f = vec![
            RankFigures {
                rank: 0,
                host: "a".into(),
                lookups: 10,
                hits: 5,
                bytes: 2_000_000_000,
                busy_s: 1.0,
            },
            RankFigures {
                rank: 1,
                host: "b".into(),
                lookups: 10,
                hits: 10,
                bytes: 0,
                busy_s: 0.0,
            },
        ];
        let line = ranks_line(&f).unwrap();
        assert!(
            line.contains("rank 0 (a) hit 50.0% 2.00 GB read 1.00s busy 2.00 GB/s"),
            "{line}"
        );
        assert!(
            line.contains("all 2 ranks hit 75.0% 2.00 GB read"),
            "{line}"
        );
        assert!(ranks_line(&[]).is_none());
        assert_eq!(ranks_json(&f)[1]["expert_hit_percent"], 100.0);
    }
}
