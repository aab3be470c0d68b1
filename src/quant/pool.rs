//! When an op's pieces go across the rayon pool and when they stay on the calling thread.
//!
//! Handing work to the pool from the engine's thread (which is no pool worker) costs a
//! queue push, a futex wake of a sleeping worker and a blocking wait for it: tens of
//! microseconds on a small VM, more than a one-token op of a small model computes. Below
//! [`POOL_WORK_FROM`] an op's parallel iterator is given a minimum length of all its items,
//! so rayon never splits it and runs it inline. Which thread computes a piece never
//! changes what it computes, so results are the same bits either way.

use std::cell::Cell;

/// Work, counted in multiply-adds (or element steps of like cost), from which an op pays
/// for the pool: tens of microseconds of one core, so that splitting it saves more than a
/// hand-off costs. A one-token op of the real model's widest matrices is far above it; the
/// demo model's ops and a decode step's elementwise ops are below it.
pub(crate) const POOL_WORK_FROM: usize = 1 << 18;

/// Work, in the units of [`POOL_WORK_FROM`], from which an op of several rows that stays off
/// the pool gives half of itself to the partner thread ([`super::partner`]): a few
/// microseconds of one core, several times what the hand-off costs.
pub(crate) const PARTNER_WORK_FROM: usize = 1 << 13;

/// Whether an op over `rows` rows that takes `work` and stays off the pool (see
/// [`min_len`]) splits its rows with the partner thread. One row never does: a one-stream
/// decode step runs every op on the calling thread alone.
pub(crate) fn partner_pays(rows: usize, work: usize) -> bool {
    rows >= 2 && work >= PARTNER_WORK_FROM
}

thread_local! {
    /// This thread runs one half of a split step ([`on_this_thread`]).
    static HALF_OF_A_STEP: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every op it runs kept on the calling thread: a half of a decode step that
/// runs beside the other half, which keeps the other core busy already; the pool would
/// only queue behind it.
pub(crate) fn on_this_thread<R>(f: impl FnOnce() -> R) -> R {
    /// Restores the flag, also when `f` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            HALF_OF_A_STEP.with(|h| h.set(self.0));
        }
    }
    let _restore = Restore(HALF_OF_A_STEP.with(|h| h.replace(true)));
    f()
}

/// The `with_min_len` of a parallel iterator over `items` pieces that together take
/// `work` (see [`POOL_WORK_FROM`]): all of them (one inline run) when the work is too small
/// to pay for the pool or the thread runs a half of a step ([`on_this_thread`]), else 1
/// (rayon splits as it likes).
pub(crate) fn min_len(items: usize, work: usize) -> usize {
    if work < POOL_WORK_FROM || HALF_OF_A_STEP.with(Cell::get) {
        items.max(1)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_work_stays_in_one_piece() {
        assert_eq!(min_len(8, POOL_WORK_FROM - 1), 8);
        assert_eq!(min_len(0, 0), 1);
        assert_eq!(min_len(8, POOL_WORK_FROM), 1);
    }

    #[test]
    fn a_half_of_a_step_keeps_big_work_in_one_piece() {
        assert_eq!(on_this_thread(|| min_len(8, usize::MAX)), 8);
        assert_eq!(min_len(8, usize::MAX), 1);
    }

    #[test]
    fn one_row_never_goes_to_the_partner() {
        assert!(!partner_pays(1, usize::MAX));
        assert!(!partner_pays(4, PARTNER_WORK_FROM - 1));
        assert!(partner_pays(2, PARTNER_WORK_FROM));
    }

    #[test]
    fn small_work_runs_on_the_calling_thread() {
        use rayon::prelude::*;
        let caller = std::thread::current().id();
        let mut v = [0u8; 64];
        v.par_chunks_mut(1)
            .with_min_len(min_len(64, 64))
            .for_each(|_| assert_eq!(std::thread::current().id(), caller));
    }
}
