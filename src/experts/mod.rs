//! Routed experts: where their native MXFP4 bytes come from and how they are kept.
//!
//! [`ExpertSource`] (`source.rs`) streams a layer's experts to the model, each handed over
//! as a [`Supplied`] (`supplied.rs`), built on four rooms: `plan/` (which experts a layer
//! runs and which to guess for the next), `cache/` (the host cache, its eviction policy, its
//! RAM budget and the memory-pressure guard), `io/` (the reads: shard I/O, the expert
//! reader, the loader pool) and `telemetry/` (the route trace and the disk meter). The
//! cache-policy simulators are research code under `lab/`, built only with the `lab`
//! feature.

pub mod cache;
pub mod io;
#[cfg(feature = "lab")]
pub mod lab;
pub mod plan;
pub(crate) mod remote;
pub(crate) mod source;
pub(crate) mod supplied;
pub mod telemetry;

pub use io::expert_reader::ExpertReader;
pub use io::shard_io::{FaultPlan, IoMode, ReadFault};
pub use source::{ExpertSource, StreamConfig};
pub use supplied::Supplied;
