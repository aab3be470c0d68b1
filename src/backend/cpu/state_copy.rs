//! Copying and rewinding a conversation's state: a KDA state is copied whole (its
//! recurrence cannot be undone), an MLA cache is cut back to a length; both are read to
//! and written from host values for the prompt cache.

use super::kda::KdaState;
use super::mla::MlaCache;
use crate::backend::{KdaDims, MlaDims};
use anyhow::{ensure, Result};

/// A copy of a KDA state.
pub(crate) fn kda_state_copy(s: &KdaState) -> Result<KdaState> {
    Ok(s.clone())
}

/// Forgets every cached position from `len` on.
pub(crate) fn mla_truncate(c: &mut MlaCache, len: usize) -> Result<()> {
    ensure!(
        len <= c.len,
        "mla_truncate: cannot keep {len} positions of a cache that holds {}",
        c.len
    );
    if len < c.len {
        let (latent, rope) = (c.latent.len() / c.len, c.rope.len() / c.len);
        c.latent.truncate(len * latent);
        c.rope.truncate(len * rope);
        c.len = len;
    }
    Ok(())
}

/// The KDA state's values: the three histories, then the delta-rule state.
pub(crate) fn kda_state_read(s: &KdaState) -> Vec<f32> {
    let mut v = Vec::with_capacity(s.conv.iter().map(Vec::len).sum::<usize>() + s.s.len());
    for h in &s.conv {
        v.extend_from_slice(h);
    }
    v.extend_from_slice(&s.s);
    v
}

/// A KDA state of `d` from the values [`kda_state_read`] returns.
pub(crate) fn kda_state_write(d: &KdaDims, values: &[f32]) -> Result<KdaState> {
    let mut s = KdaState::new(d);
    let hist = s.conv[0].len();
    ensure!(
        values.len() == 3 * hist + s.s.len(),
        "kda_state_write: {} values for a state of {}",
        values.len(),
        3 * hist + s.s.len()
    );
    for (i, h) in s.conv.iter_mut().enumerate() {
        h.copy_from_slice(&values[i * hist..(i + 1) * hist]);
    }
    s.s.copy_from_slice(&values[3 * hist..]);
    Ok(s)
}

/// The cache's positions, each the latent then the rope part.
pub(crate) fn mla_cache_read(c: &MlaCache) -> Vec<f32> {
    if c.len == 0 {
        return Vec::new();
    }
    let (kv, r) = (c.latent.len() / c.len, c.rope.len() / c.len);
    let mut v = Vec::with_capacity(c.len * (kv + r));
    for t in 0..c.len {
        v.extend_from_slice(&c.latent[t * kv..(t + 1) * kv]);
        v.extend_from_slice(&c.rope[t * r..(t + 1) * r]);
    }
    v
}

/// A cache of `d` holding the positions of `values` ([`mla_cache_read`]'s layout).
pub(crate) fn mla_cache_write(d: &MlaDims, values: &[f32]) -> Result<MlaCache> {
    let (row, len) = (d.cache_row(), d.cache_positions(values)?);
    let mut c = MlaCache::new(d);
    c.latent.reserve(len * d.kv_lora);
    c.rope.reserve(len * d.rope);
    for p in values.chunks_exact(row) {
        c.latent.extend_from_slice(&p[..d.kv_lora]);
        c.rope.extend_from_slice(&p[d.kv_lora..]);
    }
    c.len = len;
    Ok(c)
}
