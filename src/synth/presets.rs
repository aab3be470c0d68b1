//! The synthetic checkpoint presets: their dimensions and the `config.json` they imply.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::{Preset, SynthOptions};

/// Shard budget of `tiny`: small enough that even tiny spreads over several shards.
const TINY_SHARD_BYTES: u64 = 256 * 1024;
/// Shard budget of `small`.
const SMALL_SHARD_BYTES: u64 = 32 * 1024 * 1024;
/// Shard budget of `k3-slice`, close to the published shards' order of size.
const K3_SHARD_BYTES: u64 = 4 * 1024 * 1024 * 1024;

/// Most layers `--layers` asks for: the bound config.json's `num_hidden_layers` is checked
/// against (src/config/limits.rs).
pub const MAX_LAYERS: usize = 1 << 10;
/// Most routed experts per layer `--experts` asks for (the config's `num_experts` bound).
pub const MAX_EXPERTS: usize = 1 << 16;
/// Most routed experts over all MoE layers (the config's bound on layers x experts).
pub const MAX_ROUTED_EXPERTS: usize = 1 << 18;

/// Every dimension a preset fixes, after `--layers` / `--experts` overrides.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub bos: u32,
    pub eos: u32,
    pub pad: u32,
    pub intermediate: usize,
    /// MLA heads; the KDA heads are the same number.
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kda_head_dim: usize,
    /// Full attention at every 1-based multiple of this and at the last layer.
    pub full_attn_period: usize,
    pub experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    pub latent: usize,
    pub shared: usize,
    pub attn_res_block_size: usize,
    /// Most text bytes one shard may hold before the next one starts.
    pub max_shard_bytes: u64,
}

impl Dims {
    /// The preset's dimensions with the overrides of `opts` applied and checked.
    pub(crate) fn from_options(opts: &SynthOptions) -> Result<Dims> {
        let mut d = match opts.preset {
            Preset::Tiny => Dims {
                hidden: 64,
                layers: 6,
                vocab: 1024,
                bos: 768,
                eos: 770,
                pad: 1023,
                intermediate: 128,
                heads: 2,
                q_lora: 32,
                kv_lora: 32,
                nope: 16,
                rope: 8,
                v: 16,
                kda_head_dim: 32,
                full_attn_period: 3,
                experts: 8,
                top_k: 2,
                moe_intermediate: 64,
                latent: 32,
                shared: 2,
                attn_res_block_size: 2,
                max_shard_bytes: TINY_SHARD_BYTES,
            },
            Preset::Small => Dims {
                hidden: 512,
                layers: 12,
                vocab: 4096,
                bos: 3840,
                eos: 3842,
                pad: 4095,
                intermediate: 1024,
                heads: 4,
                q_lora: 128,
                kv_lora: 128,
                nope: 32,
                rope: 16,
                v: 32,
                kda_head_dim: 64,
                full_attn_period: 4,
                experts: 64,
                top_k: 4,
                moe_intermediate: 256,
                latent: 256,
                shared: 2,
                attn_res_block_size: 4,
                max_shard_bytes: SMALL_SHARD_BYTES,
            },
            Preset::K3Slice => Dims {
                hidden: 7168,
                layers: 4,
                vocab: 163840,
                bos: 163584,
                eos: 163586,
                pad: 163839,
                intermediate: 33792,
                heads: 96,
                q_lora: 1536,
                kv_lora: 512,
                nope: 128,
                rope: 64,
                v: 128,
                kda_head_dim: 128,
                full_attn_period: 4,
                experts: 896,
                top_k: 16,
                moe_intermediate: 3072,
                latent: 3584,
                shared: 2,
                attn_res_block_size: 12,
                max_shard_bytes: K3_SHARD_BYTES,
            },
        };
        // Bounded before anything is sized by them: 2^32 layers aborted on an 8 GB list.
        if let Some(layers) = opts.layers.filter(|&l| l > MAX_LAYERS) {
            bail!("--layers {layers}: at most {MAX_LAYERS} (the largest a config may state)");
        }
        if let Some(experts) = opts.experts.filter(|&e| e > MAX_EXPERTS) {
            bail!("--experts {experts}: at most {MAX_EXPERTS} (the largest a config may state)");
        }
        if let Some(layers) = opts.layers {
            // Layer 0 is dense (first_k_dense_replace = 1): a checkpoint with routed experts
            // needs at least one more layer.
            if layers < 2 {
                bail!("--layers {layers}: need at least 2 (layer 0 is dense, the rest are MoE)");
            }
            d.layers = layers;
        }
        if let Some(experts) = opts.experts {
            // Experts are spread over at least two shards.
            if experts < 2 {
                bail!("--experts {experts}: need at least 2");
            }
            d.experts = experts;
            // A slice with fewer experts than the preset's top-k routes to all of them.
            d.top_k = d.top_k.min(experts);
        }
        if let Some(top_k) = opts.top_k {
            if top_k < 1 || top_k > d.experts {
                bail!(
                    "--top-k {top_k}: need 1 to {} (the routed experts per layer)",
                    d.experts
                );
            }
            d.top_k = top_k;
        }
        let routed = (d.layers - 1) * d.experts;
        if routed > MAX_ROUTED_EXPERTS {
            bail!(
                "--layers {} x --experts {}: {routed} routed experts, at most {MAX_ROUTED_EXPERTS} \
                 (the largest a config may state)",
                d.layers,
                d.experts
            );
        }
        Ok(d)
    }

