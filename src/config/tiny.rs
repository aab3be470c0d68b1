//! The tiny config the loader, schema and hostile-input tests build on: one copy, so a
//! change to the config format is made once.

use super::Config;
use serde_json::{json, Value};

/// A small, valid K3 config as a release writes it (`text_config` nested, the
/// quantization block beside it): 3 layers (KDA, KDA, MLA), layer 0 dense, 4 experts of
/// 2 per token.
pub fn tiny_json() -> Value {
    json!({
        "model_type": "kimi_k3",
        "eos_token_id": 2,
        "text_config": {
            "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 32,
            "intermediate_size": 96, "first_k_dense_replace": 1, "rms_norm_eps": 1e-5,
            "num_attention_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
            "mla_use_nope": true, "mla_use_output_gate": true,
            "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": true,
                "kda_layers": [1, 2], "full_attn_layers": [3]},
            "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
            "routed_expert_hidden_size": 64, "latent_moe_use_norm": true,
            "num_shared_experts": 1, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": true, "routed_scaling_factor": 1.0, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 2
        },
        "quantization_config": {"quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized", "weights": {"num_bits": 4, "group_size": 32}}
    })
}

impl Config {
    /// [`tiny_json`], validated.
    pub fn tiny() -> Config {
        match Config::from_json_str(&tiny_json().to_string(), "tiny config") {
            Ok(c) => c,
            // The text is a constant of this file, checked by the tests that use it.
            Err(e) => unreachable!("the tiny config is invalid: {e:#}"),
        }
    }
}
