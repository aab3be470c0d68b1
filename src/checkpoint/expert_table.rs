//! Where every routed expert's six MXFP4 tensors lie, and whether one read fetches them.
//!
//! Contiguity is computed per expert from the safetensors offsets, never assumed
//! (docs/model.md#mxfp4-experts): the released shards store experts back to back but not in
//! id order.

use super::schema::{expert_tensor_name, expert_tensors, parse_expert_name};
use super::shards::Entry;
use crate::config::Config;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// The file byte ranges of one routed expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLocation {
    /// Index of the shard that holds all six tensors.
    pub shard: usize,
    /// Absolute file byte ranges, in order w1 packed, w1 scale, w2 packed, w2 scale,
    /// w3 packed, w3 scale.
    pub parts: [Range<u64>; 6],
    /// The six ranges are back to back in the order above: one read fetches the expert.
    pub contiguous: bool,
}

impl ExpertLocation {
    /// The smallest byte range covering all six parts.
    pub fn span(&self) -> Range<u64> {
        let start = self.parts.iter().map(|p| p.start).min().unwrap_or(0);
        let end = self.parts.iter().map(|p| p.end).max().unwrap_or(0);
        start..end
    }

    /// Bytes of the six parts together.
    pub fn byte_len(&self) -> u64 {
        self.parts.iter().map(|p| p.end - p.start).sum()
    }
}

/// Every complete, well-formed routed expert of a checkpoint.
#[derive(Clone, Debug, Default)]
pub struct ExpertTable {
    num_experts: usize,
    slots: Vec<Option<ExpertLocation>>,
    problems: BTreeMap<(usize, usize), String>,
}

impl ExpertTable {
    /// Builds the table from validated shard entries; experts with a missing, mis-typed
    /// or mis-shaped part, or parts in two shards, are left out and listed as problems.
    pub(crate) fn build(cfg: &Config, entries: &HashMap<String, Entry>) -> ExpertTable {
        let e_count = cfg.num_experts;
        let mut table = ExpertTable {
            num_experts: e_count,
            slots: vec![None; cfg.num_hidden_layers * e_count],
            problems: BTreeMap::new(),
        };
        let mut seen: BTreeMap<(usize, usize), ()> = BTreeMap::new();
        for name in entries.keys() {
            if let Some((layer, expert, _)) = parse_expert_name(name) {
                seen.insert((layer, expert), ());
            }
        }
        for &(layer, expert) in seen.keys() {
            if !cfg.is_moe_layer(layer) || expert >= e_count {
                table.problems.insert(
                    (layer, expert),
                    format!(
                        "expert {expert} of layer {layer} is not part of this model (MoE layers {}..{}, {e_count} experts)",
                        cfg.first_k_dense_replace, cfg.num_hidden_layers
                    ),
                );
                continue;
            }
            match locate(cfg, entries, layer, expert) {
                Ok(loc) => table.slots[layer * e_count + expert] = Some(loc),
                Err(msg) => {
                    table.problems.insert((layer, expert), msg);
                }
            }
        }
        table
    }

    /// The location of expert `expert` of layer `layer`, when it is present and well formed.
    pub fn get(&self, layer: usize, expert: usize) -> Option<&ExpertLocation> {
        if expert >= self.num_experts {
            return None;
        }
        self.slots
            .get(layer * self.num_experts + expert)
            .and_then(Option::as_ref)
    }

    /// Why expert `expert` of layer `layer` is not in the table, when some of its
    /// tensors exist but are unusable.
    pub fn problem(&self, layer: usize, expert: usize) -> Option<&str> {
        self.problems.get(&(layer, expert)).map(String::as_str)
    }

    /// Every unusable expert: `((layer, expert), reason)`.
    pub fn problems(&self) -> impl Iterator<Item = (&(usize, usize), &String)> {
        self.problems.iter()
    }

    /// Experts whose six parts one read fetches.
    pub fn contiguous_count(&self) -> usize {
        self.iter().filter(|(_, _, l)| l.contiguous).count()
    }

    /// Experts in the table.
    pub fn len(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// No expert is in the table.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every expert in the table: `(layer, expert, location)`.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, &ExpertLocation)> {
        let e = self.num_experts.max(1);
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(i, s)| s.as_ref().map(|l| (i / e, i % e, l)))
    }
}

fn locate(
    cfg: &Config,
    entries: &HashMap<String, Entry>,
    layer: usize,
    expert: usize,
) -> Result<ExpertLocation, String> {
    let specs = expert_tensors(cfg, layer, expert);
    let mut parts: [Range<u64>; 6] = Default::default();
    let mut shard = None;
    for (k, spec) in specs.iter().enumerate() {
        let name = expert_tensor_name(layer, expert, k);
        let entry = entries
            .get(&name)
            .ok_or_else(|| format!("`{name}` is missing"))?;
        if entry.dtype != spec.dtype || entry.shape != spec.shape {
            return Err(format!(
                "`{name}`: expected {} {:?}, found {} {:?}",
                spec.dtype, spec.shape, entry.dtype, entry.shape
            ));
        }
        match shard {
            None => shard = Some(entry.shard),
            Some(s) if s != entry.shard => {
                return Err(format!(
                    "`{name}` is in another shard than the expert's w1 (k3 reads an expert from one shard)"
                ))
            }
            Some(_) => {}
        }
        parts[k] = entry.range.clone();
    }
    let contiguous = parts.windows(2).all(|w| w[0].end == w[1].start);
    Ok(ExpertLocation {
        shard: shard.unwrap_or(0),
        parts,
        contiguous,
    })
}
