//! The prompt-cache flags `k3 run`, `k3 chat` and `k3 serve` share, and opening the cache
//! for a loaded model.

use anyhow::{bail, Result};
use clap::Args;
use k3::backend::Backend;
use k3::model::prompt_cache::{PromptCache, PromptCacheConfig, MIN_TOKENS};
use k3::model::{FormatPolicy, K3Model};
use std::path::PathBuf;
use std::sync::Arc;

/// Where prompt states are kept on disk, and how much of it they may take.
#[derive(Args, Debug, Clone)]
pub struct PromptCacheArgs {
    /// Directory of the prompt cache: the state at the end of each prompt of 256 tokens or
    /// more, so a later request or run (of any process) whose prompt starts with a stored
    /// one loads it and prefills only the rest [default: `prompts` under the user's cache
    /// directory, as for the weight cache]. Shared by `run`, `chat` and `serve`.
    #[arg(long = "prompt-cache", env = "K3_PROMPT_CACHE", value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Bytes the prompt cache may take on disk, in GB (1e9 bytes); the least recently
    /// used entries go first, and 0 turns the cache off. The RAM plan reserves one entry's
    /// working set (the state at the full context, at most this).
    #[arg(
        long = "prompt-cache-gb",
        env = "K3_PROMPT_CACHE_GB",
        default_value_t = 16.0
    )]
    pub gb: f64,
    /// Neither load nor store prompt states on disk (every prompt is prefilled whole).
    #[arg(long = "no-prompt-cache", env = "K3_NO_PROMPT_CACHE", value_parser = clap::builder::FalseyValueParser::new())]
    pub off: bool,
}

impl PromptCacheArgs {
    /// The bound in GB the RAM plan reserves a working set under (0 when off); a bad
    /// number is refused naming the flag.
    pub fn plan_gb(&self) -> Result<f64> {
        if !(self.gb.is_finite() && self.gb >= 0.0) {
            bail!(
                "--prompt-cache-gb / K3_PROMPT_CACHE_GB must be a number of GB >= 0, got {}",
                self.gb
            );
        }
        Ok(if self.off { 0.0 } else { self.gb })
    }

    /// Opens the cache for `model` (loaded in `policy`'s formats; `numerics` names any other
    /// setting that changes the state) and prints `[K3] prompt cache: ...`. A directory that
    /// cannot be made is a warning: the run goes on without the cache.
    pub fn open<B: Backend>(
        &self,
        model: &mut K3Model<B>,
        policy: &FormatPolicy,
        numerics: &str,
    ) -> Result<()> {
        let gb = self.plan_gb()?;
        if self.off || gb == 0.0 {
            model.set_prompt_cache(None);
            eprintln!("[K3] prompt cache: off");
            return Ok(());
        }
        let Some(dir) = self
            .dir
            .clone()
            .or_else(|| k3::platform::cache_dir::user_cache_dir().map(|d| d.join("prompts")))
        else {
            eprintln!(
                "[K3] prompt cache: off (no user cache directory: HOME is not set; --prompt-cache DIR names one)"
            );
            model.set_prompt_cache(None);
            return Ok(());
        };
        let stamp = match k3::model::weight_cache::model_stamp(&model.ckpt, policy) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("[K3] prompt cache: off ({e:#})");
                model.set_prompt_cache(None);
                return Ok(());
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
        match PromptCache::open(cfg, &identity) {
            Ok(pc) => {
                eprintln!(
                    "[K3] prompt cache: {} (up to {gb} GB; prompts of {MIN_TOKENS}+ tokens; key {:016x})",
                    dir.display(),
                    pc.key()
                );
                model.set_prompt_cache(Some(Arc::new(pc)));
            }
            Err(e) => {
                eprintln!("[K3] prompt cache: off ({e:#}); the run goes on without it");
                model.set_prompt_cache(None);
            }
        }
        Ok(())
    }
}
