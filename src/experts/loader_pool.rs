//! A fixed pool of loader threads (`K3_LOAD_THREADS`) that keeps several expert reads in
//! flight while the MoE computes on the experts that already arrived.

use super::disk_meter::DiskMeter;
use super::expert_reader::{ExpertReader, LoadedExpert};
use crate::checkpoint::ExpertLocation;
use anyhow::{anyhow, Context, Result};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Largest accepted `K3_LOAD_THREADS`.
pub const MAX_LOAD_THREADS: usize = 16;

/// One expert to read, and where to send it.
pub struct LoadJob {
    /// Shard file.
    pub path: PathBuf,
    /// Byte ranges of the six tensors.
    pub loc: ExpertLocation,
    /// Expert id.
    pub id: u32,
    /// Receives the loaded expert or the error.
    pub reply: Sender<Result<LoadedExpert>>,
}

/// The loader threads.
pub struct LoaderPool {
    tx: Option<Sender<LoadJob>>,
    workers: Vec<JoinHandle<()>>,
}

impl LoaderPool {
    /// Starts `threads` loaders (1..=16).
    pub fn new(threads: usize, reader: Arc<ExpertReader>, meter: Arc<DiskMeter>) -> Result<Self> {
        if threads == 0 || threads > MAX_LOAD_THREADS {
            anyhow::bail!("K3_LOAD_THREADS / --load-threads must be 1..={MAX_LOAD_THREADS}, got {threads}");
        }
        let (tx, rx) = channel::<LoadJob>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..threads)
            .map(|i| {
                let (rx, reader, meter) = (rx.clone(), reader.clone(), meter.clone());
                std::thread::Builder::new()
                    .name(format!("k3-load-{i}"))
                    .spawn(move || worker(&rx, &reader, &meter))
                    .context("starting an expert loader thread")
            })
            .collect::<Result<_>>()?;
        Ok(Self { tx: Some(tx), workers })
    }

    /// Queues a read; the result arrives on the job's `reply` channel.
    pub fn submit(&self, job: LoadJob) -> Result<()> {
        self.tx
            .as_ref()
            .ok_or_else(|| anyhow!("expert loader pool is shut down"))?
            .send(job)
            .map_err(|_| anyhow!("expert loader threads have stopped"))
    }
}

fn worker(rx: &Mutex<Receiver<LoadJob>>, reader: &ExpertReader, meter: &DiskMeter) {
    loop {
        let job = match rx.lock() {
            Ok(r) => match r.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
            Err(_) => return,
        };
        meter.begin();
        let res = reader.read_location(&job.path, &job.loc, job.id);
        meter.end(res.as_ref().map(|e| e.len() as u64).unwrap_or(0));
        // The consumer may have given up on an error elsewhere; nothing to do then.
        let _ = job.reply.send(res);
    }
}

impl Drop for LoaderPool {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
