//! The tensors a K3 checkpoint must hold, derived from its [`Config`]: the single source
//! of truth for names, shapes and dtypes, shared by the loader, `k3 inspect` and the
//! synthesizer (docs/model.md#tensor-names). The dense tensors are the blocks' sets of
//! `model_tensors.rs`, which the model loads from; the routed experts' are here.

use super::model_tensors::ModelTensors;
use super::tensor::Dtype;
use super::tensor_prefix::{expert_of, TensorPrefix};
pub use super::tensor_spec::{TensorClass, TensorKind, TensorSpec};
use crate::config::{Config, MXFP4_GROUP};

/// Prefix the released checkpoint puts on every text-model tensor name.
pub const LANGUAGE_MODEL_PREFIX: &str = "language_model.";

/// Name prefixes of the vision part, which a text engine never opens.
pub const IGNORED_PREFIXES: [&str; 2] = ["vision_tower.", "mm_projector."];

/// The six tensors of a routed expert, in on-disk order (docs/model.md#mxfp4-experts).
pub const EXPERT_PARTS: [&str; 6] = [
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
];

/// Strips the `language_model.` prefix; `None` for tensors a text engine ignores.
pub fn canonical_name(stored: &str) -> Option<&str> {
    let name = stored.strip_prefix(LANGUAGE_MODEL_PREFIX).unwrap_or(stored);
    if IGNORED_PREFIXES.iter().any(|p| name.starts_with(p)) {
        None
    } else {
        Some(name)
    }
}

/// Parses a canonical routed-expert tensor name into `(layer, expert, part)`, where
/// `part` indexes [`EXPERT_PARTS`].
pub fn parse_expert_name(name: &str) -> Option<(usize, usize, usize)> {
    let (layer, expert, leaf) = expert_of(name)?;
    let part = EXPERT_PARTS.iter().position(|p| *p == leaf)?;
    Some((layer, expert, part))
}

/// Name of a routed expert tensor; `part` indexes [`EXPERT_PARTS`].
pub fn expert_tensor_name(layer: usize, expert: usize, part: usize) -> String {
    TensorPrefix::expert(layer, expert).tensor(EXPERT_PARTS[part % EXPERT_PARTS.len()])
}

/// Every non-expert tensor, globals and each layer's, in checkpoint order: the sets of
/// [`ModelTensors`].
pub fn dense_tensors(cfg: &Config) -> Vec<TensorSpec> {
    ModelTensors::new(cfg)
        .specs()
        .into_iter()
        .cloned()
        .collect()
}

/// The six MXFP4 tensors of routed expert `expert` of layer `layer`, in on-disk order:
/// w1 packed, w1 scale, w2 packed, w2 scale, w3 packed, w3 scale.
pub fn expert_tensors(cfg: &Config, layer: usize, expert: usize) -> [TensorSpec; 6] {
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    // w1 (gate) and w3 (up) are [I, D]; w2 (down) is [D, I].
    let dims = [(i, d), (i, d), (d, i), (d, i), (i, d), (i, d)];
    std::array::from_fn(|part| {
        let (rows, cols) = dims[part];
        let width = if part % 2 == 0 {
            cols / 2
        } else {
            cols / MXFP4_GROUP
        };
        TensorSpec {
            name: expert_tensor_name(layer, expert, part),
            shape: vec![rows, width],
            dtype: Dtype::U8,
            class: TensorClass::RoutedExpert,
            kind: if part % 2 == 0 {
                TensorKind::ExpertPacked
            } else {
                TensorKind::ExpertScale
            },
        }
    })
}

/// Whether a stored dtype is acceptable for `spec`: exact, except that the small f32-born
/// vectors (`A_log`, `dt_bias`, `e_score_correction_bias`) may be stored as F32 or BF16.
pub fn dtype_accepted(spec: &TensorSpec, found: Dtype) -> bool {
    if found == spec.dtype {
        return true;
    }
    let widenable = matches!(
        spec.kind,
        TensorKind::ALog | TensorKind::DtBias | TensorKind::RouterBias
    );
    widenable && matches!(found, Dtype::F32 | Dtype::Bf16)
}

