//! The per-user directory k3 keeps rebuildable files in (the quantized-weight cache), in
//! each OS's own place: `$XDG_CACHE_HOME/k3` or `~/.cache/k3` on Linux and other unix
//! systems, `~/Library/Caches/k3` on macOS, `%LOCALAPPDATA%\k3` on Windows.

use std::path::PathBuf;

/// k3's directory under the user's cache directory; `None` when the environment names no
/// home (the caller then has nowhere but the snapshot directory).
pub fn user_cache_dir() -> Option<PathBuf> {
    base().map(|b| b.join("k3"))
}

/// An environment variable holding an absolute path (a relative one would depend on the
/// working directory, so it is ignored as the XDG specification asks).
fn absolute_var(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

#[cfg(target_os = "macos")]
fn base() -> Option<PathBuf> {
    absolute_var("HOME").map(|h| h.join("Library").join("Caches"))
}

#[cfg(windows)]
fn base() -> Option<PathBuf> {
    absolute_var("LOCALAPPDATA")
}

#[cfg(not(any(target_os = "macos", windows)))]
fn base() -> Option<PathBuf> {
    absolute_var("XDG_CACHE_HOME").or_else(|| absolute_var("HOME").map(|h| h.join(".cache")))
}
