//! Snapshots that ship a Hugging Face `tokenizer.json` instead of `tiktoken.model`:
//! encoding runs through the `tokenizers` crate, decoding through the byte table of
//! every id built here from the byte-level vocabulary.

use crate::platform::input_file::{self, FileKind};
use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use tokenizers::{AddedVocabulary, DecoderWrapper, Model, ModelWrapper, PreTokenizerWrapper};

/// A loaded `tokenizer.json` with the byte strings of its ids.
pub struct HfTokenizer {
    /// As loaded: added tokens are matched in the text.
    with_special: tokenizers::Tokenizer,
    /// The same pipeline with an empty added vocabulary, so that no added-token string
    /// (special or not) is cut out of ordinary text. `set_encode_special_tokens` alone
    /// would still match added tokens whose `special` flag is false.
    ordinary: tokenizers::Tokenizer,
}

/// What `from_file` hands back to `Tokenizer`.
pub struct HfParts {
    /// The encoder.
    pub encoder: HfTokenizer,
    /// Bytes of every id: model tokens through the inverse byte-to-unicode table,
    /// added tokens as their content.
    pub tokens: Vec<Vec<u8>>,
    /// Which ids are added tokens.
    pub special: Vec<bool>,
    /// Added token content -> id.
    pub special_ids: HashMap<String, u32>,
    /// Number of ids of the model's own vocabulary (without added tokens).
    pub n_base: u32,
}

/// GPT-2's byte -> printable character table (`bytes_to_unicode` in `encoder.py`): the
/// printable Latin-1 bytes map to themselves, the rest to U+0100 upwards in byte order.
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        // Codes stay below 0x200, far from the surrogate range.
        table[b as usize] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

fn model_kind(m: &ModelWrapper) -> &'static str {
    match m {
        ModelWrapper::BPE(_) => "BPE",
        ModelWrapper::WordPiece(_) => "WordPiece",
        ModelWrapper::WordLevel(_) => "WordLevel",
        ModelWrapper::Unigram(_) => "Unigram",
    }
}

fn decoder_kind(d: Option<&DecoderWrapper>) -> &'static str {
    match d {
        None => "none",
        Some(DecoderWrapper::BPE(_)) => "BPEDecoder",
        Some(DecoderWrapper::ByteLevel(_)) => "ByteLevel",
        Some(DecoderWrapper::WordPiece(_)) => "WordPiece",
        Some(DecoderWrapper::Metaspace(_)) => "Metaspace",
        Some(DecoderWrapper::CTC(_)) => "CTC",
        Some(DecoderWrapper::Sequence(_)) => "Sequence",
        Some(DecoderWrapper::Replace(_)) => "Replace",
        Some(DecoderWrapper::Fuse(_)) => "Fuse",
        Some(DecoderWrapper::Strip(_)) => "Strip",
        Some(DecoderWrapper::ByteFallback(_)) => "ByteFallback",
    }
}

fn has_byte_level_pre_tokenizer(p: Option<&PreTokenizerWrapper>) -> bool {
    match p {
        Some(PreTokenizerWrapper::ByteLevel(_)) => true,
        Some(PreTokenizerWrapper::Sequence(seq)) => seq
            .as_ref()
            .iter()
            .any(|p| has_byte_level_pre_tokenizer(Some(p))),
        _ => false,
    }
}

/// Loads a byte-level BPE `tokenizer.json` (what GPT-2-style tokenizers, Llama 3, Qwen
/// and DeepSeek ship). Other kinds (sentencepiece-style Metaspace, WordPiece, ...) are
/// refused: their ids have no fixed byte string, which streaming decode needs.
pub fn from_file(path: &Path) -> Result<HfParts> {
    let bytes = input_file::read(path, FileKind::TokenizerJson)?;
    from_bytes(&bytes, path)
}

