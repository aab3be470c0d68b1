//! The wgpu context: device and queue on the chosen adapter with the adapter's own limits,
//! the pipeline cache, and the pending command encoder every op records into. The encoder
//! is submitted only when the host must read something (a download, the router's
//! choices) or before a queue write into a reused buffer.

use super::adapters;
use super::chunk_gemm::{ChunkGemm, GemmTile};
use super::device_errors::DeviceErrors;
use super::param_arena::{ParamArena, SLOT_BYTES};
use super::pipeline_variants::{pipeline_kinds, AdapterShape, PipelineKind, PipelineVariant};
use super::profiler::Profiler;
use super::shaders::Shader;
use super::stationary::{CsPlan, Stationary};
use anyhow::{anyhow, bail, Context as _, Result};
use rayon::prelude::*;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{mpsc, Mutex};
use wgpu::util::DeviceExt;

/// Largest workgroup any kernel uses; the reduction scratch arrays are sized for it.
pub const MAX_WG: u32 = 256;

/// u32 words of every uniform parameter block (the largest kernel struct has 12).
const PARAM_WORDS: usize = 16;

/// Recorded passes after which the pending encoder is submitted anyway, bounding the
/// memory a long chain of ops (a big prefill with no readback) keeps alive.
const MAX_PENDING_PASSES: usize = 4096;

/// The size [`GpuContext::buffer`] gives a buffer asked for `bytes`: whole 16-byte units,
/// at least one.
pub fn storage_size(bytes: u64) -> u64 {
    bytes.max(16).div_ceil(16) * 16
}

/// Default for [`GpuOptions::submit_every`]: submit at readbacks (and every
/// `MAX_PENDING_PASSES`). Submitting every few passes, so the GPU starts while the host
/// records, measured within the runs' noise of this (docs/perf.md#decode-resident).
pub const SUBMIT_EVERY: usize = MAX_PENDING_PASSES;

/// How a [`GpuContext`] is made.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Substring of the adapter name to use (`--adapter`).
    pub adapter: Option<String>,
    /// Accept CPU-type adapters such as lavapipe (explicit `--backend gpu`, tests).
    pub allow_cpu_adapter: bool,
    /// Use the workgroup-memory reductions even when subgroups exist (tests both paths).
    pub no_subgroups: bool,
    /// Cap on the bytes of one binding, below the adapter's limit (tests the row split).
    pub max_binding: Option<u64>,
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
    /// Give every activation a new buffer instead of reusing those of dropped activations
    /// (benchmarks compare; reuse spares wgpu's zero-fill of each new buffer).
    pub no_buffer_reuse: bool,
    /// Give every dispatch a uniform buffer of its own for its parameters, instead of a
    /// slot in the reused ones (`param_arena.rs`; benchmarks compare the host time).
    pub fresh_params: bool,
    /// Fill a reused activation buffer with NaN before handing it out, so a kernel that
    /// leaves part of its output unwritten shows up in the results (the tests set it).
    pub poison_reused: bool,
    /// Recorded passes after which the host submits them without waiting for a readback
    /// (`K3_LAB_SUBMIT_EVERY`), so the GPU starts on them while the host records the rest;
    /// `None` = [`SUBMIT_EVERY`].
    pub submit_every: Option<usize>,
    /// Whether experts are read straight into upload staging (`K3_LAB_READ_STAGING`).
    pub read_staging: ReadStaging,
    /// Compose every kernel from this directory's WGSL files instead of the text built in
    /// (shader work: a variant is measured without a rebuild; the benchmarks' `wgsl=DIR`).
    pub wgsl_dir: Option<PathBuf>,
    /// The runtime checks wgpu builds the matvec modules with; `None` =
    /// `default_matvec_checks()`, or none where the geometry is `unchecked`. Benchmarks
    /// set them (`nochecks=`) to see which costs what.
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
    /// BAR). Where it is VRAM the read buffer's one copy is already the transfer; where CPU
    /// and GPU share memory reads into lent buffers took longer (docs/perf.md#decode-from-disk).
    #[default]
    Auto,
    /// Always (measurements; a read that fails into it falls back to host memory).
    On,
    /// Never: read into host memory, then copy into staging.
    Off,
}

/// How the one-token int4 matvecs meet x.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Decode {
    /// Every weight decoded to f32 by bit placement (no conversion instructions) and
    /// multiplied with x as it is.
    Float,
    /// x split into exact integer digits by an `x_planes` pass and met by byte dot products
    /// (x rounded to 2^-22 of each 32-column unit's largest value).
    Digits,
}

