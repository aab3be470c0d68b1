//! A compute pipeline as data: module, entry point, the override constants its dispatch
//! sets and whether the module takes the subgroup reductions.
//!
//! Each kernel module lists the pipelines it creates (`pipeline_variants` in
//! `kernels/*.rs` and `experts/mod.rs`), running the functions its dispatch builds the
//! overrides with over the geometries the engine uses, so the list follows the code;
//! [`crate::backend::gpu::pipeline_variants`] gathers them.
//! [`GpuContext::pipeline`](crate::backend::gpu::device::context::GpuContext::pipeline)
//! builds every pipeline from a [`PipelineVariant`] and refuses one whose kind (module,
//! entry, override names) the list lacks, and `tests/gpu/shader_translation.rs` translates every
//! listed variant to MSL, HLSL and SPIR-V: a new kernel or override is tested on every
//! backend's shading language as soon as the engine can create it.

use crate::backend::gpu::device::shaders::Shader;
use std::fmt;

/// One compute pipeline: a module (composed for `subgroups`), an entry point and the
/// override constants its dispatch sets.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PipelineVariant {
    /// Module family.
    pub shader: Shader,
    /// Entry point.
    pub entry: &'static str,
    /// Override constants as the dispatch sets them (`WG` only where it sets its own).
    pub consts: Vec<(&'static str, u32)>,
    /// Whether the module is composed with the subgroup reductions (it then needs the
    /// adapter's SUBGROUP feature).
    pub subgroups: bool,
}

/// What identifies a kind of pipeline whatever the override values: module, entry point
/// and the names of the overrides set.
pub type PipelineKind = (Shader, &'static str, Vec<&'static str>);

impl PipelineVariant {
    /// The full WGSL text of the module.
    pub fn source(&self) -> String {
        self.shader.source(self.subgroups)
    }

    /// Whether creating the pipeline needs the adapter's SUBGROUP feature.
    pub fn needs_subgroups(&self) -> bool {
        self.subgroups && self.shader.reduces()
    }

    /// The override constants the pipeline is created with on workgroups of `wg` lanes:
    /// the dispatch's, and `WG = wg` unless the dispatch sets its own.
    pub fn constants(&self, wg: u32) -> Vec<(&'static str, f64)> {
        let mut all: Vec<(&str, f64)> = self
            .consts
            .iter()
            .map(|&(k, v)| (k, f64::from(v)))
            .collect();
        if !self.consts.iter().any(|&(k, _)| k == "WG") {
            all.push(("WG", f64::from(wg)));
        }
        all
    }

    /// The variant's kind: module, entry and the override names, sorted.
    pub fn kind(&self) -> PipelineKind {
        let mut names: Vec<&'static str> = self.consts.iter().map(|&(k, _)| k).collect();
        names.sort_unstable();
        (self.shader, self.entry, names)
    }
}

impl fmt::Display for PipelineVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let consts: Vec<String> = self
            .consts
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        write!(
            f,
            "{}:{} [{}] subgroups {}",
            self.shader.file(),
            self.entry,
            consts.join(","),
            if self.subgroups { "on" } else { "off" }
        )
    }
}

/// The adapter facts the overrides derive from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdapterShape {
    /// Workgroup size of every kernel (`GpuContext::wg`).
    pub wg: u32,
    /// Workgroup memory a kernel may use, in bytes.
    pub shared_bytes: u32,
    /// Smallest and largest subgroup (`AdapterInfo::subgroup_min_size`, `max`).
    pub subgroup_sizes: (u32, u32),
}

impl AdapterShape {
    /// Adapters whose facts give different overrides: a discrete GPU (48 KiB of workgroup
    /// memory, 32-lane subgroups), Apple's GPUs (32 KiB), and a small one (64 lanes, 16 KiB,
    /// where no chunk tile of 256 lanes fits and fewer units of x are staged).
    pub const TYPICAL: [AdapterShape; 3] = [
        AdapterShape {
            wg: 256,
            shared_bytes: 48 << 10,
            subgroup_sizes: (32, 32),
        },
        AdapterShape {
            wg: 256,
            shared_bytes: 32 << 10,
            subgroup_sizes: (32, 32),
        },
        AdapterShape {
            wg: 64,
            shared_bytes: 16 << 10,
            subgroup_sizes: (8, 64),
        },
    ];
}

/// The pipelines the kernel modules list, each once, in the order first listed.
#[derive(Debug)]
pub struct VariantList {
    subgroups: bool,
    out: Vec<PipelineVariant>,
}

impl VariantList {
    /// An empty list of pipelines whose modules are composed with the subgroup reductions
    /// (`subgroups`) or the workgroup-memory ones.
    pub fn new(subgroups: bool) -> Self {
        Self {
            subgroups,
            out: Vec::new(),
        }
    }

    /// Adds the pipeline of `shader`'s `entry` with `consts`, unless it is listed already.
    pub fn push(&mut self, shader: Shader, entry: &'static str, consts: Vec<(&'static str, u32)>) {
        let v = PipelineVariant {
            shader,
            entry,
            consts,
            subgroups: self.subgroups,
        };
        if !self.out.contains(&v) {
            self.out.push(v);
        }
    }

    /// Whether the modules are composed with the subgroup reductions.
    pub fn subgroups(&self) -> bool {
        self.subgroups
    }

    /// The listed pipelines.
    pub fn into_vec(self) -> Vec<PipelineVariant> {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_add_the_workgroup_size_unless_the_dispatch_sets_it() {
        let v = PipelineVariant {
            shader: Shader::KdaStep,
            entry: "kda_norm",
            consts: vec![("WG", 32)],
            subgroups: true,
        };
        assert_eq!(v.constants(256), vec![("WG", 32.0)]);
        let v = PipelineVariant {
            consts: vec![("CG", 16)],
            entry: "kda_state",
            ..v
        };
        assert_eq!(v.constants(256), vec![("CG", 16.0), ("WG", 256.0)]);
        assert!(v.needs_subgroups());
        let plain = PipelineVariant {
            shader: Shader::Elementwise,
            ..v.clone()
        };
        assert!(!plain.needs_subgroups());
        assert_eq!(
            v.to_string(),
            "kda_step.wgsl:kda_state [CG=16] subgroups on"
        );
    }
}
