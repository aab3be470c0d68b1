//! What differs between Linux, macOS and Windows, one module per concern, each with the same
//! interface on every OS: the rest of the engine never names an OS.

pub mod aligned_buf;
pub mod available_memory;
pub mod cache_dir;
#[cfg(windows)]
pub(crate) mod file_identity;
pub mod file_size_signal;
pub mod input_file;
pub mod memory_pressure;
pub mod positional_read;
pub(crate) mod thread_priority;
pub mod uncached_read;