    /// 1-based indices of the full-attention (MLA) layers.
    pub(crate) fn full_attn_layers(&self) -> Vec<usize> {
        (1..=self.layers)
            .filter(|&i| self.is_full_attn(i))
            .collect()
    }

    /// 1-based indices of the KDA layers.
    pub(crate) fn kda_layers(&self) -> Vec<usize> {
        (1..=self.layers)
            .filter(|&i| !self.is_full_attn(i))
            .collect()
    }

    /// Whether 1-based layer `i` is a full-attention (MLA) layer.
    fn is_full_attn(&self, i: usize) -> bool {
        i % self.full_attn_period == 0 || i == self.layers
    }
}

/// The compressed-tensors block of the published checkpoint: only routed experts are
/// MXFP4, everything else stays BF16.
fn quantization_config() -> Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": null,
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": ["Linear"],
                "input_activations": null,
                "output_activations": null,
                "weights": {
                    "num_bits": 4,
                    "group_size": 32,
                    "type": "float",
                    "strategy": "group",
                    "symmetric": true,
                    "dynamic": false,
                    "actorder": null,
                    "block_structure": null,
                    "observer": "minmax"
                }
            }
        },
        "weights": { "num_bits": 4, "group_size": 32 },
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                   "re:.*gate$", "re:.*routed_expert_(up|down)_proj$", "lm_head",
                   "re:vision_tower.*", "re:mm_projector.*"]
    })
}

/// The `text_config` object of the checkpoint (`model_type: kimi_linear`).
pub(crate) fn text_config(d: &Dims) -> Value {
    json!({
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "bos_token_id": d.bos,
        "eos_token_id": d.eos,
        "pad_token_id": d.pad,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "vocab_size": d.vocab,
        "intermediate_size": d.intermediate,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": d.heads,
        // llama.cpp's converter reads it; MLA shares one latent, so it equals the heads.
        "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora,
        "kv_lora_rank": d.kv_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "linear_attn_config": {
            "num_heads": d.heads,
            "head_dim": d.kda_head_dim,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": true,
            "kda_layers": d.kda_layers(),
            "full_attn_layers": d.full_attn_layers()
        },
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "moe_intermediate_size": d.moe_intermediate,
        "routed_expert_hidden_size": d.latent,
        "latent_moe_use_norm": true,
        "num_shared_experts": d.shared,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": true,
        "routed_scaling_factor": 1.0,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": d.attn_res_block_size,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config()
    })
}

