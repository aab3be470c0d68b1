//! Device-limits profiles: the limits and features wgpu's Metal backend reports for an Apple
//! GPU family, so that any adapter (lavapipe in CI, an NVIDIA GPU) plans and validates
//! every buffer, binding, workgroup and subgroup use as that Mac would
//! (`K3_GPU_LIMITS` / `--gpu-limits`).
//!
//! The values are those of `wgpu-hal` 30.0.2, `src/metal/adapter.rs`
//! (`CapabilitiesQuery::new`, `features`, `capabilities`, without
//! `STRICT_WEBGPU_COMPLIANCE`), after `auxil::adjust_raw_limits`, for macOS on the family's
//! GPUs; `docs/platforms.md` lists them with the lines they come from. A device cannot be
//! given more than its adapter has, so the effective limits are the worse of the profile's
//! and the adapter's for every limit, and the features those both have.

use anyhow::{bail, Result};
use std::fmt;
use std::str::FromStr;

/// The environment variable that selects a profile when the options leave it unset.
pub const LIMITS_ENV: &str = "K3_GPU_LIMITS";

/// Which limits the GPU backend requests and plans with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LimitsProfile {
    /// The adapter's own limits and features.
    #[default]
    Native,
    /// Apple M1 family (`MTLGPUFamily::Apple7`, Metal 3).
    AppleM1,
    /// Apple M3 family (`Apple9`).
    AppleM3,
    /// Apple M5 family (`Apple10`).
    AppleM5,
}

/// Every profile, in the order `--help` lists them.
pub const PROFILES: [LimitsProfile; 4] = [
    LimitsProfile::Native,
    LimitsProfile::AppleM1,
    LimitsProfile::AppleM3,
    LimitsProfile::AppleM5,
];

impl LimitsProfile {
    /// The name users write (`apple-m1`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LimitsProfile::Native => "native",
            LimitsProfile::AppleM1 => "apple-m1",
            LimitsProfile::AppleM3 => "apple-m3",
            LimitsProfile::AppleM5 => "apple-m5",
        }
    }

    /// The profile `K3_GPU_LIMITS` names (unset or empty: native).
    pub fn from_env() -> Result<Self> {
        match std::env::var(LIMITS_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                v.parse().map_err(|e| anyhow::anyhow!("{LIMITS_ENV}: {e}"))
            }
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(LimitsProfile::Native),
            Err(std::env::VarError::NotUnicode(v)) => {
                bail!("{LIMITS_ENV} is not UTF-8 ({v:?}); use one of {}", names())
            }
        }
    }

    /// The device facts of the profile, or `None` for [`LimitsProfile::Native`].
    pub fn device(self) -> Option<ProfileDevice> {
        let (family, smallest_ram_gib, apple9, apple10) = match self {
            LimitsProfile::Native => return None,
            LimitsProfile::AppleM1 => ("Apple7", 8, false, false),
            LimitsProfile::AppleM3 => ("Apple9", 8, true, false),
            LimitsProfile::AppleM5 => ("Apple10", 16, true, true),
        };
        Some(ProfileDevice {
            family,
            limits: apple_limits(smallest_ram_gib, apple9, apple10),
            features: apple_features(apple9),
            subgroup_sizes: METAL_SUBGROUP_SIZES,
            unified_memory: true,
        })
    }
}

impl fmt::Display for LimitsProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn names() -> String {
    PROFILES.map(LimitsProfile::name).join(", ")
}

impl FromStr for LimitsProfile {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        PROFILES
            .into_iter()
            .find(|p| p.name() == t)
            .ok_or_else(|| format!("unknown GPU limits profile {s:?}; use one of {}", names()))
    }
}

/// What a profile's Mac reports: its limits, features, subgroup sizes and memory.
#[derive(Clone, Debug)]
pub struct ProfileDevice {
    /// The `MTLGPUFamily` the values are those of.
    pub family: &'static str,
    /// `Adapter::limits()` on that Mac.
    pub limits: wgpu::Limits,
    /// The compute-relevant part of `Adapter::features()` on that Mac.
    pub features: wgpu::Features,
    /// `AdapterInfo::subgroup_min_size` and `max`, which wgpu's Metal backend fixes.
    pub subgroup_sizes: (u32, u32),
    /// Whether CPU and GPU share memory (every Apple-silicon Mac).
    pub unified_memory: bool,
}

