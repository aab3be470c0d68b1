//! The bounds every value of `config.json` is checked against before it sizes anything.

/// Largest `config.json` read: the published one is a few KB, and a config of hundreds of
/// MB would cost gigabytes as a JSON tree before any field is checked.
pub const MAX_CONFIG_BYTES: u64 = crate::platform::input_file::FileKind::ModelConfig.max_bytes();

/// Largest value accepted for each dimension: far above Kimi K3's own (in brackets), low
/// enough that every product the engine forms of two or three of them fits in 64 bits, and
/// that a mistyped value is refused before it sizes an allocation.
pub(super) const DIM_LIMITS: &[(&str, usize)] = &[
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
pub(super) const MAX_ROUTED_EXPERTS: usize = 1 << 18;

/// The sane range of each float field, inclusive: a value outside it is a broken config,
/// and computing with it would give silent garbage (an overflowing scale, a zero norm).
pub(super) const FLOAT_RANGES: &[(&str, f32, f32)] = &[
    ("rms_norm_eps", 1e-12, 1.0),
    ("activation_situ_beta", 1e-6, 1e4),
    ("activation_situ_linear_beta", 1e-6, 1e4),
    ("routed_scaling_factor", 1e-6, 1e3),
    ("gate_lower_bound", -1e3, 1e3),
];
