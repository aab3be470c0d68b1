//! The chat splitter conserves text: every generated id reaches the caller as text of some
//! channel, except the structural tokens it consumes (complete tags and the stop token).
//! A reference reading of the same stream, written independently of the splitter's
//! streaming state, says what must come out.

use std::path::Path;

use k3::tokenizer::{Channel, ChatEvent, ChatSplitter, Tokenizer, MAX_TAG_BYTES};
use proptest::prelude::*;

fn tok() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/synthetic");
        Tokenizer::from_dir(&dir).expect("the synthetic tokenizer fixture loads")
    })
}

fn special(t: &Tokenizer, name: &str) -> u32 {
    t.special_id(name)
        .expect("the fixture has the XTML specials")
}

/// Every special id of the fixture.
fn specials(t: &Tokenizer) -> Vec<u32> {
    (0..t.vocab_size() as u32)
        .filter(|&id| t.is_special(id))
        .collect()
}

/// Runs ids through a splitter (and `finish`): all text in order, the text per channel,
/// and whether it stopped.
fn split(t: &Tokenizer, ids: &[u32], stops: &[u32]) -> (String, Vec<(Channel, String)>, bool) {
    let mut sp = ChatSplitter::new(t, false, stops).unwrap();
    let mut events = Vec::new();
    for &id in ids {
        events.extend(sp.push(id).unwrap());
    }
    events.extend(sp.finish());
    let (mut all, mut parts, mut stopped): (String, Vec<(Channel, String)>, bool) =
        (String::new(), Vec::new(), false);
    for e in events {
        match e {
            ChatEvent::Text { channel, text } => {
                all.push_str(&text);
                match parts.last_mut() {
                    Some((c, s)) if *c == channel => s.push_str(&text),
                    _ => parts.push((channel, text)),
                }
            }
            ChatEvent::Stop => stopped = true,
        }
    }
    (all, parts, stopped)
}

/// What the splitter must emit: the stream up to its first stop id, decoded, without the
/// complete tags (a marker, ordinary ids of at most `MAX_TAG_BYTES` bytes, `<|sep|>`);
/// any other special id appears by name. Decoding restarts at each special id, as a
/// special id ends the text run before it.
fn expected(t: &Tokenizer, ids: &[u32], stops: &[u32]) -> String {
    let (open, close, sep) = (
        special(t, "<|open|>"),
        special(t, "<|close|>"),
        special(t, "<|sep|>"),
    );
    let bytes = |id: u32| t.token_bytes(id).unwrap().to_vec();
    let mut out = String::new();
    let mut run: Vec<u8> = Vec::new();
    let flush = |run: &mut Vec<u8>, out: &mut String| {
        out.push_str(&String::from_utf8_lossy(run));
        run.clear();
    };
    let mut i = 0;
    while i < ids.len() {
        let id = ids[i];
        if stops.contains(&id) {
            break;
        }
        if id == open || id == close {
            let (mut j, mut len) = (i + 1, 0);
            while j < ids.len() && !t.is_special(ids[j]) {
                len += bytes(ids[j]).len();
                j += 1;
            }
            if j < ids.len() && ids[j] == sep && len <= MAX_TAG_BYTES {
                flush(&mut run, &mut out);
                i = j + 1;
                continue;
            }
        }
        if t.is_special(id) {
            flush(&mut run, &mut out);
            out.push_str(&String::from_utf8_lossy(&bytes(id)));
        } else {
            run.extend(bytes(id));
        }
        i += 1;
    }
    flush(&mut run, &mut out);
    out
}