/// `AdapterInfo::subgroup_{min,max}_size` on every Metal adapter (`wgpu-hal`
/// `src/metal/mod.rs`: "hardcoded based on typical values for Metal devices").
const METAL_SUBGROUP_SIZES: (u32, u32) = (4, 64);

/// Metal's buffer argument table has 31 entries; wgpu keeps 2 for immediates and buffer
/// sizes (`MAX_BUFFERS - 2`), and counts storage and uniform buffers against one pool.
const METAL_USABLE_BUFFERS: u32 = 31 - 2;

/// `maxBufferLength` of the family's smallest-RAM Mac: half its RAM, as an 8 GB M1 reports
/// exactly (4 GiB); larger machines report more (36 GiB on a 64 GB M1 Max).
fn smallest_max_buffer(ram_gib: u64) -> u64 {
    (ram_gib << 30) / 2
}

/// The limits `CapabilitiesQuery::capabilities` reports on macOS for an Apple7+ GPU.
fn apple_limits(ram_gib: u64, apple9: bool, apple10: bool) -> wgpu::Limits {
    let max_buffer = smallest_max_buffer(ram_gib);
    wgpu::Limits {
        max_texture_dimension_1d: if apple10 { 32768 } else { 16384 },
        max_texture_dimension_2d: if apple10 { 32768 } else { 16384 },
        max_texture_dimension_3d: 2048,
        max_texture_array_layers: 2048,
        // u32::MAX, capped by adjust_raw_limits to wgpu-hal's MAX_BIND_GROUPS (8),
        // MAX_VERTEX_BUFFERS (16) and their sum (24).
        max_bind_groups: 8,
        max_bind_groups_plus_vertex_buffers: 24,
        max_bindings_per_bind_group: u32::MAX,
        max_dynamic_uniform_buffers_per_pipeline_layout: METAL_USABLE_BUFFERS,
        max_dynamic_storage_buffers_per_pipeline_layout: METAL_USABLE_BUFFERS,
        max_sampled_textures_per_shader_stage: 96,
        max_samplers_per_shader_stage: 16,
        max_storage_buffers_per_shader_stage: METAL_USABLE_BUFFERS,
        max_storage_textures_per_shader_stage: 32,
        max_uniform_buffers_per_shader_stage: METAL_USABLE_BUFFERS,
        max_buffers_and_acceleration_structures_per_shader_stage: METAL_USABLE_BUFFERS,
        max_acceleration_structures_per_shader_stage: METAL_USABLE_BUFFERS,
        max_binding_array_elements_per_shader_stage: 1_000_000,
        max_binding_array_sampler_elements_per_shader_stage: if apple9 { 500_000 } else { 1024 },
        max_uniform_buffer_binding_size: max_buffer,
        max_storage_buffer_binding_size: max_buffer & !3,
        max_vertex_buffers: 16,
        max_buffer_size: max_buffer,
        max_vertex_attributes: 31,
        max_vertex_buffer_array_stride: 2048,
        min_uniform_buffer_offset_alignment: 256,
        min_storage_buffer_offset_alignment: 32,
        max_inter_stage_shader_variables: 31,
        max_color_attachments: 8,
        max_color_attachment_bytes_per_sample: 64,
        max_compute_workgroup_storage_size: 32 << 10,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_size_x: 1024,
        max_compute_workgroup_size_y: 1024,
        max_compute_workgroup_size_z: 1024,
        max_compute_workgroups_per_dimension: 0xFFFF,
        // 0x1000, capped to 256 by adjust_raw_limits.
        max_immediate_size: 256,
        max_non_sampler_bindings: u32::MAX,
        ..wgpu::Limits::default()
    }
}

