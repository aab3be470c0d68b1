//! Where the GPU backend's uploads are written. wgpu stages every upload in a mapped buffer,
//! and on Vulkan its allocator (gpu-allocator, location `CpuToGpu`) places mapped buffers in
//! memory that is both device-local and host-visible whenever the GPU offers such a type.
//! When that heap spans the VRAM (resizable BAR), the single CPU copy out of the read buffer
//! writes across the bus straight into VRAM, and the copy into an expert's slot stays on the
//! device: there is no second host copy. Without such a type the staging is host memory, and
//! the GPU fetches it in a second transfer.

/// How uploads reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadPath {
    /// Staging in device-local, host-visible memory: the CPU's copy is the transfer.
    /// `window` is the size of the heap that memory type lives in.
    DeviceLocal {
        /// Bytes of the host-visible device-local heap.
        window: u64,
    },
    /// Staging in host memory; the GPU copies it over the bus.
    HostMemory,
    /// CPU and GPU share one memory (CPU-type adapters, integrated GPUs).
    Shared,
    /// The backend cannot tell.
    Unknown,
}

/// A mapped-write staging buffer smaller than this fits a classic 256 MiB BAR window but many
/// expert uploads at once do not; such a window is reported as such.
const SMALL_WINDOW: u64 = 1 << 30;

impl UploadPath {
    /// One line for `k3 devices`.
    pub fn describe(self) -> String {
        match self {
            UploadPath::DeviceLocal { window } if window < SMALL_WINDOW => format!(
                "written into VRAM through a {:.0} MiB host-visible window; uploads past it stage in host memory",
                window as f64 / (1u64 << 20) as f64
            ),
            UploadPath::DeviceLocal { window } => format!(
                "written straight into VRAM (host-visible device-local heap of {:.1} GiB: the read buffer is copied once)",
                window as f64 / (1u64 << 30) as f64
            ),
            UploadPath::HostMemory => {
                "staged in host memory, then copied by the GPU (no resizable BAR)".into()
            }
            UploadPath::Shared => "CPU and GPU share memory".into(),
            UploadPath::Unknown => "not reported by this backend".into(),
        }
    }
}

/// The path for memory types given as `(device_local, host_visible, host_coherent, heap
/// bytes)`, chosen the way gpu-allocator chooses for mapped writes: a coherent
/// host-visible type that is also device-local when one exists, else host memory.
pub fn classify(types: impl IntoIterator<Item = (bool, bool, bool, u64)>) -> UploadPath {
    let mut host = false;
    let mut window = None::<u64>;
    for (local, visible, coherent, heap) in types {
        if !(visible && coherent) {
            continue;
        }
        if local {
            window = Some(window.map_or(heap, |w| w.max(heap)));
        } else {
            host = true;
        }
    }
    match (window, host) {
        (Some(window), _) => UploadPath::DeviceLocal { window },
        (None, true) => UploadPath::HostMemory,
        (None, false) => UploadPath::Unknown,
    }
}

/// Whether an adapter of `device_type` shares one memory with the CPU. wgpu reports it in
/// the device type: Metal says `IntegratedGpu` exactly when the device has unified memory
/// (Apple silicon; `MTLDevice.hasUnifiedMemory`), DX12 when the adapter is UMA, Vulkan for
/// an integrated GPU; a CPU-type adapter (lavapipe, WARP) computes in host memory.
pub fn unified_memory(device_type: wgpu::DeviceType) -> bool {
    matches!(
        device_type,
        wgpu::DeviceType::Cpu | wgpu::DeviceType::IntegratedGpu
    )
}

/// How uploads reach `adapter`'s memory.
pub fn of(adapter: &wgpu::Adapter) -> UploadPath {
    let info = adapter.get_info();
    if unified_memory(info.device_type) {
        return UploadPath::Shared;
    }
    match info.backend {
        #[cfg(any(
            windows,
            target_os = "linux",
            target_os = "android",
            target_os = "freebsd"
        ))]
        wgpu::Backend::Vulkan => vulkan_types(adapter).map_or(UploadPath::Unknown, classify),
        _ => UploadPath::Unknown,
    }
}

#[cfg(any(
    windows,
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd"
))]
fn vulkan_types(adapter: &wgpu::Adapter) -> Option<Vec<(bool, bool, bool, u64)>> {
    use ash::vk::MemoryPropertyFlags as F;
    // SAFETY: the HAL adapter is only read (its handles are queried, nothing is destroyed),
    // and the guard is dropped before this function returns.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let inst = hal.shared_instance().raw_instance();
    // SAFETY: the physical device belongs to this instance; the call only fills the
    // returned struct.
    let props = unsafe { inst.get_physical_device_memory_properties(hal.raw_physical_device()) };
    let heaps =
        &props.memory_heaps[..(props.memory_heap_count as usize).min(props.memory_heaps.len())];
    let types =
        &props.memory_types[..(props.memory_type_count as usize).min(props.memory_types.len())];
    Some(
        types
            .iter()
            .filter_map(|t| {
                let f = t.property_flags;
                heaps.get(t.heap_index as usize).map(|h| {
                    (
                        f.contains(F::DEVICE_LOCAL),
                        f.contains(F::HOST_VISIBLE),
                        f.contains(F::HOST_COHERENT),
                        h.size,
                    )
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn integrated_and_cpu_adapters_share_memory() {
        use wgpu::DeviceType as T;
        assert!(unified_memory(T::IntegratedGpu));
        assert!(unified_memory(T::Cpu));
        for t in [T::DiscreteGpu, T::VirtualGpu, T::Other] {
            assert!(!unified_memory(t), "{t:?}");
        }
    }

    #[test]
    fn a_bar_heap_over_the_vram_is_the_direct_path() {
        // A discrete NVIDIA GPU's types (94 GiB of VRAM), as its Vulkan driver lists them.
        let nvidia = [
            (false, false, false, 94 * GIB),
            (true, false, false, 140 * GIB),
            (false, true, true, 94 * GIB),
            (false, true, true, 94 * GIB),
            (true, true, true, 140 * GIB),
        ];
        assert_eq!(
            classify(nvidia),
            UploadPath::DeviceLocal { window: 140 * GIB }
        );
        assert!(classify(nvidia).describe().contains("straight into VRAM"));
    }

    #[test]
    fn a_small_bar_window_and_no_window_say_so() {
        let small = [
            (true, false, false, 24 * GIB),
            (false, true, true, 64 * GIB),
            (true, true, true, 256 << 20),
        ];
        let p = classify(small);
        assert_eq!(p, UploadPath::DeviceLocal { window: 256 << 20 });
        assert!(p.describe().contains("256 MiB"), "{}", p.describe());
        let none = [
            (true, false, false, 24 * GIB),
            (false, true, true, 64 * GIB),
        ];
        assert_eq!(classify(none), UploadPath::HostMemory);
        // Visible but not coherent is not what mapped writes get.
        assert_eq!(classify([(true, true, false, GIB)]), UploadPath::Unknown);
    }
}
