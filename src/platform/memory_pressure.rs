//! The OS's memory-pressure signal: macOS's `DISPATCH_SOURCE_TYPE_MEMORYPRESSURE` (the
//! signal the system sends before it compresses and swaps), Linux's pressure-stall
//! information (`/proc/pressure/memory`, kernel 4.20 and later with PSI enabled). Windows
//! and systems without either have none. The expert cache's guard
//! (`experts/pressure_guard.rs`) polls a [`PressureSource`], so tests drive it with their
//! own.

use std::fmt;

/// How hard the OS is pressed for memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PressureLevel {
    /// No pressure.
    Normal,
    /// The OS is reclaiming memory: time to hand some back.
    Warning,
    /// The OS is about to swap or kill: hand back a lot, now.
    Critical,
}

impl fmt::Display for PressureLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PressureLevel::Normal => "normal",
            PressureLevel::Warning => "warning",
            PressureLevel::Critical => "critical",
        })
    }
}

/// Something that says how pressed the machine's memory is now.
pub trait PressureSource: Send + Sync {
    /// The level now, and what it was read from (for the line that reports a shrink).
    fn level(&self) -> (PressureLevel, String);
}

/// Share of the last 10 s in which some task stalled on memory (`some avg10`) from which
/// Linux PSI counts as a warning.
pub const PSI_WARNING_SOME_PCT: f64 = 10.0;
/// Share of the last 10 s in which every task stalled on memory (`full avg10`) from which
/// Linux PSI counts as critical.
pub const PSI_CRITICAL_FULL_PCT: f64 = 5.0;

/// The `avg10` figures of a `/proc/pressure/memory` text: (`some`, `full`), in percent.
pub fn parse_psi(text: &str) -> Option<(f64, f64)> {
    let avg10 = |kind: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.starts_with(kind))?;
        let field = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("avg10="))?;
        field.parse().ok().filter(|v: &f64| v.is_finite())
    };
    // Kernels before 5.13 have no `full` line for the system as a whole in some configs.
    Some((avg10("some ")?, avg10("full ").unwrap_or(0.0)))
}

/// The level PSI figures (`some`, `full` avg10 in percent) mean.
pub fn psi_level((some, full): (f64, f64)) -> PressureLevel {
    if full >= PSI_CRITICAL_FULL_PCT {
        PressureLevel::Critical
    } else if some >= PSI_WARNING_SOME_PCT {
        PressureLevel::Warning
    } else {
        PressureLevel::Normal
    }
}

/// Linux PSI, read at every poll.
#[cfg(target_os = "linux")]
struct Psi;

#[cfg(target_os = "linux")]
const PSI_PATH: &str = "/proc/pressure/memory";

#[cfg(target_os = "linux")]
impl PressureSource for Psi {
    fn level(&self) -> (PressureLevel, String) {
        match std::fs::read_to_string(PSI_PATH)
            .ok()
            .as_deref()
            .and_then(parse_psi)
        {
            Some(f) => (
                psi_level(f),
                format!("PSI some avg10 {:.1}%, full avg10 {:.1}%", f.0, f.1),
            ),
            None => (PressureLevel::Normal, format!("{PSI_PATH} unreadable")),
        }
    }
}

/// The OS's pressure signal, or why there is none.
#[cfg(target_os = "linux")]
pub fn os_source() -> Result<Box<dyn PressureSource>, String> {
    match std::fs::read_to_string(PSI_PATH) {
        Ok(t) if parse_psi(&t).is_some() => Ok(Box::new(Psi)),
        Ok(_) => Err(format!("{PSI_PATH} has no avg10 figures")),
        Err(e) => Err(format!(
            "{PSI_PATH}: {e} (a kernel without PSI, or psi=0 on its command line)"
        )),
    }
}

/// The OS's pressure signal, or why there is none.
#[cfg(target_os = "macos")]
pub fn os_source() -> Result<Box<dyn PressureSource>, String> {
    macos::DispatchPressure::start().map(|s| Box::new(s) as Box<dyn PressureSource>)
}

/// The OS's pressure signal, or why there is none.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub fn os_source() -> Result<Box<dyn PressureSource>, String> {
    Err("this OS gives no memory-pressure signal k3 reads".into())
}

#[cfg(target_os = "macos")]
mod macos {
    //! `DISPATCH_SOURCE_TYPE_MEMORYPRESSURE` through libdispatch's C interface (part of
    //! libSystem, which every macOS program links): the handler runs on a global queue and
    //! stores the latest level, which polls read.

    use super::{PressureLevel, PressureSource};
    use std::ffi::c_void;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const DISPATCH_MEMORYPRESSURE_NORMAL: usize = 0x01;
    const DISPATCH_MEMORYPRESSURE_WARN: usize = 0x02;
    const DISPATCH_MEMORYPRESSURE_CRITICAL: usize = 0x04;
    const DISPATCH_QUEUE_PRIORITY_LOW: isize = -2;

