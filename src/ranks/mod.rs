//! Expert parallel over MPI ranks (docs/architecture.md, "Ranks"): `mpirun -np N k3 …` runs
//! one model over N processes. Rank 0, the head, runs everything but the routed experts it
//! does not own; every rank owns a share of each MoE layer's experts ([`placement`]) and
//! runs them from its own disk, caches and backend. The head's MoE layer hands rows to the
//! owners through [`crate::experts::remote::RemoteExperts`] and sums what comes back in
//! the canonical order. The placement, the messages ([`wire`]) and the start-up report
//! ([`hello`]) build without MPI; the transport needs the `mpi` feature.

pub mod hello;
pub mod placement;
pub mod wire;

#[cfg(feature = "mpi")]
pub mod head;
#[cfg(feature = "mpi")]
pub mod worker;
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

/// Returned by a command run as a rank other than the head once it served the job: the
/// command's own output is the head's, so the process only ends.
#[derive(Debug, thiserror::Error)]
#[error("this rank served the job's experts; the head prints its results")]
pub struct WorkerDone;
