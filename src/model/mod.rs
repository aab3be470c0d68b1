//! The Kimi K3 model: the layer schedule and its blocks, written against the op interface.

mod batch;
pub(crate) mod context;
pub(crate) mod dense_footprint;
pub(crate) mod format_policy;
pub(crate) mod glu_mlp;
pub(crate) mod host_state;
pub(crate) mod k3;
pub(crate) mod kda;
pub mod loader;
pub(crate) mod mla;
pub(crate) mod moe;
mod pass_observer;
mod pieces;
pub(crate) mod prefill_progress;
pub(crate) mod prefill_window;
pub mod prompt_cache;
mod runner;
pub(crate) mod runtime;
pub mod state_size;
pub(crate) mod state_snapshot;
pub mod trace;
pub mod weight_cache;

pub use format_policy::FormatPolicy;
pub use k3::{K3Model, Logits, Segment, State};
pub use runner::Runner;
pub use runtime::{Runtime, RuntimeSettings};
pub use state_snapshot::StateSnapshot;
