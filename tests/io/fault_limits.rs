//! Size limits on files read whole: an oversized file is refused naming the file and the
//! limit before it is read into memory.

use crate::support;

use k3::checkpoint::shards::MAX_INDEX_BYTES;
use k3::checkpoint::Checkpoint;
use std::io::Write;
use support::tiny_ckpt::{tiny_snapshot, Layout};

#[test]
fn an_oversized_shard_index_is_refused_before_it_is_parsed() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let path = tmp.path().join("model.safetensors.index.json");
    // Valid JSON, padded with whitespace past the limit: without the limit it loads.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    let pad = vec![b' '; 1 << 20];
    for _ in 0..=(MAX_INDEX_BYTES >> 20) {
        f.write_all(&pad).unwrap();
    }
    drop(f);
    let e = match Checkpoint::open(tmp.path(), &[]) {
        Ok(_) => panic!(
            "an index of {} bytes opened",
            std::fs::metadata(&path).unwrap().len()
        ),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("model.safetensors.index.json")
            && e.contains("too large for a shard index")
            && e.contains(&MAX_INDEX_BYTES.to_string()),
        "{e}"
    );
}

#[test]
fn an_index_just_under_the_limit_still_opens() {
    let (tmp, _) = tiny_snapshot(&Layout::default());
    let path = tmp.path().join("model.safetensors.index.json");
    let len = std::fs::metadata(&path).unwrap().len();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(&vec![b' '; (MAX_INDEX_BYTES - len) as usize])
        .unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), MAX_INDEX_BYTES);
    Checkpoint::open(tmp.path(), &[]).unwrap();
}

/// Runs `k3 chat` on the tiny model with a context of `context` tokens and `input` on
/// standard input; returns (status, stdout, stderr).
fn chat(context: usize, input: &[u8]) -> (std::process::ExitStatus, String, String) {
    let out = support::chat(&["--max-tokens", &context.to_string()], input);
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn chat_stops_an_answer_at_the_context_and_refuses_a_turn_past_it() {
    // The tiny model's first turn renders to 49 tokens: a context of 52 leaves room for
    // 4 answer tokens of the 6 asked, and none for a second turn.
    let (ok, one, _) = chat(4096, b"hello there\n");
    assert!(ok.success());
    let (status, out, err) = chat(52, b"hello there\nand again\n/reset\nhello there\n");
    assert!(status.success(), "{err}");
    assert!(
        err.contains("[K3] context full: the answer stopped after 4 tokens")
            && err.contains("--max-tokens / K3_MAXT 52"),
        "{err}"
    );
    assert!(
        err.contains("[K3] context full: with this line the conversation is")
            && err.contains("the line was not sent"),
        "{err}"
    );
    // The refused turn reached nothing: after /reset the same first line gets the same
    // (cut) answer, and that cut answer is the start of the uncut one.
    let answers: Vec<&str> = out.lines().collect();
    assert_eq!(answers.len(), 2, "{out}");
    assert_eq!(answers[0], answers[1]);
    assert!(
        one.starts_with(answers[0]) && one.len() > answers[0].len(),
        "{one} / {out}"
    );
}

#[test]
fn chat_refuses_a_first_line_longer_than_the_context_and_keeps_going() {
    let (status, out, err) = chat(40, b"hello there\n");
    assert!(status.success(), "{err}");
    assert!(
        err.contains(
            "context full: with this line the conversation is 49 tokens and the context holds 40"
        ),
        "{err}"
    );
    assert!(out.is_empty(), "nothing was generated: {out}");
}
