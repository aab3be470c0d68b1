//! The partner thread: a second thread that takes half of a small op of several rows.
//!
//! A batched decode step of a small model is a long run of ops of a few microseconds each,
//! too small for the rayon pool, whose hand-off from a thread outside it costs tens of
//! microseconds (see [`super::pool`]). The partner is one thread that spins for a while
//! after each job, so that handing it the next one costs a cache-line exchange. [`join`]
//! posts one closure to it and runs the other on the calling thread; a job the partner has
//! not taken by the time the caller is done is taken back and run by the caller, so a
//! parked or descheduled partner never makes the caller wait. Which thread runs a closure
//! never changes what it computes.

use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long the partner spins for the next job before it parks: longer than the gaps
/// between the ops of a decode step, short enough that an idle engine leaves the core.
const SPIN_FOR: Duration = Duration::from_millis(2);

/// How long a caller spins for the partner to finish its half before it blocks: past the
/// imbalance of two halves of a small op; a longer wait is the partner having lost its core,
/// and the caller's core is better given up to it.
const WAIT_SPIN_FOR: Duration = Duration::from_micros(50);

/// Spins between two reads of the clock.
const SPINS_PER_CHECK: u32 = 256;

/// Nothing posted.
const IDLE: u8 = 0;
/// A job waits for the partner.
const POSTED: u8 = 1;
/// The partner runs the job.
const TAKEN: u8 = 2;
/// The partner has finished the job.
const DONE: u8 = 3;

/// A posted job: a type-erased pointer to a [`Slot`] on the poster's stack and the function
/// that runs it.
#[derive(Clone, Copy)]
struct JobRef {
    data: *mut (),
    run: unsafe fn(*mut ()),
}

/// The closure the partner runs and what it left: its result, or its panic.
struct Slot<F, R> {
    f: Option<F>,
    out: Option<thread::Result<R>>,
}

/// Runs the [`Slot`] behind `data` (a `*mut Slot<F, R>`), keeping a panic as its outcome.
///
/// # Safety
/// `data` points to a live `Slot<F, R>` no other thread touches until this returns.
unsafe fn run_slot<F: FnOnce() -> R, R>(data: *mut ()) {
    // SAFETY: the caller guarantees `data` is a live, exclusively held `Slot<F, R>`.
    let slot = unsafe { &mut *data.cast::<Slot<F, R>>() };
    if let Some(f) = slot.f.take() {
        slot.out = Some(panic::catch_unwind(AssertUnwindSafe(f)));
    }
}

/// The partner's shared state.
struct Partner {
    state: AtomicU8,
    /// A caller holds the partner (between its post and its take-back or collection).
    held: AtomicBool,
    /// The partner is parked (or about to be) and needs an unpark to see a post.
    parked: AtomicBool,
    /// The caller blocks on `finished` until the partner is done.
    waiting: AtomicBool,
    job: UnsafeCell<Option<JobRef>>,
    thread: OnceLock<Thread>,
    /// What `finished` waits with.
    lock: Mutex<()>,
    /// Signalled when the partner finishes a job its caller is blocked on.
    finished: Condvar,
}

// SAFETY: `job` is written only by the caller that holds `held`, while `state` is IDLE, and
// read only by the partner after it moved `state` from POSTED to TAKEN; the Release store of
// POSTED and the Acquire exchange order the two. The pointer in it is dereferenced only by
// the thread that owns the job at that moment (see `join`).
unsafe impl Sync for Partner {}

/// The most partner threads: the first takes half of an op or of a step, the others the
/// further parts of a step split across a wide machine ([`scatter`]).
const CREW: usize = 16;

/// The first partner, started on first use; `None` where its thread cannot be started.
fn partner() -> Option<&'static Partner> {
    partner_at(0)
}

