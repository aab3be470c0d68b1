//! `model.safetensors.index.json` text: shard names are plain file names.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok((names, _)) =
        k3::checkpoint::shards::parse_index(text, Path::new("model.safetensors.index.json"))
    {
        for n in names {
            assert!(!n.is_empty() && !n.contains(['/', '\\']) && n != "." && n != "..");
        }
    }
});
