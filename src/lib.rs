//! k3: a Kimi K3 inference engine that streams routed experts from disk and runs every
//! kernel through one op interface (CPU oracle, WGSL on wgpu).

pub mod atomic_file;
pub mod backend;
pub mod canonical_json;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod experts;
pub mod generate;
pub mod grammar;
pub mod model;
pub mod platform;
pub mod quant;
pub mod routed_expert;
pub mod sampling;
pub mod serve;
pub mod session;
pub mod stats;
pub mod synth;
pub mod token_picker;
pub mod tokenizer;
pub mod unique_json;
