//! Reads that bypass the OS page cache, so streamed experts (read once per use) do not push
//! out the memory the engine keeps: `O_DIRECT` on Linux, `F_NOCACHE` with read-ahead off on
//! macOS, `FILE_FLAG_NO_BUFFERING` on Windows. Linux and Windows want the buffer, the offset
//! and the length aligned to the device's logical sector; callers align all three to
//! [`crate::platform::aligned_buf::IO_ALIGN`] (4096), a multiple of the 512- and 4096-byte
//! sectors disks report, on every OS.
//!
//! Also the read-ahead hint of buffered mode, which only Linux and macOS have.

use std::fs::File;
use std::io;
use std::path::Path;

/// The OS mechanism [`open_uncached`] uses, as `k3 inspect` and the run's first lines name it.
pub const UNCACHED_MECHANISM: &str = if cfg!(target_os = "linux") {
    "O_DIRECT"
} else if cfg!(target_os = "macos") {
    "F_NOCACHE"
} else if cfg!(windows) {
    "FILE_FLAG_NO_BUFFERING"
} else {
    "none (buffered only on this OS)"
};

/// Opens `path` for reads that bypass the page cache.
#[cfg(target_os = "linux")]
pub fn open_uncached(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        // O_NONBLOCK: a FIFO swapped in for the shard opens at once (and is then refused as
        // not being the file already checked) instead of waiting for a writer; it changes
        // nothing for a regular file.
        .custom_flags(libc::O_DIRECT | libc::O_NONBLOCK)
        .open(path)
}

/// Opens `path` for reads that bypass the page cache.
#[cfg(target_os = "macos")]
pub fn open_uncached(path: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK, as on Linux: a FIFO swapped in for the shard must not block the open.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    // SAFETY: fcntl on a descriptor this function owns; F_NOCACHE and F_RDAHEAD take an int
    // argument and touch no memory.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    // Read-ahead would pull bytes past each expert into the cache F_NOCACHE keeps them out of.
    // SAFETY: as above.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_RDAHEAD, 0) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// Opens `path` for reads that bypass the page cache.
#[cfg(windows)]
pub fn open_uncached(path: &Path) -> io::Result<File> {
    use std::os::windows::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(windows_sys::Win32::Storage::FileSystem::FILE_FLAG_NO_BUFFERING)
        .open(path)
}

/// Opens `path` for reads that bypass the page cache.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
pub fn open_uncached(path: &Path) -> io::Result<File> {
    let _ = path;
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "uncached reads are not supported on this OS",
    ))
}

/// Whether `e`, from a first uncached read, means the filesystem refuses uncached reads
/// (tmpfs and some network filesystems on Linux, some volumes on Windows) rather than a
/// failing disk: the caller then falls back to buffered reads.
pub fn is_refusal(e: &io::Error) -> bool {
    #[cfg(target_os = "linux")]
    return e.raw_os_error() == Some(libc::EINVAL);
    #[cfg(windows)]
    return e.raw_os_error()
        == Some(windows_sys::Win32::Foundation::ERROR_INVALID_PARAMETER as i32);
    #[cfg(not(any(target_os = "linux", windows)))]
    {
        let _ = e;
        false
    }
}

/// Asks the OS to start reading `len` bytes at `offset` of `f` into the page cache
/// (buffered mode), where the OS has such a hint; elsewhere it does nothing.
pub fn read_ahead_hint(f: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return;
        };
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor stays open
        // for the call. A hint that fails changes nothing, so its result is ignored.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED);
        }
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(ra_offset), Ok(ra_count)) =
            (libc::off_t::try_from(offset), libc::c_int::try_from(len))
        else {
            return;
        };
        let mut advice = libc::radvisory {
            ra_offset,
            ra_count,
        };
        // SAFETY: F_RDADVISE reads the radvisory struct, which lives across the call; a hint
        // that fails changes nothing.
        unsafe {
            libc::fcntl(f.as_raw_fd(), libc::F_RDADVISE, &mut advice);
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    let _ = (f, offset, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::aligned_buf::{AlignedBuf, IO_ALIGN};
    use std::io::Write;

    #[test]
    fn an_uncached_read_of_aligned_blocks_returns_the_file_bytes_or_is_a_refusal() {
        let data: Vec<u8> = (0..3 * IO_ALIGN).map(|i| (i * 7 % 253) as u8).collect();
        // The temp dir may be tmpfs, which refuses O_DIRECT: both outcomes are legitimate
        // here; what may not happen is wrong bytes or an error that is not a refusal.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("blocks.bin");
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(&data))
            .unwrap();
        match open_uncached(&path) {
            Ok(f) => {
                let mut buf = AlignedBuf::new(2 * IO_ALIGN);
                let region = buf.block_region_mut();
                match crate::platform::positional_read::read_exact_at(&f, region, IO_ALIGN as u64) {
                    Ok(()) => assert_eq!(&region[..], &data[IO_ALIGN..3 * IO_ALIGN]),
                    Err(e) => assert!(is_refusal(&e), "{e}"),
                }
            }
            Err(e) => assert!(
                is_refusal(&e) || e.kind() == io::ErrorKind::Unsupported,
                "{e}"
            ),
        }
        read_ahead_hint(&std::fs::File::open(&path).unwrap(), 0, IO_ALIGN as u64);
    }

    #[cfg(unix)]
    #[test]
    fn an_uncached_open_of_a_fifo_returns_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("shard.safetensors");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(made, "mkfifo {}", fifo.display());
        // The open happens on a thread: a blocking open (no writer ever comes) fails the test
        // by timing out instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let opened = open_uncached(&fifo).map(|f| f.metadata().map(|m| m.is_file()));
            let _ = tx.send(opened.map(|m| m.unwrap_or(false)));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(10)) {
            // Either refused outright or opened as what it is: never a regular file.
            Ok(Ok(is_file)) => assert!(!is_file),
            Ok(Err(_)) => {}
            Err(_) => panic!("opening a FIFO for uncached reads blocked"),
        }
    }

    #[test]
    fn the_mechanism_is_named() {
        #[cfg(target_os = "linux")]
        assert_eq!(UNCACHED_MECHANISM, "O_DIRECT");
        assert!(!UNCACHED_MECHANISM.is_empty());
    }
}
