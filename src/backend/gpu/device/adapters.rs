//! Adapter discovery and choice: which GPUs wgpu sees (honouring `WGPU_BACKEND`), what
//! they offer, and which one a run uses (`--adapter NAME`, CPU-type adapters only on request).

use crate::backend::gpu::device::context::device_limits::max_binding_bytes;
use crate::backend::gpu::device::context::limits_profile::{EffectiveLimits, LimitsProfile};
use crate::backend::gpu::device::upload_path::{self, UploadPath};
use anyhow::{bail, Result};
use std::sync::OnceLock;

/// The wgpu instance every k3 GPU path uses, one per process; its backends come from
/// `WGPU_BACKEND` as set when it is first asked for. Shared because NVIDIA's Vulkan driver
/// stops listing its GPU after 30 instances in one process, even when each was dropped
/// (the 31st enumeration comes back empty).
pub fn instance() -> wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all());
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
            desc.backends = backends;
            wgpu::Instance::new(desc)
        })
        .clone()
}

/// Every adapter the instance can see.
pub fn enumerate(inst: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
}

/// What `k3 devices` prints about one adapter.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    /// Adapter name as the driver reports it.
    pub name: String,
    /// wgpu backend (Vulkan, Metal, Dx12, ...).
    pub backend: String,
    /// Discrete, integrated, virtual, CPU or other.
    pub device_type: String,
    /// Driver name and version text.
    pub driver: String,
    /// `max_storage_buffer_binding_size` in bytes.
    pub max_storage_binding: u64,
    /// `max_buffer_size` in bytes.
    pub max_buffer: u64,
    /// `max_compute_workgroup_storage_size` in bytes.
    pub workgroup_storage: u32,
    /// `max_compute_invocations_per_workgroup`.
    pub invocations: u32,
    /// `max_storage_buffers_per_shader_stage`.
    pub storage_buffers: u32,
    /// Subgroup operations in compute shaders.
    pub subgroups: bool,
    /// Smallest and largest subgroup size the adapter reports.
    pub subgroup_sizes: (u32, u32),
    /// f16 in shaders.
    pub f16: bool,
    /// Timestamp queries (pass boundaries).
    pub timestamps: bool,
    /// Matrix-unit (cooperative matrix) shapes the driver offers, `MxNxK in->acc`.
    pub matrix_units: Vec<String>,
    /// Whether CPU and GPU share one memory ([`upload_path::unified_memory`]).
    pub unified_memory: bool,
    /// The most bytes the engine binds at once on this adapter (its buffers are split
    /// below it: [`max_binding_bytes`]).
    pub engine_binding: u64,
    /// Where uploads are written.
    pub uploads: UploadPath,
    /// The limits profile the facts above are under (native: the adapter's own).
    pub profile: LimitsProfile,
    /// The limits the profile lowers below the adapter's, `name own->effective`.
    pub lowered: Vec<String>,
}

impl AdapterReport {
    /// Reads an adapter's info, and the limits and features the engine opens it with under
    /// `profile` (the adapter's own under [`LimitsProfile::Native`]).
    pub fn of(a: &wgpu::Adapter, profile: LimitsProfile) -> Self {
        let info = a.get_info();
        let own = a.limits();
        let eff = EffectiveLimits::of(
            profile,
            &own,
            a.features(),
            &info,
            upload_path::unified_memory(info.device_type),
        );
        let l = eff.limits.clone();
        let f = eff.features;
        let binding_backend = if eff.metal_caps {
            wgpu::Backend::Metal
        } else {
            info.backend
        };
        Self {
            name: info.name.clone(),
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
            max_storage_binding: l.max_storage_buffer_binding_size,
            max_buffer: l.max_buffer_size,
            workgroup_storage: l.max_compute_workgroup_storage_size,
            invocations: l.max_compute_invocations_per_workgroup,
            storage_buffers: l.max_storage_buffers_per_shader_stage,
            subgroups: f.contains(wgpu::Features::SUBGROUP),
            subgroup_sizes: eff.subgroup_sizes,
            f16: f.contains(wgpu::Features::SHADER_F16),
            timestamps: f.contains(wgpu::Features::TIMESTAMP_QUERY),
            matrix_units: a
                .cooperative_matrix_properties()
                .iter()
                .map(|m| {
                    format!(
                        "{}x{}x{} {:?}->{:?}",
                        m.m_size, m.n_size, m.k_size, m.ab_type, m.cr_type
                    )
                })
                .collect(),
            unified_memory: eff.unified_memory,
            engine_binding: max_binding_bytes(binding_backend, &l, None),
            uploads: upload_path::of(a),
            lowered: eff.lowered(&own),
            profile,
        }
    }

