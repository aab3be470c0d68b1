//! Every pipeline the engine creates, translated through naga to each shading language a
//! wgpu backend feeds its driver: MSL (Metal), HLSL (DX12) and SPIR-V (Vulkan). The
//! pipelines come from `pipeline_variants`, the list the engine itself creates its pipelines
//! against (a pipeline it lacks is a device error), so a new kernel, entry point or override
//! is translated here without touching this file. No GPU is needed: an error here is what
//! would otherwise first show on a Mac or a Windows machine, at run time.
//!
//! The language versions are the ones wgpu 30's backends ask for (wgpu-hal's
//! `metal/adapter.rs`, `dx12/adapter.rs`, `vulkan/adapter.rs`): the newest the machine has,
//! from the oldest that can run the engine up to the newest wgpu knows.

use k3::backend::gpu::device::context::default_matvec_checks;
use k3::backend::gpu::device::pipeline::{AdapterShape, PipelineVariant};
use k3::backend::gpu::device::shaders::Shader;
use k3::backend::gpu::kernels::matrix_units::{
    pipeline_variants as matrix_unit_variants, SUBGROUP_COUNTS,
};
use k3::backend::gpu::pipeline_variants;
use naga::back::{hlsl, msl, spv};
use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
use naga::valid::{Capabilities, ModuleInfo, ShaderStages, SubgroupOperationSet, Validator};
use naga::{AddressSpace, Module, ShaderStage, StorageAccess};
use std::collections::{BTreeSet, HashMap, HashSet};

/// MSL versions wgpu's Metal backend asks for: 2.2 (macOS 10.15, the oldest whose GPUs
/// report the families wgpu checks before it offers subgroups), 2.3 (macOS 11, the first on
/// Apple silicon) and 4.0 (macOS 26, the newest wgpu 30 knows).
const MSL_VERSIONS: [(u8, u8); 3] = [(2, 2), (2, 3), (4, 0)];

/// HLSL shader models wgpu's DX12 backend asks for: 5.1 (FXC, where no DXC is found; no
/// wave operations, so no subgroups), 6.0 (the oldest DXC model it exposes an adapter with)
/// and 6.9 (the newest).
const HLSL_MODELS: [hlsl::ShaderModel; 3] = [
    hlsl::ShaderModel::V5_1,
    hlsl::ShaderModel::V6_0,
    hlsl::ShaderModel::V6_9,
];

/// SPIR-V versions wgpu's Vulkan backend asks for: 1.0 (Vulkan 1.0; no subgroup
/// operations), 1.3 (Vulkan 1.1) and 1.6 (Vulkan 1.3 and later).
const SPIRV_VERSIONS: [(u8, u8); 3] = [(1, 0), (1, 3), (1, 6)];

/// Whether a target version has subgroup operations, and so whether wgpu offers the
/// SUBGROUP feature there (the engine then composes the modules with subgroup reductions).
fn has_subgroups(target: &Target) -> bool {
    match *target {
        Target::Msl(_) => true,
        Target::Hlsl(m) => m >= hlsl::ShaderModel::V6_0,
        Target::Spirv(v) => v >= (1, 3),
    }
}

/// One shading language at one version.
#[derive(Clone, Copy, Debug)]
enum Target {
    Msl((u8, u8)),
    Hlsl(hlsl::ShaderModel),
    Spirv((u8, u8)),
}

/// Entry points a module has that the engine never runs: the MXFP4 module is composed
/// with the shared matvec driver, whose dense entries only the dense formats use.
const UNUSED_ENTRIES: [(Shader, &str); 4] = [
    (Shader::MatvecMxfp4, "dense"),
    (Shader::MatvecMxfp4, "dense_xs"),
    (Shader::MatvecMxfp4, "dense_cs"),
    (Shader::MatvecMxfp4, "gemm"),
];

