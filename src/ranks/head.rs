//! The head's side of an expert-parallel job: the handshake with every rank at start, then,
//! for each MoE layer, the rows sent to each owner before waiting on any and the answers
//! taken back within a bounded wait. The ranks are told to stop when MPI ends
//! (`world::RankGuard`).

use super::hello::{check, Hello};
use super::placement::Placement;
use super::wire::{work_request, ReadCounts, Reply};
use super::world::with_world;
use super::{TAG_HELLO, TAG_REPLY, TAG_WORK};
use crate::experts::remote::{ExpertOutputs, ExpertRows, RemoteExperts};
use crate::stats::Stats;
use anyhow::{anyhow, bail, Context, Result};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::Communicator;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One rank's totals, for the stats lines, `--stats-json`, `/health` and `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct RankTotals {
    /// The rank.
    pub rank: usize,
    /// Its host.
    pub host: String,
    /// Its read counters summed over the run.
    pub counts: ReadCounts,
}

/// The head of a job of several ranks.
pub(crate) struct Head {
    placement: Placement,
    hellos: Vec<Hello>,
    /// How long the head waits for a rank's answer before it ends the job.
    timeout: Duration,
    /// The ranks the last send is waiting on.
    pending: Mutex<Vec<usize>>,
    totals: Mutex<Vec<RankTotals>>,
}

impl Head {
    /// Waits (at most `start_timeout`) for every other rank's start-up report and checks
    /// it against `own`; any rank that could not start, opened another checkpoint or was
    /// given other flags stops the job here, named.
    pub(crate) fn connect(
        placement: Placement,
        own: Hello,
        start_timeout: Duration,
        timeout: Duration,
    ) -> Result<Self> {
        let size = placement.ranks();
        let mut hellos = vec![own.clone()];
        for r in 1..size {
            let bytes = wait_for(r, TAG_HELLO, start_timeout).with_context(|| {
                format!("rank {r} sent no start-up report within {}s (still loading? raise --rank-timeout)", start_timeout.as_secs())
            })?;
            let h: Hello = serde_json::from_slice(&bytes)
                .with_context(|| format!("rank {r}: unreadable start-up report"))?;
            check(&own, &h)?;
            hellos.push(h);
        }
        let totals = hellos
            .iter()
            .map(|h| RankTotals {
                rank: h.rank,
                host: h.host.clone(),
                counts: ReadCounts::default(),
            })
            .collect();
        Ok(Self {
            placement,
            hellos,
            timeout,
            pending: Mutex::new(Vec::new()),
            totals: Mutex::new(totals),
        })
    }

    /// Each rank's totals so far (rank 0's are the head's own `Stats`, not counted here).
    pub(crate) fn totals(&self) -> Vec<RankTotals> {
        self.totals.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Which rank owns which expert.
    pub(crate) fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Each rank's start-up report.
    pub(crate) fn hellos(&self) -> &[Hello] {
        &self.hellos
    }

    fn who(&self, r: usize) -> String {
        match self.hellos.get(r) {
            Some(h) => format!("rank {r} on host {} (pid {})", h.host, h.pid),
            None => format!("rank {r}"),
        }
    }
}

/// Waits up to `limit` for a message from rank `r` with `tag`, polling so that a rank that
/// never answers ends in an error instead of a hang.
fn wait_for(r: usize, tag: i32, limit: Duration) -> Result<Vec<u8>> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let got = with_world(|w| {
            w.process_at_rank(r as i32)
                .immediate_matched_probe_with_tag(tag)
                .map(|pair| pair.matched_receive_vec::<u8>().0)
        });
        if let Some(b) = got {
            return Ok(b);
        }
        if start.elapsed() > limit {
            bail!("no answer within {:.0}s", limit.as_secs_f64());
        }
        // Spin briefly (a decode step's answer comes within microseconds to milliseconds),
        // then sleep so an idle wait costs no core.
        spins += 1;
        if spins > 2000 {
            std::thread::sleep(Duration::from_micros(200));
        } else {
            std::thread::yield_now();
        }
    }
}

impl RemoteExperts for Head {
    fn owner(&self, layer: usize, id: u32) -> usize {
        self.placement.owner(layer, id)
    }

    fn send(
        &self,
        layer: usize,
        z: &[f32],
        cols: usize,
        work: &[(usize, Vec<ExpertRows>)],
    ) -> Result<()> {
        let mut pending = self
            .pending
            .lock()
            .map_err(|_| anyhow!("internal: the ranks' pending list was poisoned"))?;
        if !pending.is_empty() {
            bail!(
                "internal: layer {layer} sent while {} ranks still owe answers",
                pending.len()
            );
        }
        for (r, experts) in work {
            let msg = work_request(layer, z, cols, experts);
            with_world(|w| {
                w.process_at_rank(*r as i32)
                    .send_with_tag(&msg[..], TAG_WORK)
            });
            pending.push(*r);
        }
        Ok(())
    }

    fn receive(&self, layer: usize, stats: &mut Stats) -> Result<ExpertOutputs> {
        let ranks = std::mem::take(
            &mut *self
                .pending
                .lock()
                .map_err(|_| anyhow!("internal: the ranks' pending list was poisoned"))?,
        );
        let mut out = ExpertOutputs::new();
        for r in ranks {
            let bytes = wait_for(r, TAG_REPLY, self.timeout).with_context(|| {
                format!(
                    "{} did not answer for MoE layer {layer} (it may have died; --rank-timeout {}s)",
                    self.who(r),
                    self.timeout.as_secs()
                )
            })?;
            match Reply::decode(&bytes)
                .with_context(|| format!("{}: unreadable answer", self.who(r)))?
            {
                Reply::Failed(e) => bail!("{} failed on MoE layer {layer}: {e}", self.who(r)),
                Reply::Done { outputs, counts } => {
                    stats.expert_lookups += counts.lookups;
                    stats.expert_hits += counts.hits;
                    if let Ok(mut t) = self.totals.lock() {
                        if let Some(t) = t.get_mut(r) {
                            t.counts.lookups += counts.lookups;
                            t.counts.hits += counts.hits;
                            t.counts.bytes += counts.bytes;
                            t.counts.busy_ns += counts.busy_ns;
                        }
                    }
                    out.extend(outputs);
                }
            }
        }
        Ok(out)
    }
}

static CURRENT: OnceLock<Arc<Head>> = OnceLock::new();

/// Records the job's head for the stats lines, `/health` and `/metrics`.
pub(crate) fn set_current(h: Arc<Head>) {
    let _ = CURRENT.set(h);
}

/// The job's head, when this process is one.
pub(crate) fn current() -> Option<&'static Arc<Head>> {
    CURRENT.get()
}
