//! Arbitrary conversations render and encode; text is text: the encoded prompt holds
//! exactly as many special ids as the template inserted control pieces, whatever markers
//! the messages contain.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use k3::tokenizer::{
    chat_prompt, render_chat_with, ChatOptions, Message, Piece, Role, ThinkingEffort, Tokenizer,
};
use libfuzzer_sys::fuzz_target;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer/synthetic");
        Tokenizer::from_dir(&dir).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    // Messages are separated by U+001E; a message is `R<content>[U+001F<reasoning>]`
    // with R one of s, u, a.
    let messages: Vec<Message> = text
        .split('\u{1e}')
        .filter_map(|m| {
            let mut chars = m.chars();
            let role = match chars.next()? {
                's' => Role::System,
                'u' => Role::User,
                _ => Role::Assistant,
            };
            let body = chars.as_str();
            let (content, reasoning) = match body.split_once('\u{1f}') {
                Some((c, r)) => (c.to_string(), Some(r.to_string())),
                None => (body.to_string(), None),
            };
            Some(Message {
                role,
                content,
                reasoning,
            })
        })
        .collect();
    let opts = ChatOptions {
        add_generation_prompt: flags & 1 != 0,
        thinking: flags & 2 != 0,
        thinking_effort: match flags >> 2 & 3 {
            0 => None,
            1 => Some(ThinkingEffort::Low),
            _ => Some(ThinkingEffort::Max),
        },
    };
    let rendered = render_chat_with(&messages, &opts);
    let prompt = chat_prompt(&messages, &opts);
    let controls = prompt
        .pieces()
        .iter()
        .filter(|p| matches!(p, Piece::Control(_)))
        .count();
    let tok = tok();
    let ids = tok.encode_prompt(&prompt).unwrap();
    let specials = ids.iter().filter(|&&id| tok.is_special(id)).count();
    assert_eq!(specials, controls);
    assert_eq!(tok.decode(&ids, true).unwrap(), prompt.text());
    let _ = rendered;
});
