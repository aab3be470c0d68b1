//! The wgpu context: device and queue on the chosen adapter with the adapter's own limits,
//! the pipeline and module caches, buffers and the host's reads and writes. What the
//! context is made from, the matvec geometry, the adapter facts it derives, the recording
//! of ops and the host copies each have a file under `context/`.

pub(crate) mod device_limits;
mod host_copy;
pub mod limits_profile;
mod matvec_shape;
mod options;
mod readback;
mod recording;

pub use device_limits::{max_binding_bytes, use_subgroups, workgroup_size, MAX_WG};
pub use limits_profile::{EffectiveLimits, LimitsProfile};
pub(crate) use matvec_shape::MATVEC_SHARED_BYTES;
pub use matvec_shape::{x_tile_units, Int4Decode, MatvecShape};
pub use options::{default_matvec_checks, GpuOptions, ReadStaging, SUBMIT_EVERY};
pub(crate) use readback::PendingRead;
pub use recording::Dispatch;

use crate::backend::gpu::device::adapters;
use crate::backend::gpu::device::device_errors::DeviceErrors;
use crate::backend::gpu::device::pipeline::{AdapterShape, PipelineKind, PipelineVariant};
use crate::backend::gpu::device::profiler::Profiler;
use crate::backend::gpu::device::shaders::Shader;
use crate::backend::gpu::device::upload_path;
use crate::backend::gpu::kernels::chunk_gemm::{ChunkGemm, GemmTile};
use crate::backend::gpu::kernels::stationary::{CsPlan, Stationary};
use crate::backend::gpu::{matrix_unit_kinds, pipeline_kinds};
use anyhow::{anyhow, bail, Context as _, Result};
use host_copy::{parallel_copy, parallel_copy_parts};
use readback::Readback;
use recording::Pending;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use wgpu::util::DeviceExt;

/// Recorded passes after which the pending encoder is submitted anyway, bounding the
/// memory a long chain of ops (a big prefill with no readback) keeps alive.
const MAX_PENDING_PASSES: usize = 4096;

