//! A read `config.json` ([`RawConfig`]) into a [`Config`] k3 can trust: every dimension
//! positive and within [`DIM_LIMITS`], every float within [`FLOAT_RANGES`], the fields
//! agreeing with each other, and only the model forms k3 runs. Each error names the field
//! by its JSON path and the value found.

use super::json_values::{join, read, read_object, Int, Num, Text, Token, Tokens};
use super::limits::{DIM_LIMITS, FLOAT_RANGES, MAX_ROUTED_EXPERTS};
use super::raw::{RawConfig, RawGroup, RawLinear, RawQuant, RawWeights};
use super::{AttnKind, Config, KdaConfig, MXFP4_GROUP, QUANT_BITS, QUANT_FORMAT};
use anyhow::{bail, Result};
use serde_json::Value;

/// A positive dimension, at most its [`DIM_LIMITS`] entry; `name` is the field's own name,
/// `at` the object holding it.
fn dim(at: &str, name: &str, v: Int) -> Result<usize> {
    let v = v.0;
    if v == 0 {
        bail!("{}: 0 is not allowed (must be positive)", join(at, name));
    }
    if let Some(&(_, max)) = DIM_LIMITS.iter().find(|(n, _)| *n == name) {
        if v > max {
            bail!(
                "{}: {v} is out of range (at most {max}; Kimi K3's own values are far below)",
                join(at, name)
            );
        }
    }
    Ok(v)
}

/// A float within its [`FLOAT_RANGES`] entry.
fn float(at: &str, name: &str, x: Num) -> Result<f32> {
    let x = x.0;
    if let Some(&(_, lo, hi)) = FLOAT_RANGES.iter().find(|(n, _, _)| *n == name) {
        if !(lo as f64..=hi as f64).contains(&x) {
            bail!(
                "{}: {x} is out of range (expected {lo} to {hi})",
                join(at, name)
            );
        }
    }
    Ok(x as f32)
}

/// A positive float within its [`FLOAT_RANGES`] entry.
fn positive_float(at: &str, name: &str, x: Num) -> Result<f32> {
    let x = float(at, name, x)?;
    if x <= 0.0 {
        bail!("{}: {x} is not allowed (must be positive)", join(at, name));
    }
    Ok(x)
}

/// A boolean the engine only runs one way.
fn require_bool(at: &str, name: &str, got: bool, want: bool, why: &str) -> Result<()> {
    if got != want {
        bail!("{}: {got} is not supported ({why})", join(at, name));
    }
    Ok(())
}

/// A string the engine only runs one way.
fn require_str(at: &str, name: &str, got: &Text, want: &str, why: &str) -> Result<()> {
    if got.0 != want {
        bail!(
            "{}: \"{}\" is not supported ({why}; expected \"{want}\")",
            join(at, name),
            got.0
        );
    }
    Ok(())
}

