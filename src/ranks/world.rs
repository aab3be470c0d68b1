//! The MPI world of an expert-parallel job: started once by the command line, one lock
//! around every MPI call (MPI runs at the serialized thread level: any thread may call,
//! one at a time), this rank's place in it.

use anyhow::{anyhow, Result};
use mpi::environment::Universe;
use mpi::point_to_point::Destination;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;
use std::sync::{Mutex, OnceLock};

/// Where this process stands in the job.
#[derive(Clone, Debug)]
pub struct RankInfo {
    /// Its rank (0: the head).
    pub rank: usize,
    /// Ranks in the job.
    pub size: usize,
    /// Its rank among the ranks on its host (MPI split by shared memory).
    pub local_rank: usize,
    /// Ranks on its host.
    pub local_size: usize,
    /// Its host's name as MPI reports it.
    pub host: String,
}

/// Holds MPI up for the process; dropping it tells the other ranks to stop when this is
/// the head, then finalizes MPI.
pub struct RankGuard {
    _universe: Universe,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        if let Some(i) = info().filter(|_| is_head()) {
            stop_ranks(i.size);
        }
    }
}

static INFO: OnceLock<RankInfo> = OnceLock::new();
static CALLS: Mutex<()> = Mutex::new(());

/// Starts MPI and records this rank's place; call once, before any thread calls MPI, and
/// only in a process `mpirun` started.
pub fn init() -> Result<RankGuard> {
    let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
        .ok_or_else(|| anyhow!("MPI was already started in this process"))?;
    if level < Threading::Serialized {
        return Err(anyhow!(
            "this MPI library gives thread level {level:?}; k3 needs Serialized (any thread calls MPI, one at a time)"
        ));
    }
    let world = universe.world();
    let rank = world.rank() as usize;
    let local = world.split_shared(world.rank());
    let info = RankInfo {
        rank,
        size: world.size() as usize,
        local_rank: local.rank() as usize,
        local_size: local.size() as usize,
        host: mpi::environment::processor_name().unwrap_or_else(|_| "?".into()),
    };
    let _ = INFO.set(info);
    Ok(RankGuard {
        _universe: universe,
    })
}

/// This rank's place, when MPI was started.
pub fn info() -> Option<&'static RankInfo> {
    INFO.get()
}

/// Whether this process is a rank other than the head of a job of several ranks.
pub fn is_worker() -> bool {
    info().is_some_and(|i| i.size > 1 && i.rank != 0)
}

/// Whether this process heads a job of several ranks.
pub fn is_head() -> bool {
    info().is_some_and(|i| i.size > 1 && i.rank == 0)
}

/// Runs `f` on the world communicator with the MPI lock held.
pub fn with_world<T>(f: impl FnOnce(&SimpleCommunicator) -> T) -> T {
    // A panic while the lock was held leaves MPI as it was: the lock guards order, not data.
    let _held = CALLS.lock().unwrap_or_else(|p| p.into_inner());
    f(&SimpleCommunicator::world())
}

/// Every rank's `v`, in rank order (a collective: every rank of the job calls it once).
pub fn all_gather_f64(v: f64) -> Vec<f64> {
    use mpi::collective::CommunicatorCollectives;
    let size = info().map_or(1, |i| i.size);
    let mut all = vec![0.0f64; size];
    with_world(|w| w.all_gather_into(&v, &mut all[..]));
    all
}

/// Ends every rank of the job with `code` (after an error the head cannot recover from).
pub fn abort(code: i32) -> ! {
    let world = SimpleCommunicator::world();
    world.abort(code)
}

/// Tells every other rank the job is over, so each leaves its loop and ends cleanly.
pub fn stop_ranks(size: usize) {
    let stop = super::wire::stop_request();
    for r in 1..size {
        with_world(|w| {
            w.process_at_rank(r as i32)
                .send_with_tag(&stop[..], super::TAG_WORK)
        });
    }
}