/// How a matvec workgroup is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatvecShape {
    /// Lanes that share one output row (a power of two ≤ 32; a row over two 32-lane blocks
    /// measured slower: docs/perf.md#kernels).
    pub lanes_per_row: u32,
    /// Of a row's lanes, how many sit side by side in one 32-lane block (the `LW` override; a
    /// power of two, 4..=lanes_per_row); fewer means a block's x loads touch fewer lines and
    /// the row's partial sums meet in workgroup memory. Capped to fit the workgroup.
    pub lanes_per_block: u32,
    /// Rows each lane group computes together, sharing its loads of x (1..=8).
    pub rows_per_lane: u32,
    /// How one-token int4 matvecs meet x (the `DIGITS` override of `matvec_int4.wgsl`;
    /// other formats ignore it). `None`: the digits in the row-split kernel where the int4
    /// matrices of one input have [`DIGITS_FROM_ROWS`](super::DIGITS_FROM_ROWS) rows or
    /// more together, the float decode elsewhere; `Some(d)`: `d` in every one-token int4
    /// matvec.
    pub int4_decode: Option<Int4Decode>,
    /// Load the next unit's weights before computing this one (the `PIPE` override; two
    /// units ahead measured no faster: docs/perf.md#kernels).
    pub pipelined: bool,
    /// Build the matvec shaders without wgpu's injected bounds checks and loop bounding
    /// (the driver's robust buffer access still applies); benchmarks measure what it buys.
    pub unchecked: bool,
    /// The most 32-column units of x the row-split kernel of the 32-column formats (int4
    /// outside the digit decode, MXFP4) stages in workgroup memory at a time, padded against
    /// bank conflicts: the `XT` override, sized by [`x_tile_units`]. 0 reads x from global
    /// memory; the default, `u32::MAX`, stages as much as the workgroup memory holds.
    pub stage_x: u32,
    /// Rows a lane in the row-split kernel of the int4 digit decode, in place of
    /// `rows_per_lane`: two read faster there, where int8 and MXFP4 are slower at two
    /// (docs/perf.md#kernels).
    pub digit_rows_per_lane: u32,
}

impl Default for MatvecShape {
    fn default() -> Self {
        Self {
            lanes_per_row: 32,
            lanes_per_block: 32,
            rows_per_lane: 4,
            int4_decode: None,
            pipelined: true,
            unchecked: false,
            stage_x: u32::MAX,
            digit_rows_per_lane: 2,
        }
    }
}

impl MatvecShape {
    /// The expert kernel's default: its rows are short (3072 or 3584 columns), so fewer lanes
    /// per row give each lane a longer run, and rows split over blocks share their x lines
    /// (docs/perf.md#kernels).
    pub fn experts() -> Self {
        Self {
            lanes_per_row: 8,
            lanes_per_block: 4,
            ..Self::default()
        }
    }

    /// The expert kernel's default in the MoE's down projection: two rows a lane instead of
    /// four, at least as fast there (docs/perf.md#kernels).
    pub fn expert_down() -> Self {
        Self {
            rows_per_lane: 2,
            ..Self::experts()
        }
    }

    /// Checks the shape and fits its split to a workgroup of `wg` lanes.
    fn fitted(mut self, wg: u32) -> Result<Self> {
        if !self.lanes_per_row.is_power_of_two()
            || self.lanes_per_row > 32
            || !self.lanes_per_block.is_power_of_two()
            || self.lanes_per_block < 4
            || !(1..=8).contains(&self.rows_per_lane)
            || !(1..=8).contains(&self.digit_rows_per_lane)
        {
            bail!("matvec shape {self:?}: lanes per row must be a power of two ≤ 32, lanes per block a power of two ≥ 4, rows per lane (and digit rows per lane) 1..=8");
        }
        self.lanes_per_block = split_lanes(self.lanes_per_row, self.lanes_per_block, wg);
        Ok(self)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PipeKey {
    shader: Shader,
    entry: &'static str,
    consts: Vec<(&'static str, u32)>,
}

/// One dispatch: pipeline entry, overrides, the uniform parameters and the storage buffers.
pub struct Dispatch<'a> {
    /// Module family.
    pub shader: Shader,
    /// Entry point.
    pub entry: &'static str,
    /// Pipeline-overridable constants (`WG` defaults to the context's workgroup size).
    pub consts: &'a [(&'static str, u32)],
    /// Uniform block at binding 0 (u32 words; f32 as bits), zero-padded here.
    pub params: &'a [u32],
    /// Storage buffers at bindings 1, 2, ...
    pub buffers: &'a [&'a wgpu::Buffer],
    /// Workgroup counts.
    pub groups: (u32, u32, u32),
}

