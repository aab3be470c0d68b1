//! `config.json` → a typed, validated K3 configuration.
//!
//! serde reads the file into raw structs (`raw.rs`, leaf values in `json_values.rs`), then
//! one validation (`validate.rs`) checks every field the engine relies on, so that the rest
//! of the code can trust the numbers; anything the engine cannot run is refused with an
//! error that names the field (as a JSON path) and the value found.

mod json_values;
mod limits;
mod raw;
mod tiny;
mod validate;

pub use limits::MAX_CONFIG_BYTES;
pub use tiny::tiny_json;

use crate::platform::input_file::{self, FileKind};
use anyhow::{anyhow, Context, Result};
use serde_json::Value;
use std::path::Path;

/// Attention kind of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKind {
    /// Kimi Delta Attention (linear, recurrent state).
    Kda,
    /// Gated multi-head latent attention (full, causal, no rotary embedding).
    Mla,
}

/// `linear_attn_config`: shape of the KDA layers.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaConfig {
    /// Number of KDA heads.
    pub num_heads: usize,
    /// Width of one KDA head.
    pub head_dim: usize,
    /// Width of the causal short convolution (`short_conv_kernel_size`).
    pub conv_kernel: usize,
    /// `gate_lower_bound`: `Some` selects the K3 decay form.
    pub gate_lower_bound: Option<f32>,
}

/// The text model's configuration, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Model width H.
    pub hidden_size: usize,
    /// Number of layers L.
    pub num_hidden_layers: usize,
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Width of the dense MLP of the first layers.
    pub intermediate_size: usize,
    /// Layers below this index are dense, the rest MoE.
    pub first_k_dense_replace: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// MLA heads.
    pub num_attention_heads: usize,
    /// MLA query low-rank width.
    pub q_lora_rank: usize,
    /// MLA latent (cached) width.
    pub kv_lora_rank: usize,
    /// MLA per-head width of the non-positional query/key part.
    pub qk_nope_head_dim: usize,
    /// MLA per-head width of the (un-rotated) "rope" query/key part.
    pub qk_rope_head_dim: usize,
    /// MLA per-head value width.
    pub v_head_dim: usize,
    /// KDA layer shape.
    pub kda: KdaConfig,
    /// Attention kind of every layer, 0-based.
    pub layer_kinds: Vec<AttnKind>,
    /// Routed experts per MoE layer E.
    pub num_experts: usize,
    /// Experts chosen per token k.
    pub num_experts_per_token: usize,
    /// Routed expert width I.
    pub moe_intermediate_size: usize,
    /// Latent width D the routed experts work in.
    pub routed_expert_hidden_size: usize,
    /// RMSNorm on the summed latent expert output.
    pub latent_moe_use_norm: bool,
    /// Shared experts, fused into one MLP of width `num_shared_experts · I`.
    pub num_shared_experts: usize,
    /// Multiplier on the routing weights.
    pub routed_scaling_factor: f32,
    /// Divide the chosen router scores by their sum.
    pub moe_renormalize: bool,
    /// `activation_situ_beta`.
    pub situ_beta: f32,
    /// `activation_situ_linear_beta`.
    pub situ_linear_beta: f32,
    /// Block size of the attention-residual bank.
    pub attn_res_block_size: usize,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Padding token.
    pub pad_token_id: Option<u32>,
    /// The context the checkpoint states it was built for (`max_position_embeddings`),
    /// when its config states one.
    pub max_position_embeddings: Option<usize>,
}

/// The only routed-expert weight format the engine runs.
pub(super) const QUANT_FORMAT: &str = "mxfp4-pack-quantized";
/// MXFP4 bits per weight.
pub(super) const QUANT_BITS: u64 = 4;
/// MXFP4 weights per shared E8M0 scale.
pub const MXFP4_GROUP: usize = 32;

