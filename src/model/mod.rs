//! The Kimi K3 model: the layer schedule and its blocks, written against the op interface.

pub mod batch;
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
pub mod prefill_progress;
pub mod prefill_window;
pub mod prompt_cache;
pub mod state_size;
pub mod state_snapshot;
pub mod trace;
pub mod weight_cache;

pub use batch::Segment;
pub use format_policy::FormatPolicy;
pub use k3::{K3Model, Logits, State};
pub use state_snapshot::StateSnapshot;
