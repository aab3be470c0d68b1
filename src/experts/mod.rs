//! Routed experts: where their native MXFP4 bytes come from.

pub mod direct_reader;

pub use direct_reader::{DirectReader, LoadedExpert};