/// The compute-relevant features `CapabilitiesQuery::features` sets on an Apple7+ GPU: f16,
/// simdgroup operations (`SUBGROUP`), timestamps at pass boundaries only (Apple GPUs sample
/// counters at stage boundaries, not at blit or dispatch boundaries, so neither
/// `TIMESTAMP_QUERY_INSIDE_ENCODERS` nor `_INSIDE_PASSES`), mappable primary buffers.
fn apple_features(apple9: bool) -> wgpu::Features {
    use wgpu::Features as F;
    let mut f = F::MAPPABLE_PRIMARY_BUFFERS
        | F::IMMEDIATES
        | F::SHADER_F16
        | F::SHADER_I16
        | F::SHADER_INT64
        | F::SHADER_FLOAT32_ATOMIC
        | F::SUBGROUP
        | F::SUBGROUP_BARRIER
        | F::TIMESTAMP_QUERY;
    if apple9 {
        f |= F::SHADER_INT64_ATOMIC_MIN_MAX;
    }
    f
}

/// What the device is opened and planned with: a profile met by an adapter.
#[derive(Clone, Debug)]
pub struct EffectiveLimits {
    /// The profile asked for.
    pub profile: LimitsProfile,
    /// For every limit the worse of the profile's and the adapter's.
    pub limits: wgpu::Limits,
    /// The features both have.
    pub features: wgpu::Features,
    /// The subgroup sizes plans must hold for: those of the profile's Mac and of the
    /// adapter the kernels run on, so the widest range of the two.
    pub subgroup_sizes: (u32, u32),
    /// Whether the plan is that of a unified-memory machine (the adapter's own fact, or
    /// the profile's).
    pub unified_memory: bool,
    /// Whether the binding caps of Metal apply (the adapter is Metal, or the profile is).
    pub metal_caps: bool,
}

impl EffectiveLimits {
    /// `profile` met by an adapter with `limits`, `features` and `info`, whose memory is
    /// shared with the CPU when `unified`.
    pub fn of(
        profile: LimitsProfile,
        limits: &wgpu::Limits,
        features: wgpu::Features,
        info: &wgpu::AdapterInfo,
        unified: bool,
    ) -> Self {
        let own = (info.subgroup_min_size, info.subgroup_max_size);
        let metal = info.backend == wgpu::Backend::Metal;
        match profile.device() {
            None => Self {
                profile,
                limits: limits.clone(),
                features,
                subgroup_sizes: own,
                unified_memory: unified,
                metal_caps: metal,
            },
            Some(p) => Self {
                profile,
                limits: limits.clone().or_worse_values_from(&p.limits),
                features: features & p.features,
                subgroup_sizes: widest(own, p.subgroup_sizes),
                unified_memory: p.unified_memory,
                metal_caps: true,
            },
        }
    }

    /// The limits that differ from the adapter's own, `name adapter->effective`, for the
    /// start-up line and `k3 devices` (empty under the native profile).
    pub fn lowered(&self, adapter: &wgpu::Limits) -> Vec<String> {
        let mut out = Vec::new();
        adapter.check_limits_with_fail_fn(&self.limits, false, |name, own, eff| {
            out.push(format!("{name} {own}->{eff}"));
        });
        out
    }
}

