//! How many prompt tokens one forward pass takes (the prefill window) and the per-row
//! widths that bound a backend's rows.
//!
//! A MoE layer reads each expert its window routes to once, so the window is what bounds
//! the expert bytes a prompt reads: one window reads each routed expert at most once a
//! layer. Its cost is memory: every activation of a pass, and the attention-residual bank
//! that lives through all layers, is `window × width`. A backend whose bindings hold fewer
//! rows of the widest op holds the window's activations in parts that fit them
//! ([`widest_row_bytes`], `Backend::fit_rows`).

use crate::config::Config;

/// f32 bytes of `values` values.
fn f32s(values: usize) -> u64 {
    values as u64 * 4
}

/// Bytes a prompt token of the window holds at the peak of a pass: the bank of raw layer
/// inputs (at most `ceil(L / bs) + 1` entries), the residual stream and the mixes, and the
/// widest block's transients (KDA's six projections and packed copy, MLA's query and
/// latent, the dense MLP, or the MoE layer's router, latent and (token, expert) pairs).
pub(crate) fn bytes_per_token(cfg: &Config) -> u64 {
    let h = cfg.hidden_size;
    let bank = cfg
        .num_hidden_layers
        .div_ceil(cfg.attn_res_block_size.max(1))
        + 1;
    // h, p, the mix, its norm, the attention output, the FFN input and output.
    let stream = f32s((bank + 7) * h);
    let p = cfg.kda_width();
    let kda = f32s(12 * p + 2 * cfg.kda.num_heads);
    let mla = f32s(
        cfg.q_lora_rank
            + 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank
            + cfg.qk_rope_head_dim
            + 2 * cfg.num_attention_heads * cfg.v_head_dim,
    );
    let dense = f32s(3 * cfg.intermediate_size);
    let (i, d) = (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size);
    let shared = 3 * i * cfg.num_shared_experts;
    let moe = f32s(cfg.num_experts + 3 * d + shared + cfg.num_experts_per_token * (3 * i + d));
    stream + kda.max(mla).max(dense).max(moe)
}

/// The widest single buffer a row needs in one op (the attention-residual mix packs every
/// bank entry of a row into one binding; KDA packs five projections), so that
/// `Backend::max_rows` of it bounds the rows of an activation's part for every op outside
/// the routed experts and the head (`Backend::fit_rows`).
pub(crate) fn widest_row_bytes(cfg: &Config) -> usize {
    let h = cfg.hidden_size;
    let bank = cfg
        .num_hidden_layers
        .div_ceil(cfg.attn_res_block_size.max(1))
        + 2;
    let p = cfg.kda_width();
    let mla_q = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim);
    let widths = [
        bank * h,
        5 * p + cfg.kda.num_heads,
        mla_q,
        cfg.num_attention_heads * cfg.v_head_dim,
        2 * cfg.intermediate_size,
    ];
    widths.into_iter().max().unwrap_or(h) * 4
}

/// The widest buffer a row of the whole window needs in the MoE layer, which runs its
/// router, latent projection, shared experts and routed experts over the window at once
/// (so each expert is uploaded once for all its tokens).
pub(crate) fn moe_row_bytes(cfg: &Config) -> usize {
    let i = cfg.moe_intermediate_size;
    let widths = [
        cfg.hidden_size,
        cfg.num_experts,
        cfg.routed_expert_hidden_size,
        2 * i * cfg.num_shared_experts.max(1),
    ];
    widths.into_iter().max().unwrap_or(cfg.hidden_size) * 4
}

/// `rows` split into consecutive ranges of at most `per` rows.
pub(crate) fn row_chunks(rows: usize, per: usize) -> Vec<std::ops::Range<usize>> {
    let per = per.max(1);
    (0..rows.div_ceil(per))
        .map(|j| j * per..((j + 1) * per).min(rows))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_chunks_cover_the_rows_in_order() {
        assert_eq!(row_chunks(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(row_chunks(3, 8), vec![0..3]);
        assert_eq!(row_chunks(4, 0), vec![0..1, 1..2, 2..3, 3..4]);
        assert!(row_chunks(0, 4).is_empty());
    }
}
