//! `tokenizer.json` bytes: only byte-level BPE loads; a loaded one decodes every id.
#![no_main]

use std::path::Path;

use k3::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(tok) = Tokenizer::from_hf_json_bytes(data, Path::new("tokenizer.json")) else {
        return;
    };
    let ids: Vec<u32> = (0..tok.vocab_size().min(4096) as u32).collect();
    let _ = tok.decode(&ids, true);
    let _ = tok.try_encode("hello world <|open|> 你好");
    let _ = tok.try_encode_with_special("hello world <|open|> 你好");
});
