//! What the engine takes from an adapter's limits and features, whatever the adapter
//! claims: the workgroup size, the binding cap (below 4 GiB on Metal), subgroup use.

use anyhow::{bail, Result};

/// Largest workgroup any kernel uses; the reduction scratch arrays are sized for it.
pub const MAX_WG: u32 = 256;

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
/// bound the caller asks for): the adapter's limits, `MAX_BINDING_BYTES` on every backend
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
pub fn workgroup_size(l: &wgpu::Limits) -> Result<u32> {
    let cap = l
        .max_compute_invocations_per_workgroup
        .min(l.max_compute_workgroup_size_x)
        .min(MAX_WG);
    if cap < 32 {
        bail!("the adapter allows only {cap} invocations per workgroup; the kernels need 32");
    }
    Ok(1 << (31 - cap.leading_zeros()))
}

#[cfg(test)]
mod tests {
    use super::{backend_binding_cap, max_binding_bytes, use_subgroups, MAX_BINDING_BYTES};

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
}
