//! The prompt-cache flags `k3 run`, `k3 chat` and `k3 serve` share, mapped onto the
//! engine's [`PromptCacheSettings`].

use clap::Args;
use k3::engine::config::PromptCacheSettings;
use std::path::PathBuf;

/// Where prompt states are kept on disk, and how much of it they may take.
#[derive(Args, Debug, Clone)]
pub(crate) struct PromptCacheArgs {
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
    /// The prompt-cache settings these flags ask for; `in_use` says whether the job's
    /// sessions use it.
    pub(crate) fn settings(&self, in_use: bool) -> PromptCacheSettings {
        PromptCacheSettings {
            in_use,
            dir: self.dir.clone(),
            gb: self.gb,
            off: self.off,
        }
    }
}
