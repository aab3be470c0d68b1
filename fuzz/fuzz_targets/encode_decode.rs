//! Arbitrary text round-trips through the Kimi-pattern tiktoken tokenizer of the test
//! fixture, with and without special tokens; arbitrary ids decode (or are refused)
//! without a panic, whole and streamed.
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use k3::tokenizer::{StreamDecoder, Tokenizer};
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
    let tok = tok();
    if let Ok(text) = std::str::from_utf8(data) {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&id| !tok.is_special(id)));
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        let ids = tok.encode_with_special(text);
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        let mut stream = StreamDecoder::new(tok, true);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&stream.push(id).unwrap());
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, text);
    }
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) << 8 | u32::from(*c.get(1).unwrap_or(&0)))
        .collect();
    let whole = tok.decode(&ids, false);
    let mut stream = StreamDecoder::new(tok, false);
    let mut streamed = String::new();
    let mut ok = true;
    for &id in &ids {
        match stream.push(id) {
            Ok(s) => streamed.push_str(&s),
            Err(_) => ok = false,
        }
    }
    streamed.push_str(&stream.finish());
    assert_eq!(whole.is_ok(), ok);
    if let Ok(whole) = whole {
        assert_eq!(streamed, whole);
    }
});