/// Pieces a stream is built from: single special ids, ordinary ids, and the ids of tag
/// names, so complete tags occur often.
fn atom() -> impl Strategy<Value = Vec<u32>> {
    let t = tok();
    let sp = specials(t);
    let n_base = t.num_base_tokens();
    let words: Vec<Vec<u32>> = [
        "think",
        "response",
        "tools",
        "message",
        "call tool=\"f\" index=\"1\"",
        "argument key=\"x\" type=\"string\"",
        "Good morning",
        "é",
        "\n",
    ]
    .iter()
    .map(|w| t.encode(w))
    .collect();
    prop_oneof![
        3 => proptest::sample::select(sp).prop_map(|id| vec![id]),
        3 => (0..n_base).prop_map(|id| vec![id]),
        2 => proptest::sample::select(words),
        1 => (0..n_base, 1usize..80).prop_map(|(id, n)| vec![id; n]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn every_id_but_consumed_structure_reaches_the_caller(
        atoms in proptest::collection::vec(atom(), 0..40),
        stop_on_eom in any::<bool>(),
    ) {
        let t = tok();
        let ids: Vec<u32> = atoms.concat();
        let stops: Vec<u32> = if stop_on_eom { Vec::new() } else { vec![special(t, "[EOS]")] };
        let mut all_stops = stops.clone();
        all_stops.push(special(t, "<|end_of_msg|>"));
        let (all, _, _) = split(t, &ids, &stops);
        prop_assert_eq!(all, expected(t, &ids, &all_stops));
    }

    #[test]
    fn without_stops_every_id_but_complete_tags_reaches_the_caller(
        atoms in proptest::collection::vec(atom(), 0..40),
    ) {
        let t = tok();
        let ids: Vec<u32> = atoms.concat();
        let mut sp = ChatSplitter::new(t, true, &[special(t, "[EOS]")]).unwrap().without_stops();
        let mut all = String::new();
        for &id in &ids {
            for e in sp.push(id).unwrap() {
                prop_assert!(e != ChatEvent::Stop);
                if let ChatEvent::Text { text, .. } = e {
                    all.push_str(&text);
                }
            }
        }
        for e in sp.finish() {
            if let ChatEvent::Text { text, .. } = e {
                all.push_str(&text);
            }
        }
        prop_assert_eq!(all, expected(t, &ids, &[]));
    }
}

#[test]
fn an_open_marker_that_no_sep_follows_is_text_by_the_end() {
    // The model opens a tag and then only writes text: nothing is lost.
    let t = tok();
    let mut ids = t.encode("Hello");
    ids.push(special(t, "<|open|>"));
    ids.extend(t.encode(" there, good morning"));
    let (all, parts, stopped) = split(t, &ids, &[]);
    assert!(!stopped);
    assert_eq!(all, "Hello<|open|> there, good morning");
    assert_eq!(
        parts,
        vec![(
            Channel::Response,
            "Hello<|open|> there, good morning".to_string()
        )]
    );
}

#[test]
fn a_tag_longer_than_the_limit_flushes_at_once() {
    let t = tok();
    let mut sp = ChatSplitter::new(t, false, &[]).unwrap();
    assert!(sp.push(special(t, "<|open|>")).unwrap().is_empty());
    let word = t.encode("abcdefgh");
    let mut shown = String::new();
    let mut pushed = 0;
    while shown.is_empty() {
        for &id in &word {
            for e in sp.push(id).unwrap() {
                if let ChatEvent::Text { text, .. } = e {
                    shown.push_str(&text);
                }
            }
        }
        pushed += 8;
        assert!(
            pushed <= MAX_TAG_BYTES + 8,
            "still silent after {pushed} bytes"
        );
    }
    assert!(shown.starts_with("<|open|>abcdefgh"), "{shown}");
}

#[test]
fn a_special_token_inside_a_tag_flushes_it_as_text() {
    let t = tok();
    let mut ids = vec![special(t, "<|close|>")];
    ids.extend(t.encode("resp"));
    ids.push(special(t, "[EOS]"));
    ids.extend(t.encode("onse"));
    ids.push(special(t, "<|sep|>"));
    let (all, _, _) = split(t, &ids, &[]);
    assert_eq!(all, "<|close|>resp[EOS]onse<|sep|>");
}

#[test]
fn a_stop_after_an_unfinished_tag_keeps_the_tag_as_text() {
    let t = tok();
    let mut ids = t.encode("a");
    ids.push(special(t, "<|open|>"));
    ids.extend(t.encode("b"));
    ids.push(special(t, "<|end_of_msg|>"));
    ids.extend(t.encode("never"));
    let (all, _, stopped) = split(t, &ids, &[]);
    assert!(stopped);
    assert_eq!(all, "a<|open|>b");
}