/// Whether a stored shape is acceptable for `spec`, including the documented alternatives:
/// conv `[P,1,K]` or `[P,K]`; attention-residual projections `[H]` or `[1,H]`; `A_log` with at
/// least `heads` entries along its only non-unit dimension (padded to 128, or `[1,1,heads,1]`);
/// `dt_bias` in any shape of `P` elements (`[P]` or `[heads, head_dim]`).
pub fn shape_accepted(spec: &TensorSpec, found: &[usize]) -> bool {
    if found == spec.shape.as_slice() {
        return true;
    }
    match spec.kind {
        TensorKind::Conv if spec.shape.len() == 3 => found == [spec.shape[0], spec.shape[2]],
        TensorKind::ResProj if spec.shape.len() == 1 => found == [1, spec.shape[0]],
        TensorKind::ALog => {
            let heads = spec.numel();
            let big: Vec<usize> = found.iter().copied().filter(|&d| d != 1).collect();
            match big.as_slice() {
                [] => heads == 1 && !found.is_empty(),
                [n] => *n >= heads,
                _ => false,
            }
        }
        TensorKind::DtBias => !found.is_empty() && found.iter().product::<usize>() == spec.numel(),
        _ => false,
    }
}

/// A matrix of the C engine's repacked container (`k3_repack.py`): the `U8` tensor `q`
/// holds the quantized values and the F32 tensor `<name>.qs` their scales, laid out as
/// k3's own formats except for the int4 nibble code (docs/model.md, load-time formats):
/// - int8 per row: `q` is `[rows, cols]` two's-complement bytes, `rows` scales;
/// - int4 in groups of 64 (`cols` a multiple of 64): `q` is `[rows, cols / 2]`, two values
///   a byte, low nibble the even column, each nibble in offset binary (`value + 8`, where
///   k3 stores two's complement), `rows · cols / 64` scales.
///
/// Refuses, saying why, a tensor that fits neither or a scale that is not finite.
pub fn container_matrix(
    spec: &TensorSpec,
    q_shape: &[usize],
    q: &[u8],
    scale_dtype: Dtype,
    scale_shape: &[usize],
    scale: &[u8],
) -> anyhow::Result<crate::quant::DenseMatrix> {
    use crate::quant::{DenseData, DenseMatrix};
    use anyhow::bail;
    let [rows, cols] = spec.shape[..] else {
        bail!(
            "is stored pre-quantized (U8), but it is not a matrix (shape {:?})",
            spec.shape
        );
    };
    if scale_dtype != Dtype::F32 {
        bail!("its scales `.qs` are {scale_dtype}, expected F32");
    }
    let scales: usize = scale_shape.iter().product();
    let values: Vec<f32> = scale
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        bail!("scale {i} of its `.qs` is {}, not finite", values[i]);
    }
    let int8 = q_shape == [rows, cols] && scales == rows;
    let int4 = cols % 64 == 0 && q_shape == [rows, cols / 2] && scales == rows * (cols / 64);
    let data = if int8 {
        DenseData::Int8 {
            q: bytemuck::cast_slice::<u8, i8>(q).to_vec(),
            scale: values,
        }
    } else if int4 {
        // Offset binary to two's complement: flipping the top bit of each nibble maps
        // v + 8 to v for every v in -8..=7.
        DenseData::Int4 {
            q: q.iter().map(|b| b ^ 0x88).collect(),
            scale: values,
        }
    } else {
        bail!(
            "U8 {q_shape:?} with {scales} scales matches neither int8 per row (U8 [{rows}, {cols}], \
             {rows} scales) nor int4 in groups of 64 (U8 [{rows}, {}], {} scales, {cols} a \
             multiple of 64)",
            cols / 2,
            rows * (cols / 64)
        );
    };
    Ok(DenseMatrix { rows, cols, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Config {
        Config::tiny()
    }

    #[test]
    fn dense_schema_has_every_layer_and_unique_names() {
        let c = tiny();
        let specs = dense_tensors(&c);
        let mut names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[0], "model.embed_tokens.weight");
        assert_eq!(*names.last().unwrap(), "lm_head.weight");
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "duplicate names");
        let has = |s: &str| specs.iter().any(|t| t.name == s);
        assert!(has("model.layers.0.mlp.gate_proj.weight"));
        assert!(has("model.layers.0.self_attn.A_log"));
        assert!(has(
            "model.layers.1.block_sparse_moe.routed_expert_norm.weight"
        ));
        assert!(has("model.layers.2.self_attn.kv_b_proj.weight"));
        assert!(!has("model.layers.2.self_attn.A_log"));
        let kv_b = specs
            .iter()
            .find(|t| t.name == "model.layers.2.self_attn.kv_b_proj.weight")
            .unwrap();
        assert_eq!(kv_b.shape, vec![2 * (4 + 4), 8]);
    }

    #[test]
    fn expert_schema_matches_config_bytes() {
        let c = tiny();
        let parts = expert_tensors(&c, 1, 3);
        assert_eq!(
            parts[0].name,
            "model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"
        );
        assert_eq!(parts[3].shape, vec![64, 1]);
        let total: usize = parts.iter().map(|p| p.byte_len()).sum();
        assert_eq!(total, c.expert_bytes());
        for (k, p) in parts.iter().enumerate() {
            assert_eq!(parse_expert_name(&p.name), Some((1, 3, k)));
        }
        assert_eq!(
            parse_expert_name("model.layers.1.block_sparse_moe.gate.weight"),
            None
        );
    }

    #[test]
    fn canonical_names() {
        assert_eq!(
            canonical_name("language_model.lm_head.weight"),
            Some("lm_head.weight")
        );
        assert_eq!(canonical_name("lm_head.weight"), Some("lm_head.weight"));
        assert_eq!(canonical_name("vision_tower.blocks.0.w"), None);
        assert_eq!(canonical_name("language_model.mm_projector.x"), None);
    }

    #[test]
    fn documented_shape_alternatives() {
        // The tiny schema's own specs: the alternatives follow each tensor's kind.
        let schema = dense_tensors(&tiny());
        let spec = |name: &str, shape: Vec<usize>| {
            let s = schema.iter().find(|s| s.name == name).unwrap().clone();
            assert_eq!(s.shape, shape, "{name}");
            s
        };
        let conv = spec("model.layers.0.self_attn.q_conv1d.weight", vec![16, 1, 4]);
        assert!(shape_accepted(&conv, &[16, 1, 4]) && shape_accepted(&conv, &[16, 4]));
        assert!(!shape_accepted(&conv, &[16, 4, 1]));
        let a = spec("model.layers.0.self_attn.A_log", vec![1, 1, 2, 1]);
        assert!(
            shape_accepted(&a, &[128])
                && shape_accepted(&a, &[2])
                && shape_accepted(&a, &[1, 1, 2, 1])
        );
        assert!(!shape_accepted(&a, &[1]) && !shape_accepted(&a, &[2, 2]));
        let dt = spec("model.layers.0.self_attn.dt_bias", vec![16]);
        assert!(shape_accepted(&dt, &[2, 8]) && !shape_accepted(&dt, &[2, 7]));
        let proj = spec("model.output_attn_res_proj.weight", vec![64]);
        assert!(shape_accepted(&proj, &[1, 64]) && !shape_accepted(&proj, &[64, 1]));
        let q = spec("model.layers.0.self_attn.q_proj.weight", vec![16, 64]);
        assert!(!shape_accepted(&q, &[64, 16]));
        assert!(dtype_accepted(&dt, Dtype::F32) && !dtype_accepted(&q, Dtype::F32));
    }
}
