//! Giving a read-only file mapping's pages back to the OS once the bytes were copied out,
//! where the OS lets a process do that (unix `madvise(MADV_DONTNEED)`). Windows has no such
//! call for file views: there the pages stay in the working set until the view is unmapped,
//! which the checkpoint does when it drops the map.

/// Drops `map`'s resident pages; they are re-read from the file if touched again.
#[cfg(unix)]
pub fn release_pages(map: &memmap2::Mmap) {
    // SAFETY: the map is a read-only file mapping; DONTNEED only discards clean pages, which
    // the kernel re-reads from the file if they are touched again. A hint that fails changes
    // nothing, so its result is ignored.
    let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
}

/// Drops `map`'s resident pages where the OS allows it; on Windows it does nothing.
#[cfg(not(unix))]
pub fn release_pages(map: &memmap2::Mmap) {
    let _ = map;
}
