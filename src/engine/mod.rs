//! The engine assembled from its parts: [`EngineBuilder`] turns an [`EngineConfig`] into a
//! loaded, sized and configured model ([`Engine`]); [`memory_plan`] says what a machine's
//! memory allows for the model's dense weights, state, context and experts.

pub(crate) mod builder;
mod cache_setup;
pub mod config;
pub mod memory_plan;
pub(crate) mod plan;
mod prompt_cache_setup;
pub mod streaming;
pub mod tiers;

pub use builder::{AnyModel, Engine, EngineBuilder, ModelJob};
pub use config::EngineConfig;
pub use plan::Plan;
