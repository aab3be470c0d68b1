//! What the Vulkan driver made of a kernel: registers, code size and (where the driver shares
//! it) the compiled code, through `VK_KHR_pipeline_executable_properties`.
//!
//! The WGSL is composed exactly as the engine composes it, overrides resolved by naga and
//! written to SPIR-V with the options wgpu uses on Vulkan, then compiled by the driver. Use it
//! to see why a kernel variant is slow (register count bounds occupancy, spills show up as
//! local memory) before spending device time on benchmarks.
//!
//! ```text
//! cargo run --release --example shader_stats -- [--dump DIR] [--unchecked] [--wgsl-dir DIR] [--spirv-only] \
//!     SHADER:ENTRY[:NAME=VALUE,...] ...
//! # e.g. matvec_int4:dense:LPR=32,RPL=4,DEC=1,PIPE=1
//! ```
//! SHADER is a file stem under shaders_wgsl/ (matvec_int4, matvec_mxfp4, read_bench, ...).
//! `--unchecked` writes the SPIR-V without naga's index clamps too, as
//! `MatvecShape::unchecked` does; `--dump DIR` saves every text representation the driver
//! returns; `--wgsl-dir DIR` reads the WGSL files from DIR at run time (e.g. `shaders_wgsl`
//! of the working tree the device tool copies), so a variant's register count needs an
//! edit here and one device call, no rebuild; `--spirv-only` stops after naga (no driver
//! needed), to check such a variant here first; with `--dump DIR` it writes the SPIR-V to
//! DIR (`spirv-dis` reads it). The SPIR-V is written as the engine builds its matvec modules
//! (`default_matvec_checks`: index clamps, no loop counters or division guards).

use anyhow::{anyhow, bail, Context, Result};
use ash::vk;
use k3::backend::gpu::device::shaders::Shader;
use std::ffi::CStr;
use std::path::{Path, PathBuf};

/// One kernel to compile: its module, entry point and override values.
struct Spec {
    shader: Shader,
    entry: String,
    consts: naga::back::PipelineConstants,
    label: String,
}

fn parse_spec(s: &str) -> Result<Spec> {
    let mut parts = s.splitn(3, ':');
    let stem = parts.next().unwrap_or_default();
    let entry = parts
        .next()
        .ok_or_else(|| anyhow!("{s}: expected SHADER:ENTRY[:NAME=VALUE,...]"))?;
    let shader = Shader::ALL
        .into_iter()
        .find(|sh| sh.file().trim_end_matches(".wgsl") == stem)
        .ok_or_else(|| anyhow!("{s}: no shader file {stem}.wgsl"))?;
    let mut consts = naga::back::PipelineConstants::default();
    for kv in parts
        .next()
        .unwrap_or_default()
        .split(',')
        .filter(|kv| !kv.is_empty())
    {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("{s}: override {kv} is not NAME=VALUE"))?;
        let v: f64 = v
            .parse()
            .with_context(|| format!("{s}: override {k} value {v}"))?;
        consts.insert(k.to_string(), v);
    }
    Ok(Spec {
        shader,
        entry: entry.to_string(),
        consts,
        label: s.to_string(),
    })
}

/// The SPIR-V of one entry point with overrides resolved, and its bindings (group 0).
/// Binding number and descriptor type of each resource of group 0.
type Bindings = Vec<(u32, vk::DescriptorType)>;

