//! `k3 synth --routing local`: routing with the locality of real text, built into the
//! weights so that every engine that runs the checkpoint routes the same way.
//!
//! Random weights route every token to near-independent experts, so consecutive tokens share
//! almost none and no cache or chunk dedup helps. Real K3 text reuses experts: a 32-token
//! prefill chunk touches 2.7x fewer experts than its tokens select. Here the vocabulary and
//! each MoE layer's experts are split into [`TOPICS`] topics, each with a direction in the
//! hidden space:
//!
//! - a token's embedding row gets its input topic's direction, strong enough that it stays
//!   in the router inputs of every layer (the block attention-residual mix brings the
//!   embedding back at every layer);
//! - a router row gets the directions of the topics that own its expert, so a token picks
//!   some of its experts from its topic's set and the rest as random weights would;
//! - an output (lm_head) row gets its output topic's direction, so greedy decoding predicts
//!   tokens of the topic it is in; a few tokens ([`BRIDGE_SHARE`]) belong to one topic on the
//!   output side and another on the input side, so the text moves to a new topic when one of
//!   them wins.
//!
//! Text the model writes (and prompts made of it) therefore stays on a topic for a while and
//! reuses that topic's experts, then moves on. The constants are fitted to the published
//! real-K3 figures in docs/tuning.md#a-checkpoint-with-real-k3-locality. The random parts of
//! every row are the bytes `--routing random` writes; the topic parts are added on top.

use std::collections::HashMap;

use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::presets::Dims;
use crate::checkpoint::model_tensors::{FfnTensors, ModelTensors};
use crate::checkpoint::schema::LANGUAGE_MODEL_PREFIX;
use crate::checkpoint::tensor::Dtype;

/// Topics the vocabulary and each layer's experts are split into: with the set size below,
/// 32 topics own 768 of K3's 896 experts a layer, disjoint. Chosen, not fitted (the fit
/// varied the gains and the switching rate).
pub(crate) const TOPICS: usize = 32;
/// Experts each topic owns in each MoE layer, as a multiple of top-k (16 owns 24 of K3's 896):
/// a token takes most of its top-k from this set, so how often two tokens of one topic share
/// an expert is about (share taken) / (set size). Chosen from a model of routing without the
/// network (a boost on the set plus independent noise), where 1.5 fitted the figures best.
const TOPIC_SET_PER_TOP_K: f64 = 1.5;
/// RMS of the topic direction added to an embedding row, against the random row's 1: the
/// embedding is one of several entries the attention-residual mix averages at each layer, so
/// it is larger than the rest for the topic to survive to the last layer's router, and small
/// enough that the context, not the current token alone, picks the next token (at 8 greedy
/// text fell into cycles of a few tokens and 32-token chunks deduped 14x).
const EMBED_TOPIC_GAIN: f32 = 3.0;
/// Logit a router adds to its topic's experts for an input that is all topic direction (the
/// random logits have a spread of about 1): how much of a token's top-k comes from its
/// topic's set; fitted with [`BRIDGE_SHARE`] to the 2.7x dedup of 32-token chunks and the 4 %
/// hit rate at 4 slots (3.5 to 4 flatten the curve past 27 slots as the C engine's does, but
/// dedup 3.1x to 3.2x and hit 11 % at 4 slots).
const ROUTER_TOPIC_GAIN: f32 = 3.0;
/// How fast the router gain grows with depth: a layer's gain is [`ROUTER_TOPIC_GAIN`] times
/// (entries of its feed-forward mix / 2) to this power (see [`router_gain`]). Faster than the
/// embedding's share alone (1): the banked blocks and the current stream grow in size with
/// depth, so the normed mix holds less of the embedding than its weight says. Fitted on 24
/// layers, where 2 keeps the per-layer dedup of 32-token chunks level with depth (1 and 1.5
/// still fade; 2.5 rises past 3x in the last block).
const DEPTH_EXPONENT: f32 = 2.0;
/// Mix entries past which the router gain stops growing (16 times [`ROUTER_TOPIC_GAIN`] at
/// the default exponent). Fitted on 93 layers: without a cap the squared growth saturates
/// the deep routers (dedup climbs to 8x, every pick from the topic's set), while a gain held
/// from 8 entries on keeps the per-layer dedup level to the last layer, so the embedding's
/// part of the router input stops falling by then. 24 layers stay below it.
const MAX_GAIN_ENTRIES: usize = 8;
/// Logit the head adds to the tokens of the topic the hidden state is on: large, so greedy
/// decoding stays on its topic until a bridge token wins.
const HEAD_TOPIC_GAIN: f32 = 8.0;
/// Share of each topic's tokens that are bridges (input topic differs from output topic):
/// greedy text moves to another topic about once every 1 / share tokens; fitted with
/// [`ROUTER_TOPIC_GAIN`] to the dedup of 32-token chunks, which counts how many topics a
/// chunk spans.
const BRIDGE_SHARE: f64 = 0.2;
/// A token without a topic (the special tokens).
const NO_TOPIC: u16 = u16::MAX;

