//! `config.json` text through the full validation: bounds, layer kinds, float ranges.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = k3::config::Config::from_json_str(text, "config.json");
});