/// Device, queue, limits, pipelines and the pending encoder.
pub struct GpuContext {
    /// The adapter the device was opened on (native queries such as free VRAM go through it).
    pub adapter: wgpu::Adapter,
    /// The logical device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// Adapter identity.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with (the adapter's own).
    pub limits: wgpu::Limits,
    /// Features enabled on the device.
    pub features: wgpu::Features,
    /// Whether kernels use subgroup reductions.
    pub subgroups: bool,
    /// Workgroup size of every kernel: the largest power of two ≤ 256 the adapter allows.
    pub wg: u32,
    /// Bytes one storage binding may span.
    pub max_binding: u64,
    /// Matvec geometry of the dense formats.
    pub matvec: MatvecShape,
    /// The batched MXFP4 expert kernel's geometry.
    pub expert_matvec: MatvecShape,
    /// Its geometry in the MoE's down projection.
    pub expert_down_matvec: MatvecShape,
    /// When chunks of tokens take the tiled matmul kernels.
    pub chunk_gemm: ChunkGemm,
    /// When one-token matvecs take the column-stationary kernel.
    pub stationary: Stationary,
    /// Per-kernel GPU times, when profiling.
    profiler: Option<Mutex<Profiler>>,
    /// The first error the device reported (instead of wgpu's panic).
    errors: DeviceErrors,
    /// Passes recorded before the host submits them.
    submit_every: usize,
    modules: Mutex<HashMap<Shader, wgpu::ShaderModule>>,
    /// Every module's text read from `GpuOptions::wgsl_dir` at start, when it is set.
    wgsl_sources: Option<HashMap<Shader, String>>,
    /// `GpuOptions::matvec_checks`, or `default_matvec_checks()`.
    matvec_checks: wgpu::ShaderRuntimeChecks,
    pipelines: Mutex<HashMap<PipeKey, wgpu::ComputePipeline>>,
    /// The kinds of pipeline `pipeline_variants` lists for this adapter: the only ones
    /// `pipeline` creates.
    kinds: HashSet<PipelineKind>,
    /// Parameters in one uniform buffer per dispatch (`GpuOptions::fresh_params`).
    fresh_params: bool,
    pending: Mutex<Pending>,
}

/// What the host has recorded and not yet submitted.
struct Pending {
    /// The encoder and the passes in it.
    cmd: Option<(wgpu::CommandEncoder, usize)>,
    /// Its dispatches' parameters, written just before it is submitted.
    params: ParamArena,
}

impl Pending {
    /// The pending encoder and its pass count, created on demand.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut (wgpu::CommandEncoder, usize) {
        self.cmd.get_or_insert_with(|| {
            (
                device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("k3 ops"),
                }),
                0,
            )
        })
    }
}

