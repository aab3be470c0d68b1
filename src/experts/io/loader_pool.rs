//! A fixed pool of loader threads (`K3_LOAD_THREADS`) that keeps several expert reads in
//! flight while the MoE computes on the experts that already arrived.
//!
//! Two queues feed the threads: reads a layer needs now (demand) and reads guessed for the
//! next layer (speculative, see `prefetch.rs`). A thread takes a demand read whenever there
//! is one, so a guess never delays a read the running layer waits for; a guess still queued
//! when its layer routes is either promoted to the front of the demand queue or dropped
//! unread. A large expert's read is split into pieces (`piece_read.rs`): the threads take
//! the front read's pieces in order, so several threads read one expert at once.

use crate::checkpoint::ExpertLocation;
use crate::experts::io::expert_reader::ExpertReader;
use crate::experts::io::piece_read::PieceRead;
use crate::experts::telemetry::disk_meter::DiskMeter;
use crate::routed_expert::LoadedExpert;
use anyhow::{anyhow, Context, Result};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Largest accepted `K3_LOAD_THREADS`.
pub(crate) const MAX_LOAD_THREADS: usize = 16;

/// One expert to read, and where to send it.
pub(crate) struct LoadJob {
    /// Shard file.
    pub path: PathBuf,
    /// Byte ranges of the six tensors.
    pub loc: ExpertLocation,
    /// Expert id.
    pub id: u32,
    /// Receives the loaded expert or the error.
    pub reply: Sender<Result<LoadedExpert>>,
}

/// A queued read and the next of its pieces no thread has taken.
struct Task {
    read: Arc<PieceRead>,
    next: usize,
}

impl Task {
    /// Whether a thread has taken one of its pieces.
    fn started(&self) -> bool {
        self.next > 0
    }
}

/// A speculative read and the MoE layer it was guessed for.
struct Guess {
    layer: usize,
    task: Task,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Task>,
    guesses: VecDeque<Guess>,
    closed: bool,
}

/// Takes the next piece of the front task of `queue`; the task leaves the queue with its
/// last piece.
fn take_piece<T>(
    queue: &mut VecDeque<T>,
    task: impl Fn(&mut T) -> &mut Task,
) -> Option<(Arc<PieceRead>, usize)> {
    let t = task(queue.front_mut()?);
    let k = t.next;
    t.next += 1;
    let read = t.read.clone();
    if t.next >= read.pieces() {
        queue.pop_front();
    }
    Some((read, k))
}

/// What [`LoaderPool::settle`] did with a layer's queued guesses.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Settled {
    /// Guesses the layer needs that no thread had started: now first in the demand queue.
    pub promoted: Vec<u32>,
    /// Guesses the layer does not need that no thread had started: dropped unread.
    pub dropped: Vec<u32>,
}

struct Shared {
    queues: Mutex<Queues>,
    wake: Condvar,
}

/// The loader threads.
pub(crate) struct LoaderPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Splits each job's read as it is queued.
    reader: Arc<ExpertReader>,
}

impl LoaderPool {
    /// Starts `threads` loaders (1..=16).
    pub(crate) fn new(
        threads: usize,
        reader: Arc<ExpertReader>,
        meter: Arc<DiskMeter>,
    ) -> Result<Self> {
        if threads == 0 || threads > MAX_LOAD_THREADS {
            anyhow::bail!(
                "K3_LOAD_THREADS / --load-threads must be 1..={MAX_LOAD_THREADS}, got {threads}"
            );
        }
        let shared = Arc::new(Shared {
            queues: Mutex::new(Queues::default()),
            wake: Condvar::new(),
        });
        let workers = (0..threads)
            .map(|i| {
                let (shared, reader, meter) = (shared.clone(), reader.clone(), meter.clone());
                std::thread::Builder::new()
                    .name(format!("k3-load-{i}"))
                    .spawn(move || worker(&shared, &reader, &meter))
                    .context("starting an expert loader thread")
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            shared,
            workers,
            reader,
        })
    }

    fn task(&self, job: LoadJob) -> Task {
        Task {
            read: Arc::new(PieceRead::new(job, &self.reader)),
            next: 0,
        }
    }