impl Config {
    /// Reads and validates `config.json`; every error starts with the path.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = input_file::read_text(path, FileKind::ModelConfig)?;
        Config::from_json_str(&text, &path.display().to_string())
    }

    /// Parses and validates a config from JSON text; `origin` prefixes every error.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Config> {
        let root: Value = crate::unique_json::parse_str(text)
            .with_context(|| format!("{origin}: not valid JSON"))?;
        raw::RawConfig::read(&root)
            .and_then(raw::RawConfig::validate)
            .map_err(|e| anyhow!("{origin}: {e:#}"))
    }

    /// Whether layer `i` (0-based) runs the MoE rather than the dense MLP.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace && i < self.num_hidden_layers
    }

    /// Number of MoE layers.
    pub fn moe_layer_count(&self) -> usize {
        self.num_hidden_layers - self.first_k_dense_replace
    }

    /// Whether layer `i` pushes its input onto the attention-residual bank.
    pub fn is_bank_layer(&self, i: usize) -> bool {
        i % self.attn_res_block_size == 0
    }

    /// KDA projection width P = heads · head_dim.
    pub fn kda_width(&self) -> usize {
        self.kda.num_heads * self.kda.head_dim
    }

    /// Width of the fused shared-expert MLP.
    pub fn shared_width(&self) -> usize {
        self.num_shared_experts * self.moe_intermediate_size
    }

    /// Bytes of one routed expert's six MXFP4 tensors (packed + scales of w1, w2, w3).
    pub fn expert_bytes(&self) -> usize {
        let weights = self.moe_intermediate_size * self.routed_expert_hidden_size;
        3 * (weights / 2 + weights / MXFP4_GROUP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published K3 config, trimmed to the fields of docs/model.md#checkpoint-and-config,
    /// nested as released.
    pub(crate) fn k3_release_json() -> Value {
        let full: Vec<usize> = (1..=23).map(|i| 4 * i).chain([93]).collect();
        let kda: Vec<usize> = (1..=93).filter(|i| !full.contains(i)).collect();
        serde_json::json!({
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "bos_token_id": 163584,
            "eos_token_id": 163586,
            "pad_token_id": 163839,
            "text_config": {
                "model_type": "kimi_linear",
                "hidden_size": 7168,
                "num_hidden_layers": 93,
                "vocab_size": 163840,
                "intermediate_size": 33792,
                "first_k_dense_replace": 1,
                "rms_norm_eps": 1e-5,
                "num_attention_heads": 96,
                "q_lora_rank": 1536,
                "kv_lora_rank": 512,
                "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64,
                "v_head_dim": 128,
                "mla_use_nope": true,
                "mla_use_output_gate": true,
                "linear_attn_config": {
                    "num_heads": 96,
                    "head_dim": 128,
                    "short_conv_kernel_size": 4,
                    "gate_lower_bound": -5.0,
                    "use_full_rank_gate": true,
                    "kda_layers": kda,
                    "full_attn_layers": full,
                },
                "num_experts": 896,
                "num_experts_per_token": 16,
                "moe_intermediate_size": 3072,
                "routed_expert_hidden_size": 3584,
                "latent_moe_use_norm": true,
                "num_shared_experts": 2,
                "moe_router_activation_func": "sigmoid",
                "moe_renormalize": true,
                "routed_scaling_factor": 1.0,
                "num_expert_group": 1,
                "topk_group": 1,
                "hidden_act": "situ",
                "activation_situ_beta": 4.0,
                "activation_situ_linear_beta": 25.0,
                "attn_res_block_size": 12,
            },
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "group_size": 32},
            },
        })
    }

    fn parse_value(v: &Value) -> Result<Config> {
        Config::from_json_str(&v.to_string(), "config.json")
    }

    fn err_of(v: &Value) -> String {
        match parse_value(v) {
            Ok(_) => panic!("config was accepted"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn parses_the_k3_release_config() {
        let c = parse_value(&k3_release_json()).unwrap();
        assert_eq!(c.hidden_size, 7168);
        assert_eq!(c.num_hidden_layers, 93);
        assert_eq!(c.layer_kinds.len(), 93);
        let mla: Vec<usize> = (0..93)
            .filter(|&i| c.layer_kinds[i] == AttnKind::Mla)
            .collect();
        assert_eq!(mla.len(), 24);
        assert_eq!(mla[0], 3);
        assert_eq!(mla[22], 91);
        assert_eq!(mla[23], 92);
        assert_eq!(c.layer_kinds[0], AttnKind::Kda);
        assert_eq!(c.kda_width(), 12288);
        assert_eq!(c.kda.gate_lower_bound, Some(-5.0));
        assert_eq!(c.shared_width(), 6144);
        assert_eq!(c.expert_bytes(), 17_547_264);
        assert_eq!(c.moe_layer_count(), 92);
        assert!(!c.is_moe_layer(0));
        assert!(c.is_moe_layer(1) && c.is_moe_layer(92) && !c.is_moe_layer(93));
        assert!(c.is_bank_layer(0) && c.is_bank_layer(12) && !c.is_bank_layer(11));
        assert_eq!(c.eos_token_ids, vec![163586]);
        assert_eq!(c.bos_token_id, Some(163584));
        assert_eq!(c.pad_token_id, Some(163839));
        assert_eq!(c.situ_beta, 4.0);
        assert_eq!(c.situ_linear_beta, 25.0);
        assert_eq!(c.rms_norm_eps, 1e-5);
    }

    #[test]
    fn reads_the_root_when_there_is_no_text_config() {
        let mut v = k3_release_json();
        let text = v["text_config"].take();
        let root = v.as_object_mut().unwrap();
        root.remove("text_config");
        for (k, x) in text.as_object().unwrap() {
            if k != "model_type" {
                root.insert(k.clone(), x.clone());
            }
        }
        let c = parse_value(&v).unwrap();
        assert_eq!(c.num_experts, 896);
    }

    #[test]
    fn eos_list_and_text_config_fallback() {
        let mut v = k3_release_json();
        v.as_object_mut().unwrap().remove("eos_token_id");
        v["text_config"]["eos_token_id"] = serde_json::json!([7, 9]);
        assert_eq!(parse_value(&v).unwrap().eos_token_ids, vec![7, 9]);
        v["text_config"]["eos_token_id"] = serde_json::json!("x");
        assert!(err_of(&v).contains("text_config.eos_token_id: expected a token id"));
    }

    #[test]
    fn refuses_unsupported_values_naming_field_and_value() {
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "mla_use_nope",
                Value::Bool(false),
                "text_config.mla_use_nope: false is not supported",
            ),
            (
                "mla_use_output_gate",
                Value::Bool(false),
                "text_config.mla_use_output_gate: false",
            ),
            (
                "hidden_act",
                "silu".into(),
                "text_config.hidden_act: \"silu\" is not supported",
            ),
            (
                "moe_router_activation_func",
                "softmax".into(),
                "moe_router_activation_func: \"softmax\"",
            ),
            (
                "num_expert_group",
                8.into(),
                "text_config.num_expert_group: 8 is not supported",
            ),
            ("topk_group", 4.into(), "text_config.topk_group: 4"),
            (
                "first_k_dense_replace",
                94.into(),
                "first_k_dense_replace: 94 exceeds num_hidden_layers (93)",
            ),
            (
                "num_experts_per_token",
                897.into(),
                "num_experts_per_token: 897 exceeds num_experts (896)",
            ),
            (
                "hidden_size",
                0.into(),
                "text_config.hidden_size: 0 is not allowed",
            ),
            (
                "moe_intermediate_size",
                3000.into(),
                "moe_intermediate_size: 3000 is not a multiple of 32",
            ),
        ];
        for (field, value, want) in cases {
            let mut v = k3_release_json();
            v["text_config"][field] = value;
            let e = err_of(&v);
            assert!(e.starts_with("config.json: "), "{e}");
            assert!(e.contains(want), "{field}: got {e}");
        }
    }

    #[test]
    fn refuses_kimi_linear() {
        let mut v = k3_release_json();
        v["model_type"] = "kimi_linear".into();
        let e = err_of(&v);
        assert!(
            e.contains("kimi_linear") && e.contains("not supported yet"),
            "{e}"
        );
    }

    #[test]
    fn refuses_other_quantization() {
        let mut v = k3_release_json();
        v["quantization_config"]["format"] = "nvfp4-pack-quantized".into();
        assert!(err_of(&v).contains("quantization_config.format: \"nvfp4-pack-quantized\""));
        let mut v = k3_release_json();
        v["quantization_config"]["weights"]["group_size"] = 16.into();
        assert!(err_of(&v).contains("quantization_config.weights.group_size: 16"));
        let mut v = k3_release_json();
        v["quantization_config"]["weights"]["num_bits"] = 8.into();
        assert!(err_of(&v).contains("quantization_config.weights.num_bits: 8"));
        let mut v = k3_release_json();
        v.as_object_mut().unwrap().remove("quantization_config");
        assert!(err_of(&v).contains("missing field `quantization_config`"));
    }

    #[test]
    fn refuses_full_rank_gate_off() {
        let mut v = k3_release_json();
        v["text_config"]["linear_attn_config"]["use_full_rank_gate"] = false.into();
        let e = err_of(&v);
        assert!(
            e.contains("text_config.linear_attn_config.use_full_rank_gate: false"),
            "{e}"
        );
    }

    #[test]
    fn names_missing_fields_and_wrong_types() {
        let mut v = k3_release_json();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("kv_lora_rank");
        assert!(err_of(&v).contains("missing field `text_config.kv_lora_rank`"));
        let mut v = k3_release_json();
        v["text_config"]["hidden_size"] = "7168".into();
        let e = err_of(&v);
        assert!(
            e.contains(
                "text_config.hidden_size: expected a non-negative integer, got a string (\"7168\")"
            ),
            "{e}"
        );
        let mut v = k3_release_json();
        v["text_config"]["moe_renormalize"] = 1.into();
        assert!(err_of(&v)
            .contains("text_config.moe_renormalize: expected a boolean, got a number (1)"));
        assert!(Config::from_json_str("{", "x.json")
            .unwrap_err()
            .to_string()
            .starts_with("x.json: not valid JSON"));
    }

    #[test]
    fn objects_must_be_objects_and_unread_fields_are_ignored() {
        let mut v = k3_release_json();
        // serde's derived structs would take a list of the fields' values in order.
        v["text_config"]["linear_attn_config"] = serde_json::json!([96, 128]);
        let e = err_of(&v);
        assert!(
            e.contains("text_config.linear_attn_config: expected an object, got a list ([96,128])"),
            "{e}"
        );
        v["text_config"]["linear_attn_config"] = Value::Null;
        let e = err_of(&v);
        assert!(
            e.contains("missing field `text_config.linear_attn_config`"),
            "{e}"
        );
        let mut v = k3_release_json();
        v["quantization_config"]["config_groups"] =
            serde_json::json!({"g": {"weights": {"num_bits": 8, "group_size": 32}}});
        let e = err_of(&v);
        assert!(
            e.contains("quantization_config.config_groups.g.weights.num_bits: 8 is not supported"),
            "{e}"
        );
        // Unknown fields, and the copy of a field that is not the one read, are ignored.
        let mut v = k3_release_json();
        v["text_config"]["a_future_field"] = serde_json::json!({"x": [1]});
        v["text_config"]["bos_token_id"] = "not read: the root's counts".into();
        v["text_config"]["quantization_config"] = k3_release_json()["quantization_config"].clone();
        v["quantization_config"] = "not read: text_config's counts".into();
        assert_eq!(parse_value(&v).unwrap().bos_token_id, Some(163584));
    }

    #[test]
    fn refuses_inconsistent_layer_lists() {
        let lists = |kda: Vec<usize>, full: Vec<usize>| {
            let mut v = k3_release_json();
            v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!(kda);
            v["text_config"]["linear_attn_config"]["full_attn_layers"] = serde_json::json!(full);
            err_of(&v)
        };
        let all: Vec<usize> = (1..=93).collect();
        let e = lists(all.clone(), vec![4]);
        assert!(e.contains("full_attn_layers: layer 4 is also in"), "{e}");
        let e = lists(all[1..].to_vec(), vec![0]);
        assert!(
            e.contains("layer 0 is out of range (layer numbers are 1-based"),
            "{e}"
        );
        let e = lists(all[1..].to_vec(), vec![94]);
        assert!(e.contains("layer 94 is out of range"), "{e}");
        let e = lists(all[2..].to_vec(), vec![]);
        assert!(e.contains("layer(s) 1, 2 are in neither list"), "{e}");
        let e = lists(all.iter().copied().chain([5]).collect(), vec![]);
        assert!(e.contains("kda_layers: layer 5 is listed twice"), "{e}");
    }

    #[test]
    fn from_file_prefixes_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("config.json");
        let e = format!("{:#}", Config::from_file(&missing).unwrap_err());
        assert!(e.contains(&missing.display().to_string()), "{e}");
        let mut v = k3_release_json();
        v["text_config"]["mla_use_nope"] = false.into();
        std::fs::write(&missing, v.to_string()).unwrap();
        let e = format!("{:#}", Config::from_file(&missing).unwrap_err());
        assert!(
            e.starts_with(&format!(
                "{}: text_config.mla_use_nope: false",
                missing.display()
            )),
            "{e}"
        );
    }
}
