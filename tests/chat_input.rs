//! `k3 chat` input: a line that is not UTF-8 is reported and the conversation goes on;
//! an unknown `/command` answers with the list of commands and never reaches the model.

mod support;

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
