//! One-shot generation (`k3 run`, `k3 bench`): a fresh [`Session`] driven by the shared
//! decode loop, with the settings a single prompt needs.

use crate::backend::Backend;
use crate::model::trace::Trace;
use crate::model::Runner;
use crate::session::{DecodeOptions, Flow, Session};
use anyhow::Result;

pub use crate::session::{prefill, Generation, TokenEvent, MAX_WINDOW};

/// Settings of [`generate`].
pub struct GenerateOptions<'a> {
    /// Tokens to generate at most.
    pub ngen: usize,
    /// Bound on the prefill window below the model's own ([`Session::with_max_window`]);
    /// `None`: the model's window, which `--chunk` bounds through the engine.
    pub max_window: Option<usize>,
    /// Keep the logits of every prompt position.
    pub all_logits: bool,
    /// Stop when one of these ids is generated (it is still reported).
    pub stop_ids: &'a [u32],
    /// Per-layer hidden dumps.
    pub trace: Option<&'a Trace>,
}

/// Prefills `prompt` into a fresh session, then samples up to `ngen` tokens with `pick`,
/// calling `on_token` for each as soon as it exists.
pub fn generate<B: Backend>(
    model: &Runner<B>,
    prompt: &[u32],
    opts: &GenerateOptions<'_>,
    pick: &mut dyn FnMut(&[f32], &[u32]) -> u32,
    on_token: &mut dyn FnMut(&TokenEvent) -> Result<()>,
) -> Result<Generation> {
    let mut session = match opts.max_window {
        Some(w) => Session::with_max_window(model, w)?,
        None => Session::new(model)?,
    };
    let decode = DecodeOptions {
        max_tokens: opts.ngen,
        stop_ids: opts.stop_ids,
        cancel: None,
        all_logits: opts.all_logits,
        trace: opts.trace,
        snapshot_at: None,
        boundaries: &[],
    };
    session.generate(prompt, &decode, pick, &mut |ev| {
        on_token(ev)?;
        Ok(Flow::Continue)
    })
}