impl GpuContext {
    /// Opens the adapter `opts` selects, with its own limits and the features we use.
    pub fn new(opts: &GpuOptions) -> Result<Self> {
        let inst = adapters::instance();
        let adapter = adapters::choose(
            adapters::enumerate(&inst),
            opts.adapter.as_deref(),
            opts.allow_cpu_adapter,
        )?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        if !adapter
            .get_downlevel_capabilities()
            .flags
            .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32)
        {
            bail!("{} ({:?}) lacks f16 packing in shaders (SHADER_F16_IN_F32), which the MXFP4 decode uses", info.name, info.backend);
        }
        let wanted = wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        let features = adapter.features() & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("k3"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .with_context(|| format!("opening a device on {} ({:?})", info.name, info.backend))?;
        let errors = DeviceErrors::install(&device);
        let wg = workgroup_size(&limits)?;
        if limits.max_storage_buffers_per_shader_stage < 5 {
            bail!(
                "{}: {} storage buffers per shader stage, the kernels need 5",
                info.name,
                limits.max_storage_buffers_per_shader_stage
            );
        }
        if limits.max_compute_workgroup_storage_size < 8192 {
            bail!(
                "{}: {} B of workgroup storage, the kernels need 8 KiB",
                info.name,
                limits.max_compute_workgroup_storage_size
            );
        }
        let max_binding = max_binding_bytes(info.backend, &limits, opts.max_binding);
        let subgroups = use_subgroups(features, opts.no_subgroups);
        let matvec = opts.matvec.unwrap_or_default().fitted(wg)?;
        let expert_matvec = opts
            .expert_matvec
            .unwrap_or_else(MatvecShape::experts)
            .fitted(wg)?;
        let expert_down_matvec = opts
            .expert_down_matvec
            .unwrap_or_else(MatvecShape::expert_down)
            .fitted(wg)?;
        let chunk_gemm = opts.chunk_gemm.unwrap_or_default().checked()?;
        let stationary = opts.stationary.unwrap_or_default().checked()?;
        if opts.profile && !features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            bail!(
                "--gpu-profile / K3_GPU_PROFILE: {} ({:?}) has no timestamp queries; run without it",
                info.name,
                info.backend
            );
        }
        let profiler = opts
            .profile
            .then(|| Mutex::new(Profiler::new(&device, &queue)));
        let uniform_align = limits.min_uniform_buffer_offset_alignment;
        // Read at start, so a missing or unreadable file is an error here that names it,
        // not a failure in the middle of a run.
        let wgsl_sources = match &opts.wgsl_dir {
            Some(dir) => Some(
                Shader::ALL
                    .into_iter()
                    .map(|sh| Ok((sh, sh.source_from(subgroups, dir)?)))
                    .collect::<Result<HashMap<_, _>>>()
                    .with_context(|| format!("composing the kernels from {}", dir.display()))?,
            ),
            None => None,
        };
        let kinds = pipeline_kinds(
            AdapterShape {
                wg,
                shared_bytes: limits.max_compute_workgroup_storage_size,
                subgroup_sizes: (info.subgroup_min_size, info.subgroup_max_size),
            },
            subgroups,
        );
        Ok(Self {
            adapter,
            device,
            queue,
            info,
            limits,
            features,
            subgroups,
            wg,
            max_binding,
            matvec,
            expert_matvec,
            expert_down_matvec,
            chunk_gemm,
            stationary,
            profiler,
            errors,
            submit_every: opts
                .submit_every
                .unwrap_or(SUBMIT_EVERY)
                .clamp(1, MAX_PENDING_PASSES),
            modules: Mutex::new(HashMap::new()),
            wgsl_sources,
            matvec_checks: opts.matvec_checks.unwrap_or_else(default_matvec_checks),
            pipelines: Mutex::new(HashMap::new()),
            kinds,
            fresh_params: opts.fresh_params,
            pending: Mutex::new(Pending {
                cmd: None,
                params: ParamArena::new(uniform_align),
            }),
        })
    }

    /// The column-stationary plan for a one-token matvec over rows of `units` units, `rows`
    /// rows per item and `items` items, or `None` where the row-split kernel runs.
    pub fn stationary_plan(&self, units: usize, rows: usize, items: usize) -> Option<CsPlan> {
        let sub = if self.subgroups {
            (self.info.subgroup_min_size, self.info.subgroup_max_size)
        } else {
            (1, 1)
        };
        self.stationary.plan(units, rows, items, self.wg, sub)
    }

    /// Whether timestamp queries can be written between passes of an encoder.
    pub fn has_timestamps(&self) -> bool {
        self.features.contains(
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS,
        )
    }

    /// The compiled pipeline for `shader`'s `entry` with these overrides (cached). A kind of
    /// pipeline that `pipeline_variants` does not list (and so no test translates for every
    /// backend) is still created, and the device reports it as an error at the next wait.
    pub fn pipeline(
        &self,
        shader: Shader,
        entry: &'static str,
        consts: &[(&'static str, u32)],
    ) -> wgpu::ComputePipeline {
        let key = PipeKey {
            shader,
            entry,
            consts: consts.to_vec(),
        };
        let mut pipes = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pipes.get(&key) {
            return p.clone();
        }
        let variant = PipelineVariant {
            shader,
            entry,
            consts: consts.to_vec(),
            subgroups: self.subgroups,
        };
        if !self.kinds.contains(&variant.kind()) {
            self.errors.report(format!(
                "pipeline {variant} is not among pipeline_variants() (src/backend/gpu/pipeline_variants.rs), so no test translates it for every backend"
            ));
        }
        let module = self.module(shader);
        let constants = variant.constants(self.wg);
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        pipes.insert(key, p.clone());
        p
    }

    /// The compiled module of `shader` (cached).
    fn module(&self, shader: Shader) -> wgpu::ShaderModule {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        modules
            .entry(shader)
            .or_insert_with(|| {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(shader.file()),
                    source: wgpu::ShaderSource::Wgsl(
                        self.wgsl_sources
                            .as_ref()
                            .and_then(|m| m.get(&shader).cloned())
                            .unwrap_or_else(|| shader.source(self.subgroups))
                            .into(),
                    ),
                };
                let unchecked = if shader == Shader::MatvecMxfp4 {
                    self.expert_matvec.unchecked
                } else {
                    self.matvec.unchecked
                };
                let checks = match unchecked {
                    true => wgpu::ShaderRuntimeChecks::unchecked(),
                    false => self.matvec_checks,
                };
                if shader.is_matvec() {
                    // SAFETY: the matvec kernels clamp every row index to the matrix and
                    // every unit index to the row (see matvec_common.wgsl; the host runs no
                    // matvec over zero columns), their loops step by a positive override
                    // towards uniform bounds the host derives from the matrix shapes (far
                    // below u32::MAX, so no counter wraps), their divisors are overrides of
                    // 1 or more, the subgroup size and row strides of matrices with columns,
                    // and the buffers are sized from the same shapes.
                    unsafe { self.device.create_shader_module_trusted(desc, checks) }
                } else {
                    self.device.create_shader_module(desc)
                }
            })
            .clone()
    }

    /// A new storage buffer of at least `bytes` (rounded up to 16, never empty).
    pub fn buffer(&self, bytes: u64, label: &str) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: storage_size(bytes),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A new storage buffer holding `data` (written at creation, so it needs no ordering
    /// against pending work).
    pub fn buffer_init(&self, data: &[u8], label: &str) -> wgpu::Buffer {
        let padded = data.len().max(16).div_ceil(16) * 16;
        if padded == data.len() {
            return self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: data,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST,
                });
        }
        let mut v = data.to_vec();
        v.resize(padded, 0);
        self.buffer_init(&v, label)
    }

    /// A new storage buffer filled from several host slices at the given byte offsets.
    pub fn buffer_from_parts(
        &self,
        bytes: u64,
        parts: &[(u64, &[u8])],
        label: &str,
    ) -> Result<wgpu::Buffer> {
        let size = bytes.max(16).div_ceil(16) * 16;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: true,
        });
        {
            let mut view = buf
                .get_mapped_range_mut(..)
                .map_err(|e| anyhow!("mapping {label}: {e:?}"))?;
            let mut end = 0;
            for &(off, data) in parts {
                let (o, e) = (off as usize, off as usize + data.len());
                if e as u64 > size || o < end {
                    bail!("{label}: part at {o}..{e} overlaps an earlier one or is past the buffer's {size} bytes");
                }
                end = e;
            }
            let rel: Vec<(usize, &[u8])> = parts.iter().map(|&(o, d)| (o as usize, d)).collect();
            parallel_copy_parts(view.slice(..), &rel);
        }
        buf.unmap();
        Ok(buf)
    }

    /// Runs `f` on the pending encoder (created on demand).
    pub fn record<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        self.record_pending(|st| f(&mut st.encoder(&self.device).0))
    }

    /// Runs `f` on what is pending under one lock, counts the pass it records, and submits
    /// once `submit_every` passes are pending.
    fn record_pending<R>(&self, f: impl FnOnce(&mut Pending) -> R) -> R {
        let mut guard = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut guard);
        let (_, passes) = guard.encoder(&self.device);
        *passes += 1;
        let full = *passes >= self.submit_every;
        drop(guard);
        if full {
            self.flush();
        }
        r
    }

    /// Records one compute dispatch.
    pub fn dispatch(&self, d: &Dispatch<'_>) {
        self.dispatch_at(d, 1..=d.buffers.len() as u32);
    }

    /// Records a dispatch whose storage buffers go to the given binding numbers, for entry
    /// points that use only some of their module's bindings (a pipeline's derived layout
    /// holds only the bindings its entry point uses).
    pub fn dispatch_at(&self, d: &Dispatch<'_>, bindings: impl IntoIterator<Item = u32>) {
        let pipe = self.pipeline(d.shader, d.entry, d.consts);
        // Every parameter block is padded to one size, at least as large as any kernel's.
        let mut words = d.params.to_vec();
        words.resize(words.len().max(PARAM_WORDS).div_ceil(4) * 4, 0);
        let words: &[u8] = bytemuck::cast_slice(&words);
        let timed = self.profile_slot(d.entry, d.groups);
        let layout = pipe.get_bind_group_layout(0);
        let bind = |params: wgpu::BindingResource<'_>| {
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: params,
            }];
            for (b, binding) in d.buffers.iter().zip(bindings) {
                entries.push(wgpu::BindGroupEntry {
                    binding,
                    resource: b.as_entire_binding(),
                });
            }
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(d.entry),
                layout: &layout,
                entries: &entries,
            })
        };
        let encode = |enc: &mut wgpu::CommandEncoder, bg: &wgpu::BindGroup| {
            let timestamp_writes = timed
                .as_ref()
                .map(|(qs, k)| wgpu::ComputePassTimestampWrites {
                    query_set: qs,
                    beginning_of_pass_write_index: Some(*k),
                    end_of_pass_write_index: Some(k + 1),
                });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(d.entry),
                timestamp_writes,
            });
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(d.groups.0, d.groups.1, d.groups.2);
        };
        if self.fresh_params || words.len() > SLOT_BYTES {
            let ubuf = self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: words,
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            let bg = bind(ubuf.as_entire_binding());
            self.record(|enc| encode(enc, &bg));
            return;
        }
        // The slot, the bind group and the pass go in under one lock, so the slot belongs
        // to the submission that carries the pass.
        self.record_pending(|st| {
            let bg = bind(wgpu::BindingResource::Buffer(
                st.params.push(&self.device, words),
            ));
            encode(&mut st.encoder(&self.device).0, &bg);
        });
    }

    /// Records a buffer-to-buffer copy.
    pub fn copy(
        &self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        bytes: u64,
    ) {
        if bytes > 0 {
            self.record(|enc| enc.copy_buffer_to_buffer(src, src_off, dst, dst_off, bytes));
        }
    }

    /// The per-kernel GPU times so far (work submitted and waited for), when profiling.
    pub fn profile_report(&self) -> Option<String> {
        self.flush();
        let prof = self.profiler.as_ref()?;
        Some(prof.lock().unwrap_or_else(|e| e.into_inner()).report())
    }

    /// The per-kernel passes and GPU seconds so far (work submitted and waited for), when
    /// profiling.
    pub fn profile_by_entry(&self) -> Option<HashMap<&'static str, (u64, f64)>> {
        self.flush();
        let prof = self.profiler.as_ref()?;
        Some(prof.lock().unwrap_or_else(|e| e.into_inner()).by_entry())
    }

    /// When profiling, the query set and first index of the next pass's timestamps (the
    /// pending work submitted first when every query is taken).
    fn profile_slot(
        &self,
        entry: &'static str,
        groups: (u32, u32, u32),
    ) -> Option<(wgpu::QuerySet, u32)> {
        let prof = self.profiler.as_ref()?;
        loop {
            let next = prof
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .next_pass(entry, groups);
            if next.is_some() {
                return next;
            }
            self.flush();
        }
    }

    /// Submits the pending encoder, if any (when profiling, with its passes' timestamps,
    /// which it then waits for).
    pub fn flush(&self) {
        // The parameter slots are written and the encoder submitted under the lock, so no
        // other thread stages the next submission's slots in between.
        let mut guard = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let Some((mut enc, _)) = guard.cmd.take() else {
            return;
        };
        guard.params.write(&self.queue);
        let Some(prof) = &self.profiler else {
            self.queue.submit([enc.finish()]);
            return;
        };
        let mut prof = prof.lock().unwrap_or_else(|e| e.into_inner());
        let n = prof.resolve(&mut enc);
        self.queue.submit([enc.finish()]);
        drop(guard);
        if let Err(e) = prof.collect(&self.device, n) {
            eprintln!("[K3-GPU] {e:#}");
        }
    }

    /// Writes `parts`, `(offset, bytes)` lying back to back from the first offset, through
    /// one staging copy (one allocation and one submission rather than one per part, the
    /// copies spread over threads); parts that do not lie back to back are written one by one.
    pub fn write_parts(&self, buf: &wgpu::Buffer, parts: &[(u64, &[u8])]) {
        let Some(&(start, _)) = parts.first() else {
            return;
        };
        let mut end = start;
        for &(off, data) in parts {
            if off != end {
                for &(o, d) in parts {
                    self.write(buf, o, d);
                }
                return;
            }
            end += data.len() as u64;
        }
        self.flush();
        let staged = wgpu::BufferSize::new(end - start)
            .and_then(|n| self.queue.write_buffer_with(buf, start, n));
        match staged {
            Some(mut view) => {
                let rel: Vec<(usize, &[u8])> = parts
                    .iter()
                    .map(|&(o, d)| ((o - start) as usize, d))
                    .collect();
                parallel_copy_parts(view.slice(..), &rel);
            }
            None => {
                for &(o, d) in parts {
                    self.queue.write_buffer(buf, o, d);
                }
            }
        }
    }

    /// Writes host bytes into an existing buffer, after everything recorded so far.
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        // A queue write lands before the next submission's commands: submit first.
        self.flush();
        let staged = wgpu::BufferSize::new(data.len() as u64)
            .and_then(|n| self.queue.write_buffer_with(buf, offset, n));
        match staged {
            Some(mut view) => parallel_copy(view.slice(..), data),
            // Empty, or refused by validation: write_buffer reports it as wgpu does.
            None => self.queue.write_buffer(buf, offset, data),
        }
    }

    /// Copies `bytes` from `buf` at `offset` to the host, after all recorded work.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let size = bytes.div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.record(|enc| enc.copy_buffer_to_buffer(buf, offset, &staging, 0, size));
        self.flush();
        let (tx, rx) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU on {}: {e}", self.info.name))?;
        let mapped = rx.recv().map_err(|_| anyhow!("GPU readback was dropped"))?;
        // An error the device reported earlier explains a failed map better than the map.
        self.check_errors()?;
        mapped.map_err(|e| anyhow!("mapping the readback buffer: {e}"))?;
        let out = staging
            .get_mapped_range(..)
            .map_err(|e| anyhow!("reading back: {e:?}"))?[..bytes as usize]
            .to_vec();
        staging.unmap();
        Ok(out)
    }

    /// Waits until every submitted command has finished.
    pub fn finish(&self) -> Result<()> {
        self.flush();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU on {}: {e}", self.info.name))?;
        self.check_errors()
    }

    /// `Err` with the first error the device has reported, and what to do about it.
    pub fn check_errors(&self) -> Result<()> {
        self.errors.check(&self.info.name)
    }

    /// Workgroup memory a kernel may use, in bytes.
    pub fn shared_bytes(&self) -> u32 {
        self.limits.max_compute_workgroup_storage_size
    }

    /// The chunk kernel's tile for a matmul of `n` tokens, or `None` where the one-token
    /// matvec serves it (too few tokens, or no tile fits the workgroup memory).
    pub fn gemm_tile(&self, n: usize) -> Option<GemmTile> {
        if !self.chunk_gemm.applies(n) {
            return None;
        }
        let shared = u64::from(self.limits.max_compute_workgroup_storage_size);
        self.chunk_gemm.tile(self.wg, n, shared)
    }

    /// Splits `groups` workgroups into an (x, y) grid within the per-dimension limit.
    pub fn grid(&self, groups: u32) -> (u32, u32, u32) {
        let maxd = self.limits.max_compute_workgroups_per_dimension.max(1);
        let x = groups.clamp(1, maxd);
        (x, groups.div_ceil(x).max(1), 1)
    }
}