    fn queues(&self) -> Result<std::sync::MutexGuard<'_, Queues>> {
        let q = self
            .shared
            .queues
            .lock()
            .map_err(|_| anyhow!("expert loader queue poisoned"))?;
        if q.closed {
            return Err(anyhow!("expert loader pool is shut down"));
        }
        Ok(q)
    }

    /// Queues a read the running layer needs; the result arrives on the job's `reply`
    /// channel.
    pub(crate) fn submit(&self, job: LoadJob) -> Result<()> {
        let task = self.task(job);
        let pieces = task.read.pieces();
        self.queues()?.demand.push_back(task);
        self.wake(pieces);
        Ok(())
    }

    /// Queues a read guessed for MoE layer `layer`, taken only when no demand read waits.
    pub(crate) fn submit_guess(&self, layer: usize, job: LoadJob) -> Result<()> {
        let task = self.task(job);
        let pieces = task.read.pieces();
        self.queues()?.guesses.push_back(Guess { layer, task });
        self.wake(pieces);
        Ok(())
    }

    /// Wakes a thread for each of `pieces` new pieces of work (all of them when more).
    fn wake(&self, pieces: usize) {
        if pieces == 1 {
            self.shared.wake.notify_one();
        } else {
            self.shared.wake.notify_all();
        }
    }

    /// Layer `layer` has routed and needs `needed`: its queued guesses among them move to
    /// the front of the demand queue (in their queued order), the others are dropped unread
    /// (their reply channels close). A guess a thread has started is not dropped: when
    /// needed, its pieces left move to the demand queue's front like the others (but it does
    /// not count as promoted), else they stay behind the demand reads.
    pub(crate) fn settle(&self, layer: usize, needed: &[u32]) -> Result<Settled> {
        let mut q = self.queues()?;
        let mut out = Settled::default();
        let mut keep = VecDeque::with_capacity(q.guesses.len());
        let mut promote = Vec::new();
        for g in q.guesses.drain(..) {
            let id = g.task.read.id();
            if g.layer != layer {
                keep.push_back(g);
            } else if needed.contains(&id) {
                if !g.task.started() {
                    out.promoted.push(id);
                }
                promote.push(g.task);
            } else if g.task.started() {
                keep.push_back(g);
            } else {
                out.dropped.push(id);
            }
        }
        q.guesses = keep;
        for job in promote.into_iter().rev() {
            q.demand.push_front(job);
        }
        Ok(out)
    }
}

fn worker(shared: &Shared, reader: &ExpertReader, meter: &DiskMeter) {
    loop {
        let (read, k) = {
            let Ok(mut q) = shared.queues.lock() else {
                return;
            };
            loop {
                if let Some(p) = take_piece(&mut q.demand, |t| t) {
                    break p;
                }
                if let Some(p) = take_piece(&mut q.guesses, |g| &mut g.task) {
                    break p;
                }
                if q.closed {
                    return;
                }
                q = match shared.wake.wait(q) {
                    Ok(q) => q,
                    Err(_) => return,
                };
            }
        };
        read.read_piece(k, reader, meter);
    }
}