/// Stream separators, so that each table draws from its own generator.
const DIRECTIONS_STREAM: u64 = 0x746f_7069_6364_6972;
const TOKENS_STREAM: u64 = 0x746f_7069_6374_6f6b;
const EXPERTS_STREAM: u64 = 0x746f_7069_6365_7870;

/// How `k3 synth` routes: the weights' own random routing or topic locality.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Routing {
    /// Every weight random: tokens route independently (the default; same bytes as before
    /// the flag existed).
    #[default]
    Random,
    /// Topic directions shared by embedding, router and output rows (this module).
    Local,
}

impl Routing {
    /// The spelling on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Routing::Random => "random",
            Routing::Local => "local",
        }
    }
}

impl std::str::FromStr for Routing {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Routing> {
        match s {
            "random" => Ok(Routing::Random),
            "local" => Ok(Routing::Local),
            other => anyhow::bail!("--routing {other:?}: expected one of random, local"),
        }
    }
}

impl std::fmt::Display for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The topic structure of one checkpoint: directions, token topics, expert sets.
pub(crate) struct Topics {
    hidden: usize,
    /// `TOPICS x hidden`, each row of unit RMS.
    directions: Vec<f32>,
    /// Per token id: the topic its embedding carries ([`NO_TOPIC`] for specials).
    input_topic: Vec<u16>,
    /// Per token id: the topic whose hidden states predict it.
    output_topic: Vec<u16>,
    /// Per MoE layer (by its router gate's name): per expert, the topics that own it, and
    /// the layer's router gain.
    routers: HashMap<String, (Vec<Vec<u16>>, f32)>,
    /// The embedding's name: its rows carry their token's input topic.
    embed: String,
    /// The head's name: its rows carry their token's output topic.
    head: String,
}

impl Topics {
    /// The topics of a checkpoint of dimensions `d` and tensors `model` under `seed`.
    pub(crate) fn new(d: &Dims, seed: u64, model: &ModelTensors) -> Topics {
        let h = d.hidden;
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ DIRECTIONS_STREAM);
        let directions: Vec<f32> = (0..TOPICS * h).map(|_| normal(&mut rng)).collect();

        // Token ids below bos are text; the specials above keep random rows and no topic.
        let text = (d.bos as usize).min(d.vocab);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ TOKENS_STREAM);
        let mut input_topic = vec![NO_TOPIC; d.vocab];
        let mut output_topic = vec![NO_TOPIC; d.vocab];
        for v in 0..text {
            let out = rng.random_range(0..TOPICS);
            let inp = if rng.random::<f64>() < BRIDGE_SHARE {
                (out + 1 + rng.random_range(0..TOPICS - 1)) % TOPICS
            } else {
                out
            };
            input_topic[v] = inp as u16;
            output_topic[v] = out as u16;
        }

        let set = ((TOPIC_SET_PER_TOP_K * d.top_k as f64).round() as usize).clamp(1, d.experts);
        let routers = model
            .layers
            .iter()
            .enumerate()
            .filter_map(|(layer, t)| match &t.ffn {
                FfnTensors::Moe(moe) => Some((layer, &moe.gate.name)),
                FfnTensors::Dense(_) => None,
            });
        let routers = routers
            .map(|(layer, gate)| {
                let mut rng = ChaCha8Rng::seed_from_u64(
                    seed ^ EXPERTS_STREAM ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                let mut order: Vec<usize> = (0..d.experts).collect();
                order.shuffle(&mut rng);
                // Disjoint sets while they fit; past that, sets wrap around and share experts.
                let mut owners = vec![Vec::new(); d.experts];
                for t in 0..TOPICS {
                    for j in 0..set {
                        owners[order[(t * set + j) % d.experts]].push(t as u16);
                    }
                }
                let gain = router_gain(layer, d.attn_res_block_size);
                (gate.clone(), (owners, gain))
            })
            .collect();
        Topics {
            hidden: h,
            directions,
            input_topic,
            output_topic,
            routers,
            embed: model.embed.name.clone(),
            head: model.head.name.clone(),
        }
    }

    fn direction(&self, t: u16) -> &[f32] {
        let t = usize::from(t);
        &self.directions[t * self.hidden..(t + 1) * self.hidden]
    }

    /// What each row of tensor `stored_name` gets added: the topic directions and their gain
    /// (`None` for tensors without topics).
    fn row_topics<'a>(&'a self, stored_name: &str) -> Option<(RowTopics<'a>, f32)> {
        let name = stored_name
            .strip_prefix(LANGUAGE_MODEL_PREFIX)
            .unwrap_or(stored_name);
        let h = self.hidden as f32;
        if name == self.embed {
            Some((RowTopics::Tokens(&self.input_topic), EMBED_TOPIC_GAIN))
        } else if name == self.head {
            // A unit-RMS direction dotted with a unit-RMS input sums `hidden` terms: 1 / hidden
            // makes the gain the added logit.
            Some((RowTopics::Tokens(&self.output_topic), HEAD_TOPIC_GAIN / h))
        } else {
            let (owners, gain) = self.routers.get(name)?;
            Some((RowTopics::Experts(owners), gain / h))
        }
    }

    /// Adds the topic parts to `out`, the encoded elements of tensor `stored_name` (rows of
    /// `hidden`) from element `first_elem` on; tensors without topics are left as they are.
    pub(crate) fn add_to(&self, stored_name: &str, ty: Dtype, first_elem: u64, out: &mut [u8]) {
        let Some((rows, gain)) = self.row_topics(stored_name) else {
            return;
        };
        // Every tensor with topics is BF16 in the published format.
        if ty != Dtype::Bf16 {
            return;
        }
        let h = self.hidden as u64;
        for (i, elem) in out.chunks_exact_mut(2).enumerate() {
            let at = first_elem + i as u64;
            let (row, col) = ((at / h) as usize, (at % h) as usize);
            let add: f32 = match rows {
                RowTopics::Tokens(topics) => match topics.get(row) {
                    Some(&t) if t != NO_TOPIC => self.direction(t)[col],
                    _ => continue,
                },
                RowTopics::Experts(owners) => match owners.get(row) {
                    Some(ts) if !ts.is_empty() => ts.iter().map(|&t| self.direction(t)[col]).sum(),
                    _ => continue,
                },
            };
            let v = bf16::from_le_bytes([elem[0], elem[1]]).to_f32() + gain * add;
            elem.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
        }
    }
}