/// The most bytes every binding stays under on any backend (and so the largest row chunk
/// of a matrix or arena): 2 GiB, less one word.
const MAX_BINDING_BYTES: u64 = (2 << 30) - 4;

/// Below this on Metal: wgpu's Metal backend computes wrong results for storage bindings of
/// 4 GiB and more.
const METAL_MAX_BINDING_BYTES: u64 = (4 << 30) - 16;

/// What `backend` itself allows one binding, whatever the adapter claims.
fn backend_binding_cap(backend: wgpu::Backend) -> u64 {
    match backend {
        wgpu::Backend::Metal => METAL_MAX_BINDING_BYTES,
        _ => u64::MAX,
    }
}

/// The bytes one storage binding may span on `backend` with `limits` (and `cap`, a lower
/// bound the caller asks for): the adapter's limits, [`MAX_BINDING_BYTES`] on every backend
/// and below 4 GiB on Metal, in whole 16-byte units.
pub fn max_binding_bytes(backend: wgpu::Backend, limits: &wgpu::Limits, cap: Option<u64>) -> u64 {
    let mut max = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size)
        .min(MAX_BINDING_BYTES)
        .min(backend_binding_cap(backend));
    if let Some(cap) = cap {
        max = max.min(cap);
    }
    max & !15
}

