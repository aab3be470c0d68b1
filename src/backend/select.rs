//! Which backend a run uses: `--backend auto|gpu|cpu`, `--adapter NAME`, and the variables
//! users already set (`K3_GPU`, `K3_METAL`, `K3_VK`, read by the command line; wgpu's own
//! `WGPU_BACKEND`).

use super::gpu::{GpuBackend, GpuOptions};
use anyhow::{anyhow, Result};

/// The `--backend` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// GPU when a real (non-CPU) adapter exists or a GPU variable asks for one; else CPU.
    Auto,
    /// The GPU or nothing (CPU-type adapters such as lavapipe accepted).
    Gpu,
    /// The CPU oracle.
    Cpu,
}

/// The outcome of [`select`].
pub enum Selected {
    /// A started GPU backend.
    Gpu(Box<GpuBackend>),
    /// Run on the CPU; `fallback` holds the line to print when the GPU was wanted but failed.
    Cpu {
        /// `[K3-GPU] FAILED — CPU only: <reason>`, when the GPU could not start.
        fallback: Option<String>,
    },
}

/// The variables that ask for the GPU, in the order they are reported.
pub const GPU_VARIABLES: [&str; 3] = ["K3_GPU", "K3_METAL", "K3_VK"];

/// The first GPU variable that `lookup` (the environment, read by the command line) sets to
/// a true value (`1`, `true`, `yes`, `on`).
pub fn gpu_variable(lookup: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
    GPU_VARIABLES.into_iter().find(|v| {
        lookup(v).is_some_and(|s| {
            matches!(
                s.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
    })
}

/// The line printed when an automatic or variable-requested GPU start fails.
pub fn failed_line(reason: &str) -> String {
    format!("[K3-GPU] FAILED — CPU only: {reason}")
}

/// Starts the backend `kind` asks for, a GPU one with `base` (adapter, tuning). Under `Gpu`
/// a failure is an error; under `Auto` it falls back to the CPU with the FAILED line (a
/// GPU variable, `gpu_variable_set`, or `--adapter` makes `Auto` accept CPU-type adapters,
/// as an explicit request).
pub fn select(kind: BackendKind, base: &GpuOptions, gpu_variable_set: bool) -> Result<Selected> {
    let explicit = base.adapter.is_some() || gpu_variable_set;
    let opts = |allow_cpu_adapter| GpuOptions {
        allow_cpu_adapter,
        ..base.clone()
    };
    match kind {
        BackendKind::Cpu => Ok(Selected::Cpu { fallback: None }),
        BackendKind::Gpu => GpuBackend::new(&opts(true))
            .map(|g| Selected::Gpu(Box::new(g)))
            .map_err(|e| anyhow!("--backend gpu: the GPU could not start: {e:#}")),
        BackendKind::Auto => match GpuBackend::new(&opts(explicit)) {
            Ok(g) => Ok(Selected::Gpu(Box::new(g))),
            Err(e) => Ok(Selected::Cpu {
                fallback: Some(failed_line(&format!("{e:#}"))),
            }),
        },
    }
}
