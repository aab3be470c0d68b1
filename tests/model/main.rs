//! Whole models on the CPU: the forward pass, llama.cpp conformance fixtures, context
//! sizing, prefetch, expert selection, memory pressure, session snapshots, route traces.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test model NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod batch;
mod conformance;
mod context;
mod expert_selection;
mod memory_pressure;
mod model_cpu;
mod prefetch;
mod serve_snapshots;
// Lab code only (Cargo.toml's `lab` feature).
#[cfg(feature = "lab")]
mod route_trace;
