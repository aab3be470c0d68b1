//! The device plumbing the kernels run on: adapter choice, the context (device, queue,
//! limits, pipelines, recording), buffers and their reuse, the kernels' WGSL modules and
//! pipeline descriptions, upload paths and the staging lent to reads, device errors and the
//! profiler.

pub mod adapters;
pub(crate) mod buffer_pool;
pub(crate) mod buffers;
pub mod context;
pub(crate) mod device_errors;
#[cfg(feature = "lab")]
pub mod lab_switches;
pub(crate) mod param_arena;
pub mod pipeline;
pub(crate) mod profiler;
pub(crate) mod read_staging;
pub mod shaders;
pub mod upload_path;