/// Whether kernels take the subgroup reductions: only where the device has the SUBGROUP
/// feature (a module with subgroup operations fails to compile without it), and not when
/// `no_subgroups` asks for the workgroup-memory ones.
pub fn use_subgroups(features: wgpu::Features, no_subgroups: bool) -> bool {
    features.contains(wgpu::Features::SUBGROUP) && !no_subgroups
}

/// The largest power of two ≤ [`MAX_WG`] that the adapter's workgroup limits allow.
fn workgroup_size(l: &wgpu::Limits) -> Result<u32> {
    let cap = l
        .max_compute_invocations_per_workgroup
        .min(l.max_compute_workgroup_size_x)
        .min(MAX_WG);
    if cap < 32 {
        bail!("the adapter allows only {cap} invocations per workgroup; the kernels need 32");
    }
    Ok(1 << (31 - cap.leading_zeros()))
}

/// Copies `src` into a mapped range on several threads. A streamed expert is 17.5 MB; one
/// core copies that in a few milliseconds, host time on the path the read pipe must hide.
fn parallel_copy(dst: wgpu::WriteOnly<'_, [u8]>, src: &[u8]) {
    parallel_copy_parts(dst, &[(0, src)]);
}

/// Copies each `(offset, bytes)` part (increasing, non-overlapping offsets within `dst`)
/// to its place in `dst`, in 1 MB pieces spread over the rayon pool; on the calling thread
/// when there is less than 4 MB in all.
fn parallel_copy_parts(dst: wgpu::WriteOnly<'_, [u8]>, parts: &[(usize, &[u8])]) {
    const CHUNK: usize = 1 << 20;
    let total: usize = parts.iter().map(|p| p.1.len()).sum();
    let mut pieces = Vec::with_capacity(total.div_ceil(CHUNK) + parts.len());
    let (mut rest, mut at) = (dst, 0usize);
    for &(off, src) in parts {
        let (_, tail) = rest.split_at(off - at);
        let (mut head, tail) = tail.split_at(src.len());
        (rest, at) = (tail, off + src.len());
        for s in src.chunks(CHUNK) {
            let (piece, more) = head.split_at(s.len());
            pieces.push((Chunk(piece), s));
            head = more;
        }
    }
    if total < 4 * CHUNK {
        for (mut d, s) in pieces {
            d.0.copy_from_slice(s);
        }
        return;
    }
    pieces
        .into_par_iter()
        .for_each(|(mut d, s)| d.0.copy_from_slice(s));
}

