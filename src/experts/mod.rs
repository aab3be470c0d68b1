//! Routed experts: where their native MXFP4 bytes come from.

pub mod direct_reader;
pub mod source;

pub use direct_reader::{DirectReader, LoadedExpert};
pub use source::ExpertSource;
