//! `k3 inspect`: what a snapshot holds against what the config says it must hold.
//!
//! Unlike the loader, inspection never stops at the first missing or mis-shaped tensor:
//! it lists them all, so that one run tells the user everything that is wrong.

use super::schema::{self, dtype_accepted, shape_accepted, TensorClass};
use super::tensor_prefix::TensorPrefix;
use super::Checkpoint;
use crate::config::{AttnKind, Config};
use anyhow::Result;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// One tensor that is missing or does not match the schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorProblem {
    /// Canonical name.
    pub name: String,
    /// What the schema expects, e.g. `BF16 [7168]`.
    pub expected: String,
    /// What the checkpoint holds, or `missing`.
    pub found: String,
}

/// One row of the layer schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRow {
    /// Attention kind.
    pub attn: AttnKind,
    /// MoE (true) or dense MLP.
    pub moe: bool,
    /// The layer banks its input for the attention residuals.
    pub banks: bool,
}

/// The result of inspecting a snapshot.
#[derive(Clone, Debug)]
pub struct InspectReport {
    /// Snapshot directory.
    pub dir: PathBuf,
    /// The validated config.
    pub config: Config,
    /// Mapped shard files.
    pub shard_count: usize,
    /// Per-layer schedule, 0-based.
    pub layers: Vec<LayerRow>,
    /// Stored bytes of the present tensors, by class.
    pub bytes_by_class: BTreeMap<TensorClass, u64>,
    /// Routed experts the config calls for.
    pub experts_expected: usize,
    /// Complete, well-formed experts found.
    pub experts_present: usize,
    /// Of those, experts one read fetches.
    pub experts_contiguous: usize,
    /// Every missing or mis-shaped tensor.
    pub problems: Vec<TensorProblem>,
    /// Text tensors present that the schema does not know (informational).
    pub unexpected: Vec<String>,
    /// The first shard file, where a caller probes how expert reads will go.
    pub first_shard: Option<PathBuf>,
    /// How expert reads will go on this snapshot's disk (direct, or why they fall back), as
    /// the caller that probed the disk put it; printed when set.
    pub expert_reads: Option<String>,
}

impl InspectReport {
    /// True when every expected tensor is present and well formed.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Opens a snapshot and compares it with the schema its config implies.
pub fn inspect(dir: &Path, extra_dirs: &[PathBuf]) -> Result<InspectReport> {
    let ck = Checkpoint::open(dir, extra_dirs)?;
    let cfg = &ck.config;
    let mut bytes_by_class: BTreeMap<TensorClass, u64> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut known: HashSet<String> = HashSet::new();

    for spec in schema::dense_tensors(cfg) {
        match ck.tensor_info(&spec.name) {
            Ok(t) => {
                *bytes_by_class.entry(spec.class).or_default() += t.byte_len as u64;
                if !dtype_accepted(&spec, t.dtype) || !shape_accepted(&spec, t.shape) {
                    problems.push(TensorProblem {
                        name: spec.name.clone(),
                        expected: format!("{} {:?}", spec.dtype, spec.shape),
                        found: format!("{} {:?} in {}", t.dtype, t.shape, t.file.display()),
                    });
                }
            }
            Err(_) => problems.push(TensorProblem {
                name: spec.name.clone(),
                expected: format!("{} {:?}", spec.dtype, spec.shape),
                found: "missing".into(),
            }),
        }
        known.insert(spec.name);
    }

    let table = ck.experts();
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for expert in 0..cfg.num_experts {
            let specs = schema::expert_tensors(cfg, layer, expert);
            if let Some(loc) = table.get(layer, expert) {
                *bytes_by_class.entry(TensorClass::RoutedExpert).or_default() += loc.byte_len();
            } else {
                let before = problems.len();
                for spec in &specs {
                    let found = match ck.tensor_info(&spec.name) {
                        Err(_) => "missing".to_string(),
                        Ok(t) if t.dtype != spec.dtype || t.shape != spec.shape.as_slice() => {
                            format!("{} {:?} in {}", t.dtype, t.shape, t.file.display())
                        }
                        Ok(_) => continue,
                    };
                    problems.push(TensorProblem {
                        name: spec.name.clone(),
                        expected: format!("{} {:?}", spec.dtype, spec.shape),
                        found,
                    });
                }
                // Every part is fine on its own, yet the expert is unusable (parts in two
                // shards): report the expert once.
                if problems.len() == before {
                    if let Some(why) = table.problem(layer, expert) {
                        problems.push(TensorProblem {
                            name: TensorPrefix::expert(layer, expert).tensor("*"),
                            expected: "six tensors in one shard".into(),
                            found: why.to_string(),
                        });
                    }
                }
            }
            known.extend(specs.into_iter().map(|s| s.name));
        }
    }
    for ((layer, expert), why) in table.problems() {
        if !cfg.is_moe_layer(*layer) || *expert >= cfg.num_experts {
            problems.push(TensorProblem {
                name: TensorPrefix::expert(*layer, *expert).tensor("*"),
                expected: "no such expert".into(),
                found: why.clone(),
            });
        }
    }

