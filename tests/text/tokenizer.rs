//! Tokenizer: agreement with Python tiktoken (fixtures from tools/gen_tokenizer_fixtures.py),
//! round trips, streaming decode, the synthetic vocabulary, and loader errors.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use k3::tokenizer::synthetic::write_synthetic_tokenizer;
use k3::tokenizer::{StreamDecoder, Tokenizer};
use proptest::prelude::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

/// The committed synthetic vocabulary (small preset) that the Python oracle used.
fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&fixtures().join("synthetic")).unwrap())
}

#[test]
fn synthetic_writer_reproduces_the_committed_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_tokenizer(dir.path(), 4096, 3840, 3842, 4095).unwrap();
    let committed = fixtures().join("synthetic");
    if std::env::var_os("K3_BLESS").is_some() {
        std::fs::create_dir_all(&committed).unwrap();
        for f in ["tiktoken.model", "tokenizer_config.json"] {
            std::fs::copy(dir.path().join(f), committed.join(f)).unwrap();
        }
    }
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        let fresh = std::fs::read(dir.path().join(f)).unwrap();
        let old = std::fs::read(committed.join(f)).unwrap();
        assert!(
            fresh == old,
            "{f} differs from the committed fixture; if intended, rerun with K3_BLESS=1 and \
             regenerate with tools/gen_tokenizer_fixtures.py"
        );
    }
}