/// A disjoint piece of a mapped range, movable to a copy thread.
struct Chunk<'a>(wgpu::WriteOnly<'a, [u8]>);

// SAFETY: `WriteOnly<[u8]>` lacks `Send` only because its impl asks `T: Sized`; like a
// `&mut [u8]`, it is an exclusive pointer, and the chunks come from `split_at`, so no two
// threads ever touch the same bytes.
unsafe impl Send for Chunk<'_> {}

/// Workgroup memory the row-split matvec entries use besides staged x (`mv_part`, the
/// reduction prelude's `red_buf`), with room to spare.
const MATVEC_SHARED_BYTES: u32 = 4096;

/// Bytes of workgroup memory one staged unit of x takes: its eight vec4s and a pad vec4.
const STAGED_UNIT_BYTES: u32 = 9 * 16;

/// The `XT` override of a row-split matvec over rows of `units` 32-column units under `m`,
/// with `shared` bytes of workgroup memory: all the units where they fit, else the most
/// that do, at most `m.stage_x`; 0 (x from global memory) where `m.stage_x` is 0 or fewer
/// than 8 units fit. (The int4 digit decode reads x's digits and is never staged; its
/// caller asks for no tile.)
pub fn x_tile_units(m: MatvecShape, units: usize, shared: u32) -> u32 {
    let room = shared.saturating_sub(MATVEC_SHARED_BYTES) / STAGED_UNIT_BYTES;
    if m.stage_x == 0 || room < 8 {
        return 0;
    }
    room.min(m.stage_x)
        .min(u32::try_from(units).unwrap_or(u32::MAX))
}

