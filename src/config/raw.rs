//! `config.json` as written, read by serde: the root, and the text model's fields from
//! `text_config` (or from the root, when there is none). Each leaf is typed here
//! ([`super::json_values`]); ranges and the fields' agreement are [`super::validate`]'s.
//! Fields k3 does not read are ignored, and a `null` counts as absent.

use super::json_values::{read_object, Flag, Int, Layers, Num, Obj, Text};
use anyhow::{bail, Result};
use serde::Deserialize;
use serde_json::Value;

/// The root object. The fields that may also sit in `text_config` are kept as found and
/// typed by [`super::validate`] once it has chosen which copy counts, so that the copy it
/// does not read is never refused.
#[derive(Debug, Deserialize)]
pub(super) struct RawRoot {
    pub model_type: Text,
    pub text_config: Option<Value>,
    #[serde(flatten)]
    pub shared: RawShared,
}

/// The fields that may sit at the root or in `text_config`, kept as found: validation
/// types the copy that counts, so the copy it does not read is never refused.
#[derive(Debug, Deserialize)]
pub(super) struct RawShared {
    pub quantization_config: Option<Value>,
    pub bos_token_id: Option<Value>,
    pub eos_token_id: Option<Value>,
    pub pad_token_id: Option<Value>,
    pub max_position_embeddings: Option<Value>,
}

/// The text model's fields.
#[derive(Debug, Deserialize)]
pub(super) struct RawText {
    pub hidden_size: Int,
    pub num_hidden_layers: Int,
    pub vocab_size: Int,
    pub intermediate_size: Int,
    pub first_k_dense_replace: Int,
    pub rms_norm_eps: Num,
    pub hidden_act: Text,
    pub activation_situ_beta: Num,
    pub activation_situ_linear_beta: Num,
    pub num_attention_heads: Int,
    pub q_lora_rank: Int,
    pub kv_lora_rank: Int,
    pub qk_nope_head_dim: Int,
    pub qk_rope_head_dim: Int,
    pub v_head_dim: Int,
    pub mla_use_nope: Flag,
    pub mla_use_output_gate: Flag,
    pub linear_attn_config: Obj<RawLinear>,
    pub num_experts: Int,
    pub num_experts_per_token: Int,
    pub moe_intermediate_size: Int,
    pub routed_expert_hidden_size: Int,
    pub latent_moe_use_norm: Flag,
    pub num_shared_experts: Int,
    pub moe_router_activation_func: Text,
    pub moe_renormalize: Flag,
    pub routed_scaling_factor: Num,
    pub num_expert_group: Option<Int>,
    pub topk_group: Option<Int>,
    pub attn_res_block_size: Int,
    #[serde(flatten)]
    pub shared: RawShared,
}

/// `linear_attn_config`: the KDA layers' shape and the layer schedule.
#[derive(Debug, Deserialize)]
pub(super) struct RawLinear {
    pub num_heads: Int,
    pub head_dim: Int,
    pub short_conv_kernel_size: Int,
    pub gate_lower_bound: Option<Num>,
    pub use_full_rank_gate: Flag,
    pub kda_layers: Layers,
    pub full_attn_layers: Layers,
}

/// `quantization_config` (compressed-tensors). Each of `config_groups` is read as a
/// [`RawGroup`] once the format is checked.
#[derive(Debug, Deserialize)]
pub(super) struct RawQuant {
    pub format: Text,
    pub weights: Option<Obj<RawWeights>>,
    pub config_groups: Option<serde_json::Map<String, Value>>,
}

/// One entry of `config_groups`.
#[derive(Debug, Deserialize)]
pub(super) struct RawGroup {
    pub weights: Option<Obj<RawWeights>>,
}

/// The bit width and scale group of the quantized weights.
#[derive(Clone, Copy, Debug, Deserialize)]
pub(super) struct RawWeights {
    pub num_bits: Int,
    pub group_size: Int,
}

/// The whole file, read: the root, the text fields and where they were found.
pub(super) struct RawConfig {
    pub root: RawRoot,
    pub text: RawText,
    /// `text_config`, or "" when the text fields sit at the root.
    pub text_at: &'static str,
}

impl RawConfig {
    /// Reads `root`; the model type is checked before the text fields, so a model k3 does
    /// not run is named as such rather than by a field it lacks.
    pub(super) fn read(root: &Value) -> Result<RawConfig> {
        let raw_root: RawRoot = read_object(root, "")?;
        model_type(&raw_root.model_type)?;
        let (text, text_at) = match &raw_root.text_config {
            Some(v) => (read_object(v, "text_config")?, "text_config"),
            None => (read_object(root, "")?, ""),
        };
        Ok(RawConfig {
            root: raw_root,
            text,
            text_at,
        })
    }
}

/// Refuses every model type but Kimi K3's.
fn model_type(t: &Text) -> Result<()> {
    match t.0.as_str() {
        "kimi_k3" => Ok(()),
        "kimi_linear" => bail!(
            "model_type: \"kimi_linear\" (Kimi Linear) is not supported yet; k3 runs Kimi K3 checkpoints only"
        ),
        other => bail!("model_type: \"{other}\" is not supported (expected \"kimi_k3\")"),
    }
}
