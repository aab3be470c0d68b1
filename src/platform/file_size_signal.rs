//! SIGXFSZ, sent when a write passes the file-size limit (`ulimit -f`), kills the process
//! by default and leaves a cut `.partial` file behind. Ignored, the write fails with
//! `EFBIG` instead, which the atomic writer reports naming the file and byte and cleans up
//! like a full disk.

/// Makes a write past the file-size limit an `EFBIG` error rather than a signal death.
#[cfg(unix)]
pub fn ignore_file_size_signal() {
    // SAFETY: installs SIG_IGN, which runs no handler code; called once at start-up.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Makes a write past the file-size limit an `EFBIG` error rather than a signal death.
#[cfg(not(unix))]
pub fn ignore_file_size_signal() {}