/// The root `config.json` of the checkpoint (`model_type: kimi_k3`).
pub(crate) fn root_config(d: &Dims) -> Value {
    json!({
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": d.bos,
        "eos_token_id": d.eos,
        "pad_token_id": d.pad,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "text_config": text_config(d),
        "quantization_config": quantization_config()
    })
}

/// The `generation_config.json` of the checkpoint: greedy by default.
pub(crate) fn generation_config(d: &Dims) -> Value {
    json!({
        "bos_token_id": d.bos,
        "eos_token_id": d.eos,
        "pad_token_id": d.pad,
        "do_sample": false
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Routing;

    fn opts(preset: Preset, layers: Option<usize>, experts: Option<usize>) -> SynthOptions {
        SynthOptions {
            preset,
            layers,
            experts,
            top_k: None,
            routing: Routing::Random,
            seed: 0,
            progress: false,
        }
    }

    #[test]
    fn layer_schedules_match_the_presets() {
        let tiny = Dims::from_options(&opts(Preset::Tiny, None, None)).unwrap();
        assert_eq!(tiny.full_attn_layers(), vec![3, 6]);
        assert_eq!(tiny.kda_layers(), vec![1, 2, 4, 5]);
        let small = Dims::from_options(&opts(Preset::Small, None, None)).unwrap();
        assert_eq!(small.full_attn_layers(), vec![4, 8, 12]);
        let k3 = Dims::from_options(&opts(Preset::K3Slice, None, None)).unwrap();
        assert_eq!(k3.full_attn_layers(), vec![4]);
        assert_eq!(k3.kda_layers(), vec![1, 2, 3]);
        let k3_93 = Dims::from_options(&opts(Preset::K3Slice, Some(93), None)).unwrap();
        let full = k3_93.full_attn_layers();
        assert_eq!(full.len(), 24);
        assert_eq!(full[..2], [4, 8]);
        assert_eq!(full[22..], [92, 93]);
        assert_eq!(k3_93.kda_layers().len(), 69);
    }

    #[test]
    fn sizes_past_the_stated_maximum_are_refused_and_the_maximum_is_a_valid_config() {
        for (layers, experts, words) in [
            (
                Some(1usize << 32),
                None,
                "--layers 4294967296: at most 1024",
            ),
            (Some(1_000_000), None, "--layers 1000000: at most 1024"),
            (None, Some(usize::MAX), "--experts"),
            (
                Some(MAX_LAYERS),
                Some(MAX_EXPERTS),
                "routed experts, at most 262144",
            ),
        ] {
            let e = Dims::from_options(&opts(Preset::Tiny, layers, experts)).unwrap_err();
            assert!(e.to_string().contains(words), "{e}");
        }
        // The largest accepted sizes are a config k3 loads.
        for (layers, experts) in [(MAX_LAYERS, 256), (5, MAX_EXPERTS)] {
            let d = Dims::from_options(&opts(Preset::Tiny, Some(layers), Some(experts))).unwrap();
            assert_eq!(d.kda_layers().len() + d.full_attn_layers().len(), layers);
            let text = root_config(&d).to_string();
            crate::config::Config::from_json_str(&text, "synth").unwrap();
        }
    }

    #[test]
    fn overrides_apply_and_bad_ones_are_refused() {
        let d = Dims::from_options(&opts(Preset::Small, Some(3), Some(8))).unwrap();
        assert_eq!((d.layers, d.experts), (3, 8));
        assert_eq!(d.full_attn_layers(), vec![3]);
        let err = Dims::from_options(&opts(Preset::Tiny, Some(1), None)).unwrap_err();
        assert!(err.to_string().contains("--layers"));
        let err = Dims::from_options(&opts(Preset::Tiny, None, Some(1))).unwrap_err();
        assert!(err.to_string().contains("--experts"));
        let d = Dims::from_options(&opts(Preset::K3Slice, Some(2), Some(8))).unwrap();
        assert_eq!((d.experts, d.top_k), (8, 8));
    }
}
