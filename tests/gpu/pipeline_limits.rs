//! Every pipeline the engine creates, held against the limits of each Apple GPU profile
//! (`K3_GPU_LIMITS`): buffers bound per stage (Metal's 31-entry buffer table, of which
//! wgpu leaves 29), workgroup memory, invocations per workgroup. The pipelines and their
//! overrides come from `pipeline_variants` for the adapter shape the profile gives, so a
//! kernel that grows past a Mac's limits fails here, naming the kernel and the limit,
//! without a Mac. The GPU suite also runs under `K3_GPU_LIMITS=apple-m1` (`.ci/run`),
//! where wgpu validates every buffer, binding and dispatch against the same limits.

use k3::backend::gpu::device::context::limits_profile::PROFILES;
use k3::backend::gpu::device::context::{workgroup_size, LimitsProfile};
use k3::backend::gpu::device::pipeline::AdapterShape;
use k3::backend::gpu::device::shaders::Shader;
use k3::backend::gpu::pipeline_variants;
use naga::valid::{Capabilities, ModuleInfo, ShaderStages, SubgroupOperationSet, Validator};
use naga::{AddressSpace, Module, ShaderStage};
use std::collections::HashMap;

/// What one pipeline needs of the limits.
#[derive(Debug, Default, PartialEq, Eq)]
struct Needs {
    storage_buffers: u32,
    uniform_buffers: u32,
    workgroup_bytes: u32,
    invocations: u32,
}

fn parse_wgsl(label: &str, src: &str, subgroups: bool) -> (Module, ModuleInfo) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
    let caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32
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
    let info = v
        .validate(&module)
        .unwrap_or_else(|e| panic!("{label}: {}", e.emit_to_string(src)));
    (module, info)
}

/// The resources `entry` of `parsed` uses with the overrides `consts`.
fn needs_of(
    parsed: &(Module, ModuleInfo),
    entry: &str,
    consts: &[(&'static str, f64)],
) -> Result<Needs, String> {
    let consts: naga::back::PipelineConstants =
        consts.iter().map(|&(k, v)| (k.to_string(), v)).collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &parsed.0,
        &parsed.1,
        Some((ShaderStage::Compute, entry)),
        &consts,
    )
    .map_err(|e| format!("overrides: {e}"))?;
    let (index, ep) = module
        .entry_points
        .iter()
        .enumerate()
        .find(|(_, ep)| ep.name == entry)
        .ok_or_else(|| format!("no entry point {entry}"))?;
    let used = info.get_entry_point(index);
    let mut n = Needs {
        invocations: ep.workgroup_size.iter().product(),
        ..Needs::default()
    };
    for (handle, var) in module.global_variables.iter() {
        if used[handle].is_empty() {
            continue;
        }
        match var.space {
            AddressSpace::Storage { .. } => n.storage_buffers += 1,
            AddressSpace::Uniform => n.uniform_buffers += 1,
            AddressSpace::WorkGroup => {
                n.workgroup_bytes += module.types[var.ty].inner.size(module.to_ctx())
            }
            _ => {}
        }
    }
    Ok(n)
}

/// Each way `needs` exceeds `limits`, naming the limit.
fn exceeded(needs: &Needs, limits: &wgpu::Limits) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |name: &str, need: u32, allowed: u32| {
        if need > allowed {
            out.push(format!("needs {need}, {name} is {allowed}"));
        }
    };
    check(
        "max_storage_buffers_per_shader_stage",
        needs.storage_buffers,
        limits.max_storage_buffers_per_shader_stage,
    );
    check(
        "max_uniform_buffers_per_shader_stage",
        needs.uniform_buffers,
        limits.max_uniform_buffers_per_shader_stage,
    );
    check(
        "max_buffers_and_acceleration_structures_per_shader_stage",
        needs.storage_buffers + needs.uniform_buffers,
        limits.max_buffers_and_acceleration_structures_per_shader_stage,
    );
    check(
        "max_compute_workgroup_storage_size",
        needs.workgroup_bytes,
        limits.max_compute_workgroup_storage_size,
    );
    check(
        "max_compute_invocations_per_workgroup",
        needs.invocations,
        limits.max_compute_invocations_per_workgroup,
    );
    out
}