impl Drop for LoaderPool {
    fn drop(&mut self) {
        if let Ok(mut q) = self.shared.queues.lock() {
            q.closed = true;
            // Reads nobody will wait for are dropped; demand reads still queued finish.
            q.guesses.clear();
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::IoMode;
    use crate::platform::aligned_buf::IO_ALIGN;
    use std::sync::mpsc::{channel, Receiver};

    fn loc() -> ExpertLocation {
        ExpertLocation {
            shard: 0,
            parts: Default::default(),
            contiguous: true,
        }
    }

    /// A job for expert `id` reading a file that does not exist: it fails at once, with an
    /// error that names the file, so a reply tells which job a thread took.
    fn failing_job(id: u32, reply: &Sender<Result<LoadedExpert>>) -> LoadJob {
        LoadJob {
            path: PathBuf::from(format!("/nonexistent/k3-test-expert-{id}")),
            loc: loc(),
            id,
            reply: reply.clone(),
        }
    }

    /// A pool with no threads yet: jobs stay queued until the test starts one.
    fn idle_pool() -> LoaderPool {
        LoaderPool {
            shared: Arc::new(Shared {
                queues: Mutex::new(Queues::default()),
                wake: Condvar::new(),
            }),
            workers: Vec::new(),
            reader: Arc::new(ExpertReader::new(IoMode::Buffered)),
        }
    }

    fn start_one_thread(pool: &mut LoaderPool) {
        let shared = pool.shared.clone();
        let reader = Arc::new(ExpertReader::new(IoMode::Buffered));
        let meter = Arc::new(DiskMeter::default());
        pool.workers
            .push(std::thread::spawn(move || worker(&shared, &reader, &meter)));
    }

    /// The ids of the jobs in the order one thread finished them.
    fn finished_order(rx: &Receiver<Result<LoadedExpert>>, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                let e = rx.recv().unwrap().err().expect("the file does not exist");
                let msg = format!("{e:#}");
                let at = msg.find("k3-test-expert-").expect(&msg) + "k3-test-expert-".len();
                msg[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_digit())
                    .collect::<String>()
                    .parse()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn threads_take_demand_reads_before_guesses_and_settle_reorders() {
        let mut pool = idle_pool();
        let (reply, rx) = channel();
        for (layer, id) in [(1, 5), (1, 7), (2, 9), (1, 8)] {
            pool.submit_guess(layer, failing_job(id, &reply)).unwrap();
        }
        pool.submit(failing_job(3, &reply)).unwrap();
        let s = pool.settle(1, &[8, 5, 3]).unwrap();
        assert_eq!(s.promoted, vec![5, 8]);
        assert_eq!(s.dropped, vec![7]);
        start_one_thread(&mut pool);
        // Promoted guesses first, in their order, then the demand read queued before the
        // settle, then the other layer's guess; the dropped guess is never read.
        assert_eq!(finished_order(&rx, 4), vec![5, 8, 3, 9]);
        drop(reply);
        drop(pool);
        assert!(rx.recv().is_err(), "no fifth reply: 7 was dropped unread");
    }

    #[test]
    fn guesses_wait_behind_demand_reads() {
        let mut pool = idle_pool();
        let (reply, rx) = channel();
        pool.submit_guess(1, failing_job(1, &reply)).unwrap();
        pool.submit_guess(1, failing_job(2, &reply)).unwrap();
        pool.submit(failing_job(3, &reply)).unwrap();
        pool.submit(failing_job(4, &reply)).unwrap();
        start_one_thread(&mut pool);
        assert_eq!(finished_order(&rx, 4), vec![3, 4, 1, 2]);
    }

    #[test]
    fn a_started_split_guess_is_never_dropped_and_its_pieces_left_move_when_needed() {
        let pool = idle_pool();
        pool.reader.set_read_piece(IO_ALIGN);
        let (reply, _rx) = channel();
        let split = |id| LoadJob {
            loc: ExpertLocation {
                shard: 0,
                parts: std::array::from_fn(|k| k as u64 * 2000..(k as u64 + 1) * 2000),
                contiguous: true,
            },
            ..failing_job(id, &reply)
        };
        pool.submit_guess(1, split(5)).unwrap();
        pool.submit_guess(1, split(6)).unwrap();
        // A thread takes the first of expert 5's three pieces.
        let (read, k) = {
            let mut q = pool.shared.queues.lock().unwrap();
            take_piece(&mut q.guesses, |g| &mut g.task).unwrap()
        };
        assert_eq!((read.id(), k, read.pieces()), (5, 0, 3));
        // Not needed: 6 (not started) is dropped, 5 (started) stays queued.
        let s = pool.settle(1, &[]).unwrap();
        assert_eq!((s.promoted, s.dropped), (vec![], vec![6]));
        let q = pool.shared.queues.lock().unwrap();
        assert_eq!(q.guesses.len(), 1);
        assert_eq!(q.guesses[0].task.next, 1);
        drop(q);
        // Needed: its pieces left go to the demand queue, not counted as promoted.
        let s = pool.settle(1, &[5]).unwrap();
        assert_eq!((s.promoted, s.dropped), (vec![], vec![]));
        let mut q = pool.shared.queues.lock().unwrap();
        assert!(q.guesses.is_empty());
        let taken: Vec<usize> = std::iter::from_fn(|| take_piece(&mut q.demand, |t| t))
            .map(|(r, k)| {
                assert_eq!(r.id(), 5);
                k
            })
            .collect();
        assert_eq!(taken, vec![1, 2]);
    }

    #[test]
    fn a_closed_pool_refuses_jobs_and_drops_queued_guesses() {
        let mut pool = idle_pool();
        let (reply, rx) = channel();
        pool.submit_guess(1, failing_job(1, &reply)).unwrap();
        start_one_thread(&mut pool);
        let _ = finished_order(&rx, 1);
        pool.shared.queues.lock().unwrap().closed = true;
        let e = pool.submit(failing_job(2, &reply)).unwrap_err();
        assert!(format!("{e}").contains("shut down"), "{e}");
        assert!(pool.submit_guess(1, failing_job(3, &reply)).is_err());
    }
}
