//! How a [`GpuContext`](super::GpuContext) is made: the options, their defaults, and the
//! runtime checks the matvec modules keep.

use super::matvec_shape::MatvecShape;
use super::MAX_PENDING_PASSES;
use crate::backend::gpu::kernels::chunk_gemm::ChunkGemm;
use crate::backend::gpu::kernels::stationary::Stationary;
#[cfg(feature = "lab")]
use std::path::PathBuf;

/// Default for [`GpuOptions::submit_every`]: submit at readbacks (and every
/// `MAX_PENDING_PASSES`). Submitting every few passes, so the GPU starts while the host
/// records, measured within the runs' noise of this (docs/perf.md#decode-resident).
pub const SUBMIT_EVERY: usize = MAX_PENDING_PASSES;

/// How a `GpuContext` is made.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Substring of the adapter name to use (`--adapter`).
    pub adapter: Option<String>,
    /// Without `adapter`: take the n-th of the host's best GPUs (modulo their count) rather
    /// than the first, so each MPI rank on a host takes its own (its local rank).
    pub gpu_index: Option<usize>,
    /// The limits profile to open the device under (`--gpu-limits`); `None` = the one
    /// `K3_GPU_LIMITS` names, native when it is unset.
    pub limits: Option<super::LimitsProfile>,
    /// Accept CPU-type adapters such as lavapipe (explicit `--backend gpu`, tests).
    pub allow_cpu_adapter: bool,
    /// Use the workgroup-memory reductions even when subgroups exist (tests both paths).
    pub no_subgroups: bool,
    /// Cap on the bytes of one binding, below the adapter's limit (tests the row split).
    pub max_binding: Option<u64>,
    /// Cap on the rows of one activation part, below what the bindings allow once a model
    /// sets its widest row (tests cut windows into parts without shrinking the bindings).
    pub part_rows: Option<usize>,
    /// Matvec geometry of the dense formats; `None` = the default (benchmarks compare
    /// variants).
    pub matvec: Option<MatvecShape>,
    /// Geometry of the batched MXFP4 expert kernel for dispatches of 32768 output rows or
    /// more over all their (expert, token) pairs (smaller ones take `matvec`); `None` =
    /// [`MatvecShape::experts`].
    pub expert_matvec: Option<MatvecShape>,
    /// The same for the MoE's down projection (w2), whose rows are the model's width and
    /// whose x is the GLU's output; `None` = [`MatvecShape::expert_down`].
    pub expert_down_matvec: Option<MatvecShape>,
    /// When matmuls over chunks of tokens take the tiled kernels; `None` = the default.
    pub chunk_gemm: Option<ChunkGemm>,
    /// When one-token matvecs take the column-stationary kernel; `None` = the default.
    pub stationary: Option<Stationary>,
    /// Time every compute pass on the GPU and print the totals per kernel at the end
    /// (`--gpu-profile`); needs timestamp queries.
    pub profile: bool,
    /// Fill a reused activation buffer with NaN before handing it out, so a kernel that
    /// leaves part of its output unwritten shows up in the results (the tests set it).
    pub poison_reused: bool,
    /// Recorded passes after which the host submits them without waiting for a readback;
    /// `None` = [`SUBMIT_EVERY`]. The tests set it to run the early-submit path, which a
    /// full timestamp query set also takes.
    pub submit_every: Option<usize>,
    /// Whether experts are read straight into upload staging (`K3_LAB_READ_STAGING`).
    pub read_staging: ReadStaging,
    /// Whether the expert tier is the single expert pool of a unified-memory adapter
    /// (`K3_LAB_EXPERT_POOL`); `None` = on exactly where CPU and GPU share memory.
    pub expert_pool: Option<bool>,
    /// Whether experts that two to fifteen rows of a call share run through the few-token
    /// kernel (`moe_t4`, four rows a workgroup) rather than one matvec item a row
    /// (`K3_LAB_FEW_TOKEN_EXPERTS`; off: it measured no gain on the device box).
    pub few_token_experts: bool,
    /// Whether the int8 and int4 matmuls of two to eight rows (a decode step of several
    /// streams) run through the few-token kernel (`dense_few`, each weight unit decoded
    /// once for all rows) rather than one matvec a row (`K3_LAB_FEW_TOKEN_DENSE`); `None` =
    /// on.
    pub few_token_dense: Option<bool>,
    /// The few-token kernel's lanes a row and rows a lane for every format; `None` = each
    /// format's own (`few_tokens::few_token_shape_of`).
    pub few_token_shape: Option<(u32, u32)>,
    /// Whether int4 and int8 matmuls of two to eight rows run on the matrix units where the
    /// adapter has them (`matrix_units.rs`), at this many subgroups a workgroup
    /// (`K3_LAB_MATRIX_UNITS`); `None` = not.
    pub matrix_units: Option<u32>,
    /// Compose every kernel from this directory's WGSL files instead of the text built in
    /// (shader work: a variant is measured without a rebuild; lab builds only).
    #[cfg(feature = "lab")]
    pub wgsl_dir: Option<PathBuf>,
    /// The runtime checks wgpu builds the matvec modules with; `None` =
    /// `default_matvec_checks()`, or none where the geometry is `unchecked`. The lab sets
    /// them to see which check costs what, and the tests to show each is redundant.
    #[cfg(feature = "lab")]
    pub matvec_checks: Option<wgpu::ShaderRuntimeChecks>,
}

/// The runtime checks the matvec modules keep by default: wgpu's index clamps (and its
/// buffer checks where the driver has no robust buffer access), which keep a wrong index
/// inside the buffer. The loop counters and the integer-division guards go: every matvec
/// loop steps by a positive override towards a bound the host derives from the matrix
/// shapes, and every divisor is an override of 1 or more or a row stride of a matrix with
/// columns. Without them the expert and head matvecs read faster (docs/perf.md#kernels).
pub fn default_matvec_checks() -> wgpu::ShaderRuntimeChecks {
    wgpu::ShaderRuntimeChecks {
        bounds_checks: true,
        force_loop_bounding: false,
        int_div_checks: false,
        ..wgpu::ShaderRuntimeChecks::checked()
    }
}

/// When experts are read straight into mapped upload buffers (see `read_staging.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReadStaging {
    /// On a discrete GPU whose upload staging is host memory (`k3 devices`: no resizable
    /// BAR), and in the unified expert pool ([`GpuOptions::expert_pool`]), where a read
    /// lands in GPU-visible memory and one device copy moves it into its slot. Where staging
    /// is VRAM the read buffer's one copy is already the transfer.
    #[default]
    Auto,
    /// Always (measurements; a read that fails into it falls back to host memory).
    On,
    /// Never: read into host memory, then copy into staging.
    Off,
}
