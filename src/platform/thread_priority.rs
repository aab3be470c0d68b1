//! Putting the calling thread in the background, for work that must not slow the reads and
//! the compute a run waits on (the quantized-weight cache finished while the model runs):
//! Linux the idle disk class (`ioprio_set`) and nice 19 for this thread only, macOS the
//! thread's background state (`PRIO_DARWIN_BG`: CPU and disk), Windows background mode. A
//! refusal changes nothing but the priority, so it is not an error.

/// Asks the OS to give this thread the CPU and the disk after everyone else.
#[cfg(target_os = "linux")]
pub(crate) fn to_background() {
    const IOPRIO_WHO_PROCESS: libc::c_int = 1;
    const IOPRIO_CLASS_IDLE: libc::c_int = 3;
    const IOPRIO_CLASS_SHIFT: libc::c_int = 13;
    // SAFETY: ioprio_set and gettid take and return integers and touch no memory of ours;
    // `who` 0 with IOPRIO_WHO_PROCESS names the calling thread only.
    let (_, tid) = unsafe {
        (
            libc::syscall(
                libc::SYS_ioprio_set,
                IOPRIO_WHO_PROCESS,
                0,
                IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
            ),
            libc::syscall(libc::SYS_gettid),
        )
    };
    // SAFETY: setpriority takes integers only; on Linux a thread id names that one thread.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19) };
}

/// Asks the OS to give this thread the CPU and the disk after everyone else.
#[cfg(target_vendor = "apple")]
pub(crate) fn to_background() {
    // SAFETY: setpriority takes integers only; PRIO_DARWIN_THREAD with `who` 0 names the
    // calling thread.
    let _ = unsafe { libc::setpriority(libc::PRIO_DARWIN_THREAD, 0, libc::PRIO_DARWIN_BG) };
}

/// Asks the OS to give this thread the CPU and the disk after everyone else.
#[cfg(windows)]
pub(crate) fn to_background() {
    use windows_sys::Win32::System::Threading::{
        GetCurrentThread, SetThreadPriority, THREAD_MODE_BACKGROUND_BEGIN,
    };
    // SAFETY: GetCurrentThread returns a pseudo-handle that needs no closing; background
    // mode lowers only the calling thread's CPU, I/O and memory priority.
    let _ = unsafe { SetThreadPriority(GetCurrentThread(), THREAD_MODE_BACKGROUND_BEGIN) };
}

/// Where the OS has no per-thread priority k3 knows of, the thread keeps its own.
#[cfg(not(any(target_os = "linux", target_vendor = "apple", windows)))]
pub fn to_background() {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    /// (disk class, nice) of the calling thread.
    fn priority() -> (i64, i32) {
        // SAFETY: ioprio_get, gettid and getpriority take integers and read no memory of ours.
        unsafe {
            let io = libc::syscall(libc::SYS_ioprio_get, 1, 0) as i64 >> 13;
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            *libc::__errno_location() = 0;
            (io, libc::getpriority(libc::PRIO_PROCESS, tid))
        }
    }

    #[test]
    fn the_calling_thread_alone_goes_to_the_background() {
        let before = priority();
        let (io, nice) = std::thread::spawn(|| {
            super::to_background();
            priority()
        })
        .join()
        .unwrap();
        assert_eq!(io, 3, "not the idle disk class");
        assert_eq!(nice, 19);
        assert_eq!(
            priority(),
            before,
            "the calling thread's own priority changed"
        );
    }
}
