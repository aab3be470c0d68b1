//! Opening the on-disk prompt cache for a loaded model under the identity of everything
//! that changes its states.

use super::config::PromptCacheSettings;
use crate::backend::Backend;
use crate::model::prompt_cache::{PromptCache, PromptCacheConfig, MIN_TOKENS};
use crate::model::{FormatPolicy, K3Model};
use anyhow::Result;
use std::sync::Arc;

impl PromptCacheSettings {
    /// Opens the cache for `model` (loaded in `policy`'s formats; `numerics` names any other
    /// setting that changes the state) and prints `[K3] prompt cache: ...`; `None` when it
    /// is off. A directory that cannot be made is a warning: the run goes on without the cache.
    pub fn open<B: Backend>(
        &self,
        model: &K3Model<B>,
        policy: &FormatPolicy,
        numerics: &str,
    ) -> Result<Option<Arc<PromptCache>>> {
        let gb = self.plan_gb()?;
        if self.off || gb == 0.0 {
            tracing::info!("[K3] prompt cache: off");
            return Ok(None);
        }
        let Some(dir) = self
            .dir
            .clone()
            .or_else(|| crate::platform::cache_dir::user_cache_dir().map(|d| d.join("prompts")))
        else {
            tracing::warn!(
                "[K3] prompt cache: off (no user cache directory: HOME is not set; --prompt-cache DIR names one)"
            );
            return Ok(None);
        };
        let stamp = match crate::model::weight_cache::model_stamp(&model.ckpt, policy) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("[K3] prompt cache: off ({e:#})");
                return Ok(None);
            }
        };
        let identity = format!(
            "weights {stamp:016x} | backend {} | {numerics}",
            model.backend.name()
        );
        let cfg = PromptCacheConfig {
            dir: dir.clone(),
            max_bytes: (gb * 1e9) as u64,
            min_tokens: MIN_TOKENS,
        };
        Ok(match PromptCache::open(cfg, &identity) {
            Ok(pc) => {
                tracing::info!(
                    "[K3] prompt cache: {} (up to {gb} GB; prompts of {MIN_TOKENS}+ tokens; key {:016x})",
                    dir.display(),
                    pc.key()
                );
                Some(Arc::new(pc))
            }
            Err(e) => {
                tracing::warn!("[K3] prompt cache: off ({e:#}); the run goes on without it");
                None
            }
        })
    }
}
