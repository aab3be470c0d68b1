//! Request bodies of `k3 serve`: `/v1/chat/completions`, `/v1/completions` and the
//! Anthropic `/v1/messages` parsers, and the prompt rendering of an accepted chat.
#![no_main]

use k3::sampling::SamplerConfig;
use k3::serve::openai_body::{chat_request, completion_request};
use k3::serve::request::{Defaults, Limits};
use k3::serve::{anthropic, prompt};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let defaults = Defaults {
        sampling: SamplerConfig::default(),
        thinking: true,
    };
    if let Ok(req) = chat_request(data, &limits, &defaults) {
        let _ = prompt::render_request(&req);
    }
    let _ = completion_request(data, &limits, &defaults);
    if let Ok(req) = anthropic::messages_request(data, &limits, &defaults) {
        let _ = prompt::render_request(&req.chat);
    }
});
