//! Copying and rewinding a conversation's state: a KDA state is copied whole (its
//! recurrence cannot be undone), an MLA cache is cut back to a length.

use super::kda::KdaState;
use super::mla::MlaCache;
use anyhow::{ensure, Result};

/// A copy of a KDA state.
pub fn kda_state_copy(s: &KdaState) -> Result<KdaState> {
    Ok(s.clone())
}

/// Forgets every cached position from `len` on.
pub fn mla_truncate(c: &mut MlaCache, len: usize) -> Result<()> {
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