/// The adapter shape the engine plans with on `profile`'s Mac.
fn shape_of(profile: LimitsProfile) -> (AdapterShape, wgpu::Limits) {
    let dev = profile.device().expect("an Apple profile");
    let shape = AdapterShape {
        wg: workgroup_size(&dev.limits).unwrap(),
        shared_bytes: dev.limits.max_compute_workgroup_storage_size,
        subgroup_sizes: dev.subgroup_sizes,
    };
    (shape, dev.limits)
}

/// Every variant the engine creates under `profile`, with and without subgroups, against
/// its limits: the failures, each naming the kernel and the limit.
fn failures(profile: LimitsProfile) -> (usize, Vec<String>) {
    let (shape, limits) = shape_of(profile);
    let mut parsed: HashMap<(Shader, bool), (Module, ModuleInfo)> = HashMap::new();
    let mut tried = 0;
    let mut failed = Vec::new();
    for subgroups in [false, true] {
        for v in pipeline_variants(shape, subgroups) {
            let p = parsed.entry((v.shader, subgroups)).or_insert_with(|| {
                parse_wgsl(v.shader.file(), &v.shader.source(subgroups), subgroups)
            });
            tried += 1;
            match needs_of(p, v.entry, &v.constants(shape.wg)) {
                Ok(n) => failed.extend(
                    exceeded(&n, &limits)
                        .into_iter()
                        .map(|e| format!("{profile}: {v}: {e}")),
                ),
                Err(e) => failed.push(format!("{profile}: {v}: {e}")),
            }
        }
    }
    (tried, failed)
}

#[test]
fn every_pipeline_fits_every_apple_profile() {
    for profile in PROFILES {
        if profile == LimitsProfile::Native {
            continue;
        }
        let (tried, failed) = failures(profile);
        assert!(tried > 50, "{profile}: only {tried} pipelines");
        assert!(
            failed.is_empty(),
            "{} of {tried} pipelines exceed the limits:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }
}

/// The check can fail: a kernel with 30 storage buffers and 40 KiB of workgroup memory is
/// reported with the kernel's name and both limits.
#[test]
fn a_kernel_past_the_limits_is_named_with_the_limit() {
    let bindings: String = (0..30)
        .map(|i| format!("@group(0) @binding({i}) var<storage, read_write> b{i}: array<f32>;\n"))
        .collect();
    let uses: String = (1..30).map(|i| format!("b0[0] += b{i}[0];\n")).collect();
    let src = format!(
        "{bindings}var<workgroup> scratch: array<f32, 10240>;\n\
         @compute @workgroup_size(256) fn too_wide(@builtin(local_invocation_index) l: u32) {{\n\
         scratch[l] = 1.0;\n{uses}b0[1] = scratch[0];\n}}\n"
    );
    let parsed = parse_wgsl("too_wide", &src, false);
    let n = needs_of(&parsed, "too_wide", &[]).unwrap();
    assert_eq!(
        n,
        Needs {
            storage_buffers: 30,
            uniform_buffers: 0,
            workgroup_bytes: 40960,
            invocations: 256,
        }
    );
    let (_, limits) = shape_of(LimitsProfile::AppleM1);
    let errs = exceeded(&n, &limits);
    assert!(
        errs.iter()
            .any(|e| e == "needs 30, max_storage_buffers_per_shader_stage is 29"),
        "{errs:?}"
    );
    assert!(
        errs.iter()
            .any(|e| e == "needs 40960, max_compute_workgroup_storage_size is 32768"),
        "{errs:?}"
    );
}
