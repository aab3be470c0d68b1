//! `config.json` → a typed, validated K3 configuration.
//!
//! Every field the engine relies on is checked here, so that the rest of the code can
//! trust the numbers; anything the engine cannot run is refused with an error that names
//! the field (as a JSON path) and the value found.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};
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
}

/// Largest `config.json` read: the published one is a few KB, and a config of hundreds of
/// MB would cost gigabytes as a JSON tree before any field is checked.
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// Largest value accepted for each dimension: far above Kimi K3's own (in brackets), low
/// enough that every product the engine forms of two or three of them fits in 64 bits, and
/// that a mistyped value is refused before it sizes an allocation.
const DIM_LIMITS: &[(&str, usize)] = &[
    ("hidden_size", 1 << 16),               // 7168
    ("num_hidden_layers", 1 << 10),         // 93
    ("vocab_size", 1 << 22),                // 163840
    ("intermediate_size", 1 << 20),         // 33792
    ("num_attention_heads", 1 << 12),       // 96
    ("q_lora_rank", 1 << 16),               // 1536
    ("kv_lora_rank", 1 << 16),              // 512
    ("qk_nope_head_dim", 1 << 12),          // 128
    ("qk_rope_head_dim", 1 << 12),          // 64
    ("v_head_dim", 1 << 12),                // 128
    ("num_heads", 1 << 12),                 // 96 (KDA)
    ("head_dim", 1 << 12),                  // 128 (KDA)
    ("short_conv_kernel_size", 1 << 6),     // 4
    ("num_experts", 1 << 16),               // 896
    ("num_experts_per_token", 1 << 10),     // 16
    ("moe_intermediate_size", 1 << 20),     // 3072
    ("routed_expert_hidden_size", 1 << 20), // 7168
    ("num_shared_experts", 1 << 6),         // 1
    ("attn_res_block_size", 1 << 10),       // 6
];

/// Most routed experts over all MoE layers: every one is a row of the expert table and six
/// names in the schema.
const MAX_ROUTED_EXPERTS: usize = 1 << 18;

/// The sane range of each float field, inclusive: a value outside it is a broken config,
/// and computing with it would give silent garbage (an overflowing scale, a zero norm).
const FLOAT_RANGES: &[(&str, f32, f32)] = &[
    ("rms_norm_eps", 1e-12, 1.0),
    ("activation_situ_beta", 1e-6, 1e4),
    ("activation_situ_linear_beta", 1e-6, 1e4),
    ("routed_scaling_factor", 1e-6, 1e3),
    ("gate_lower_bound", -1e3, 1e3),
];

/// The only routed-expert weight format the engine runs.
const QUANT_FORMAT: &str = "mxfp4-pack-quantized";
/// MXFP4 bits per weight.
const QUANT_BITS: u64 = 4;
/// MXFP4 weights per shared E8M0 scale.
pub const MXFP4_GROUP: usize = 32;

impl Config {
    /// Reads and validates `config.json`; every error starts with the path.
    pub fn from_file(path: &Path) -> Result<Config> {
        let len = std::fs::metadata(path)
            .with_context(|| {
                format!(
                    "{}: cannot read the model config (is this a K3 snapshot directory?)",
                    path.display()
                )
            })?
            .len();
        if len > MAX_CONFIG_BYTES {
            bail!(
                "{}: {len} bytes is not a model config (a config.json is a few KB; the limit is {MAX_CONFIG_BYTES})",
                path.display()
            );
        }
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "{}: cannot read the model config (is this a K3 snapshot directory?)",
                path.display()
            )
        })?;
        Config::from_json_str(&text, &path.display().to_string())
    }

    /// Parses and validates a config from JSON text; `origin` prefixes every error.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Config> {
        let root: Value =
            serde_json::from_str(text).with_context(|| format!("{origin}: not valid JSON"))?;
        parse(&root).map_err(|e| anyhow!("{origin}: {e:#}"))
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