/// `wgsl_dir`: compose the module from that directory's files instead of the built-in text.
fn compile(spec: &Spec, unchecked: bool, wgsl_dir: Option<&Path>) -> Result<(Vec<u32>, Bindings)> {
    use naga::back::spv;
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
    use naga::valid::{
        Capabilities, ShaderStages, SubgroupOperationSet, ValidationFlags, Validator,
    };
    let src = match wgsl_dir {
        Some(dir) => spec.shader.source_from(true, dir)?,
        None => spec.shader.source(true),
    };
    let module = naga::front::wgsl::parse_str(&src)
        .map_err(|e| anyhow!("{}: {}", spec.label, e.emit_to_string(&src)))?;
    let mut v = Validator::new(
        ValidationFlags::all(),
        Capabilities::SHADER_FLOAT16_IN_FLOAT32 | Capabilities::SUBGROUP,
    );
    v.subgroup_stages(ShaderStages::COMPUTE);
    v.subgroup_operations(SubgroupOperationSet::all());
    let info = v
        .validate(&module)
        .map_err(|e| anyhow!("{}: {}", spec.label, e.emit_to_string(&src)))?;
    let stage = naga::ShaderStage::Compute;
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((stage, &spec.entry)),
        &spec.consts,
    )
    .map_err(|e| anyhow!("{}: overrides: {e}", spec.label))?;
    // wgpu on a device with robustBufferAccess2 (NVIDIA): buffers unchecked, indices clamped.
    let index = if unchecked {
        BoundsCheckPolicy::Unchecked
    } else {
        BoundsCheckPolicy::Restrict
    };
    let options = spv::Options {
        lang_version: (1, 3),
        bounds_check_policies: BoundsCheckPolicies {
            index,
            buffer: BoundsCheckPolicy::Unchecked,
            image_load: BoundsCheckPolicy::Unchecked,
            binding_array: BoundsCheckPolicy::Unchecked,
        },
        // As the engine builds its matvec modules (`default_matvec_checks`): no loop
        // counters, no division guards.
        force_loop_bounding: false,
        emit_int_div_checks: false,
        ..Default::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: stage,
        entry_point: spec.entry.clone(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline))
        .map_err(|e| anyhow!("{}: SPIR-V: {e}", spec.label))?;
    let mut bindings = Vec::new();
    for (_, g) in module.global_variables.iter() {
        let Some(b) = &g.binding else { continue };
        if b.group != 0 {
            bail!(
                "{}: binding group {} (only group 0 is set up)",
                spec.label,
                b.group
            );
        }
        let ty = match g.space {
            naga::AddressSpace::Uniform => vk::DescriptorType::UNIFORM_BUFFER,
            naga::AddressSpace::Storage { .. } => vk::DescriptorType::STORAGE_BUFFER,
            other => bail!("{}: binding {} in {other:?}", spec.label, b.binding),
        };
        bindings.push((b.binding, ty));
    }
    Ok((words, bindings))
}