/// The size [`GpuContext::buffer`] gives a buffer asked for `bytes`: whole 16-byte units,
/// at least one.
pub fn storage_size(bytes: u64) -> u64 {
    bytes.max(16).div_ceil(16) * 16
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PipeKey {
    shader: Shader,
    entry: &'static str,
    consts: Vec<(&'static str, u32)>,
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
    /// The limits the device was created with: the adapter's own, or under a limits
    /// profile the worse of the profile's and the adapter's ([`EffectiveLimits`]).
    pub limits: wgpu::Limits,
    /// Features enabled on the device.
    pub features: wgpu::Features,
    /// The limits profile the device was opened under (`K3_GPU_LIMITS`).
    pub profile: LimitsProfile,
    /// Smallest and largest subgroup the plans hold for (the adapter's, widened to the
    /// profile's Mac's).
    pub subgroup_sizes: (u32, u32),
    /// Whether the engine plans as on a unified-memory machine (the adapter shares memory
    /// with the CPU, or the profile's Mac does).
    pub unified_memory: bool,
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
    /// Whether experts shared by a few rows take the few-token kernel
    /// ([`GpuOptions::few_token_experts`]).
    pub few_token_experts: bool,
    /// Whether dense matmuls of a few rows take the few-token kernel
    /// ([`GpuOptions::few_token_dense`]).
    pub few_token_dense: bool,
    /// The few-token kernel's lanes a row and rows a lane for every format, where the
    /// options set one.
    pub few_token_shape: Option<(u32, u32)>,
    /// Subgroups a workgroup of the matrix-unit kernels, where the device was opened with
    /// the matrix units (`GpuOptions::matrix_units` asked and the adapter has them).
    pub matrix_units: Option<u32>,
    /// Per-kernel GPU times, when profiling.
    profiler: Option<Mutex<Profiler>>,
    /// The first error the device reported (instead of wgpu's panic).
    errors: DeviceErrors,
    /// Passes recorded before the host submits them.
    submit_every: usize,
    modules: Mutex<HashMap<Shader, wgpu::ShaderModule>>,
    /// Every module's text read from `GpuOptions::wgsl_dir` at start, when it is set.
    #[cfg(feature = "lab")]
    wgsl_sources: Option<HashMap<Shader, String>>,
    /// `GpuOptions::matvec_checks`, or `default_matvec_checks()`.
    matvec_checks: wgpu::ShaderRuntimeChecks,
    pipelines: Mutex<HashMap<PipeKey, wgpu::ComputePipeline>>,
    /// The kinds of pipeline `pipeline_variants` lists for this adapter: the only ones
    /// `pipeline` creates.
    kinds: HashSet<PipelineKind>,
    pending: Mutex<Pending>,
    /// The buffer readbacks map, kept between them.
    readback: Readback,
}

impl GpuContext {
    /// Opens the adapter `opts` selects, with its own limits (or those of the limits
    /// profile, never above the adapter's) and the features we use.
    pub fn new(opts: &GpuOptions) -> Result<Self> {
        let inst = adapters::instance();
        let adapter = adapters::choose(
            adapters::enumerate(&inst),
            opts.adapter.as_deref(),
            opts.allow_cpu_adapter,
            opts.gpu_index,
        )?;
        let info = adapter.get_info();
        let profile = match opts.limits {
            Some(p) => p,
            None => LimitsProfile::from_env()?,
        };
        let eff = EffectiveLimits::of(
            profile,
            &adapter.limits(),
            adapter.features(),
            &info,
            upload_path::unified_memory(info.device_type),
        );
        let limits = eff.limits.clone();
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
        let coop = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        let matrix_units = opts
            .matrix_units
            .filter(|_| adapters::has_matrix_units(&adapter) && eff.features.contains(coop));
        if opts.matrix_units.is_some() && matrix_units.is_none() {
            tracing::warn!(
                "matrix units asked for, but {} ({:?}) has no 16x16x16 f16 -> f32 matrix units in 32-lane subgroups; the few-row matmuls keep their f32 kernels",
                info.name,
                info.backend
            );
        }
        let (features, experimental_features) = match matrix_units {
            Some(_) => (
                (eff.features & wanted) | coop,
                // SAFETY: the one experimental feature enabled is the cooperative matrices,
                // which only the matrix-unit module uses (matmul_coop.wgsl): its matrix loads
                // and stores stay inside its workgroup arrays and inside B, whose rows the
                // host sizes from the same steps the kernel walks.
                unsafe { wgpu::ExperimentalFeatures::enabled() },
            ),
            None => (
                eff.features & wanted,
                wgpu::ExperimentalFeatures::disabled(),
            ),
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("k3"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features,
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
        // Under an Apple profile the bindings keep below Metal's 4 GiB on any adapter.
        let binding_backend = if eff.metal_caps {
            wgpu::Backend::Metal
        } else {
            info.backend
        };
        let max_binding = max_binding_bytes(binding_backend, &limits, opts.max_binding);
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
        #[cfg(feature = "lab")]
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
                subgroup_sizes: eff.subgroup_sizes,
            },
            subgroups,
        );
        let kinds = kinds
            .into_iter()
            .chain(matrix_units.into_iter().flat_map(matrix_unit_kinds))
            .collect();
        Ok(Self {
            adapter,
            device,
            queue,
            info,
            limits,
            features,
            profile,
            subgroup_sizes: eff.subgroup_sizes,
            unified_memory: eff.unified_memory,
            subgroups,
            wg,
            max_binding,
            matvec,
            expert_matvec,
            expert_down_matvec,
            chunk_gemm,
            stationary,
            few_token_experts: opts.few_token_experts,
            few_token_dense: opts.few_token_dense.unwrap_or(true),
            few_token_shape: opts.few_token_shape,
            matrix_units,
            profiler,
            errors,
            submit_every: opts
                .submit_every
                .unwrap_or(SUBMIT_EVERY)
                .clamp(1, MAX_PENDING_PASSES),
            modules: Mutex::new(HashMap::new()),
            #[cfg(feature = "lab")]
            wgsl_sources,
            #[cfg(feature = "lab")]
            matvec_checks: opts.matvec_checks.unwrap_or_else(default_matvec_checks),
            #[cfg(not(feature = "lab"))]
            matvec_checks: default_matvec_checks(),
            pipelines: Mutex::new(HashMap::new()),
            kinds,
            pending: Mutex::new(Pending::new(uniform_align)),
            readback: Readback::default(),
        })
    }

    /// The column-stationary plan for a one-token matvec over rows of `units` units, `rows`
    /// rows per item and `items` items, or `None` where the row-split kernel runs.
    pub fn stationary_plan(&self, units: usize, rows: usize, items: usize) -> Option<CsPlan> {
        let sub = if self.subgroups {
            self.subgroup_sizes
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
                "pipeline {variant} is not among pipeline_variants() (the kernel modules' lists), so no test translates it for every backend"
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
                #[cfg(feature = "lab")]
                let text = self
                    .wgsl_sources
                    .as_ref()
                    .and_then(|m| m.get(&shader).cloned())
                    .unwrap_or_else(|| shader.source(self.subgroups));
                #[cfg(not(feature = "lab"))]
                let text = shader.source(self.subgroups);
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(shader.file()),
                    source: wgpu::ShaderSource::Wgsl(text.into()),
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