/// The router gain of layer `layer` in a model that banks a block every `block` layers.
///
/// The topic reaches a router only through the embedding, which the feed-forward input mix
/// of layer `layer` averages with the block outputs banked since (one more every `block`
/// layers) and the current block's stream: `layer / block + 2` entries. Under an even mix the
/// embedding's share, and with it the topic's part of the router input, falls at least as
/// one over the entries; the gain grows with them so that deep layers keep the locality of
/// the first block, up to [`MAX_GAIN_ENTRIES`]. Layers before the first bank boundary (2
/// entries) get [`ROUTER_TOPIC_GAIN`].
fn router_gain(layer: usize, block: usize) -> f32 {
    let entries = (layer / block.max(1) + 2).min(MAX_GAIN_ENTRIES);
    ROUTER_TOPIC_GAIN * (entries as f32 / 2.0).powf(DEPTH_EXPONENT)
}

/// Which topics a tensor's rows carry.
#[derive(Clone, Copy)]
enum RowTopics<'a> {
    /// Row = token id.
    Tokens(&'a [u16]),
    /// Row = expert id.
    Experts(&'a [Vec<u16>]),
}

/// A standard normal draw (Box-Muller).
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_gain_is_the_base_gain_before_the_first_bank_boundary() {
        for block in [1, 2, 4, 12] {
            for layer in 0..block {
                assert_eq!(router_gain(layer, block), ROUTER_TOPIC_GAIN);
            }
        }
    }

    #[test]
    fn router_gain_grows_with_the_banked_blocks() {
        let block = 4;
        for layer in 0..96 {
            let (now, next) = (router_gain(layer, block), router_gain(layer + 1, block));
            let capped = (layer + 1) / block + 2 > MAX_GAIN_ENTRIES;
            if (layer + 1) % block == 0 && !capped {
                assert!(next > now, "layer {layer}: {now} -> {next}");
            } else {
                assert_eq!(next, now, "layer {layer}");
            }
        }
    }

    #[test]
    fn router_gain_follows_the_embedding_share() {
        // Layer 20 of a 4-layer block mixes 7 entries: 3.5 times the first block's 2.
        let ratio = router_gain(20, 4) / router_gain(0, 4);
        assert!(
            (ratio - 3.5f32.powf(DEPTH_EXPONENT)).abs() < 1e-5,
            "{ratio}"
        );
        // Past the cap the gain holds.
        assert_eq!(router_gain(92, 4), router_gain(24, 4));
        assert!(router_gain(24, 4) > router_gain(23, 4));
        // A block size of 0 (rejected by the config) must not divide by zero.
        assert!(router_gain(3, 0).is_finite());
    }
}