/// A driver-written name as text (empty if the driver left it unterminated).
fn text(name: Result<&CStr, std::ffi::FromBytesUntilNulError>) -> String {
    name.map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A Vulkan device with pipeline-executable queries enabled.
struct Vk {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    exec: ash::khr::pipeline_executable_properties::Device,
    name: String,
    /// Whether the device has robustBufferAccess2.
    robust2: &'static str,
}

impl Vk {
    fn new() -> Result<Vk> {
        // SAFETY: loading the system Vulkan loader; its functions are only called through ash.
        let entry = unsafe { ash::Entry::load() }.context("loading the Vulkan loader")?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let ici = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: valid create info; the instance is destroyed in Drop.
        let instance = unsafe { entry.create_instance(&ici, None) }.context("vkCreateInstance")?;
        // SAFETY: the instance is live.
        let phys = unsafe { instance.enumerate_physical_devices() }?;
        let want = ash::khr::pipeline_executable_properties::NAME;
        let mut chosen = None;
        for pd in phys {
            // SAFETY: pd comes from this instance.
            let exts = unsafe { instance.enumerate_device_extension_properties(pd) }?;
            // SAFETY: as above.
            let props = unsafe { instance.get_physical_device_properties(pd) };
            let has = exts
                .iter()
                .any(|e| e.extension_name_as_c_str().is_ok_and(|n| n == want));
            // A real GPU wins over a CPU implementation (lavapipe), which is still useful
            // to check the tool itself.
            let cpu = props.device_type == vk::PhysicalDeviceType::CPU;
            if has
                && chosen
                    .as_ref()
                    .is_none_or(|(_, _, was_cpu)| *was_cpu && !cpu)
            {
                chosen = Some((pd, text(props.device_name_as_c_str()), cpu));
            }
        }
        let (pd, name, _) = chosen.ok_or_else(|| {
            anyhow!("no Vulkan device offers VK_KHR_pipeline_executable_properties")
        })?;
        // Whether wgpu leaves buffer accesses to the driver on this device (it does where
        // robustBufferAccess2 is there, and clamps them itself elsewhere).
        // SAFETY: pd comes from this instance.
        let exts = unsafe { instance.enumerate_device_extension_properties(pd) }?;
        let has_rob2 = exts.iter().any(|e| {
            e.extension_name_as_c_str()
                .is_ok_and(|n| n == ash::ext::robustness2::NAME)
        });
        let robust2 = if has_rob2 {
            let mut rob2 = vk::PhysicalDeviceRobustness2FeaturesEXT::default();
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut rob2);
            // SAFETY: pd comes from this instance (Vulkan 1.3), which has the extension whose
            // feature struct is chained.
            unsafe { instance.get_physical_device_features2(pd, &mut f2) };
            if rob2.robust_buffer_access2 == vk::TRUE {
                "yes"
            } else {
                "no"
            }
        } else {
            "no (no VK_EXT_robustness2)"
        };
        let qci = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(0)
            .queue_priorities(&[1.0])];
        let ext_names = [want.as_ptr()];
        let mut exec_features =
            vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default()
                .pipeline_executable_info(true);
        let dci = vk::DeviceCreateInfo::default()
            .queue_create_infos(&qci)
            .enabled_extension_names(&ext_names)
            .push_next(&mut exec_features);
        // SAFETY: valid create info for a device of this instance; destroyed in Drop.
        let device = unsafe { instance.create_device(pd, &dci, None) }.context("vkCreateDevice")?;
        let exec = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        Ok(Vk {
            _entry: entry,
            instance,
            device,
            exec,
            name,
            robust2,
        })
    }

    /// Compiles one compute pipeline and prints what the driver reports about it.
    fn report(
        &self,
        spec: &Spec,
        words: &[u32],
        bindings: &[(u32, vk::DescriptorType)],
        dump: Option<&PathBuf>,
    ) -> Result<()> {
        let d = &self.device;
        let lb: Vec<_> = bindings
            .iter()
            .map(|&(b, ty)| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(ty)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        // SAFETY (this block): every handle is created from the live device and destroyed
        // before returning; the create infos reference locals that outlive the calls.
        unsafe {
            let dsl = d.create_descriptor_set_layout(
                &vk::DescriptorSetLayoutCreateInfo::default().bindings(&lb),
                None,
            )?;
            let layouts = [dsl];
            let pl = d.create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().set_layouts(&layouts),
                None,
            )?;
            let sm =
                d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None)?;
            let entry = std::ffi::CString::new(spec.entry.clone())?;
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(sm)
                .name(&entry);
            let ci = vk::ComputePipelineCreateInfo::default()
                .stage(stage)
                .layout(pl)
                .flags(
                    vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                        | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR,
                );
            let pipe = d
                .create_compute_pipelines(vk::PipelineCache::null(), &[ci], None)
                .map_err(|(_, e)| anyhow!("{}: vkCreateComputePipelines: {e}", spec.label))?[0];
            let result = self.print(spec, pipe, dump);
            d.destroy_pipeline(pipe, None);
            d.destroy_shader_module(sm, None);
            d.destroy_pipeline_layout(pl, None);
            d.destroy_descriptor_set_layout(dsl, None);
            result
        }
    }

    fn print(&self, spec: &Spec, pipe: vk::Pipeline, dump: Option<&PathBuf>) -> Result<()> {
        let pinfo = vk::PipelineInfoKHR::default().pipeline(pipe);
        // SAFETY: pipe was created with the capture flags on this device.
        let execs = unsafe { self.exec.get_pipeline_executable_properties(&pinfo) }?;
        for (i, e) in execs.iter().enumerate() {
            let info = vk::PipelineExecutableInfoKHR::default()
                .pipeline(pipe)
                .executable_index(i as u32);
            // SAFETY: as above; index i < the executable count the driver returned.
            let stats = unsafe { self.exec.get_pipeline_executable_statistics(&info) }?;
            let mut line = format!(
                "{}  [{} subgroup {}]",
                spec.label,
                text(e.name_as_c_str()),
                e.subgroup_size
            );
            for s in &stats {
                // SAFETY: the union member read is the one `format` names.
                let v = unsafe {
                    match s.format {
                        vk::PipelineExecutableStatisticFormatKHR::BOOL32 => s.value.b32.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::INT64 => s.value.i64.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::UINT64 => s.value.u64.to_string(),
                        _ => format!("{:.3}", s.value.f64),
                    }
                };
                line.push_str(&format!("  {}={v}", text(s.name_as_c_str())));
            }
            println!("{line}");
            if let Some(dir) = dump {
                self.dump_representations(spec, &info, i, dir)?;
            }
        }
        Ok(())
    }

    fn dump_representations(
        &self,
        spec: &Spec,
        info: &vk::PipelineExecutableInfoKHR,
        index: usize,
        dir: &PathBuf,
    ) -> Result<()> {
        let fp = self.exec.fp();
        // The spec's three-call idiom: count, then sizes, then data. Every call passes an
        // array of `count` entries (or null) whose data pointers are null or point at
        // buffers of the sizes the driver reported.
        let query =
            |count: &mut u32, reps: *mut vk::PipelineExecutableInternalRepresentationKHR| {
                // SAFETY: `info` names a pipeline of this device created with the capture flags;
                // `reps` is null or holds `count` entries, as described above.
                unsafe {
                    (fp.get_pipeline_executable_internal_representations_khr)(
                        self.device.handle(),
                        info,
                        count,
                        reps,
                    )
                }
                .result()
            };
        let mut count = 0u32;
        query(&mut count, std::ptr::null_mut())?;
        let mut reps =
            vec![vk::PipelineExecutableInternalRepresentationKHR::default(); count as usize];
        query(&mut count, reps.as_mut_ptr())?;
        let mut bufs: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
        for (r, b) in reps.iter_mut().zip(bufs.iter_mut()) {
            r.p_data = b.as_mut_ptr().cast();
        }
        // The buffers outlive this call.
        query(&mut count, reps.as_mut_ptr())?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let stem: String = spec
            .label
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        for (j, (r, b)) in reps.iter().zip(&bufs).enumerate() {
            let name = text(r.name_as_c_str());
            let path = dir.join(format!(
                "{stem}.{index}.{j}.{}",
                if r.is_text != 0 { "txt" } else { "bin" }
            ));
            let body = if r.is_text != 0 {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                &b[..end]
            } else {
                &b[..]
            };
            std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
            println!("    {name}: {} bytes -> {}", body.len(), path.display());
        }
        Ok(())
    }
}

