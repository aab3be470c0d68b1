//! Free device-local memory of an adapter, for sizing the VRAM expert tier by default.
//!
//! wgpu has no portable "free VRAM" query, so this reaches through wgpu's HAL to the native
//! API where one exists:
//! - Vulkan: `VK_EXT_memory_budget` (`heapBudget - heapUsage` over the device-local heaps).
//!   Without the extension there is no figure (wgpu-hal also hides it on RADV, where Mesa
//!   reports it wrongly).
//! - Metal: `recommendedMaxWorkingSetSize - currentAllocatedSize` of the `MTLDevice`.
//! - DX12 and GL: no figure (DXGI's `QueryVideoMemoryInfo` would need the `windows` crate's
//!   DXGI bindings enabled for k3; not done).
//! - CPU-type adapters (lavapipe, WARP) and integrated GPUs (Apple Silicon, whose memory
//!   wgpu reports as unified, and iGPUs): no figure on purpose, their "VRAM" is host RAM,
//!   which the host expert cache already budgets; a default tier there would hold a second
//!   copy of the cached experts in the same memory.

/// Bytes of device-local memory free on `adapter` now, or `None` when the backend cannot
/// tell (see the module doc) or the adapter's memory is host RAM.
pub fn free_device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    if memory_is_host_ram(adapter.get_info().device_type) {
        return None;
    }
    reported_free_bytes(adapter)
}

/// Whether an adapter of this type computes in host RAM (CPU-type, integrated, unified).
fn memory_is_host_ram(t: wgpu::DeviceType) -> bool {
    matches!(t, wgpu::DeviceType::Cpu | wgpu::DeviceType::IntegratedGpu)
}

/// What the native API reports as free device-local memory, whatever the adapter type
/// (tests run it on lavapipe, which [`free_device_local_bytes`] skips).
pub fn reported_free_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    match adapter.get_info().backend {
        #[cfg(any(
            windows,
            target_os = "linux",
            target_os = "android",
            target_os = "freebsd"
        ))]
        wgpu::Backend::Vulkan => vulkan::free_bytes(adapter),
        #[cfg(target_vendor = "apple")]
        wgpu::Backend::Metal => metal::free_bytes(adapter),
        _ => None,
    }
}

/// Why [`free_device_local_bytes`] gave no figure for an adapter like `info`, for the
/// start-up line.
pub fn why_unknown(info: &wgpu::AdapterInfo) -> &'static str {
    match info.device_type {
        wgpu::DeviceType::Cpu => return "a CPU-type adapter's memory is host RAM",
        wgpu::DeviceType::IntegratedGpu => {
            return "an integrated GPU's memory is host RAM, which the host expert cache already budgets"
        }
        _ => {}
    }
    match info.backend {
        wgpu::Backend::Vulkan => "the Vulkan driver does not offer VK_EXT_memory_budget",
        wgpu::Backend::Metal => "Metal did not report its working-set size",
        _ => "this wgpu backend cannot report free VRAM",
    }
}

/// Free bytes over the device-local heaps, from `(device_local, budget, usage)` per heap;
/// a heap used past its budget counts as 0, not as negative.
pub fn sum_free_device_local(heaps: impl IntoIterator<Item = (bool, u64, u64)>) -> u64 {
    heaps
        .into_iter()
        .filter(|&(local, _, _)| local)
        .map(|(_, budget, usage)| budget.saturating_sub(usage))
        .fold(0u64, u64::saturating_add)
}

#[cfg(any(
    windows,
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd"
))]
mod vulkan {
    use ash::{ext, khr, vk};
    use wgpu::hal::api::Vulkan;

