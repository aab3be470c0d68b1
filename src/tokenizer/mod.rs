//! Text in, text out: Kimi's tiktoken-style tokenizer, streaming decode, the XTML
//! chat format, and a synthetic tokenizer for test models.

pub mod bpe;
pub mod chat;
pub mod special;
pub mod stream_decode;
pub mod synthetic;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Result};

pub use chat::{
    render_chat, render_chat_with, Channel, ChatEvent, ChatOptions, ChatSplitter, Message, Role,
    ThinkingEffort,
};
pub use stream_decode::StreamDecoder;

/// A snapshot's tokenizer: rank BPE from `tiktoken.model` plus the added tokens of
/// `tokenizer_config.json`. Ids `0..n_base` are BPE ranks; the rest are special.
pub struct Tokenizer {
    bpe: bpe::RankBpe,
    /// Bytes of every id: the rank bytes, then the special names.
    tokens: Vec<Vec<u8>>,
    n_base: u32,
    special_ids: HashMap<String, u32>,
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a snapshot directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let model = dir.join("tiktoken.model");
        let config = dir.join("tokenizer_config.json");
        if !model.is_file() {
            if dir.join("tokenizer.json").is_file() {
                bail!(
                    "{} has a tokenizer.json but no tiktoken.model; only Kimi's tiktoken \
                     format is supported (tokenizer.json loading is not built in)",
                    dir.display()
                );
            }
            bail!(
                "{} has no tiktoken.model; point at a Kimi snapshot directory",
                dir.display()
            );
        }
        if !config.is_file() {
            bail!(
                "{} has no tokenizer_config.json; it names the special tokens and must sit \
                 beside tiktoken.model",
                dir.display()
            );
        }
        let ranks = bpe::read_tiktoken_model(&model)?;
        let mut single = [false; 256];
        for r in &ranks {
            if let [b] = r.as_slice() {
                single[*b as usize] = true;
            }
        }
        if let Some(missing) = single.iter().position(|&s| !s) {
            bail!(
                "{}: byte {missing:#04x} has no token of its own; a byte-level BPE needs all \
                 256 single bytes",
                model.display()
            );
        }
        let added = special::read_added_tokens(&config)?;
        let names = special::special_table(ranks.len() as u32, &added, &config)?;
        Self::from_parts(ranks, names, bpe::KIMI_PAT_STR)
    }

    fn from_parts(ranks: Vec<Vec<u8>>, names: Vec<String>, pattern: &str) -> Result<Self> {
        let n_base = ranks.len() as u32;
        let bpe = bpe::RankBpe::new(&ranks, &names, pattern)?;
        let special_ids = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), n_base + i as u32))
            .collect();
        let mut tokens = ranks;
        tokens.extend(names.into_iter().map(String::into_bytes));
        Ok(Self {
            bpe,
            tokens,
            n_base,
            special_ids,
        })
    }

    /// Encodes ordinary text; special-token strings in it stay ordinary text.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Encodes text in which special-token strings (`<|open|>`, `[BOS]`, ...) become their ids.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special(text)
    }

    /// Decodes ids to text; special tokens appear as their names only when `show_special`.
    /// Invalid UTF-8 becomes U+FFFD only after all bytes are joined.
    pub fn decode(&self, ids: &[u32], show_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, show_special)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Decodes ids to raw bytes (no UTF-8 repair), with the same special-token rule.
    pub fn decode_bytes(&self, ids: &[u32], show_special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.piece(id, show_special)?);
        }
        Ok(out)
    }

    /// The bytes that id stands for in decoded text (empty for a hidden special token).
    pub(crate) fn piece(&self, id: u32, show_special: bool) -> Result<&[u8]> {
        let Some(bytes) = self.tokens.get(id as usize) else {
            bail!(
                "token id {id} is out of range: the vocabulary has {} ids (0..={})",
                self.vocab_size(),
                self.vocab_size().saturating_sub(1)
            );
        };
        if !show_special && self.is_special(id) {
            return Ok(&[]);
        }
        Ok(bytes)
    }

    /// The raw bytes of a BPE token, or the name of a special token.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(Vec::as_slice)
    }

    /// The id of a special token by name, e.g. `special_id("<|end_of_msg|>")`.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    /// Whether id is an added token (every id from the end of the BPE ranks on).
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base && (id as usize) < self.tokens.len()
    }

    /// Number of BPE ranks, i.e. the first special id.
    pub fn num_base_tokens(&self) -> u32 {
        self.n_base
    }

    /// Total number of ids: BPE ranks plus the special range.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("num_base_tokens", &self.n_base)
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}