impl RawConfig {
    /// Checks every field (the first failure is the error) and builds the [`Config`].
    pub(super) fn validate(self) -> Result<Config> {
        let RawConfig {
            root,
            text: t,
            text_at: at,
        } = self;
        let hidden_size = dim(at, "hidden_size", t.hidden_size)?;
        let num_hidden_layers = dim(at, "num_hidden_layers", t.num_hidden_layers)?;
        let vocab_size = dim(at, "vocab_size", t.vocab_size)?;
        let intermediate_size = dim(at, "intermediate_size", t.intermediate_size)?;
        let first_k_dense_replace = t.first_k_dense_replace.0;
        if first_k_dense_replace > num_hidden_layers {
            bail!(
                "{}: {first_k_dense_replace} exceeds num_hidden_layers ({num_hidden_layers})",
                join(at, "first_k_dense_replace")
            );
        }
        let rms_norm_eps = positive_float(at, "rms_norm_eps", t.rms_norm_eps)?;

        require_str(
            at,
            "hidden_act",
            &t.hidden_act,
            "situ",
            "k3 implements the SiTU gated activation only",
        )?;
        let situ_beta = positive_float(at, "activation_situ_beta", t.activation_situ_beta)?;
        let situ_linear_beta = positive_float(
            at,
            "activation_situ_linear_beta",
            t.activation_situ_linear_beta,
        )?;

        let num_attention_heads = dim(at, "num_attention_heads", t.num_attention_heads)?;
        let q_lora_rank = dim(at, "q_lora_rank", t.q_lora_rank)?;
        let kv_lora_rank = dim(at, "kv_lora_rank", t.kv_lora_rank)?;
        let qk_nope_head_dim = dim(at, "qk_nope_head_dim", t.qk_nope_head_dim)?;
        let qk_rope_head_dim = dim(at, "qk_rope_head_dim", t.qk_rope_head_dim)?;
        let v_head_dim = dim(at, "v_head_dim", t.v_head_dim)?;
        require_bool(
            at,
            "mla_use_nope",
            t.mla_use_nope.0,
            true,
            "k3 runs MLA without rotary embedding only",
        )?;
        require_bool(
            at,
            "mla_use_output_gate",
            t.mla_use_output_gate.0,
            true,
            "k3 runs gated MLA only (the Kimi Linear ungated form is not implemented)",
        )?;

        let lin_at = join(at, "linear_attn_config");
        let (kda, layer_kinds) = linear(&lin_at, &t.linear_attn_config.0, num_hidden_layers)?;

        let num_experts = dim(at, "num_experts", t.num_experts)?;
        let num_experts_per_token = dim(at, "num_experts_per_token", t.num_experts_per_token)?;
        if num_experts_per_token > num_experts {
            bail!(
                "{}: {num_experts_per_token} exceeds num_experts ({num_experts})",
                join(at, "num_experts_per_token")
            );
        }
        let moe_layers = num_hidden_layers - first_k_dense_replace;
        if moe_layers.saturating_mul(num_experts) > MAX_ROUTED_EXPERTS {
            bail!(
                "{}: {num_experts} experts in each of {moe_layers} MoE layers is {} routed experts, more than the {MAX_ROUTED_EXPERTS} k3 accepts (Kimi K3 has 82432)",
                join(at, "num_experts"),
                moe_layers.saturating_mul(num_experts)
            );
        }
        let moe_intermediate_size = dim(at, "moe_intermediate_size", t.moe_intermediate_size)?;
        let routed_expert_hidden_size =
            dim(at, "routed_expert_hidden_size", t.routed_expert_hidden_size)?;
        for (name, v) in [
            ("moe_intermediate_size", moe_intermediate_size),
            ("routed_expert_hidden_size", routed_expert_hidden_size),
        ] {
            if v % MXFP4_GROUP != 0 {
                bail!(
                    "{}: {v} is not a multiple of {MXFP4_GROUP} (the MXFP4 scale group size)",
                    join(at, name)
                );
            }
        }
        let num_shared_experts = dim(at, "num_shared_experts", t.num_shared_experts)?;
        require_str(
            at,
            "moe_router_activation_func",
            &t.moe_router_activation_func,
            "sigmoid",
            "k3 implements the sigmoid router only",
        )?;
        let routed_scaling_factor =
            positive_float(at, "routed_scaling_factor", t.routed_scaling_factor)?;
        for (name, v) in [
            ("num_expert_group", t.num_expert_group),
            ("topk_group", t.topk_group),
        ] {
            if let Some(Int(v)) = v.filter(|v| v.0 != 1) {
                bail!(
                    "{}: {v} is not supported (k3 has no group-limited routing; expected 1)",
                    join(at, name)
                );
            }
        }
        let attn_res_block_size = dim(at, "attn_res_block_size", t.attn_res_block_size)?;

        // The quantization block and the special tokens may sit at the root or in
        // text_config: the first copy found counts (the root first for tokens, text_config
        // first for the rest), and only it is read.
        let Some((quant, quant_at)) = first_of([
            (&t.shared.quantization_config, at),
            (&root.shared.quantization_config, ""),
        ]) else {
            bail!("missing field `quantization_config`")
        };
        let quant_at = join(quant_at, "quantization_config");
        quantization(&read_object::<RawQuant>(quant, &quant_at)?, &quant_at)?;

        let tokens = [
            (&root.shared.bos_token_id, ""),
            (&t.shared.bos_token_id, at),
        ];
        let bos_token_id = token_field(tokens, "bos_token_id", vocab_size)?;
        let tokens = [
            (&root.shared.pad_token_id, ""),
            (&t.shared.pad_token_id, at),
        ];
        let pad_token_id = token_field(tokens, "pad_token_id", vocab_size)?;
        let eos_token_ids = eos_field(
            [
                (&root.shared.eos_token_id, ""),
                (&t.shared.eos_token_id, at),
            ],
            vocab_size,
        )?;
        const CONTEXT: &str = "max_position_embeddings";
        let max_position_embeddings = match first_of([
            (&t.shared.max_position_embeddings, at),
            (&root.shared.max_position_embeddings, ""),
        ]) {
            Some((v, at)) => Some(dim(at, CONTEXT, read(v, &join(at, CONTEXT))?)?),
            None => None,
        };

        Ok(Config {
            hidden_size,
            num_hidden_layers,
            vocab_size,
            intermediate_size,
            first_k_dense_replace,
            rms_norm_eps,
            num_attention_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            kda,
            layer_kinds,
            num_experts,
            num_experts_per_token,
            moe_intermediate_size,
            routed_expert_hidden_size,
            latent_moe_use_norm: t.latent_moe_use_norm.0,
            num_shared_experts,
            routed_scaling_factor,
            moe_renormalize: t.moe_renormalize.0,
            situ_beta,
            situ_linear_beta,
            attn_res_block_size,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
            max_position_embeddings,
        })
    }
}

/// The first present copy among `(value, path of the object holding it)` pairs.
fn first_of<'a, 'b, const N: usize>(
    copies: [(&'a Option<Value>, &'b str); N],
) -> Option<(&'a Value, &'b str)> {
    copies
        .into_iter()
        .find_map(|(v, at)| v.as_ref().map(|v| (v, at)))
}

