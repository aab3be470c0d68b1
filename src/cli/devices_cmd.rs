//! `k3 devices`: every adapter wgpu sees, with the limits and features the kernels use.

use clap::Args;
use k3::backend::gpu::device::adapters;
use k3::backend::gpu::LimitsProfile;

/// Flags of `k3 devices` (`WGPU_BACKEND` narrows the backends searched).
#[derive(Args, Debug)]
pub(crate) struct DevicesArgs {
    /// Show the limits the engine would open each adapter with under this profile
    /// (apple-m1, apple-m3, apple-m5: wgpu's Metal values, each limit the lower of the
    /// profile's and the adapter's); native = the adapter's own.
    #[arg(
        long = "gpu-limits",
        env = "K3_GPU_LIMITS",
        value_name = "PROFILE",
        default_value = "native"
    )]
    pub gpu_limits: LimitsProfile,
}

/// Prints the adapter list.
pub(crate) fn run(a: DevicesArgs) -> anyhow::Result<()> {
    let list = adapters::list(a.gpu_limits);
    if list.is_empty() {
        println!(
            "no GPU adapters (WGPU_BACKEND={}); k3 runs on the CPU",
            std::env::var("WGPU_BACKEND").unwrap_or_else(|_| "unset".into())
        );
    }
    for (i, a) in list.iter().enumerate() {
        println!("{}", a.render(i));
    }
    Ok(())
}