/// The smallest and largest of two subgroup ranges together (0 = unknown, kept unknown).
fn widest(a: (u32, u32), b: (u32, u32)) -> (u32, u32) {
    let lo = match (a.0, b.0) {
        (0, _) | (_, 0) => 0,
        (x, y) => x.min(y),
    };
    let hi = match (a.1, b.1) {
        (0, _) | (_, 0) => 0,
        (x, y) => x.max(y),
    };
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lavapipe_like() -> (wgpu::Limits, wgpu::AdapterInfo) {
        let limits = wgpu::Limits {
            max_storage_buffers_per_shader_stage: 1 << 20,
            max_buffers_and_acceleration_structures_per_shader_stage: u32::MAX,
            max_storage_buffer_binding_size: (2 << 30) - 4,
            max_buffer_size: 1 << 32,
            max_compute_workgroup_storage_size: 64 << 10,
            max_compute_invocations_per_workgroup: 1024,
            min_uniform_buffer_offset_alignment: 16,
            ..wgpu::Limits::default()
        };
        let info = wgpu::AdapterInfo {
            subgroup_min_size: 8,
            subgroup_max_size: 8,
            ..wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan)
        };
        (limits, info)
    }

    #[test]
    fn names_parse_and_unknown_ones_list_the_choices() {
        for p in PROFILES {
            assert_eq!(p.name().parse::<LimitsProfile>(), Ok(p));
        }
        assert_eq!(" Apple-M1 ".parse(), Ok(LimitsProfile::AppleM1));
        let e = "apple-m2".parse::<LimitsProfile>().unwrap_err();
        assert!(
            e.contains("apple-m2") && e.contains("apple-m1, apple-m3"),
            "{e}"
        );
    }

    #[test]
    fn the_profile_is_the_worse_of_mac_and_adapter() {
        let (limits, info) = lavapipe_like();
        let feats = wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        let e = EffectiveLimits::of(LimitsProfile::AppleM1, &limits, feats, &info, false);
        let l = &e.limits;
        assert_eq!(l.max_storage_buffers_per_shader_stage, 29);
        assert_eq!(
            l.max_buffers_and_acceleration_structures_per_shader_stage,
            29
        );
        assert_eq!(l.max_compute_workgroup_storage_size, 32 << 10);
        assert_eq!(l.max_buffer_size, 4 << 30);
        // The adapter's own binding limit is lower than the Mac's: it stays.
        assert_eq!(l.max_storage_buffer_binding_size, (2 << 30) - 4);
        // Alignments are minimums: the larger wins.
        assert_eq!(l.min_uniform_buffer_offset_alignment, 256);
        assert_eq!(
            e.features,
            wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY,
            "no timestamps inside encoders on Apple GPUs"
        );
        assert_eq!(e.subgroup_sizes, (4, 64));
        assert!(e.unified_memory && e.metal_caps);
        let lowered = e.lowered(&limits);
        assert!(
            lowered
                .iter()
                .any(|s| s == "max_storage_buffers_per_shader_stage 1048576->29"),
            "{lowered:?}"
        );
        // The real adapter can have less than the Mac: it is never raised.
        let small = wgpu::Limits {
            max_compute_workgroup_storage_size: 16 << 10,
            ..limits.clone()
        };
        let e = EffectiveLimits::of(LimitsProfile::AppleM5, &small, feats, &info, false);
        assert_eq!(e.limits.max_compute_workgroup_storage_size, 16 << 10);
        assert_eq!(e.limits.max_buffer_size, 4 << 30, "the adapter's 4 GiB");
    }

    #[test]
    fn native_keeps_the_adapter_and_the_families_differ_where_wgpu_says() {
        let (limits, info) = lavapipe_like();
        let e = EffectiveLimits::of(
            LimitsProfile::Native,
            &limits,
            wgpu::Features::SUBGROUP,
            &info,
            false,
        );
        assert_eq!(e.limits, limits);
        assert_eq!(e.subgroup_sizes, (8, 8));
        assert!(!e.unified_memory && !e.metal_caps);
        assert!(e.lowered(&limits).is_empty());
        let (m1, m3, m5) = (
            LimitsProfile::AppleM1.device().unwrap(),
            LimitsProfile::AppleM3.device().unwrap(),
            LimitsProfile::AppleM5.device().unwrap(),
        );
        assert_eq!(m1.limits.max_texture_dimension_2d, 16384);
        assert_eq!(m5.limits.max_texture_dimension_2d, 32768);
        assert_eq!(m5.limits.max_buffer_size, 8 << 30);
        assert!(!m1
            .features
            .contains(wgpu::Features::SHADER_INT64_ATOMIC_MIN_MAX));
        assert!(m3
            .features
            .contains(wgpu::Features::SHADER_INT64_ATOMIC_MIN_MAX));
        // Every compute limit a kernel can hit is the same on the three families.
        for p in [&m3, &m5] {
            let (a, b) = (&m1.limits, &p.limits);
            assert_eq!(
                a.max_compute_workgroup_storage_size,
                b.max_compute_workgroup_storage_size
            );
            assert_eq!(
                a.max_storage_buffers_per_shader_stage,
                b.max_storage_buffers_per_shader_stage
            );
            assert_eq!(
                a.max_compute_invocations_per_workgroup,
                b.max_compute_invocations_per_workgroup
            );
        }
    }

    #[test]
    fn unknown_subgroup_sizes_stay_unknown() {
        assert_eq!(widest((0, 0), (4, 64)), (0, 0));
        assert_eq!(widest((8, 8), (4, 64)), (4, 64));
        assert_eq!(widest((32, 128), (4, 64)), (4, 128));
    }
}