/// A module parsed and validated as wgpu does before any pipeline is made of it.
fn parse(sh: Shader, subgroups: bool) -> (Module, ModuleInfo) {
    let src = sh.source(subgroups);
    let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
        panic!(
            "{} (subgroups {subgroups}): {}",
            sh.file(),
            e.emit_to_string(&src)
        )
    });
    let coop = if sh == Shader::MatmulCoop {
        Capabilities::SHADER_FLOAT16 | Capabilities::COOPERATIVE_MATRIX
    } else {
        Capabilities::empty()
    };
    let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32
        | coop
        | if subgroups {
            Capabilities::SUBGROUP
        } else {
            Capabilities::empty()
        };
    let mut v = Validator::new(naga::valid::ValidationFlags::all(), caps);
    if subgroups {
        v.subgroup_stages(ShaderStages::COMPUTE);
        v.subgroup_operations(SubgroupOperationSet::all());
    }
    let info = v.validate(&module).unwrap_or_else(|e| {
        panic!(
            "{} (subgroups {subgroups}): {}",
            sh.file(),
            e.emit_to_string(&src)
        )
    });
    (module, info)
}

/// The bounds-check policy and loop bounding wgpu builds `sh` with in the engine: the
/// matvec modules with `default_matvec_checks`, the others with wgpu's full checks.
fn checks_of(sh: Shader) -> (BoundsCheckPolicy, bool) {
    if sh.is_matvec() {
        let c = default_matvec_checks();
        let policy = if c.bounds_checks {
            BoundsCheckPolicy::Restrict
        } else {
            BoundsCheckPolicy::Unchecked
        };
        (policy, c.force_loop_bounding)
    } else {
        (BoundsCheckPolicy::Restrict, true)
    }
}

/// `variant` translated to `target`: `Err` with the backend's message.
fn translate(
    variant: &PipelineVariant,
    wg: u32,
    parsed: &(Module, ModuleInfo),
    target: Target,
) -> Result<(), String> {
    let consts: naga::back::PipelineConstants = variant
        .constants(wg)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &parsed.0,
        &parsed.1,
        Some((ShaderStage::Compute, variant.entry)),
        &consts,
    )
    .map_err(|e| format!("overrides: {e}"))?;
    let entry = Some((ShaderStage::Compute, variant.entry.to_string()));
    let (policy, loop_bounding) = checks_of(variant.shader);
    let policies = BoundsCheckPolicies {
        index: policy,
        buffer: policy,
        image_load: policy,
        binding_array: BoundsCheckPolicy::Unchecked,
    };
    match target {
        Target::Msl(lang_version) => {
            let mut resources = msl::BindingMap::new();
            for (_, var) in module.global_variables.iter() {
                if let Some(rb) = &var.binding {
                    let mutable = matches!(var.space,
                        AddressSpace::Storage { access } if access.contains(StorageAccess::STORE));
                    resources.insert(
                        *rb,
                        msl::BindTarget {
                            buffer: Some(rb.binding as u8),
                            mutable,
                            ..Default::default()
                        },
                    );
                }
            }
            let options = msl::Options {
                lang_version,
                per_entry_point_map: msl::EntryPointResourceMap::from([(
                    variant.entry.to_string(),
                    msl::EntryPointResources {
                        resources,
                        immediates_buffer: None,
                        sizes_buffer: Some(30),
                    },
                )]),
                fake_missing_bindings: false,
                bounds_check_policies: policies,
                zero_initialize_workgroup_memory: false,
                force_loop_bounding: loop_bounding,
                ..Default::default()
            };
            let pipeline = msl::PipelineOptions {
                entry_point: entry,
                ..Default::default()
            };
            msl::write_string(&module, &info, &options, &pipeline)
                .map(|_| ())
                .map_err(|e| format!("{e}"))
        }
        Target::Hlsl(shader_model) => {
            let options = hlsl::Options {
                shader_model,
                zero_initialize_workgroup_memory: true,
                restrict_indexing: true,
                force_loop_bounding: true,
                ..Default::default()
            };
            let pipeline = hlsl::PipelineOptions { entry_point: entry };
            let mut out = String::new();
            hlsl::Writer::new(&mut out, &options, &pipeline)
                .write(&module, &info, None)
                .map(|_| ())
                .map_err(|e| format!("{e}"))
        }
        Target::Spirv(lang_version) => {
            let options = spv::Options {
                lang_version,
                bounds_check_policies: policies,
                zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
                force_loop_bounding: loop_bounding,
                ..Default::default()
            };
            let pipeline = spv::PipelineOptions {
                shader_stage: ShaderStage::Compute,
                entry_point: variant.entry.to_string(),
            };
            spv::write_vec(&module, &info, &options, Some(&pipeline))
                .map(|_| ())
                .map_err(|e| format!("{e}"))
        }
    }
}