/// A JSON object together with its path, so that errors can name fields fully.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Value, path: &str) -> Result<Obj<'a>> {
        match v {
            Value::Object(map) => Ok(Obj {
                map,
                path: path.to_string(),
            }),
            other => bail!(
                "{}: expected an object, got {}",
                display_path(path),
                describe(other)
            ),
        }
    }

    fn field_name(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    fn opt(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn req(&self, name: &str) -> Result<&'a Value> {
        self.opt(name)
            .ok_or_else(|| anyhow!("missing field `{}`", self.field_name(name)))
    }

    fn child(&self, name: &str) -> Result<Obj<'a>> {
        Obj::new(self.req(name)?, &self.field_name(name))
    }

    fn usize(&self, name: &str) -> Result<usize> {
        as_usize(self.req(name)?, &self.field_name(name))
    }

    /// A positive dimension, at most its [`DIM_LIMITS`] entry.
    fn positive(&self, name: &str) -> Result<usize> {
        let v = self.usize(name)?;
        if v == 0 {
            bail!(
                "{}: 0 is not allowed (must be positive)",
                self.field_name(name)
            );
        }
        if let Some(&(_, max)) = DIM_LIMITS.iter().find(|(n, _)| *n == name) {
            if v > max {
                bail!(
                    "{}: {v} is out of range (at most {max}; Kimi K3's own values are far below)",
                    self.field_name(name)
                );
            }
        }
        Ok(v)
    }

    fn f32(&self, name: &str) -> Result<f32> {
        let field = self.field_name(name);
        let v = self.req(name)?;
        let x = v
            .as_f64()
            .ok_or_else(|| anyhow!("{field}: expected a number, got {}", describe(v)))?;
        if !x.is_finite() {
            bail!("{field}: expected a finite number, got {x}");
        }
        if let Some(&(_, lo, hi)) = FLOAT_RANGES.iter().find(|(n, _, _)| *n == name) {
            if !(lo as f64..=hi as f64).contains(&x) {
                bail!("{field}: {x} is out of range (expected {lo} to {hi})");
            }
        }
        Ok(x as f32)
    }

    fn positive_f32(&self, name: &str) -> Result<f32> {
        let x = self.f32(name)?;
        if x <= 0.0 {
            bail!(
                "{}: {x} is not allowed (must be positive)",
                self.field_name(name)
            );
        }
        Ok(x)
    }

    fn bool(&self, name: &str) -> Result<bool> {
        let v = self.req(name)?;
        v.as_bool().ok_or_else(|| {
            anyhow!(
                "{}: expected a boolean, got {}",
                self.field_name(name),
                describe(v)
            )
        })
    }

    fn str(&self, name: &str) -> Result<&'a str> {
        let v = self.req(name)?;
        v.as_str().ok_or_else(|| {
            anyhow!(
                "{}: expected a string, got {}",
                self.field_name(name),
                describe(v)
            )
        })
    }

    /// A boolean the engine only runs one way.
    fn require_bool(&self, name: &str, want: bool, why: &str) -> Result<()> {
        let got = self.bool(name)?;
        if got != want {
            bail!("{}: {got} is not supported ({why})", self.field_name(name));
        }
        Ok(())
    }

    /// A string the engine only runs one way.
    fn require_str(&self, name: &str, want: &str, why: &str) -> Result<()> {
        let got = self.str(name)?;
        if got != want {
            bail!(
                "{}: \"{got}\" is not supported ({why}; expected \"{want}\")",
                self.field_name(name)
            );
        }
        Ok(())
    }
}

fn display_path(path: &str) -> &str {
    if path.is_empty() {
        "the config root"
    } else {
        path
    }
}

/// A short description of a JSON value for "expected X, got Y" messages.
fn describe(v: &Value) -> String {
    let kind = match v {
        Value::Null => return "null".to_string(),
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    };
    let mut text = v.to_string();
    if text.len() > 40 {
        let cut = (0..=40)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        text.truncate(cut);
        text.push_str("...");
    }
    format!("{kind} ({text})")
}

fn as_usize(v: &Value, field: &str) -> Result<usize> {
    v.as_u64()
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| {
            anyhow!(
                "{field}: expected a non-negative integer, got {}",
                describe(v)
            )
        })
}

fn as_token(v: &Value, field: &str) -> Result<u32> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| anyhow!("{field}: expected a token id, got {}", describe(v)))
}

fn parse(root_value: &Value) -> Result<Config> {
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

    let bos_token_id = token_field(&root, &text, "bos_token_id")?;
    let pad_token_id = token_field(&root, &text, "pad_token_id")?;
    let eos_token_ids = eos_field(&root, &text)?;

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
    })
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
fn token_field(root: &Obj<'_>, text: &Obj<'_>, name: &str) -> Result<Option<u32>> {
    for obj in [root, text] {
        if let Some(v) = obj.opt(name) {
            return as_token(v, &obj.field_name(name)).map(Some);
        }
    }
    Ok(None)
}

/// `eos_token_id`: an int or a list of ints, at the root first, then in `text_config`.
fn eos_field(root: &Obj<'_>, text: &Obj<'_>) -> Result<Vec<u32>> {
    let name = "eos_token_id";
    for obj in [root, text] {
        let Some(v) = obj.opt(name) else { continue };
        let field = obj.field_name(name);
        let ids = match v {
            Value::Array(list) => list
                .iter()
                .map(|x| as_token(x, &field))
                .collect::<Result<Vec<u32>>>()?,
            other => vec![as_token(other, &field)?],
        };
        if ids.is_empty() {
            bail!("{field}: the list is empty (generation needs a stop token)");
        }
        return Ok(ids);
    }
    bail!("missing field `eos_token_id` (looked at the root and in text_config)")
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
