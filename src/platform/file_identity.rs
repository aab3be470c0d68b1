//! A file's identity and change time read from its open handle on Windows, where `Metadata`
//! has neither on stable Rust: the volume serial number and file index say which file a
//! handle or path is (another file renamed over the path has another index), and the
//! change time (`FILE_BASIC_INFO::ChangeTime`) moves on every write and metadata change, as
//! Unix's `ctime` does, so a rewrite that restores the modification time is still seen.

/// Which file a handle is: its volume serial number and 64-bit file index.
pub(crate) type FileId = (u64, u64);

/// A change time, as `(ticks, 0)` in 100-nanosecond ticks on Windows.
pub(crate) type ChangeTime = (i64, i64);

/// The identity of `f` and its change time; `None` for a figure the file system does not
/// report.
pub(crate) fn of_handle(f: &std::fs::File) -> (Option<FileId>, Option<ChangeTime>) {
    use std::os::windows::io::AsRawHandle;
    use windows_sys::Win32::Storage::FileSystem::{
        FileBasicInfo, GetFileInformationByHandle, GetFileInformationByHandleEx,
        BY_HANDLE_FILE_INFORMATION, FILE_BASIC_INFO,
    };
    let handle = f.as_raw_handle();
    // SAFETY: `handle` is the open handle `f` owns for the whole call, and `info` is a
    // writable BY_HANDLE_FILE_INFORMATION the call fills.
    let id = unsafe {
        let mut info: BY_HANDLE_FILE_INFORMATION = std::mem::zeroed();
        (GetFileInformationByHandle(handle, &mut info) != 0).then(|| {
            (
                u64::from(info.dwVolumeSerialNumber),
                (u64::from(info.nFileIndexHigh) << 32) | u64::from(info.nFileIndexLow),
            )
        })
    };
    // SAFETY: as above; `basic` is a writable FILE_BASIC_INFO and the size passed is its own.
    let changed = unsafe {
        let mut basic: FILE_BASIC_INFO = std::mem::zeroed();
        (GetFileInformationByHandleEx(
            handle,
            FileBasicInfo,
            (&mut basic as *mut FILE_BASIC_INFO).cast(),
            std::mem::size_of::<FILE_BASIC_INFO>() as u32,
        ) != 0)
            .then_some((basic.ChangeTime, 0))
    };
    (id, changed)
}