/// Every listed variant on every adapter shape, with and without subgroups, to every
/// target that would run it; returns the failures, each naming shader, entry point,
/// variant and target.
fn failures(targets: &[Target]) -> (usize, Vec<String>) {
    let mut parsed: HashMap<(Shader, bool), (Module, ModuleInfo)> = HashMap::new();
    let mut done = BTreeSet::new();
    let mut tried = 0;
    let mut failed = Vec::new();
    for a in AdapterShape::TYPICAL {
        for subgroups in [false, true] {
            for v in pipeline_variants(a, subgroups) {
                if !done.insert((v.to_string(), a.wg)) {
                    continue;
                }
                let p = parsed
                    .entry((v.shader, subgroups))
                    .or_insert_with(|| parse(v.shader, subgroups));
                for &t in targets {
                    if v.needs_subgroups() && !has_subgroups(&t) {
                        continue;
                    }
                    tried += 1;
                    if let Err(e) = translate(&v, a.wg, p, t) {
                        failed.push(format!("{v} (WG {}) to {t:?}: {e}", a.wg));
                    }
                }
            }
        }
    }
    (tried, failed)
}

fn check(targets: &[Target]) {
    let (tried, failed) = failures(targets);
    assert!(tried > 0);
    assert!(
        failed.is_empty(),
        "{} of {tried} translations failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn every_pipeline_variant_translates_to_msl() {
    check(&MSL_VERSIONS.map(Target::Msl));
}

#[test]
fn every_pipeline_variant_translates_to_hlsl() {
    check(&HLSL_MODELS.map(Target::Hlsl));
}

#[test]
fn every_pipeline_variant_translates_to_spirv() {
    check(&SPIRV_VERSIONS.map(Target::Spirv));
}

/// The list covers every entry point of every module (bar those the engine never runs), so
/// a new kernel cannot be left out of the translations.
#[test]
fn every_entry_point_of_every_module_is_a_listed_variant() {
    for subgroups in [false, true] {
        let listed: HashSet<(Shader, &str)> = AdapterShape::TYPICAL
            .iter()
            .flat_map(|&a| pipeline_variants(a, subgroups))
            .map(|v| (v.shader, v.entry))
            .collect();
        for sh in Shader::ALL {
            let (module, _) = parse(sh, subgroups);
            for ep in &module.entry_points {
                let name = ep.name.as_str();
                let unused = UNUSED_ENTRIES.contains(&(sh, name));
                let found = listed.iter().any(|&(s, e)| s == sh && e == name);
                assert!(
                    found != unused,
                    "{}:{name} (subgroups {subgroups}): {}",
                    sh.file(),
                    if unused {
                        "listed as unused but the engine creates it"
                    } else {
                        "an entry point no pipeline variant lists"
                    }
                );
            }
        }
    }
}

/// The matrix-unit kernels (matmul_coop.wgsl) at every subgroup count, to the SPIR-V of the
/// Vulkan versions with cooperative matrices, the only backend wgpu offers 16x16 f16 matrix
/// units on; and every entry point of the module is one of them.
#[test]
fn matrix_unit_variants_translate_to_spirv() {
    let parsed = parse(Shader::MatmulCoop, false);
    let mut failed = Vec::new();
    let mut listed = HashSet::new();
    for sgs in SUBGROUP_COUNTS {
        for v in matrix_unit_variants(sgs) {
            listed.insert(v.entry);
            for t in [Target::Spirv((1, 3)), Target::Spirv((1, 6))] {
                if let Err(e) = translate(&v, 256, &parsed, t) {
                    failed.push(format!("{v} to {t:?}: {e}"));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    for ep in &parsed.0.entry_points {
        assert!(
            listed.contains(ep.name.as_str()),
            "matmul_coop.wgsl:{}: an entry point no matrix-unit variant lists",
            ep.name
        );
    }
}
