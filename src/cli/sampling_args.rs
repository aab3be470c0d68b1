//! Sampling flags shared by `run` and `chat`.

use clap::Args;
use k3::sampling::SamplerConfig;

/// How the next token is picked.
#[derive(Args, Debug, Clone)]
pub(crate) struct SamplingArgs {
    /// Temperature; 0 = greedy (ties to the lowest id).
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below MIN_P times the most likely one's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty over the context (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed: the same seed on the same backend gives the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler settings.
    pub(crate) fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temp,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: self.seed,
        }
    }
}