    /// `VK_EXT_memory_budget` through the adapter's ash instance and physical device.
    pub(in crate::backend::gpu) fn free_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
        // SAFETY: the HAL adapter is only read (its handles are queried, nothing is
        // destroyed), and the guard is dropped before this function returns.
        let hal = unsafe { adapter.as_hal::<Vulkan>() }?;
        let caps = hal.physical_device_capabilities();
        // The physical device must offer the extension for the budget struct to be valid
        // in the chain; wgpu-hal already drops it from this list on drivers that misreport.
        if !caps.supports_extension(ext::memory_budget::NAME) {
            return None;
        }
        let phd = hal.raw_physical_device();
        let shared = hal.shared_instance();
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
        // wgpu-hal enables VK_KHR_get_physical_device_properties2 whenever the instance
        // has it; otherwise the Vulkan 1.1 core entry point is the only other way.
        if shared
            .extensions()
            .contains(&khr::get_physical_device_properties2::NAME)
        {
            let ext = khr::get_physical_device_properties2::Instance::new(
                shared.entry(),
                shared.raw_instance(),
            );
            // SAFETY: `phd` belongs to this instance, the extension is enabled on it (checked
            // above), and `props` is a valid chain of two structs that outlive the call.
            unsafe { ext.get_physical_device_memory_properties2(phd, &mut props) };
        } else if shared.instance_api_version() >= vk::API_VERSION_1_1
            && caps.properties().api_version >= vk::API_VERSION_1_1
        {
            // SAFETY: both the instance and the device are Vulkan 1.1, so the core function
            // is loaded and valid for `phd`; `props` is a valid chain as above.
            unsafe {
                shared
                    .raw_instance()
                    .get_physical_device_memory_properties2(phd, &mut props)
            };
        } else {
            return None;
        }
        let mem = props.memory_properties;
        let count = (mem.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
        Some(super::sum_free_device_local((0..count).map(|h| {
            (
                mem.memory_heaps[h]
                    .flags
                    .contains(vk::MemoryHeapFlags::DEVICE_LOCAL),
                budget.heap_budget[h],
                budget.heap_usage[h],
            )
        })))
    }
}

#[cfg(target_vendor = "apple")]
mod metal {
    use objc2_metal::MTLDevice as _;
    use wgpu::hal::api::Metal;

    /// `recommendedMaxWorkingSetSize - currentAllocatedSize` of the adapter's `MTLDevice`.
    pub(in crate::backend::gpu) fn free_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
        // SAFETY: the HAL adapter is only read (two size properties of its device), and the
        // guard is dropped before this function returns.
        let hal = unsafe { adapter.as_hal::<Metal>() }?;
        let dev = hal.raw_device();
        let limit = dev.recommendedMaxWorkingSetSize();
        if limit == 0 {
            return None;
        }
        Some(limit.saturating_sub(dev.currentAllocatedSize() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_discrete_and_virtual_gpus_get_a_default_tier() {
        use wgpu::DeviceType as T;
        assert!(memory_is_host_ram(T::Cpu));
        assert!(memory_is_host_ram(T::IntegratedGpu));
        assert!(!memory_is_host_ram(T::DiscreteGpu));
        assert!(!memory_is_host_ram(T::VirtualGpu));
        assert!(!memory_is_host_ram(T::Other));
    }

    #[test]
    fn vram_sum_counts_only_device_local_heaps_and_clamps_overuse() {
        let g = 1u64 << 30;
        assert_eq!(
            sum_free_device_local([(true, 80 * g, 20 * g), (false, 64 * g, 0), (true, g, 2 * g)]),
            60 * g
        );
        assert_eq!(sum_free_device_local([(false, g, 0)]), 0);
        assert_eq!(sum_free_device_local([]), 0);
    }

    #[test]
    fn vram_reason_names_host_memory_adapters_first() {
        let mut info = wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan);
        assert!(why_unknown(&info).contains("CPU-type"));
        info.device_type = wgpu::DeviceType::IntegratedGpu;
        assert!(why_unknown(&info).contains("integrated GPU"));
        info.backend = wgpu::Backend::Metal;
        assert!(why_unknown(&info).contains("integrated GPU"));
        info.device_type = wgpu::DeviceType::DiscreteGpu;
        info.backend = wgpu::Backend::Vulkan;
        assert!(why_unknown(&info).contains("VK_EXT_memory_budget"));
    }
}
