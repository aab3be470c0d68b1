//! How much memory the OS can still give, the machine's RAM, this process's resident set,
//! and the physical core count: the inputs of the RAM clamp and of the default thread count.
//!
//! "Available" is what the OS could hand out without swapping: Linux `MemAvailable`; macOS
//! free + inactive + purgeable pages (`host_statistics64`); Windows `ullAvailPhys`
//! (`GlobalMemoryStatusEx`).

use anyhow::Result;

/// Bytes the OS can still give this process without swapping.
#[cfg(target_os = "linux")]
pub fn available_bytes() -> Result<u64> {
    use anyhow::Context;
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    parse_meminfo_available(&text)
        .context("/proc/meminfo has no MemAvailable line: set RAM_GB (or --ram-gb)")
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Bytes the OS can still give this process without swapping.
#[cfg(target_os = "macos")]
pub fn available_bytes() -> Result<u64> {
    // SAFETY: vm_statistics64 is plain integers, so all-zero is a valid value.
    let mut vm: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: host_statistics64 writes at most `count` integers into `vm`, which holds
    // HOST_VM_INFO64_COUNT of them; mach_host_self only returns this task's host port.
    #[allow(deprecated)] // libc points to the mach2 crate for these; the ABI is stable.
    let rc = unsafe {
        libc::host_statistics64(
            libc::mach_host_self(),
            libc::HOST_VM_INFO64,
            (&mut vm as *mut libc::vm_statistics64).cast(),
            &mut count,
        )
    };
    if rc != libc::KERN_SUCCESS {
        anyhow::bail!("host_statistics64 failed (kern_return {rc}): set RAM_GB (or --ram-gb)");
    }
    // SAFETY: sysconf only reads its argument.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).unwrap_or(16384);
    let pages =
        u64::from(vm.free_count) + u64::from(vm.inactive_count) + u64::from(vm.purgeable_count);
    Ok(pages.saturating_mul(page))
}

/// Bytes the OS can still give this process without swapping.
#[cfg(windows)]
pub fn available_bytes() -> Result<u64> {
    use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
    // SAFETY: MEMORYSTATUSEX is plain integers, so all-zero is a valid value.
    let mut status: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
    status.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
    // SAFETY: the struct lives across the call and carries its own size, as the call requires.
    if unsafe { GlobalMemoryStatusEx(&mut status) } == 0 {
        anyhow::bail!(
            "GlobalMemoryStatusEx failed ({}): set RAM_GB (or --ram-gb)",
            std::io::Error::last_os_error()
        );
    }
    Ok(status.ullAvailPhys)
}

/// Bytes the OS can still give this process without swapping.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
pub fn available_bytes() -> Result<u64> {
    anyhow::bail!("cannot measure available memory on this OS: set RAM_GB (or --ram-gb)")
}

/// Physical RAM of the machine in bytes, or `None` where the OS does not say.
#[cfg(target_os = "linux")]
pub fn total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Physical RAM of the machine in bytes, or `None` where the OS does not say.
#[cfg(target_os = "macos")]
pub fn total_bytes() -> Option<u64> {
    let mut bytes: u64 = 0;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: the name is a NUL-terminated C string; sysctlbyname writes at most `len`
    // bytes into `bytes`, which is that large, and sets `len` to what it wrote.
    let rc = unsafe {
        libc::sysctlbyname(
            c"hw.memsize".as_ptr(),
            (&mut bytes as *mut u64).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0 && len == std::mem::size_of::<u64>()).then_some(bytes)
}

/// Physical RAM of the machine in bytes, or `None` where the OS does not say.
#[cfg(windows)]
pub fn total_bytes() -> Option<u64> {
    use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
    // SAFETY: MEMORYSTATUSEX is plain integers, so all-zero is a valid value.
    let mut status: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
    status.dwLength = std::mem::size_of::<MEMORYSTATUSEX>() as u32;
    // SAFETY: the struct lives across the call and carries its own size, as the call requires.
    (unsafe { GlobalMemoryStatusEx(&mut status) } != 0).then_some(status.ullTotalPhys)
}

/// Physical RAM of the machine in bytes, or `None` where the OS does not say.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
pub fn total_bytes() -> Option<u64> {
    None
}

/// Resident set of this process in bytes, or `None` where the OS does not say.
#[cfg(target_os = "linux")]
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads its argument.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    pages.checked_mul(page)
}

/// Resident set of this process in bytes, or `None` where the OS does not say.
#[cfg(target_os = "macos")]
pub fn resident_bytes() -> Option<u64> {
    // SAFETY: proc_taskinfo is plain integers, so all-zero is a valid value.
    let mut info: libc::proc_taskinfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::proc_taskinfo>() as libc::c_int;
    // SAFETY: proc_pidinfo writes at most `size` bytes into `info`, which is that large.
    let got = unsafe {
        libc::proc_pidinfo(
            libc::getpid(),
            libc::PROC_PIDTASKINFO,
            0,
            (&mut info as *mut libc::proc_taskinfo).cast(),
            size,
        )
    };
    (got == size).then_some(info.pti_resident_size)
}

/// Resident set of this process in bytes, or `None` where the OS does not say.
#[cfg(windows)]
pub fn resident_bytes() -> Option<u64> {
    use windows_sys::Win32::System::ProcessStatus::{
        GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS,
    };
    use windows_sys::Win32::System::Threading::GetCurrentProcess;
    // SAFETY: PROCESS_MEMORY_COUNTERS is plain integers, so all-zero is a valid value.
    let mut pmc: PROCESS_MEMORY_COUNTERS = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<PROCESS_MEMORY_COUNTERS>() as u32;
    // SAFETY: the pseudo-handle of this process needs no closing; the call writes at most
    // `size` bytes into `pmc`, which is that large.
    let ok = unsafe { GetProcessMemoryInfo(GetCurrentProcess(), &mut pmc, size) };
    (ok != 0).then_some(pmc.WorkingSetSize as u64)
}

/// Resident set of this process in bytes, or `None` where the OS does not say.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
pub fn resident_bytes() -> Option<u64> {
    None
}

/// Physical cores (hyper-threads only add contention to memory-bound kernels).
pub fn physical_cores() -> usize {
    num_cpus::get_physical().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_available_is_read_in_bytes() {
        let m = "MemTotal:       32000000 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(parse_meminfo_available(m), Some(16_384_000_000));
        assert_eq!(parse_meminfo_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_meminfo_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn this_machine_reports_its_memory_and_cores() {
        let avail = available_bytes().unwrap();
        assert!(avail > 1 << 20, "available {avail}");
        let rss = resident_bytes().unwrap();
        // A test binary holds at least a megabyte and far less than what the machine has.
        assert!(rss > 1 << 20 && rss < 1 << 40, "resident {rss}");
        assert!(physical_cores() >= 1);
        let total = total_bytes().unwrap();
        assert!(total >= avail && total > rss, "total {total}");
    }
}
