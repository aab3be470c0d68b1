//! k3: a Kimi K3 inference engine that streams routed experts from disk and runs every
//! kernel through one op interface (CPU oracle, WGSL on wgpu).

pub mod backend;
pub mod quant;
pub mod sampling;
pub mod tokenizer;
