//! `k3 devices`: every adapter wgpu sees, with the limits and features the kernels use.

use clap::Args;
use k3::backend::gpu::adapters;

/// Flags of `k3 devices` (none yet; `WGPU_BACKEND` narrows the backends searched).
#[derive(Args, Debug)]
pub struct DevicesArgs {}

/// Prints the adapter list.
pub fn run(_a: DevicesArgs) -> anyhow::Result<()> {
    let list = adapters::list();
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