/// Partner `i` of the crew, started on first use; `None` where `i` is past the crew or its
/// thread cannot be started.
fn partner_at(i: usize) -> Option<&'static Partner> {
    static SLOTS: [OnceLock<Option<&'static Partner>>; CREW] = [const { OnceLock::new() }; CREW];
    *SLOTS.get(i)?.get_or_init(|| {
        let p: &'static Partner = Box::leak(Box::new(Partner {
            state: AtomicU8::new(IDLE),
            held: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
            job: UnsafeCell::new(None),
            thread: OnceLock::new(),
            lock: Mutex::new(()),
            finished: Condvar::new(),
        }));
        let handle = thread::Builder::new()
            .name(format!("k3-partner-{i}"))
            .spawn(move || serve(p))
            .ok()?;
        let _ = p.thread.set(handle.thread().clone());
        Some(p)
    })
}

/// The partner thread's loop: wait for a post (spinning, then parked), run it, repeat.
fn serve(p: &'static Partner) {
    loop {
        wait_for_post(p);
        if p.state
            .compare_exchange(POSTED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue; // taken back by its caller
        }
        // SAFETY: winning POSTED -> TAKEN makes this thread the job's only runner; the
        // caller wrote `job` before its Release store of POSTED and waits for DONE before
        // it touches the slot again or returns.
        unsafe {
            if let Some(job) = *p.job.get() {
                (job.run)(job.data);
            }
        }
        p.state.store(DONE, Ordering::SeqCst);
        if p.waiting.load(Ordering::SeqCst) {
            let _guard = p.lock.lock().unwrap_or_else(|e| e.into_inner());
            p.finished.notify_one();
        }
    }
}

/// Returns once a job is posted: spins for [`SPIN_FOR`], then parks until a poster
/// unparks it.
fn wait_for_post(p: &Partner) {
    let mut since = Instant::now();
    loop {
        for _ in 0..SPINS_PER_CHECK {
            if p.state.load(Ordering::Acquire) == POSTED {
                return;
            }
            std::hint::spin_loop();
        }
        if since.elapsed() >= SPIN_FOR {
            p.parked.store(true, Ordering::SeqCst);
            if p.state.load(Ordering::SeqCst) != POSTED {
                thread::park();
            }
            p.parked.store(false, Ordering::SeqCst);
            since = Instant::now();
        }
    }
}

/// Whether [`join`] may hand work to the partner: the process runs at least two compute
/// threads (`--threads`; one means one) and the partner's thread started.
pub(crate) fn available() -> bool {
    rayon::current_num_threads() >= 2 && partner().is_some()
}

/// Where to cut items whose work is `work` into two runs of about equal work for [`join`]:
/// the index of the second run's first item, never 0, and short of the end for two items
/// or more.
pub(crate) fn even_cut(work: &[usize]) -> usize {
    let total: usize = work.iter().sum();
    let mut at = 1;
    let mut first = work.first().copied().unwrap_or(0);
    while at + 1 < work.len() && 2 * (first + work[at]) <= total {
        first += work[at];
        at += 1;
    }
    at
}

