//! Model output as the server reads it: think and response channels, tool-call sections
//! (malformed or cut off included) and stop strings, over arbitrary markup.
#![no_main]

use k3::serve::reply::{parse_reply, pieces_from_markup};
use k3::serve::stop_strings::StopStrings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let pieces = pieces_from_markup(text);
    let _ = parse_reply(&pieces, flags & 1 != 0);
    // Stop strings: the first line names them (split by U+001F), the rest streams in
    // pieces of (flags >> 1) + 1 bytes.
    let (stops, body) = text.split_once('\n').unwrap_or(("", text));
    let stops: Vec<String> = stops
        .split('\u{1f}')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    let mut s = StopStrings::new(&stops);
    let step = usize::from(flags >> 1) + 1;
    let mut out = String::new();
    let mut rest = body;
    while !rest.is_empty() && !s.hit() {
        let mut cut = step.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        out.push_str(&s.push(&rest[..cut]));
        rest = &rest[cut..];
    }
    out.push_str(&s.finish());
    if !s.hit() {
        assert_eq!(out, body);
    }
});
