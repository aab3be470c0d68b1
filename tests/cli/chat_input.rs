//! `k3 chat` input: a line that is not UTF-8 is reported and the conversation goes on;
//! an unknown `/command` answers with the list of commands and never reaches the model.

use crate::support;

use std::process::Output;

/// Runs `k3 chat` on the tiny model with `input` on standard input.
fn chat(input: &[u8]) -> Output {
    support::chat(&[], input)
}

#[test]
fn bad_lines_and_unknown_commands_keep_the_conversation() {
    let plain = chat(b"hello there\nand again\n");
    let plain_err = String::from_utf8_lossy(&plain.stderr);
    assert!(plain.status.success(), "{plain_err}");
    assert!(!plain.stdout.is_empty());

    let hostile = chat(b"hello there\n\xff\xfe bad \xc3\n/frobnicate\nand again\n");
    let err = String::from_utf8_lossy(&hostile.stderr);
    assert!(hostile.status.success(), "{err}");
    assert!(err.contains("not UTF-8 text"), "{err}");
    assert!(err.contains("conversation is kept"), "{err}");
    assert!(err.contains("unknown command /frobnicate"), "{err}");
    assert!(
        err.contains("/reset") && err.contains("/think on|off") && err.contains("/quit"),
        "{err}"
    );
    // Both answers came, and the same as without the bad lines: the invalid line and the
    // unknown command reached neither the history nor the model.
    assert_eq!(
        String::from_utf8_lossy(&hostile.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
}

#[test]
fn a_double_slash_sends_text_that_begins_with_a_slash() {
    let out = chat(b"//frobnicate\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("unknown command"), "{err}");
    assert!(!out.stdout.is_empty(), "{err}");
}

#[test]
fn a_line_longer_than_the_context_could_hold_is_refused_before_tokenizing() {
    let mut input = b"hello there\n".to_vec();
    input.extend(std::iter::repeat_n(b'x', 4 << 20));
    input.extend(b"\nand again\n");
    let out = support::chat(&["--max-tokens", "256"], &input);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("that line is 4194305 bytes") && err.contains("holds at most"),
        "{err}"
    );
    assert!(err.contains("conversation is kept"), "{err}");
    // Both short turns were answered, the same as without the long line.
    let plain = support::chat(&["--max-tokens", "256"], b"hello there\nand again\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&plain.stdout)
    );
}