    let mut unexpected: Vec<String> = ck
        .tensor_names()
        .filter(|n| !known.contains(*n))
        .filter(|n| {
            // Stray experts are already reported as problems.
            schema::parse_expert_name(n).is_none()
        })
        .map(str::to_string)
        .collect();
    unexpected.sort();

    let layers = (0..cfg.num_hidden_layers)
        .map(|i| LayerRow {
            attn: cfg.layer_kinds[i],
            moe: cfg.is_moe_layer(i),
            banks: cfg.is_bank_layer(i),
        })
        .collect();
    Ok(InspectReport {
        expert_reads: None,
        first_shard: (ck.shard_count() > 0).then(|| ck.shard_path(0).to_path_buf()),
        dir: ck.dir.clone(),
        config: cfg.clone(),
        shard_count: ck.shard_count(),
        layers,
        bytes_by_class,
        experts_expected: cfg.moe_layer_count() * cfg.num_experts,
        experts_present: table.len(),
        experts_contiguous: table.contiguous_count(),
        problems,
        unexpected,
    })
}

impl fmt::Display for InspectReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "snapshot: {} ({} text shard(s))",
            self.dir.display(),
            self.shard_count
        )?;
        writeln!(
            f,
            "dims: hidden {} vocab {} layers {} (first {} dense, intermediate {})",
            c.hidden_size,
            c.vocab_size,
            c.num_hidden_layers,
            c.first_k_dense_replace,
            c.intermediate_size
        )?;
        writeln!(
            f,
            "KDA: {} heads x {} (P = {}), conv {}, gate lower bound {:?}",
            c.kda.num_heads,
            c.kda.head_dim,
            c.kda_width(),
            c.kda.conv_kernel,
            c.kda.gate_lower_bound
        )?;
        writeln!(
            f,
            "MLA: {} heads, q_lora {}, kv_lora {}, nope/rope/v {}/{}/{}",
            c.num_attention_heads,
            c.q_lora_rank,
            c.kv_lora_rank,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim
        )?;
        writeln!(
            f,
            "MoE: {} experts, top {}, width {}, latent {}, shared width {}, {} bytes per expert",
            c.num_experts,
            c.num_experts_per_token,
            c.moe_intermediate_size,
            c.routed_expert_hidden_size,
            c.shared_width(),
            c.expert_bytes()
        )?;
        writeln!(f, "layers (attention / mlp / AttnRes bank):")?;
        for (i, l) in self.layers.iter().enumerate() {
            let attn = match l.attn {
                AttnKind::Kda => "KDA",
                AttnKind::Mla => "MLA",
            };
            let mlp = if l.moe { "MoE" } else { "dense" };
            let bank = if l.banks { "bank" } else { "-" };
            writeln!(f, "  {i:>3}  {attn}  {mlp:<5}  {bank}")?;
        }
        writeln!(f, "bytes by class:")?;
        let mut total = 0u64;
        for (class, bytes) in &self.bytes_by_class {
            total += bytes;
            writeln!(
                f,
                "  {:<14} {:>16} ({:.2} GB)",
                format!("{class:?}"),
                bytes,
                *bytes as f64 / 1e9
            )?;
        }
        writeln!(
            f,
            "  {:<14} {:>16} ({:.2} GB)",
            "total",
            total,
            total as f64 / 1e9
        )?;
        writeln!(
            f,
            "experts: {} of {} present, {} contiguous, {} split",
            self.experts_present,
            self.experts_expected,
            self.experts_contiguous,
            self.experts_present - self.experts_contiguous
        )?;
        if let Some(reads) = &self.expert_reads {
            writeln!(f, "expert reads: {reads}")?;
        }
        if !self.unexpected.is_empty() {
            writeln!(
                f,
                "{} tensor(s) not in the schema (ignored):",
                self.unexpected.len()
            )?;
            for n in &self.unexpected {
                writeln!(f, "  {n}")?;
            }
        }
        if self.problems.is_empty() {
            writeln!(f, "OK: every expected tensor is present and well formed")
        } else {
            writeln!(f, "{} problem(s):", self.problems.len())?;
            for p in &self.problems {
                writeln!(
                    f,
                    "  {}: expected {}, found {}",
                    p.name, p.expected, p.found
                )?;
            }
            Ok(())
        }
    }
}
