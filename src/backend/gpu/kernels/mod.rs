//! The op kernels on the device, one module per op family, each dispatching its WGSL
//! kernels and listing the pipelines it creates (`pipeline_variants`): dense matmuls
//! (`matmul.rs`, over the device matrices of `device_matrix.rs`, with the chunk GEMM and
//! column-stationary policies, the row-split kernel's geometry and overrides in
//! `row_split.rs`, the few-token matvec in `few_tokens.rs`, the few-row matmuls on the matrix
//! units in `matrix_units.rs`, and the matvec family's pipeline list in
//! `matvec_variants.rs`), elementwise ops and the GLU, the norms, KDA, MLA, the router and the
//! state copies.

pub mod chunk_gemm;
pub mod device_matrix;
pub(crate) mod elementwise;
pub(crate) mod few_tokens;
pub(crate) mod kda;
pub(crate) mod matmul;
pub mod matrix_units;
pub(crate) mod matvec_variants;
pub(crate) mod mla;
pub(crate) mod norm;
pub(crate) mod router;
pub(crate) mod row_split;
pub(crate) mod state_copy;
pub mod stationary;