#[test]
fn synthetic_presets_lay_out_specials_like_k3() {
    for (vocab, bos, eos, pad) in [
        (1024usize, 768u32, 770u32, 1023u32),
        (4096, 3840, 3842, 4095),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic_tokenizer(dir.path(), vocab, bos, eos, pad).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.vocab_size(), vocab);
        assert_eq!(t.num_base_tokens(), bos);
        assert_eq!(t.special_id("[BOS]"), Some(bos));
        assert_eq!(t.special_id("[EOS]"), Some(bos + 1));
        assert_eq!(t.special_id("<|end_of_msg|>"), Some(eos));
        assert_eq!(t.special_id("<|open|>"), Some(bos + 3));
        assert_eq!(t.special_id("<|close|>"), Some(bos + 4));
        assert_eq!(t.special_id("<|sep|>"), Some(bos + 5));
        assert_eq!(t.special_id("[UNK]"), Some(vocab as u32 - 2));
        assert_eq!(t.special_id("[PAD]"), Some(pad));
        let reserved = format!("<|reserved_token_{}|>", bos + 8);
        assert_eq!(t.special_id(&reserved), Some(bos + 8));
        // The merges are real: common English takes well under one token per byte.
        let text = "The quick brown fox jumps over the lazy dog.";
        let ids = t.encode(text);
        assert!(
            ids.len() * 3 < text.len() * 2,
            "{} ids for {} bytes",
            ids.len(),
            text.len()
        );
        assert_eq!(t.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn synthetic_rejects_bad_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let err = write_synthetic_tokenizer(dir.path(), 1000, 768, 770, 999).unwrap_err();
    assert!(err.to_string().contains("vocab_size 1000"), "{err}");
    let err = write_synthetic_tokenizer(dir.path(), 1024, 768, 1024, 1023).unwrap_err();
    assert!(err.to_string().contains("eos 1024"), "{err}");
    let err = write_synthetic_tokenizer(dir.path(), 1024, 768, 770, 770).unwrap_err();
    assert!(err.to_string().contains("eos and pad"), "{err}");
}

#[derive(serde::Deserialize)]
struct TiktokenCase {
    text: String,
    special: bool,
    ids: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct TiktokenFixture {
    cases: Vec<TiktokenCase>,
}

#[test]
fn encode_matches_python_tiktoken() {
    let raw = std::fs::read_to_string(fixtures().join("tiktoken_cases.json")).unwrap();
    let fx: TiktokenFixture = serde_json::from_str(&raw).unwrap();
    assert!(fx.cases.len() > 30);
    let t = tok();
    for case in &fx.cases {
        let ids = if case.special {
            t.encode_with_special(&case.text)
        } else {
            t.encode(&case.text)
        };
        let shown: String = case.text.chars().take(60).collect();
        assert_eq!(ids, case.ids, "special={} text={shown:?}", case.special);
        assert_eq!(
            t.decode(&ids, case.special).unwrap(),
            case.text,
            "round trip of {shown:?}"
        );
    }
}

#[test]
fn special_strings_are_text_unless_asked() {
    let t = tok();
    let open = t.special_id("<|open|>").unwrap();
    let plain = t.encode("<|open|>");
    assert!(!plain.contains(&open) && plain.len() > 1);
    assert_eq!(t.encode_with_special("<|open|>"), vec![open]);
    let ids = t.encode_with_special("a<|open|>b");
    assert_eq!(t.decode(&ids, true).unwrap(), "a<|open|>b");
    assert_eq!(t.decode(&ids, false).unwrap(), "ab");
    assert_eq!(t.token_bytes(open), Some(&b"<|open|>"[..]));
    assert_eq!(t.token_bytes(u32::from(b'A')), Some(&b"A"[..]));
    assert_eq!(t.token_bytes(t.vocab_size() as u32), None);
}

#[test]
fn out_of_range_id_is_an_error_naming_it() {
    let t = tok();
    let err = t.decode(&[1, 99_999], false).unwrap_err().to_string();
    assert!(err.contains("99999") && err.contains("4096"), "{err}");
    let mut s = StreamDecoder::new(t, false);
    assert!(s.push(4096).is_err());
}

#[test]
fn decode_is_lossy_only_at_the_end() {
    let t = tok();
    // "é" is two bytes, each its own token: decoding them together restores it.
    let ids: Vec<u32> = "é".bytes().map(u32::from).collect();
    assert_eq!(t.decode(&ids, false).unwrap(), "é");
    assert_eq!(t.decode(&ids[..1], false).unwrap(), "\u{fffd}");
    let mut s = StreamDecoder::new(t, false);
    assert_eq!(s.push(ids[0]).unwrap(), "");
    assert!(s.has_pending());
    assert_eq!(s.push(ids[1]).unwrap(), "é");
    let mut s = StreamDecoder::new(t, false);
    assert_eq!(s.push(ids[0]).unwrap(), "");
    assert_eq!(s.finish(), "\u{fffd}");
}

#[test]
fn stream_decode_of_invalid_bytes_matches_whole_decode() {
    let t = tok();
    // Lone continuation bytes, a truncated 4-byte sequence, an overlong form, then text.
    let bytes: Vec<u32> = [
        0x80, 0xf0, 0x9f, 0x98, b'a', 0xc0, 0xaf, 0xe4, 0xbd, b'!', 0xf0,
    ]
    .iter()
    .map(|&b| u32::from(b))
    .collect();
    let whole = t.decode(&bytes, false).unwrap();
    let mut s = StreamDecoder::new(t, false);
    let mut streamed = String::new();
    for &id in &bytes {
        streamed.push_str(&s.push(id).unwrap());
    }
    streamed.push_str(&s.finish());
    assert_eq!(streamed, whole);
}

#[test]
fn loader_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("no tiktoken.model"), "{err}");
    std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::write(dir.path().join("tiktoken.model"), "QQ== 0\nQg== 0\n").unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("rank 0 appears twice"), "{err}");
    std::fs::write(dir.path().join("tiktoken.model"), "QQ== 0\n").unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("all 256"), "{err}");
    // A config naming an id inside the rank range is refused.
    write_synthetic_tokenizer(dir.path(), 1024, 768, 770, 1023).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"added_tokens_decoder": {"5": {"content": "<|x|>", "special": true}}}"#,
    )
    .unwrap();
    let err = format!("{:#}", Tokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("id 5") && err.contains("<|x|>"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn round_trip_arbitrary_unicode(s in "\\PC*") {
        let t = tok();
        let ids = t.encode(&s);
        prop_assert_eq!(t.decode(&ids, false).unwrap(), s.clone());
        let ids = t.encode_with_special(&s);
        prop_assert_eq!(t.decode(&ids, true).unwrap(), s);
    }

    #[test]
    fn round_trip_any_chars(chars in proptest::collection::vec(any::<char>(), 0..64)) {
        let t = tok();
        let s: String = chars.into_iter().collect();
        prop_assert_eq!(t.decode(&t.encode(&s), false).unwrap(), s);
    }

    #[test]
    fn streaming_equals_whole_decode(
        ids in proptest::collection::vec(0u32..4096, 0..80),
        show_special in any::<bool>(),
    ) {
        let t = tok();
        let whole = t.decode(&ids, show_special).unwrap();
        let mut s = StreamDecoder::new(t, show_special);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&s.push(id).unwrap());
        }
        streamed.push_str(&s.finish());
        prop_assert_eq!(streamed, whole);
    }
}

#[test]
fn synthetic_writer_fills_a_release_sized_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    write_synthetic_tokenizer(dir.path(), 163840, 163584, 163586, 163839).unwrap();
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.vocab_size(), 163840);
    assert_eq!(t.special_id("<|end_of_msg|>"), Some(163586));
    let text = "Kimi K3 streams experts: 你好 🙂";
    assert_eq!(t.decode(&t.encode(text), false).unwrap(), text);
}
