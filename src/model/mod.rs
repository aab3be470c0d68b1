//! The Kimi K3 model: the layer schedule and its blocks, written against the op interface.

mod batch;
pub mod context;
pub mod dense_footprint;
pub mod format_policy;
pub mod glu_mlp;
pub mod host_state;
pub mod k3;
pub mod kda;
pub mod loader;
pub mod mla;
pub mod moe;
mod pass_observer;
mod pieces;
pub mod prefill_progress;
pub mod prefill_window;
pub mod prompt_cache;
mod runner;
pub mod runtime;
pub mod state_size;
pub mod state_snapshot;
pub mod trace;
pub mod weight_cache;

pub use format_policy::FormatPolicy;
pub use k3::{K3Model, Logits, Segment, State};
pub use runner::Runner;
pub use runtime::{Runtime, RuntimeSettings};
pub use state_snapshot::StateSnapshot;