/// Runs `a` on the calling thread and `b` on the partner thread at the same time, and
/// returns both results. When the partner is held by another caller (or this is a nested
/// call), cannot start, or has not taken `b` by the time `a` is done, `b` runs on the
/// calling thread after `a`; with one compute thread (`--threads 1`) both run here. A panic in either closure reaches the caller once both are
/// over.
pub(crate) fn join<A, B, RA, RB>(a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA,
    B: FnOnce() -> RB + Send,
    RB: Send,
{
    join_on(0, a, b)
}

/// [`join`] with partner `i` of the crew taking `b`.
fn join_on<A, B, RA, RB>(i: usize, a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA,
    B: FnOnce() -> RB + Send,
    RB: Send,
{
    let Some(p) = partner_at(i).filter(|_| rayon::current_num_threads() >= 2) else {
        return (a(), b());
    };
    // A plain read first: while one caller holds the partner, the others' checks leave its
    // cache line shared rather than pulling it from core to core.
    if p.held.load(Ordering::Relaxed) || p.held.swap(true, Ordering::Acquire) {
        return (a(), b());
    }
    let mut slot = Slot {
        f: Some(b),
        out: None,
    };
    let data: *mut Slot<B, RB> = &mut slot;
    // SAFETY: this caller holds the partner and `state` is IDLE, so the partner does not read
    // `job` until the POSTED store below.
    unsafe {
        *p.job.get() = Some(JobRef {
            data: data.cast(),
            run: run_slot::<B, RB>,
        });
    }
    p.state.store(POSTED, Ordering::SeqCst);
    if p.parked.load(Ordering::SeqCst) {
        if let Some(t) = p.thread.get() {
            t.unpark();
        }
    }
    // Takes `b` back or waits for the partner to finish it, also when `a` panics, so the
    // slot outlives every use of it.
    let settle = Settle { p };
    let ra = a();
    drop(settle);
    // SAFETY: `settle` has run: the partner no longer touches the slot.
    let slot = unsafe { &mut *data };
    if let Some(f) = slot.f.take() {
        slot.out = Some(panic::catch_unwind(AssertUnwindSafe(f)));
    }
    match slot.out.take() {
        Some(Ok(rb)) => (ra, rb),
        Some(Err(e)) => panic::resume_unwind(e),
        None => unreachable!("the partner's job left no outcome"),
    }
}

/// Runs `f(first, part)` on `data[..at]` on the calling thread and on `data[at..]` on the
/// partner ([`join`]); `first` is the part's offset in `data`.
pub(crate) fn halves<T: Send>(data: &mut [T], at: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (lo, hi) = data.split_at_mut(at.min(data.len()));
    let f = &f;
    join(|| f(0, lo), || f(at, hi));
}

/// `f(first, part)` for `parts` runs of `items` of about equal length (the earlier ones the
/// longer), at once: the first on the calling thread, the others on partners of the crew (a binary tree of [`join`]s, each
/// level on partners of its own, so no two runs wait for one partner). The results come in
/// item order; `first` is a run's offset in `items`. Where a partner is busy or cannot
/// start, its run goes to the thread that would have posted it, as in [`join`].
pub(crate) fn scatter<T: Send, R: Send>(
    items: &mut [T],
    parts: usize,
    f: &(dyn Fn(usize, &mut [T]) -> R + Sync),
) -> Vec<R> {
    let mut out = Vec::with_capacity(parts.max(1));
    scatter_node(items, 0, parts.clamp(1, items.len().max(1)), 0, f, &mut out);
    out
}

/// One node of [`scatter`]'s tree: `parts` runs of `items` (offset `first`), split in two
/// with partner `node` taking the second half; its children are nodes 2·node + 1 and + 2.
fn scatter_node<T: Send, R: Send>(
    items: &mut [T],
    first: usize,
    parts: usize,
    node: usize,
    f: &(dyn Fn(usize, &mut [T]) -> R + Sync),
    out: &mut Vec<R>,
) {
    if parts <= 1 {
        out.push(f(first, items));
        return;
    }
    // The first half the larger where the items do not split evenly: a partner may still
    // be waking.
    let lo_parts = parts.div_ceil(2);
    let at = (items.len() * lo_parts).div_ceil(parts);
    let (lo, hi) = items.split_at_mut(at);
    let (mut a, b) = join_on(
        node,
        || {
            let mut a = Vec::with_capacity(lo_parts);
            scatter_node(lo, first, lo_parts, 2 * node + 1, f, &mut a);
            a
        },
        || {
            let mut b = Vec::with_capacity(parts - lo_parts);
            scatter_node(hi, first + at, parts - lo_parts, 2 * node + 2, f, &mut b);
            b
        },
    );
    out.append(&mut a);
    out.extend(b);
}

/// On drop, ends a post: takes the job back if the partner has not taken it, else waits for
/// it to finish; then frees the partner for the next caller.
struct Settle {
    p: &'static Partner,
}

impl Drop for Settle {
    fn drop(&mut self) {
        let p = self.p;
        if p.state
            .compare_exchange(POSTED, IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            let since = Instant::now();
            'spin: while p.state.load(Ordering::Acquire) != DONE {
                for _ in 0..SPINS_PER_CHECK {
                    if p.state.load(Ordering::Acquire) == DONE {
                        break 'spin;
                    }
                    std::hint::spin_loop();
                }
                if since.elapsed() >= WAIT_SPIN_FOR {
                    let mut guard = p.lock.lock().unwrap_or_else(|e| e.into_inner());
                    p.waiting.store(true, Ordering::SeqCst);
                    while p.state.load(Ordering::SeqCst) != DONE {
                        guard = p.finished.wait(guard).unwrap_or_else(|e| e.into_inner());
                    }
                    p.waiting.store(false, Ordering::SeqCst);
                }
            }
            p.state.store(IDLE, Ordering::Release);
        }
        p.held.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::Any;

    /// A panic payload's message.
    fn message(e: &(dyn Any + Send)) -> String {
        e.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| e.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    }

    #[test]
    fn an_even_cut_splits_the_work_in_two_non_empty_runs() {
        assert_eq!(even_cut(&[1, 1, 1, 1]), 2);
        assert_eq!(even_cut(&[10, 1, 1]), 1);
        assert_eq!(even_cut(&[1, 1, 10]), 2);
        assert_eq!(even_cut(&[5, 5]), 1);
    }

    #[test]
    fn both_results_come_back() {
        for i in 0..2000u64 {
            let v: Vec<u64> = (0..64).map(|k| k * i).collect();
            let (a, b) = join(
                || v[..32].iter().sum::<u64>(),
                || v[32..].iter().sum::<u64>(),
            );
            assert_eq!(a + b, v.iter().sum::<u64>());
        }
    }

    #[test]
    fn nested_and_concurrent_calls_run_inline() {
        let outer = join(|| join(|| 1, || 2), || join(|| 3, || 4));
        assert_eq!(outer, ((1, 2), (3, 4)));
        let hs: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    (0..500)
                        .map(|i| join(|| i, || t).0 + join(|| t, || i).1)
                        .sum::<i32>()
                })
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().ok(), Some((0..500).sum::<i32>() * 2));
        }
    }

    #[test]
    fn a_panic_on_either_side_reaches_the_caller() {
        let r = panic::catch_unwind(|| join(|| 1, || -> i32 { panic!("partner side") }));
        let e = r.err().map(|e| message(&*e));
        assert_eq!(e.as_deref(), Some("partner side"));
        let r = panic::catch_unwind(|| join(|| -> i32 { panic!("caller side") }, || 2));
        let e = r.err().map(|e| message(&*e));
        assert_eq!(e.as_deref(), Some("caller side"));
        // The partner is free again.
        assert_eq!(join(|| 5, || 6), (5, 6));
    }

    #[test]
    fn scatter_gives_each_run_in_order_on_threads_of_the_crew() {
        let mut items: Vec<u32> = (0..11).collect();
        for parts in [1, 2, 3, 4, 7, 11, 20] {
            let got = scatter(&mut items, parts, &|first, run: &mut [u32]| {
                (first, run.to_vec(), thread::current().id())
            });
            assert_eq!(got.len(), parts.min(11), "{parts} parts");
            let mut next = 0;
            for (first, run, _) in &got {
                assert_eq!(*first, next, "{parts} parts: runs in order");
                assert!(!run.is_empty() && run[0] == *first as u32);
                next += run.len();
            }
            assert_eq!(next, 11, "{parts} parts cover every item");
            let longest = got.iter().map(|r| r.1.len()).max().unwrap_or(0);
            let shortest = got.iter().map(|r| r.1.len()).min().unwrap_or(0);
            assert!(
                longest - shortest <= 1,
                "{parts} parts of about equal length"
            );
        }
        // Four runs that each wait a while: several threads take them.
        let mut four = [0u8; 4];
        let mut threads = std::collections::HashSet::new();
        for _ in 0..20 {
            let ids = scatter(&mut four, 4, &|_, _| {
                std::thread::sleep(Duration::from_micros(300));
                thread::current().id()
            });
            threads.extend(ids);
        }
        assert!(
            threads.len() >= 3,
            "the runs went to {} threads",
            threads.len()
        );
    }

    #[test]
    fn a_parked_partner_wakes_for_a_post() {
        assert_eq!(join(|| 1, || 2), (1, 2));
        std::thread::sleep(SPIN_FOR * 3);
        let caller = thread::current().id();
        let mut elsewhere = false;
        for _ in 0..200 {
            let (_, id) = join(
                || std::thread::sleep(Duration::from_micros(200)),
                || thread::current().id(),
            );
            elsewhere |= id != caller;
        }
        assert!(elsewhere, "the partner never took a job");
    }
}
