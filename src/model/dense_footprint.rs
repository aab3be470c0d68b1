//! The bytes the dense weights take once loaded, from the config's tensor shapes and the
//! format policy alone (no tensor data: `k3 inspect --plan` plans a machine from a config).
//! The formats are the loader's: `K3_BITS` for the KDA, MLP, shared-expert and latent
//! projections, `K3_MLA_BITS` for MLA, `K3_HEAD_BITS` for the head, bf16 for the router and
//! the KDA gate projections, f32 for MLA's absorbed `kv_b_proj` and every vector. The
//! embedding table is read a row per token and is not resident.

use super::format_policy::FormatPolicy;
use crate::checkpoint::model_tensors::{AttnTensors, ModelTensors};
use crate::checkpoint::schema::{TensorClass, TensorSpec};
use crate::config::Config;
use crate::quant::DenseFormat;
use std::collections::HashMap;

/// Loaded bytes of a `[rows, cols]` matrix in `fmt`, scales included.
pub(crate) fn matrix_bytes(rows: usize, cols: usize, fmt: DenseFormat) -> u64 {
    let (r, c) = (rows as u64, cols as u64);
    match fmt {
        DenseFormat::F32 => r * c * 4,
        DenseFormat::Bf16 => r * c * 2,
        DenseFormat::Int8 => r * c + r * 4,
        DenseFormat::Int4 => r * c.div_ceil(2) + r * c.div_ceil(64) * 4,
    }
}

/// The matrices the loader keeps out of the policy's formats (`kda.rs`, `mla.rs`): the
/// small KDA gate projections in bf16, MLA's absorbed `kv_b_proj` (split on the host) in f32.
fn fixed_formats(model: &ModelTensors) -> HashMap<&str, DenseFormat> {
    let mut fixed = HashMap::new();
    for layer in &model.layers {
        match &layer.attn {
            AttnTensors::Kda(t) => {
                for spec in [&t.f_a_proj, &t.f_b_proj, &t.b_proj] {
                    fixed.insert(spec.name.as_str(), DenseFormat::Bf16);
                }
            }
            AttnTensors::Mla(t) => {
                fixed.insert(t.kv_b_proj.name.as_str(), DenseFormat::F32);
            }
        }
    }
    fixed
}

/// The format the loader gives a 2-D tensor of `spec`'s class, unless it is `fixed`.
fn format_of(
    spec: &TensorSpec,
    policy: &FormatPolicy,
    fixed: &HashMap<&str, DenseFormat>,
) -> DenseFormat {
    if let Some(&fmt) = fixed.get(spec.name.as_str()) {
        return fmt;
    }
    match spec.class {
        TensorClass::Head => policy.head,
        TensorClass::Mla => policy.mla,
        TensorClass::Router => DenseFormat::Bf16,
        _ => policy.dense,
    }
}

/// Resident bytes of each class of dense tensor, in [`TensorClass::ALL`] order (classes of
/// no bytes left out).
pub(crate) fn dense_footprint(cfg: &Config, policy: &FormatPolicy) -> Vec<(TensorClass, u64)> {
    let mut by_class: Vec<(TensorClass, u64)> = TensorClass::ALL.iter().map(|&c| (c, 0)).collect();
    let model = ModelTensors::new(cfg);
    let fixed = fixed_formats(&model);
    for spec in model.specs() {
        let bytes = match (spec.class, spec.shape.as_slice()) {
            (TensorClass::Embedding, _) => 0,
            (_, &[rows, cols]) => matrix_bytes(rows, cols, format_of(spec, policy, &fixed)),
            // Each attention-residual norm and projection pair loads as one product vector.
            (TensorClass::AttnRes, _) => spec.numel() as u64 * 2,
            _ => spec.numel() as u64 * 4,
        };
        if let Some(slot) = by_class.iter_mut().find(|(c, _)| *c == spec.class) {
            slot.1 += bytes;
        }
    }
    by_class.retain(|&(_, b)| b > 0);
    by_class
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_cost_what_the_quantizers_store() {
        assert_eq!(matrix_bytes(2, 128, DenseFormat::F32), 1024);
        assert_eq!(matrix_bytes(2, 128, DenseFormat::Bf16), 512);
        assert_eq!(matrix_bytes(2, 128, DenseFormat::Int8), 256 + 8);
        // 64 bytes of nibbles and two f32 scales per row.
        assert_eq!(matrix_bytes(2, 128, DenseFormat::Int4), 2 * (64 + 8));
        assert_eq!(matrix_bytes(1, 65, DenseFormat::Int4), 33 + 8);
    }

    #[test]
    fn the_tiny_model_footprint_matches_its_shapes() {
        let cfg = crate::synth::preset_config_for_tests(crate::synth::Preset::Tiny, None);
        let f32s = dense_footprint(&cfg, &FormatPolicy::exact());
        let int4 = dense_footprint(&cfg, &FormatPolicy::default());
        let total = |v: &[(TensorClass, u64)]| v.iter().map(|x| x.1).sum::<u64>();
        assert!(total(&int4) < total(&f32s));
        assert!(!f32s.iter().any(|&(c, _)| c == TensorClass::Embedding));
        // The head alone in f32: vocab x hidden x 4 bytes.
        let head = f32s.iter().find(|x| x.0 == TensorClass::Head).unwrap().1;
        assert_eq!(head, (cfg.vocab_size * cfg.hidden_size * 4) as u64);
    }
}
