//! What a generation is asked: its stop rule, its switches and the prompt positions worth a
//! state.

use crate::model::trace::Trace;
use std::sync::atomic::AtomicBool;

/// The stop rule and switches of [`Session::generate`](super::Session::generate).
#[derive(Clone, Copy, Default)]
pub struct DecodeOptions<'a> {
    /// Tokens to generate at most (0 generates nothing).
    pub max_tokens: usize,
    /// Stop when one of these ids is generated (it is still reported).
    pub stop_ids: &'a [u32],
    /// Checked before each layer of a prefill window and between tokens; raised means
    /// stop now.
    pub cancel: Option<&'a AtomicBool>,
    /// Keep the logits of every prompt position fed by this call.
    pub all_logits: bool,
    /// Per-layer hidden dumps.
    pub trace: Option<&'a Trace>,
    /// A prompt position to keep a state snapshot at besides the prompt's end: where the
    /// next prompt of the conversation is expected to part from this one (the server's
    /// tool-choice note), so that prompt resumes there instead of from the start.
    pub snapshot_at: Option<usize>,
    /// Prompt positions at message boundaries later prompts are likely to share (the end
    /// of the system prompt and tools, a client's cache breakpoints), ascending: the
    /// prefill keeps a state snapshot at each and stores it in the prompt cache, so a
    /// prompt that shares only those messages resumes there. The last [`MAX_BOUNDARIES`]
    /// are kept a prompt.
    pub boundaries: &'a [usize],
}

/// Message boundaries kept per prompt ([`DecodeOptions::boundaries`]), the last ones (a
/// client puts its latest breakpoint last; Anthropic allows four): each costs a state
/// snapshot in RAM and a prompt-cache entry on disk.
pub const MAX_BOUNDARIES: usize = 4;

/// The boundaries of `marked` (ascending) a prompt keeps: the last [`MAX_BOUNDARIES`].
pub fn kept_boundaries(marked: &[usize]) -> &[usize] {
    &marked[marked.len().saturating_sub(MAX_BOUNDARIES)..]
}