impl Drop for Vk {
    fn drop(&mut self) {
        // SAFETY: every object made from these was destroyed in `report`; nothing is in use.
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

fn main() -> Result<()> {
    let mut dump = None;
    let mut unchecked = false;
    let mut wgsl_dir = None;
    let mut spirv_only = false;
    let mut specs = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--dump" => {
                dump = Some(PathBuf::from(
                    args.next().ok_or_else(|| anyhow!("--dump needs a DIR"))?,
                ))
            }
            "--unchecked" => unchecked = true,
            "--wgsl-dir" => {
                wgsl_dir = Some(PathBuf::from(
                    args.next()
                        .ok_or_else(|| anyhow!("--wgsl-dir needs a DIR"))?,
                ))
            }
            "--spirv-only" => spirv_only = true,
            "-h" | "--help" => {
                println!("usage: shader_stats [--dump DIR] [--unchecked] [--wgsl-dir DIR] [--spirv-only] SHADER:ENTRY[:NAME=VALUE,...] ...");
                return Ok(());
            }
            _ => specs.push(parse_spec(&a)?),
        }
    }
    if specs.is_empty() {
        bail!("no kernel given (see --help)");
    }
    if spirv_only {
        // No driver: the WGSL composed, validated and written to SPIR-V by naga only.
        for s in &specs {
            let (words, _) = compile(s, unchecked, wgsl_dir.as_deref())?;
            println!("{}  SPIR-V {} words", s.label, words.len());
            if let Some(dir) = &dump {
                let path = dir.join(format!("{}.spv", s.label.replace([':', ',', '='], "_")));
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                std::fs::write(&path, bytemuck::cast_slice::<u32, u8>(&words))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
        return Ok(());
    }
    let vk = Vk::new()?;
    println!(
        "device: {} (unchecked {unchecked}; robustBufferAccess2 {})",
        vk.name, vk.robust2
    );
    for s in &specs {
        let (words, bindings) = compile(s, unchecked, wgsl_dir.as_deref())?;
        vk.report(s, &words, &bindings, dump.as_ref())?;
    }
    Ok(())
}
