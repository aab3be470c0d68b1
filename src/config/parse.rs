//! `config.json` as released (root and `text_config`) into a validated [`Config`].

use super::json_fields::{as_token, as_usize, describe, Obj};
use super::limits::MAX_ROUTED_EXPERTS;
use super::{AttnKind, Config, KdaConfig, MXFP4_GROUP, QUANT_BITS, QUANT_FORMAT};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub(super) fn parse(root_value: &Value) -> Result<Config> {
    let root = Obj::new(root_value, "")?;
    let model_type = root.str("model_type")?;
    match model_type {
        "kimi_k3" => {}
        "kimi_linear" => bail!(
            "model_type: \"kimi_linear\" (Kimi Linear) is not supported yet; k3 runs Kimi K3 checkpoints only"
        ),
        other => bail!("model_type: \"{other}\" is not supported (expected \"kimi_k3\")"),
    }
    let text = match root.opt("text_config") {
        Some(v) => Obj::new(v, "text_config")?,
        None => Obj::new(root_value, "")?,
    };

    let hidden_size = text.positive("hidden_size")?;
    let num_hidden_layers = text.positive("num_hidden_layers")?;
    let vocab_size = text.positive("vocab_size")?;
    let intermediate_size = text.positive("intermediate_size")?;
    let first_k_dense_replace = text.usize("first_k_dense_replace")?;
    if first_k_dense_replace > num_hidden_layers {
        bail!(
            "{}: {first_k_dense_replace} exceeds num_hidden_layers ({num_hidden_layers})",
            text.field_name("first_k_dense_replace")
        );
    }
    let rms_norm_eps = text.positive_f32("rms_norm_eps")?;

    text.require_str(
        "hidden_act",
        "situ",
        "k3 implements the SiTU gated activation only",
    )?;
    let situ_beta = text.positive_f32("activation_situ_beta")?;
    let situ_linear_beta = text.positive_f32("activation_situ_linear_beta")?;

    let num_attention_heads = text.positive("num_attention_heads")?;
    let q_lora_rank = text.positive("q_lora_rank")?;
    let kv_lora_rank = text.positive("kv_lora_rank")?;
    let qk_nope_head_dim = text.positive("qk_nope_head_dim")?;
    let qk_rope_head_dim = text.positive("qk_rope_head_dim")?;
    let v_head_dim = text.positive("v_head_dim")?;
    text.require_bool(
        "mla_use_nope",
        true,
        "k3 runs MLA without rotary embedding only",
    )?;
    text.require_bool(
        "mla_use_output_gate",
        true,
        "k3 runs gated MLA only (the Kimi Linear ungated form is not implemented)",
    )?;

    let lin = text.child("linear_attn_config")?;
    let kda = KdaConfig {
        num_heads: lin.positive("num_heads")?,
        head_dim: lin.positive("head_dim")?,
        conv_kernel: lin.positive("short_conv_kernel_size")?,
        gate_lower_bound: match lin.opt("gate_lower_bound") {
            Some(_) => Some(lin.f32("gate_lower_bound")?),
            None => None,
        },
    };
    lin.require_bool(
        "use_full_rank_gate",
        true,
        "k3 implements the full-rank output gate g_proj only",
    )?;
    let layer_kinds = layer_schedule(&lin, num_hidden_layers)?;

    let num_experts = text.positive("num_experts")?;
    let num_experts_per_token = text.positive("num_experts_per_token")?;
    if num_experts_per_token > num_experts {
        bail!(
            "{}: {num_experts_per_token} exceeds num_experts ({num_experts})",
            text.field_name("num_experts_per_token")
        );
    }
    let moe_layers = num_hidden_layers - first_k_dense_replace;
    if moe_layers.saturating_mul(num_experts) > MAX_ROUTED_EXPERTS {
        bail!(
            "{}: {num_experts} experts in each of {moe_layers} MoE layers is {} routed experts, more than the {MAX_ROUTED_EXPERTS} k3 accepts (Kimi K3 has 82432)",
            text.field_name("num_experts"),
            moe_layers.saturating_mul(num_experts)
        );
    }
    let moe_intermediate_size = text.positive("moe_intermediate_size")?;
    let routed_expert_hidden_size = text.positive("routed_expert_hidden_size")?;
    for (name, v) in [
        ("moe_intermediate_size", moe_intermediate_size),
        ("routed_expert_hidden_size", routed_expert_hidden_size),
    ] {
        if v % MXFP4_GROUP != 0 {
            bail!(
                "{}: {v} is not a multiple of {MXFP4_GROUP} (the MXFP4 scale group size)",
                text.field_name(name)
            );
        }
    }
    let latent_moe_use_norm = text.bool("latent_moe_use_norm")?;
    let num_shared_experts = text.positive("num_shared_experts")?;
    text.require_str(
        "moe_router_activation_func",
        "sigmoid",
        "k3 implements the sigmoid router only",
    )?;
    let moe_renormalize = text.bool("moe_renormalize")?;
    let routed_scaling_factor = text.positive_f32("routed_scaling_factor")?;
    for name in ["num_expert_group", "topk_group"] {
        if text.opt(name).is_some() {
            let v = text.usize(name)?;
            if v != 1 {
                bail!(
                    "{}: {v} is not supported (k3 has no group-limited routing; expected 1)",
                    text.field_name(name)
                );
            }
        }
    }
    let attn_res_block_size = text.positive("attn_res_block_size")?;

    let quant = match text.opt("quantization_config") {
        Some(_) => text.child("quantization_config")?,
        None => root.child("quantization_config")?,
    };
    quant.require_str(
        "format",
        QUANT_FORMAT,
        "k3 runs routed experts from native MXFP4 bytes only",
    )?;
    let weights = quant
        .opt("weights")
        .map(|v| Obj::new(v, &quant.field_name("weights")))
        .transpose()?;
    // compressed-tensors nests the bit width under config_groups.*.weights in some
    // exports and directly under weights in others; check whichever is present.
    let mut weight_specs: Vec<Obj<'_>> = weights.into_iter().collect();
    if let Some(groups) = quant.opt("config_groups") {
        let groups = Obj::new(groups, &quant.field_name("config_groups"))?;
        for (name, g) in groups.map {
            let g = Obj::new(g, &groups.field_name(name))?;
            if g.opt("weights").is_some() {
                weight_specs.push(g.child("weights")?);
            }
        }
    }
    if weight_specs.is_empty() {
        bail!("missing field `{}`", quant.field_name("weights"));
    }
    for w in &weight_specs {
        let bits = w.usize("num_bits")?;
        if bits as u64 != QUANT_BITS {
            bail!(
                "{}: {bits} is not supported (MXFP4 has {QUANT_BITS}-bit weights)",
                w.field_name("num_bits")
            );
        }
        let group = w.usize("group_size")?;
        if group != MXFP4_GROUP {
            bail!(
                "{}: {group} is not supported (MXFP4 shares one scale per {MXFP4_GROUP} weights)",
                w.field_name("group_size")
            );
        }
    }

    let bos_token_id = token_field(&root, &text, "bos_token_id", vocab_size)?;
    let pad_token_id = token_field(&root, &text, "pad_token_id", vocab_size)?;
    let eos_token_ids = eos_field(&root, &text, vocab_size)?;
    let max_position_embeddings = context_field(&root, &text)?;

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
        latent_moe_use_norm,
        num_shared_experts,
        routed_scaling_factor,
        moe_renormalize,
        situ_beta,
        situ_linear_beta,
        attn_res_block_size,
        bos_token_id,
        eos_token_ids,
        pad_token_id,
        max_position_embeddings,
    })
}

