//! Reads at a file offset without moving a shared cursor, so loader threads can share one
//! descriptor: `pread` on unix, `ReadFile` with an offset on Windows.

use std::fs::File;
use std::io;

/// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at end of file).
#[cfg(unix)]
pub fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(f, buf, offset)
}

/// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at end of file).
#[cfg(windows)]
pub fn read_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // seek_read moves the handle's cursor as a side effect; nothing here reads through the
    // cursor, so concurrent positional reads on one handle stay independent.
    match std::os::windows::fs::FileExt::seek_read(f, buf, offset) {
        // Windows reports a read that starts at or past the end as ERROR_HANDLE_EOF where
        // unix returns 0.
        Err(e) if e.raw_os_error() == Some(ERROR_HANDLE_EOF) => Ok(0),
        r => r,
    }
}

#[cfg(windows)]
const ERROR_HANDLE_EOF: i32 = windows_sys::Win32::Foundation::ERROR_HANDLE_EOF as i32;

/// Fills `buf` from `offset`, or fails with `UnexpectedEof` when the file ends first.
pub fn read_exact_at(f: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match read_at(f, buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file ends before offset {}", offset + buf.len() as u64),
                ))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(data: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(data).unwrap();
        f.flush().unwrap();
        f
    }

    #[test]
    fn reads_at_offsets_without_a_shared_cursor() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let f = file_of(&data);
        let h = File::open(f.path()).unwrap();
        let mut a = [0u8; 100];
        let mut b = [0u8; 100];
        read_exact_at(&h, &mut a, 5000).unwrap();
        read_exact_at(&h, &mut b, 17).unwrap();
        assert_eq!(&a[..], &data[5000..5100]);
        assert_eq!(&b[..], &data[17..117]);
    }

    #[test]
    fn end_of_file_is_zero_bytes_and_exact_reads_past_it_fail() {
        let f = file_of(&[7u8; 64]);
        let h = File::open(f.path()).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(read_at(&h, &mut buf, 64).unwrap(), 0);
        assert_eq!(read_at(&h, &mut buf, 1000).unwrap(), 0);
        assert_eq!(read_at(&h, &mut buf, 60).unwrap(), 4);
        let e = read_exact_at(&h, &mut buf, 56).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("before offset 72"), "{e}");
    }
}