    #[repr(C)]
    struct DispatchSourceType {
        _opaque: [u8; 0],
    }

    extern "C" {
        static _dispatch_source_type_memorypressure: DispatchSourceType;
        fn dispatch_get_global_queue(identifier: isize, flags: usize) -> *mut c_void;
        fn dispatch_source_create(
            kind: *const DispatchSourceType,
            handle: usize,
            mask: usize,
            queue: *mut c_void,
        ) -> *mut c_void;
        fn dispatch_set_context(object: *mut c_void, context: *mut c_void);
        fn dispatch_source_set_event_handler_f(
            source: *mut c_void,
            handler: extern "C" fn(*mut c_void),
        );
        fn dispatch_source_get_data(source: *mut c_void) -> usize;
        fn dispatch_resume(object: *mut c_void);
    }

    /// The dispatch source and the level its handler last stored; lives for the process
    /// (the source is never cancelled, so its context must never be freed).
    struct Shared {
        source: *mut c_void,
        level: AtomicUsize,
    }

    // SAFETY: `source` is only passed to dispatch_source_get_data, which libdispatch allows
    // from any thread; `level` is atomic.
    unsafe impl Send for Shared {}
    // SAFETY: as above.
    unsafe impl Sync for Shared {}

    extern "C" fn on_pressure(context: *mut c_void) {
        // SAFETY: the context is the leaked `Shared` of `start`, alive for the process.
        let shared = unsafe { &*(context as *const Shared) };
        // SAFETY: the source is the one this handler was installed on.
        let data = unsafe { dispatch_source_get_data(shared.source) };
        shared.level.store(data, Ordering::Relaxed);
    }

    /// The memory-pressure dispatch source's latest level.
    pub(crate) struct DispatchPressure {
        shared: &'static Shared,
    }

    impl DispatchPressure {
        /// Installs the source on a low-priority global queue.
        pub(crate) fn start() -> Result<Self, String> {
            let mask = DISPATCH_MEMORYPRESSURE_NORMAL
                | DISPATCH_MEMORYPRESSURE_WARN
                | DISPATCH_MEMORYPRESSURE_CRITICAL;
            // SAFETY: a global queue always exists; the source type is libdispatch's own
            // static, and the handle of this type is 0 by definition.
            let source = unsafe {
                let queue = dispatch_get_global_queue(DISPATCH_QUEUE_PRIORITY_LOW, 0);
                dispatch_source_create(&_dispatch_source_type_memorypressure, 0, mask, queue)
            };
            if source.is_null() {
                return Err("dispatch_source_create(MEMORYPRESSURE) returned NULL".into());
            }
            let shared: &'static Shared = Box::leak(Box::new(Shared {
                source,
                level: AtomicUsize::new(DISPATCH_MEMORYPRESSURE_NORMAL),
            }));
            // SAFETY: `source` is a valid, suspended source; the context outlives it (leaked)
            // and the handler only reads it as a `Shared`.
            unsafe {
                dispatch_set_context(source, shared as *const Shared as *mut c_void);
                dispatch_source_set_event_handler_f(source, on_pressure);
                dispatch_resume(source);
            }
            Ok(Self { shared })
        }
    }

    impl PressureSource for DispatchPressure {
        fn level(&self) -> (PressureLevel, String) {
            let data = self.shared.level.load(Ordering::Relaxed);
            let level = if data & DISPATCH_MEMORYPRESSURE_CRITICAL != 0 {
                PressureLevel::Critical
            } else if data & DISPATCH_MEMORYPRESSURE_WARN != 0 {
                PressureLevel::Warning
            } else {
                PressureLevel::Normal
            };
            (level, "DISPATCH_SOURCE_TYPE_MEMORYPRESSURE".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_figures_are_read_and_graded() {
        let calm = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_psi(calm), Some((0.0, 0.0)));
        assert_eq!(psi_level((0.0, 0.0)), PressureLevel::Normal);
        let warn = "some avg10=23.50 avg60=4.00 avg300=1.00 total=99\n\
                    full avg10=1.25 avg60=0.00 avg300=0.00 total=9\n";
        assert_eq!(parse_psi(warn), Some((23.5, 1.25)));
        assert_eq!(psi_level((23.5, 1.25)), PressureLevel::Warning);
        assert_eq!(psi_level((60.0, 7.0)), PressureLevel::Critical);
        // No `full` line: `some` alone decides.
        assert_eq!(
            parse_psi("some avg10=12.00 avg60=0 avg300=0 total=1\n"),
            Some((12.0, 0.0))
        );
        assert_eq!(parse_psi(""), None);
        assert_eq!(parse_psi("some avg10=lots\n"), None);
        assert_eq!(parse_psi("some avg10=NaN\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_kernel_either_has_psi_or_says_why_not() {
        match os_source() {
            Ok(s) => {
                let (_, from) = s.level();
                assert!(from.starts_with("PSI some avg10"), "{from}");
            }
            Err(why) => assert!(why.contains("/proc/pressure/memory"), "{why}"),
        }
    }
}
