//! Snapshots of a conversation's state, so a session can return to an earlier point of
//! what it consumed: the KDA layers' recurrent states are copied (a recurrence cannot be
//! undone), the MLA caches are only cut back to the snapshot's length on restore (their
//! earlier rows are the same as when the snapshot was taken, as long as the tokens before
//! it are).

use super::k3::LayerState;
use super::state_size::snapshot_bytes;
use super::{K3Model, State};
use crate::backend::Backend;
use anyhow::{ensure, Result};

/// The state after the first `pos` tokens of a conversation, minus the MLA caches' rows,
/// which the live state still holds.
pub struct StateSnapshot<B: Backend> {
    /// A copy of each KDA layer's state (`None` for an MLA layer).
    kda: Vec<Option<B::KdaState>>,
    /// Tokens consumed when it was taken.
    pos: usize,
}

impl<B: Backend> StateSnapshot<B> {
    /// Tokens the state had consumed when the snapshot was taken.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

impl<B: Backend> K3Model<B> {
    /// Bytes one [`StateSnapshot`] takes (the KDA states; on the GPU, in device memory).
    pub fn snapshot_bytes(&self) -> usize {
        snapshot_bytes(&self.ckpt.config)
    }

    /// Copies the KDA states of `st` into a snapshot of its current position.
    pub fn snapshot(&self, st: &State<B>) -> Result<StateSnapshot<B>> {
        let kda = st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => self.backend.kda_state_copy(s).map(Some),
                LayerState::Mla(_) => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(StateSnapshot { kda, pos: st.pos })
    }

    /// Brings `st` back to `snap`: the KDA states from the snapshot, the MLA caches cut to
    /// its length. `st` must have consumed the same tokens as the snapshot up to its
    /// position (the session that keeps the snapshots makes sure of that); on an error
    /// `st` is left half restored and must be replaced.
    pub fn restore(&self, st: &mut State<B>, snap: &StateSnapshot<B>) -> Result<()> {
        ensure!(
            snap.pos <= st.pos && snap.kda.len() == st.layers.len(),
            "restoring a snapshot of {} tokens and {} layers into a state of {} tokens and {} layers",
            snap.pos,
            snap.kda.len(),
            st.pos,
            st.layers.len()
        );
        for (l, s) in st.layers.iter_mut().zip(&snap.kda) {
            match (l, s) {
                (LayerState::Kda(live), Some(saved)) => {
                    *live = self.backend.kda_state_copy(saved)?
                }
                (LayerState::Mla(cache), None) => self.backend.mla_truncate(cache, snap.pos)?,
                _ => anyhow::bail!("a snapshot's layer kinds do not match the state's"),
            }
        }
        st.pos = snap.pos;
        Ok(())
    }

    /// A copy of `st` that goes on apart from it: each KDA layer copied on the backend,
    /// each MLA cache through the host ([`Backend::mla_cache_read`] and
    /// [`Backend::mla_cache_write`], which keep its values exactly). The server's `n`
    /// choices start from one prefilled prompt this way.
    pub fn copy_state(&self, st: &State<B>) -> Result<State<B>> {
        let dims = super::mla::Mla::<B>::dims(&self.ckpt.config);
        let layers = st
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Kda(s) => LayerState::Kda(self.backend.kda_state_copy(s)?),
                    LayerState::Mla(c) => {
                        let v = self.backend.mla_cache_read(c)?;
                        LayerState::Mla(self.backend.mla_cache_write(&dims, &v)?)
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(State {
            layers,
            pos: st.pos,
        })
    }
}
