//! `tiktoken.model` and `tokenizer_config.json` text (split at the first NUL byte): a
//! tokenizer that loads must encode and decode a sample of the input without hanging.
#![no_main]

use std::path::Path;

use k3::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (model, config) = text.split_once('\0').unwrap_or((text, "{}"));
    let Ok(tok) = Tokenizer::from_tiktoken_text(
        model,
        config,
        Path::new("tiktoken.model"),
        Path::new("tokenizer_config.json"),
    ) else {
        return;
    };
    let sample: String = config.chars().take(256).collect();
    let ids = tok.encode(&sample);
    assert_eq!(
        tok.decode(&ids, true).ok().as_deref(),
        Some(sample.as_str())
    );
    let ids = tok.encode_with_special(&sample);
    assert_eq!(
        tok.decode(&ids, true).ok().as_deref(),
        Some(sample.as_str())
    );
});
