//! Routed experts: where their native MXFP4 bytes come from and how they are kept.

pub mod cache_policy;
#[cfg(feature = "lab")]
pub mod cache_policy_sim;
#[cfg(feature = "lab")]
pub mod cache_policy_synth;
pub mod disk_meter;
pub mod expert_cache;
pub mod expert_plan;
pub mod expert_reader;
pub mod expert_selection;
pub mod loader_pool;
pub mod piece_read;
pub mod prefetch;
pub mod prefetch_gate;
pub mod pressure_guard;
pub mod ram_budget;
pub mod remote;
pub mod route_trace;
pub mod shard_io;
pub mod source;
pub mod usage_history;

pub use expert_reader::ExpertReader;
pub use shard_io::{FaultPlan, IoMode, ReadFault};
pub use source::{ExpertSource, StreamConfig, Supplied};