/// [`from_file`] over the file's bytes; `path` only names the file in errors.
pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<HfParts> {
    // The `tokenizers` crate panics (`expect("Helper")`) on some malformed JSON inside a
    // decoder instead of returning an error, so the syntax is checked here first, and a
    // panic left in its parser still becomes an error naming the file.
    let text = std::str::from_utf8(bytes)
        .map_err(|e| anyhow!("{}: not valid JSON: not UTF-8: {e}", path.display()))?;
    // Duplicate keys too: the crate keeps the last of two equal vocabulary entries.
    if let Err(e) = crate::unique_json::check_str(text) {
        bail!("{}: not valid JSON: {e}", path.display());
    }
    let mut with_special = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes))
        .map_err(|_| {
            anyhow!(
                "{}: not a loadable tokenizer.json (its parser failed on this file)",
                path.display()
            )
        })?
        .map_err(|e| anyhow!("{}: not a loadable tokenizer.json: {e}", path.display()))?;
    let model = model_kind(with_special.get_model());
    let decoder = decoder_kind(with_special.get_decoder());
    if model != "BPE" || decoder != "ByteLevel" {
        bail!(
            "{}: model {model} with decoder {decoder} is not supported; only byte-level BPE \
             (model BPE, decoder ByteLevel) loads from tokenizer.json",
            path.display()
        );
    }
    if !has_byte_level_pre_tokenizer(with_special.get_pre_tokenizer()) {
        bail!(
            "{}: the decoder is ByteLevel but no ByteLevel pre-tokenizer maps text to the \
             byte alphabet; this tokenizer.json is inconsistent",
            path.display()
        );
    }
    with_special.set_encode_special_tokens(false);

    let inverse: HashMap<char, u8> = byte_to_char()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect();
    let vocab = with_special.get_model().get_vocab();
    let added = with_special.get_added_tokens_decoder();
    let n_base = vocab.len() as u32;
    let max_id = vocab
        .values()
        .chain(added.keys())
        .copied()
        .max()
        .ok_or_else(|| anyhow!("{}: the vocabulary is empty", path.display()))?;
    // Ids run 0..=max_id without gaps, so there are at least max_id + 1 entries; a larger
    // id is refused before it sizes the byte table.
    let entries = vocab.len() + added.len();
    if max_id as usize >= entries {
        bail!(
            "{}: id {max_id} is out of range: {} vocabulary and {} added tokens leave ids \
             0..{entries} without gaps",
            path.display(),
            vocab.len(),
            added.len()
        );
    }
    let mut tokens: Vec<Option<Vec<u8>>> = vec![None; max_id as usize + 1];
    for (text, &id) in &vocab {
        let bytes = text
            .chars()
            .map(|c| inverse.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| {
                anyhow!(
                    "{}: token {text:?} (id {id}) has a character outside the byte-level \
                     alphabet; the vocabulary is not byte-level",
                    path.display()
                )
            })?;
        tokens[id as usize] = Some(bytes);
    }
    let mut special = vec![false; tokens.len()];
    let mut special_ids = HashMap::new();
    for (&id, tok) in &added {
        tokens[id as usize] = Some(tok.content.clone().into_bytes());
        special[id as usize] = true;
        special_ids.insert(tok.content.clone(), id);
    }
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            t.ok_or_else(|| {
                anyhow!(
                    "{}: id {id} belongs to no token (ids must run 0..={max_id} without gaps)",
                    path.display()
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let mut ordinary = with_special.clone();
    ordinary.with_added_vocabulary(AddedVocabulary::new());
    Ok(HfParts {
        encoder: HfTokenizer {
            with_special,
            ordinary,
        },
        tokens,
        special,
        special_ids,
        n_base,
    })
}

impl HfTokenizer {
    /// Encodes text without matching added tokens.
    pub fn encode_ordinary(&self, text: &str) -> Result<Vec<u32>> {
        Self::run(&self.ordinary, text)
    }

    /// Encodes text in which added-token strings become their ids.
    pub fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        Self::run(&self.with_special, text)
    }

    fn run(tok: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
        // add_special_tokens=false: the caller's text (e.g. a rendered chat) already
        // carries every marker; the post-processor must not add BOS/EOS.
        let enc = tok
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizer.json encoding failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }
}
