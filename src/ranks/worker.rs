//! A rank other than the head: after its start-up report it serves the head's requests,
//! each one MoE layer's experts it owns run on the rows the head sent, until the head says
//! stop. It holds the model like the head (its expert source, cache, tier and backend
//! sized by its own flags and RAM plan) but runs only the routed experts.

use super::hello::{checkpoint_files, own_args, Hello};
use super::wire::{ReadCounts, Reply, Request};
use super::world::{info, with_world};
use super::{TAG_HELLO, TAG_REPLY, TAG_WORK};
use crate::backend::Backend;
use crate::model::moe::expert_rows;
use crate::model::{K3Model, Runner};
use crate::stats::Stats;
use anyhow::Result;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::Communicator;
use std::collections::HashMap;
use std::time::Duration;

/// This rank's start-up report for a model that loaded (`error: None`) or the error that
/// stopped it.
pub(crate) fn hello<B: Backend>(model: Option<&K3Model<B>>, error: Option<String>) -> Hello {
    Hello {
        rank: info().map_or(0, |i| i.rank),
        host: info().map_or_else(String::new, |i| i.host.clone()),
        pid: std::process::id(),
        args: own_args(),
        files: model.map(|m| checkpoint_files(&m.ckpt)).unwrap_or_default(),
        backend: model.map(|m| m.backend.name()).unwrap_or_default(),
        error,
    }
}

/// Sends this rank's start-up report to the head.
pub(crate) fn send_hello(h: &Hello) -> Result<()> {
    let bytes = serde_json::to_vec(h)?;
    with_world(|w| w.process_at_rank(0).send_with_tag(&bytes[..], TAG_HELLO));
    Ok(())
}

/// Reports a failed start to the head, then waits a little for the head to end the job (it
/// names this rank's error); returns so the process exits on its own if it does not.
pub(crate) fn report_failure(error: &anyhow::Error) {
    let h = hello::<crate::backend::cpu::CpuBackend>(None, Some(format!("{error:#}")));
    if send_hello(&h).is_ok() {
        std::thread::sleep(Duration::from_secs(10));
    }
}

/// Serves the head's requests on `model` until it says stop.
pub(crate) fn serve<B: Backend>(model: &mut Runner<B>) -> Result<()> {
    send_hello(&hello(Some(&model.model), None))?;
    loop {
        let (bytes, _) = with_world(|w| w.process_at_rank(0).receive_vec_with_tag::<u8>(TAG_WORK));
        let reply = match Request::decode(&bytes) {
            Ok(Request::Stop) => return Ok(()),
            Ok(Request::Work {
                layer,
                cols,
                z,
                experts,
            }) => run(model, layer, cols, &z, &experts)
                .unwrap_or_else(|e| Reply::Failed(format!("{e:#}"))),
            Err(e) => Reply::Failed(format!("{e:#}")),
        };
        let out = reply.encode();
        with_world(|w| w.process_at_rank(0).send_with_tag(&out[..], TAG_REPLY));
    }
}

/// Runs `experts` of `layer` on `z` through this rank's expert source, in the order given.
fn run<B: Backend>(
    model: &Runner<B>,
    layer: usize,
    cols: usize,
    z: &[f32],
    experts: &[crate::experts::remote::ExpertRows],
) -> Result<Reply> {
    let (b, ck, glu) = (&model.backend, &model.ckpt, model.glu());
    let ids: Vec<u32> = experts.iter().map(|e| e.id).collect();
    let rows: HashMap<u32, &[usize]> = experts.iter().map(|e| (e.id, e.rows.as_slice())).collect();
    let resident = b.pin_resident_experts(layer, &ids)?;
    let mut stats = Stats::default();
    let mut ys: HashMap<u32, Vec<f32>> = HashMap::new();
    let mut consume = |batch: &[crate::experts::Supplied<'_>]| -> Result<()> {
        for s in batch {
            let r = rows.get(&s.id()).copied().unwrap_or_default();
            ys.insert(s.id(), expert_rows(b, ck, layer, s, z, cols, r, glu)?);
        }
        Ok(())
    };
    model.rt.experts().stream(
        ck,
        layer,
        &ids,
        &resident,
        &mut stats,
        &mut || Ok(()),
        &mut consume,
    )?;
    let outputs = ids
        .iter()
        .map(|id| (*id, ys.remove(id).unwrap_or_default()))
        .collect();
    Ok(Reply::Done {
        outputs,
        counts: ReadCounts {
            lookups: stats.expert_lookups,
            hits: stats.expert_hits,
            bytes: stats.bytes_streamed,
            busy_ns: stats.disk_busy.as_nanos() as u64,
        },
    })
}
