//! The GPU backend: each op and whole models against the CPU, activations in row parts,
//! the few-row matmuls on the matrix units, the expert tiers and the unified pool, injected GPU faults, every pipeline against
//! Apple's limits and translated to MSL, HLSL and SPIR-V. `.ci/run` runs this binary again under
//! `K3_GPU_LIMITS=apple-m1`.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test gpu NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod batch_gpu;
mod expert_tiers;
mod fault_gpu;
mod gpu_model;
mod gpu_ops;
mod matrix_units;
mod pipeline_limits;
mod row_parts;
mod shader_translation;
mod unified_pool;