/// `linear_attn_config` (at `at`): the KDA shape and the 0-based layer schedule.
fn linear(at: &str, lin: &RawLinear, layers: usize) -> Result<(KdaConfig, Vec<AttnKind>)> {
    let kda = KdaConfig {
        num_heads: dim(at, "num_heads", lin.num_heads)?,
        head_dim: dim(at, "head_dim", lin.head_dim)?,
        conv_kernel: dim(at, "short_conv_kernel_size", lin.short_conv_kernel_size)?,
        gate_lower_bound: match lin.gate_lower_bound {
            Some(x) => Some(float(at, "gate_lower_bound", x)?),
            None => None,
        },
    };
    require_bool(
        at,
        "use_full_rank_gate",
        lin.use_full_rank_gate.0,
        true,
        "k3 implements the full-rank output gate g_proj only",
    )?;
    Ok((kda, layer_schedule(at, lin, layers)?))
}

/// Builds the 0-based layer schedule from the 1-based `kda_layers` / `full_attn_layers`.
fn layer_schedule(at: &str, lin: &RawLinear, layers: usize) -> Result<Vec<AttnKind>> {
    let mut kinds: Vec<Option<AttnKind>> = vec![None; layers];
    for (name, list, kind) in [
        ("kda_layers", &lin.kda_layers, AttnKind::Kda),
        ("full_attn_layers", &lin.full_attn_layers, AttnKind::Mla),
    ] {
        let field = join(at, name);
        for &n in &list.0 {
            if n == 0 || n > layers {
                bail!(
                    "{field}: layer {n} is out of range (layer numbers are 1-based, 1..={layers})"
                );
            }
            match kinds[n - 1] {
                None => kinds[n - 1] = Some(kind),
                Some(prev) if prev == kind => {
                    bail!("{field}: layer {n} is listed twice")
                }
                Some(_) => bail!(
                    "{field}: layer {n} is also in {} (the lists must be disjoint)",
                    join(at, "kda_layers")
                ),
            }
        }
    }
    let missing: Vec<String> = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| k.is_none())
        .map(|(i, _)| (i + 1).to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} / full_attn_layers: layer(s) {} are in neither list (every layer 1..={layers} needs an attention kind)",
            join(at, "kda_layers"),
            missing.join(", ")
        );
    }
    Ok(kinds.into_iter().flatten().collect())
}

/// `quantization_config` (at `at`): MXFP4 routed experts, 4-bit weights in groups of 32.
fn quantization(q: &RawQuant, at: &str) -> Result<()> {
    require_str(
        at,
        "format",
        &q.format,
        QUANT_FORMAT,
        "k3 runs routed experts from native MXFP4 bytes only",
    )?;
    // compressed-tensors nests the bit width under config_groups.*.weights in some
    // exports and directly under weights in others; check whichever is present.
    let mut specs: Vec<(RawWeights, String)> = Vec::new();
    if let Some(w) = &q.weights {
        specs.push((w.0, join(at, "weights")));
    }
    let groups_at = join(at, "config_groups");
    for (name, g) in q.config_groups.iter().flatten() {
        let g_at = join(&groups_at, name);
        if let Some(w) = read_object::<RawGroup>(g, &g_at)?.weights {
            specs.push((w.0, join(&g_at, "weights")));
        }
    }
    if specs.is_empty() {
        bail!("missing field `{}`", join(at, "weights"));
    }
    for (w, w_at) in specs {
        let bits = w.num_bits.0;
        if bits as u64 != QUANT_BITS {
            bail!(
                "{}: {bits} is not supported (MXFP4 has {QUANT_BITS}-bit weights)",
                join(&w_at, "num_bits")
            );
        }
        let group = w.group_size.0;
        if group != MXFP4_GROUP {
            bail!(
                "{}: {group} is not supported (MXFP4 shares one scale per {MXFP4_GROUP} weights)",
                join(&w_at, "group_size")
            );
        }
    }
    Ok(())
}

/// A token id, from the first copy present.
fn token_field(
    copies: [(&Option<Value>, &str); 2],
    name: &str,
    vocab: usize,
) -> Result<Option<u32>> {
    match first_of(copies) {
        Some((v, at)) => {
            let field = join(at, name);
            in_vocab(read::<Token>(v, &field)?.0, &field, vocab).map(Some)
        }
        None => Ok(None),
    }
}

/// A token id must index the vocabulary (the embedding and the logits have `vocab` rows).
fn in_vocab(id: u32, field: &str, vocab: usize) -> Result<u32> {
    if id as usize >= vocab {
        bail!("{field}: token id {id} is not below vocab_size {vocab} (no such token)");
    }
    Ok(id)
}

/// `eos_token_id`: an id or a list of ids, from the first copy present.
fn eos_field(copies: [(&Option<Value>, &str); 2], vocab: usize) -> Result<Vec<u32>> {
    let Some((v, at)) = first_of(copies) else {
        bail!("missing field `eos_token_id` (looked at the root and in text_config)")
    };
    let field = join(at, "eos_token_id");
    let ids = read::<Tokens>(v, &field)?.0;
    if ids.is_empty() {
        bail!("{field}: the list is empty (generation needs a stop token)");
    }
    ids.into_iter()
        .map(|id| in_vocab(id, &field, vocab))
        .collect()
}
