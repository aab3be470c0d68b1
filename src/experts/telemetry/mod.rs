//! What the expert path records: the route trace and routing tap (`route_trace.rs`) and
//! the disk's busy time (`disk_meter.rs`).

pub(crate) mod disk_meter;
pub mod route_trace;
