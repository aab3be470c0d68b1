//! The CPU ops and kernels: each op against its reference, the SIMD levels, quantized
//! formats, the int8 dot products, sampling, state sizes.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test ops NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod cpu_ops;
mod idot;
mod quant;
mod sampling;
mod simd_kernels;
mod small_ops_inline;
mod state_size;