/// The `LW` a workgroup of `wg` lanes can hold: a row split over `lpr / lw` 32-lane blocks
/// needs whole blocks, as many per workgroup as the split; otherwise the row's lanes stay
/// side by side (`lw = lpr`).
fn split_lanes(lpr: u32, lw: u32, wg: u32) -> u32 {
    let lw = lw.min(lpr);
    if lw == lpr || (wg % 32 == 0 && (wg / 32) % (lpr / lw) == 0) {
        lw
    } else {
        lpr
    }
}

#[cfg(test)]
mod tests {
    use super::{
        backend_binding_cap, max_binding_bytes, split_lanes, use_subgroups, x_tile_units,
        MatvecShape, MAX_BINDING_BYTES,
    };

    #[test]
    fn bindings_stay_below_4_gib_on_metal_and_2_gib_everywhere() {
        let huge = wgpu::Limits {
            max_storage_buffer_binding_size: 1 << 40,
            max_buffer_size: 1 << 40,
            ..wgpu::Limits::default()
        };
        for backend in [
            wgpu::Backend::Metal,
            wgpu::Backend::Vulkan,
            wgpu::Backend::Dx12,
        ] {
            let max = max_binding_bytes(backend, &huge, None);
            assert!(max < 4 << 30, "{backend:?}");
            assert_eq!(max, MAX_BINDING_BYTES & !15, "{backend:?}");
            assert_eq!(max % 16, 0);
        }
        // Metal's own cap holds even if the general one is raised.
        assert!(backend_binding_cap(wgpu::Backend::Metal) < 4 << 30);
        assert_eq!(backend_binding_cap(wgpu::Backend::Metal) % 16, 0);
        assert_eq!(backend_binding_cap(wgpu::Backend::Vulkan), u64::MAX);
        // The adapter's own limits and the caller's cap, whichever is lower, in 16-byte units.
        let small = wgpu::Limits {
            max_storage_buffer_binding_size: 1000,
            ..huge.clone()
        };
        assert_eq!(max_binding_bytes(wgpu::Backend::Metal, &small, None), 992);
        assert_eq!(
            max_binding_bytes(wgpu::Backend::Vulkan, &huge, Some(64 << 20)),
            64 << 20
        );
        let buffer = wgpu::Limits {
            max_buffer_size: 4096,
            ..huge
        };
        assert_eq!(
            max_binding_bytes(wgpu::Backend::Metal, &buffer, Some(1 << 20)),
            4096
        );
    }

    #[test]
    fn subgroups_only_where_the_adapter_has_them() {
        let sub = wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY;
        assert!(use_subgroups(sub, false));
        assert!(!use_subgroups(sub, true));
        assert!(!use_subgroups(wgpu::Features::TIMESTAMP_QUERY, false));
        assert!(!use_subgroups(wgpu::Features::empty(), false));
    }

    #[test]
    fn staged_x_takes_what_fits() {
        let m = MatvecShape::default();
        // 224 units (7168 columns) fit NVIDIA's 48 KiB whole, and 199 of them 32 KiB.
        assert_eq!(x_tile_units(m, 224, 49152), 224);
        assert_eq!(x_tile_units(m, 224, 32768), 199);
        // A short row is staged whole.
        assert_eq!(x_tile_units(m, 5, 49152), 5);
        // Room for fewer than 8 units: not staged.
        assert_eq!(x_tile_units(m, 224, 5000), 0);
        let off = MatvecShape { stage_x: 0, ..m };
        assert_eq!(x_tile_units(off, 224, 49152), 0);
        let small = MatvecShape { stage_x: 5, ..m };
        assert_eq!(x_tile_units(small, 224, 49152), 5);
    }

    #[test]
    fn a_row_is_split_over_blocks_only_when_the_workgroup_holds_them() {
        assert_eq!(split_lanes(32, 4, 256), 4);
        assert_eq!(split_lanes(32, 32, 256), 32);
        // 8 blocks of 32 per row need a workgroup of at least 256 lanes.
        assert_eq!(split_lanes(32, 4, 128), 32);
        assert_eq!(split_lanes(32, 8, 128), 8);
        assert_eq!(split_lanes(8, 4, 64), 4);
        assert_eq!(split_lanes(8, 16, 64), 8);
    }
}
