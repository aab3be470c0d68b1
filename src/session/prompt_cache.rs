//! A session and the model's prompt cache on disk: the longest stored prefix of a prompt
//! loaded in place of prefilling it, and the state at a prompt's end stored.

use super::Session;
use crate::backend::Backend;

impl<B: Backend> Session<'_, B> {
    /// Loads the longest prefix of `prompt` longer than `reused` tokens that the model's
    /// prompt cache holds, in place of the session's state. Returns the tokens the session
    /// now holds of `prompt` (`reused` when nothing better was loaded).
    pub(super) fn load_cached_prefix(&mut self, prompt: &[u32], reused: usize) -> usize {
        let Some(pc) = self.model.rt.prompt_cache() else {
            return reused;
        };
        let Some(e) = pc.lookup(prompt, reused, &self.model.state_shape()) else {
            return reused;
        };
        match self.model.state_from_host(&e.state) {
            Ok(state) => {
                self.state = state;
                self.tokens = e.tokens;
                self.last_logits = e.logits;
                // Their MLA rows were the session's own; the loaded ones were computed apart.
                self.snapshots.clear();
                self.tokens.len()
            }
            Err(err) => {
                tracing::warn!(
                    "[K3] prompt cache: {}: {err:#}; prefilling instead",
                    pc.dir().display()
                );
                reused
            }
        }
    }

    /// Stores the state at the end of the prompt just fed in the model's prompt cache, when
    /// it has one that wants it; a failure is a warning.
    pub(super) fn store_prompt(&self) {
        let Some(pc) = self.model.rt.prompt_cache() else {
            return;
        };
        if !pc.wants(&self.tokens) {
            return;
        }
        match self.model.state_to_host(&self.state) {
            Ok(state) => pc.store(crate::model::prompt_cache::entry_file::Entry {
                tokens: self.tokens.clone(),
                logits: self.last_logits.clone(),
                state,
            }),
            Err(err) => {
                tracing::warn!("[K3] prompt cache: reading the state back: {err:#}; not stored")
            }
        }
    }
}
