//! Tensor names built a segment at a time, as the checkpoint nests them:
//! `TensorPrefix::layer(3).push("self_attn").tensor("q_proj.weight")` is
//! `model.layers.3.self_attn.q_proj.weight`. The blocks' tensor sets
//! ([`super::model_tensors`]) name every tensor through it, and the few names that are
//! parsed back (a per-layer name's layer, a routed expert's layer and id) are parsed here,
//! against the same segments.

use std::fmt::Display;

/// The segments before a layer's index.
const LAYERS: [&str; 2] = ["model", "layers"];
/// A MoE layer's block, under the layer.
const MOE: &str = "block_sparse_moe";
/// The routed experts, under the MoE block.
const EXPERTS: &str = "experts";

/// A tensor-name prefix (canonical: without `language_model.`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPrefix(String);

impl TensorPrefix {
    /// The text model's top: no prefix.
    pub fn root() -> TensorPrefix {
        TensorPrefix(String::new())
    }

    /// Layer `i`: `model.layers.{i}`.
    pub fn layer(i: usize) -> TensorPrefix {
        LAYERS
            .iter()
            .fold(TensorPrefix::root(), |p, s| p.push(s))
            .push(i)
    }

    /// The MoE block of layer `i`: `model.layers.{i}.block_sparse_moe`.
    pub fn moe(i: usize) -> TensorPrefix {
        TensorPrefix::layer(i).push(MOE)
    }

    /// Routed expert `expert` of layer `layer`: `model.layers.{layer}.block_sparse_moe.experts.{expert}`.
    pub fn expert(layer: usize, expert: usize) -> TensorPrefix {
        TensorPrefix::moe(layer).push(EXPERTS).push(expert)
    }

    /// This prefix and one more segment.
    pub fn push(&self, segment: impl Display) -> TensorPrefix {
        TensorPrefix(self.join(&segment.to_string()))
    }

    /// The full name of tensor `leaf` (`q_proj.weight`, `A_log`) under this prefix.
    pub fn tensor(&self, leaf: &str) -> String {
        self.join(leaf)
    }

    fn join(&self, tail: &str) -> String {
        if self.0.is_empty() {
            tail.to_string()
        } else {
            format!("{}.{tail}", self.0)
        }
    }
}

/// The index and the rest of a name under `model.layers.{i}.`.
fn split_layer(name: &str) -> Option<(usize, &str)> {
    let rest = LAYERS
        .iter()
        .try_fold(name, |rest, s| rest.strip_prefix(s)?.strip_prefix('.'))?;
    let (layer, rest) = rest.split_once('.')?;
    Some((layer.parse().ok()?, rest))
}

#[cfg(test)]
/// The layer of a per-layer tensor name (`model.layers.12.mlp.up_proj.weight` → 12).
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    split_layer(name).map(|(layer, _)| layer)
}

/// The layer, expert and leaf of a routed-expert tensor name
/// (`model.layers.1.block_sparse_moe.experts.3.w1.weight_packed` → 1, 3, `w1.weight_packed`).
pub(crate) fn expert_of(name: &str) -> Option<(usize, usize, &str)> {
    let (layer, rest) = split_layer(name)?;
    let rest = rest
        .strip_prefix(MOE)?
        .strip_prefix('.')?
        .strip_prefix(EXPERTS)?
        .strip_prefix('.')?;
    let (expert, leaf) = rest.split_once('.')?;
    Some((layer, expert.parse().ok()?, leaf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_build_and_parse_back() {
        let q = TensorPrefix::layer(3)
            .push("self_attn")
            .tensor("q_proj.weight");
        assert_eq!(q, "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(
            TensorPrefix::root().tensor("lm_head.weight"),
            "lm_head.weight"
        );
        let w = TensorPrefix::expert(1, 3).tensor("w1.weight_packed");
        assert_eq!(
            w,
            "model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"
        );
        assert_eq!(expert_of(&w), Some((1, 3, "w1.weight_packed")));
        assert_eq!(
            expert_of("model.layers.1.block_sparse_moe.gate.weight"),
            None
        );
        assert_eq!(
            expert_of("model.layers.x.block_sparse_moe.experts.3.w1"),
            None
        );
    }

    #[test]
    fn layer_names() {
        assert_eq!(layer_of("model.layers.12.mlp.up_proj.weight"), Some(12));
        assert_eq!(layer_of("model.norm.weight"), None);
        assert_eq!(layer_of("model.layersX.1.a"), None);
    }
}