/// `max_position_embeddings` from `text_config`, else the root; absent or `null` is `None`.
fn context_field(root: &Obj<'_>, text: &Obj<'_>) -> Result<Option<usize>> {
    const NAME: &str = "max_position_embeddings";
    for obj in [text, root] {
        if obj.opt(NAME).is_some() {
            return obj.positive(NAME).map(Some);
        }
    }
    Ok(None)
}

/// Builds the 0-based layer schedule from the 1-based `kda_layers` / `full_attn_layers`.
fn layer_schedule(lin: &Obj<'_>, layers: usize) -> Result<Vec<AttnKind>> {
    let mut kinds: Vec<Option<AttnKind>> = vec![None; layers];
    for (name, kind) in [
        ("kda_layers", AttnKind::Kda),
        ("full_attn_layers", AttnKind::Mla),
    ] {
        let field = lin.field_name(name);
        let v = lin.req(name)?;
        let list = v.as_array().ok_or_else(|| {
            anyhow!(
                "{field}: expected a list of layer numbers, got {}",
                describe(v)
            )
        })?;
        for item in list {
            let n = as_usize(item, &field)?;
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
                    lin.field_name("kda_layers")
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
            lin.field_name("kda_layers"),
            missing.join(", ")
        );
    }
    Ok(kinds.into_iter().flatten().collect())
}

/// A token id looked up at the root first, then in `text_config`.
fn token_field(root: &Obj<'_>, text: &Obj<'_>, name: &str, vocab: usize) -> Result<Option<u32>> {
    for obj in [root, text] {
        if let Some(v) = obj.opt(name) {
            let field = obj.field_name(name);
            return in_vocab(as_token(v, &field)?, &field, vocab).map(Some);
        }
    }
    Ok(None)
}

/// A token id must index the vocabulary (the embedding and the logits have `vocab` rows).
fn in_vocab(id: u32, field: &str, vocab: usize) -> Result<u32> {
    if id as usize >= vocab {
        bail!("{field}: token id {id} is not below vocab_size {vocab} (no such token)");
    }
    Ok(id)
}

/// `eos_token_id`: an int or a list of ints, at the root first, then in `text_config`.
fn eos_field(root: &Obj<'_>, text: &Obj<'_>, vocab: usize) -> Result<Vec<u32>> {
    let name = "eos_token_id";
    for obj in [root, text] {
        let Some(v) = obj.opt(name) else { continue };
        let field = obj.field_name(name);
        let ids = match v {
            Value::Array(list) => list
                .iter()
                .map(|x| in_vocab(as_token(x, &field)?, &field, vocab))
                .collect::<Result<Vec<u32>>>()?,
            other => vec![in_vocab(as_token(other, &field)?, &field, vocab)?],
        };
        if ids.is_empty() {
            bail!("{field}: the list is empty (generation needs a stop token)");
        }
        return Ok(ids);
    }
    bail!("missing field `eos_token_id` (looked at the root and in text_config)")
}
