//! The cache file still being written after the load ([`PendingWrite`]), how that write
//! ended ([`WriteReport`]), and the writer thread that writes it.

use super::file_format::Builder;
use super::write_queue::{Queue, WriterGone, MAX_BACKLOG};
use super::{mb, Building, Progress};
use anyhow::anyhow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Seconds between progress lines while a process waits for the cache write.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// A cache file still being written after the load: the writer thread finishes it while
/// the model runs. [`PendingWrite::wait`] (or dropping it) waits for the file to be whole
/// and in place, or for the write to fail, which leaves no file.
pub struct PendingWrite {
    pub(super) building: Option<Building>,
    /// When the load handed the rest of the write to the background.
    pub(super) ready: Instant,
    pub(super) announce: bool,
}

/// How a background cache write ended.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteReport {
    /// The cache's words for the stats line: `built (N MB, path)`, `stale or corrupt (…),
    /// rebuilt: built (…)`, or `off: cannot be written (…)`.
    pub line: String,
    /// Whether the file is whole and in place.
    pub built: bool,
    /// The file's bytes (0 when it was not written).
    pub bytes: u64,
    /// Seconds from the writer's start (the load's first matrix) to the file in place.
    pub write_s: f64,
    /// Of those, seconds after the model was ready.
    pub after_ready_s: f64,
    /// Seconds the process waited for the write (it ended before the writer).
    pub waited_s: f64,
}

impl WriteReport {
    /// `[K3] weight cache: built (…) in Ws, As of it after the model was ready, Ps waited for`
    pub fn stats_line(&self) -> String {
        if self.built {
            format!(
                "[K3] weight cache: {} in {:.1}s, {:.1}s of it after the model was ready, {:.1}s waited for",
                self.line, self.write_s, self.after_ready_s, self.waited_s
            )
        } else {
            format!("[K3] weight cache: {}", self.line)
        }
    }
}

impl PendingWrite {
    /// Whether the writer thread is done (the file in place, or the write failed).
    pub fn is_done(&self) -> bool {
        self.building
            .as_ref()
            .is_none_or(|b| b.writer.is_finished())
    }

    /// Waits for the write to end (with a progress line on stderr when announced and it is
    /// still under way) and says how it ended.
    pub fn wait(mut self) -> WriteReport {
        self.end()
    }

    fn end(&mut self) -> WriteReport {
        let Some(b) = self.building.take() else {
            return WriteReport {
                line: "off".to_string(),
                built: false,
                bytes: 0,
                write_s: 0.0,
                after_ready_s: 0.0,
                waited_s: 0.0,
            };
        };
        let waiting = Instant::now();
        let mut shown = None::<Instant>;
        while !b.writer.is_finished() {
            if self.announce && shown.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
                let written = b.progress.written.load(Ordering::Relaxed);
                let step = if b.progress.syncing.load(Ordering::Relaxed) {
                    "syncing it to disk".to_string()
                } else {
                    format!("{:.0} MB written", mb(written))
                };
                tracing::info!(
                    "[K3] weight cache: finishing the write of {:.0} MB to {} ({step}) ...",
                    mb(b.sent),
                    b.path.display()
                );
                shown = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let waited_s = waiting.elapsed().as_secs_f64();
        let done = b
            .writer
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the cache writer thread panicked")));
        match done {
            Ok((bytes, path, at)) => {
                let built = format!("built ({:.0} MB, {})", mb(bytes), path.display());
                WriteReport {
                    line: match b.replaced {
                        Some(why) => format!("stale or corrupt ({why}), rebuilt: {built}"),
                        None => built,
                    },
                    built: true,
                    bytes,
                    write_s: at.saturating_duration_since(b.started).as_secs_f64(),
                    after_ready_s: at.saturating_duration_since(self.ready).as_secs_f64(),
                    waited_s,
                }
            }
            Err(e) => WriteReport {
                line: format!(
                    "off: cannot be written ({e:#}); quantized this start only, the next start \
                     quantizes again"
                ),
                built: false,
                bytes: 0,
                write_s: waiting.saturating_duration_since(b.started).as_secs_f64(),
                after_ready_s: 0.0,
                waited_s,
            },
        }
    }
}

impl Drop for PendingWrite {
    /// A write nobody waited for is waited for here, so a process never ends with the file
    /// half written; its outcome is printed when the load was announced.
    fn drop(&mut self) {
        if self.building.is_some() {
            let r = self.end();
            if self.announce {
                tracing::info!("{}", r.stats_line());
            }
        }
    }
}

impl Builder {
    /// Moves the file to a writer thread that writes each matrix it is sent, then the table,
    /// and commits once the queue is closed. After an error it stops taking matrices and
    /// returns the error (the partial file is removed).
    pub(super) fn spawn(mut self, replaced: Option<String>) -> Building {
        let queue = Arc::new(Queue::new(MAX_BACKLOG));
        let progress = Arc::new(Progress::default());
        let path = self.file.path().to_path_buf();
        let (q, prog) = (Arc::clone(&queue), Arc::clone(&progress));
        let writer = std::thread::spawn(move || {
            let _gone = WriterGone(Arc::clone(&q));
            // While the load runs it may wait for this thread (a full backlog), so the thread
            // keeps its priority; once the model is ready its reads and compute come first
            // and this file can wait (a process that ends before it waits for it).
            let mut background = false;
            while let Some(parts) = q.recv() {
                if !background && q.is_closed() {
                    crate::platform::thread_priority::to_background();
                    background = true;
                }
                self.add(parts)?;
                prog.written.store(self.file.written(), Ordering::Relaxed);
            }
            if !background {
                crate::platform::thread_priority::to_background();
            }
            prog.syncing.store(true, Ordering::Relaxed);
            let (bytes, path) = self.commit()?;
            Ok((bytes, path, Instant::now()))
        });
        Building {
            queue,
            progress,
            writer,
            path,
            sent: 0,
            started: Instant::now(),
            replaced,
        }
    }
}
