//! Which tensor goes to which shard, in which order: the published layout, with each
//! expert's six tensors back to back, experts shuffled within their layer, spread over
//! several shards, and the vision tower alone in the last shard.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::random_weights::{init_for, Init, VISION_INIT};
use crate::checkpoint::model_tensors::ModelTensors;
use crate::checkpoint::schema::{expert_tensors, TensorSpec, LANGUAGE_MODEL_PREFIX};
use crate::checkpoint::tensor::Dtype;
use crate::config::Config;

/// One tensor to write: stored name (with prefix), shape, dtype and how its values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PlannedTensor {
    /// Name as stored in the shard.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Stored dtype.
    pub dtype: Dtype,
    /// The values' initialisation.
    pub init: Init,
}

impl PlannedTensor {
    /// Data size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }

    fn from_spec(spec: &TensorSpec) -> PlannedTensor {
        PlannedTensor {
            name: format!("{LANGUAGE_MODEL_PREFIX}{}", spec.name),
            shape: spec.shape.clone(),
            dtype: spec.dtype,
            init: init_for(spec.kind, &spec.shape),
        }
    }
}

/// Tensors that must stay contiguous and in one shard (an expert's six, or one tensor).
struct Group {
    tensors: Vec<PlannedTensor>,
    is_expert: bool,
}

impl Group {
    fn bytes(&self) -> u64 {
        self.tensors.iter().map(PlannedTensor::bytes).sum()
    }
}

/// Small stand-ins for the vision part, which a text loader must skip.
fn vision_tensors() -> Vec<PlannedTensor> {
    let t = |name: &str, shape: &[usize]| PlannedTensor {
        name: name.to_string(),
        shape: shape.to_vec(),
        dtype: Dtype::Bf16,
        init: VISION_INIT,
    };
    vec![
        t("vision_tower.patch_embed.proj.weight", &[32, 3, 4, 4]),
        t("vision_tower.encoder.blocks.0.norm0.weight", &[32]),
        t("vision_tower.encoder.blocks.0.wqkv.weight", &[96, 32]),
        t("mm_projector.proj.0.weight", &[64, 32]),
    ]
}

/// Expert ids of `layer` in the on-disk order: a seeded shuffle, never id order.
fn expert_order(seed: u64, layer: usize, experts: usize) -> Vec<usize> {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut order: Vec<usize> = (0..experts).collect();
    let identity = order.clone();
    order.shuffle(&mut rng);
    // A shuffle of two can come out as the identity; the layout promises it never does.
    if order == identity && experts > 1 {
        order.rotate_left(1);
    }
    order
}

/// The text tensors in write order: schema order, each MoE layer's experts right after
/// that layer's other tensors.
fn text_groups(cfg: &Config, seed: u64) -> Vec<Group> {
    let model = ModelTensors::new(cfg);
    let single = |spec: &TensorSpec| Group {
        tensors: vec![PlannedTensor::from_spec(spec)],
        is_expert: false,
    };
    let mut groups = vec![single(&model.embed)];
    for (layer, tensors) in model.layers.iter().enumerate() {
        groups.extend(tensors.specs().into_iter().map(single));
        if cfg.is_moe_layer(layer) {
            for e in expert_order(seed, layer, cfg.num_experts) {
                groups.push(Group {
                    tensors: expert_tensors(cfg, layer, e)
                        .iter()
                        .map(PlannedTensor::from_spec)
                        .collect(),
                    is_expert: true,
                });
            }
        }
    }
    groups.extend(model.final_specs().into_iter().map(single));
    groups
}

/// The shards in order, each a list of tensors in data order. Text shards close when
/// the next group would pass `max_shard_bytes`, and once more before the middle expert
/// so experts always span at least two shards; the vision part is the last shard.
pub(crate) fn plan_shards(
    cfg: &Config,
    seed: u64,
    max_shard_bytes: u64,
) -> Vec<Vec<PlannedTensor>> {
    let groups = text_groups(cfg, seed);
    let n_experts = groups.iter().filter(|g| g.is_expert).count();
    let forced_break = n_experts / 2;
    let mut shards: Vec<Vec<PlannedTensor>> = Vec::new();
    let mut current: Vec<PlannedTensor> = Vec::new();
    let mut current_bytes = 0u64;
    let mut experts_seen = 0usize;
    for g in groups {
        let bytes = g.bytes();
        let force = g.is_expert && experts_seen == forced_break && n_experts >= 2;
        let full = current_bytes + bytes > max_shard_bytes;
        if !current.is_empty() && (force || full) {
            shards.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        if g.is_expert {
            experts_seen += 1;
        }
        current_bytes += bytes;
        current.extend(g.tensors);
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards.push(vision_tensors());
    shards
}

/// The file name of shard `index` (0-based) of `count`, as Hugging Face names them.
pub(crate) fn shard_file_name(index: usize, count: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", index + 1, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_order_is_a_shuffle_and_reproducible() {
        for n in [2usize, 3, 8, 896] {
            let a = expert_order(5, 1, n);
            assert_eq!(a, expert_order(5, 1, n));
            assert_ne!(a, (0..n).collect::<Vec<_>>());
            let mut sorted = a.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        }
        assert_ne!(expert_order(5, 1, 896), expert_order(6, 1, 896));
        assert_ne!(expert_order(5, 1, 896), expert_order(5, 2, 896));
    }

    #[test]
    fn shard_names() {
        // The per-layer name parse this test also checked is tensor_prefix::layer_of's.
        assert_eq!(shard_file_name(0, 7), "model-00001-of-00007.safetensors");
    }
}