    /// One line per fact, as `k3 devices` prints them.
    pub fn render(&self, index: usize) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let profile = match self.profile {
            LimitsProfile::Native => String::new(),
            p => format!(
                "\n    limits profile: {p} (each limit the lower of {p}'s and this adapter's, the features both have){}",
                if self.lowered.is_empty() {
                    String::new()
                } else {
                    format!("\n    lowered: {}", self.lowered.join(", "))
                }
            ),
        };
        format!(
            "[{index}] {}\n    backend: {}  type: {}  driver: {}\n    limits: storage binding {:.0} MiB ({} B), buffer {:.0} MiB, workgroup storage {} B, invocations {}, storage buffers/stage {}\n    features: subgroups {} (size {}..{}), f16 {}, timestamps {}, matrix units {}\n    memory: {}; k3 binds at most {:.0} MiB at once\n    uploads: {}{profile}",
            self.name,
            self.backend,
            self.device_type,
            if self.driver.is_empty() { "-" } else { &self.driver },
            mib(self.max_storage_binding),
            self.max_storage_binding,
            mib(self.max_buffer),
            self.workgroup_storage,
            self.invocations,
            self.storage_buffers,
            yes(self.subgroups),
            self.subgroup_sizes.0,
            self.subgroup_sizes.1,
            yes(self.f16),
            yes(self.timestamps),
            if self.matrix_units.is_empty() {
                "none".to_string()
            } else {
                self.matrix_units.join(", ")
            },
            if self.unified_memory {
                "unified (CPU and GPU share it)"
            } else {
                "separate (the GPU's own VRAM)"
            },
            mib(self.engine_binding),
            self.uploads.describe(),
        )
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// Reports for every adapter under `profile`, in enumeration order.
pub fn list(profile: LimitsProfile) -> Vec<AdapterReport> {
    enumerate(&instance())
        .iter()
        .map(|a| AdapterReport::of(a, profile))
        .collect()
}

/// Whether an adapter is a real GPU (not a CPU rasterizer such as lavapipe or WARP).
pub fn is_gpu(a: &wgpu::Adapter) -> bool {
    !matches!(a.get_info().device_type, wgpu::DeviceType::Cpu)
}

fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// Picks an adapter: the first whose name contains `name` (case-insensitive) when given,
/// otherwise the best real GPU (discrete first), or with `index` the index-th (modulo their
/// count) of the adapters of that best type; CPU-type adapters only when `allow_cpu`.
pub fn choose(
    adapters: Vec<wgpu::Adapter>,
    name: Option<&str>,
    allow_cpu: bool,
    index: Option<usize>,
) -> Result<wgpu::Adapter> {
    if adapters.is_empty() {
        bail!(
            "no GPU adapter found (WGPU_BACKEND={}); install a Vulkan/Metal/DX12 driver or run with --backend cpu",
            std::env::var("WGPU_BACKEND").unwrap_or_else(|_| "unset".into())
        );
    }
    let names: Vec<String> = adapters
        .iter()
        .map(|a| {
            format!(
                "{} ({:?}, {:?})",
                a.get_info().name,
                a.get_info().backend,
                a.get_info().device_type
            )
        })
        .collect();
    let mut cands: Vec<wgpu::Adapter> = match name {
        Some(n) => {
            let n = n.to_lowercase();
            adapters
                .into_iter()
                .filter(|a| a.get_info().name.to_lowercase().contains(&n))
                .collect()
        }
        None => adapters
            .into_iter()
            .filter(|a| allow_cpu || is_gpu(a))
            .collect(),
    };
    if cands.is_empty() {
        match name {
            Some(n) => bail!(
                "no adapter name contains {n:?}; adapters: {} (see `k3 devices`)",
                names.join(", ")
            ),
            None => bail!(
                "only CPU-type adapters found ({}); use --backend gpu to run on one anyway",
                names.join(", ")
            ),
        }
    }
    cands.sort_by_key(|a| type_rank(a.get_info().device_type));
    let best = type_rank(cands[0].get_info().device_type);
    let same = cands
        .iter()
        .take_while(|a| type_rank(a.get_info().device_type) == best)
        .count();
    let at = match (name, index) {
        (None, Some(i)) => pick_index(i, same),
        _ => 0,
    };
    Ok(cands.remove(at))
}

/// How many of `adapters` share the best type (discrete first): the count [`choose`] wraps
/// a rank's index at when no name is given.
pub fn best_type_count(adapters: &[wgpu::Adapter]) -> usize {
    let ranks: Vec<u8> = adapters
        .iter()
        .map(|a| type_rank(a.get_info().device_type))
        .collect();
    ranks
        .iter()
        .min()
        .map_or(0, |b| ranks.iter().filter(|r| *r == b).count())
}

/// Which of `count` equal adapters the `index`-th rank of a host takes: its own while there
/// are enough, shared round-robin beyond.
pub fn pick_index(index: usize, count: usize) -> usize {
    index % count.max(1)
}

/// Whether `adapter` offers what the matrix-unit kernels (kernels/matrix_units.rs) need:
/// `SHADER_F16`, the experimental cooperative matrices with a 16x16x16 f16 -> f32 subgroup
/// shape, and subgroups of exactly 32 lanes (they place 16 rows on each 32 lanes).
pub fn has_matrix_units(adapter: &wgpu::Adapter) -> bool {
    let features = adapter.features();
    let info = adapter.get_info();
    let shape = adapter.cooperative_matrix_properties().iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    features.contains(wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && shape
        && (info.subgroup_min_size, info.subgroup_max_size) == (32, 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_local_rank_takes_its_own_gpu_then_they_share() {
        assert_eq!(pick_index(0, 4), 0);
        assert_eq!(pick_index(3, 4), 3);
        assert_eq!(pick_index(5, 4), 1);
        assert_eq!(pick_index(2, 1), 0);
        assert_eq!(pick_index(2, 0), 0);
    }

    #[test]
    fn the_report_says_whether_memory_is_unified_and_the_binding_cap() {
        let r = AdapterReport {
            name: "Apple M2".into(),
            backend: "Metal".into(),
            device_type: "IntegratedGpu".into(),
            driver: String::new(),
            max_storage_binding: 1 << 32,
            max_buffer: 1 << 32,
            workgroup_storage: 32768,
            invocations: 1024,
            storage_buffers: 31,
            subgroups: true,
            subgroup_sizes: (32, 32),
            f16: true,
            timestamps: false,
            matrix_units: vec!["8x8x8 F32->F32".into()],
            unified_memory: true,
            engine_binding: 2048 << 20,
            uploads: upload_path::UploadPath::Shared,
            profile: LimitsProfile::Native,
            lowered: Vec::new(),
        };
        let text = r.render(0);
        assert!(!text.contains("limits profile"), "{text}");
        assert!(text.contains("matrix units 8x8x8 F32->F32"), "{text}");
        assert!(
            text.contains("memory: unified (CPU and GPU share it); k3 binds at most 2048 MiB"),
            "{text}"
        );
        let discrete = AdapterReport {
            unified_memory: false,
            ..r
        };
        assert!(discrete.render(1).contains("memory: separate"));
        let profiled = AdapterReport {
            profile: LimitsProfile::AppleM1,
            lowered: vec!["max_storage_buffers_per_shader_stage 1048576->29".into()],
            ..discrete
        };
        let text = profiled.render(2);
        assert!(
            text.contains("limits profile: apple-m1 (each limit the lower of apple-m1's and this adapter's, the features both have)")
                && text.contains("lowered: max_storage_buffers_per_shader_stage 1048576->29"),
            "{text}"
        );
    }
}
