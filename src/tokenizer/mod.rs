//! Text in, text out: Kimi's tiktoken-style tokenizer, streaming decode, the XTML
//! chat format, and a synthetic tokenizer for test models.

pub(crate) mod bpe;
pub(crate) mod chat;
pub(crate) mod chat_splitter;
pub mod hf_json;
pub mod special;
pub(crate) mod stream_decode;
pub mod synthetic;

use crate::platform::input_file::is_present;
use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Result};

pub use chat::{
    chat_prompt, render_chat, render_chat_with, ChatOptions, Message, Piece, Prompt, Role,
    ThinkingEffort,
};
pub use chat_splitter::{chat_stop_ids, Channel, ChatEvent, ChatSplitter, MAX_TAG_BYTES};
pub use stream_decode::StreamDecoder;

/// A rendered prompt's ids and where its marks fall among them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MarkedIds {
    /// The prompt's ids.
    pub ids: Vec<u32>,
    /// Ids before the divergence mark ([`Prompt::mark_divergence`]), if one was set.
    pub divergence: Option<usize>,
    /// Ids before each message boundary ([`Prompt::mark_boundary`]), ascending.
    pub boundaries: Vec<usize>,
}

/// A snapshot's tokenizer: rank BPE from `tiktoken.model` plus the added tokens of
/// `tokenizer_config.json` (ids `0..n_base` are BPE ranks, the rest special), or a
/// byte-level BPE `tokenizer.json` whose added tokens are the specials.
pub struct Tokenizer {
    encoder: Encoder,
    /// Bytes of every id: BPE token bytes, or the name of a special token.
    tokens: Vec<Vec<u8>>,
    /// Which ids are special (added) tokens.
    special: Vec<bool>,
    n_base: u32,
    special_ids: HashMap<String, u32>,
}

/// Where encoding runs; decoding always goes through `Tokenizer::tokens`.
enum Encoder {
    Tiktoken(Box<bpe::RankBpe>),
    HfJson(Box<hf_json::HfTokenizer>),
}

impl Tokenizer {
    /// Loads a snapshot directory's tokenizer: `tiktoken.model` with
    /// `tokenizer_config.json` when present, else a byte-level BPE `tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let model = dir.join("tiktoken.model");
        let config = dir.join("tokenizer_config.json");
        // Whatever is under a tokenizer file's name is opened and judged (a FIFO or device
        // there is named as such), so only an empty name counts as missing.
        if !is_present(&model) {
            let json = dir.join("tokenizer.json");
            if is_present(&json) {
                return Self::from_hf_json(&json);
            }
            bail!(
                "{} has no tiktoken.model and no tokenizer.json; point at a model snapshot \
                 directory that ships one of them",
                dir.display()
            );
        }
        if !is_present(&config) {
            bail!(
                "{} has no tokenizer_config.json; it names the special tokens and must sit \
                 beside tiktoken.model",
                dir.display()
            );
        }
        let ranks = bpe::read_tiktoken_model(&model)?;
        let added = special::read_added_tokens(&config)?;
        Self::from_tiktoken_parts(ranks, &added, &model, &config)
    }

    /// Builds a tiktoken tokenizer from the text of `tiktoken.model` and of
    /// `tokenizer_config.json`, checked as [`Self::from_dir`] checks the files; the paths
    /// only name the files in errors.
    pub fn from_tiktoken_text(
        model_text: &str,
        config_text: &str,
        model: &Path,
        config: &Path,
    ) -> Result<Self> {
        let ranks = bpe::parse_tiktoken_model(model_text, model)?;
        let added = special::parse_added_tokens(config_text, config)?;
        Self::from_tiktoken_parts(ranks, &added, model, config)
    }

    fn from_tiktoken_parts(
        ranks: Vec<Vec<u8>>,
        added: &std::collections::BTreeMap<u32, special::AddedToken>,
        model: &Path,
        config: &Path,
    ) -> Result<Self> {
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
        let names = special::special_table(ranks.len() as u32, added, config)?;
        let n_base = ranks.len();
        // A regex build error names neither file nor token: say which token is the longest.
        let longest = names
            .iter()
            .enumerate()
            .max_by_key(|(_, n)| n.len())
            .map(|(i, n)| (n_base + i, n.len()));
        Self::from_parts(ranks, names, bpe::KIMI_PAT_STR).map_err(|e| match longest {
            Some((id, len)) => e.context(format!(
                "{}: building the special-token matcher failed; its longest token is id {id}, \
                 {len} bytes",
                config.display()
            )),
            None => e.context(format!("{}: building the BPE failed", model.display())),
        })
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
        let special = (0..tokens.len()).map(|i| i >= n_base as usize).collect();
        Ok(Self {
            encoder: Encoder::Tiktoken(Box::new(bpe)),
            tokens,
            special,
            n_base,
            special_ids,
        })
    }

    /// Loads a byte-level BPE `tokenizer.json`; its added tokens are the special tokens.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        Self::from_hf_parts(hf_json::from_file(path)?)
    }

    /// [`Self::from_hf_json`] over the file's bytes; `path` only names it in errors.
    pub fn from_hf_json_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        Self::from_hf_parts(hf_json::from_bytes(bytes, path)?)
    }

    fn from_hf_parts(parts: hf_json::HfParts) -> Result<Self> {
        Ok(Self {
            encoder: Encoder::HfJson(Box::new(parts.encoder)),
            tokens: parts.tokens,
            special: parts.special,
            n_base: parts.n_base,
            special_ids: parts.special_ids,
        })
    }

    /// Encodes ordinary text; special-token strings in it stay ordinary text.
    ///
    /// # Panics
    /// With a `tokenizer.json` tokenizer, if the `tokenizers` pipeline itself fails
    /// (e.g. a pre-tokenizer regex exceeds its backtrack limit); use [`Self::try_encode`]
    /// to get that as an error. tiktoken encoding cannot fail.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        match self.try_encode(text) {
            Ok(ids) => ids,
            Err(e) => panic!("{e:#}"),
        }
    }

    /// Encodes text in which special-token strings (`<|open|>`, `[BOS]`, ...) become their ids.
    ///
    /// # Panics
    /// As [`Self::encode`]; [`Self::try_encode_with_special`] returns the error instead.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        match self.try_encode_with_special(text) {
            Ok(ids) => ids,
            Err(e) => panic!("{e:#}"),
        }
    }

    /// [`Self::encode`] that reports a failing `tokenizer.json` pipeline as an error.
    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.encoder {
            Encoder::Tiktoken(bpe) => Ok(bpe.encode_ordinary(text)),
            Encoder::HfJson(hf) => hf.encode_ordinary(text),
        }
    }

    /// [`Self::encode_with_special`] that reports a failing `tokenizer.json` pipeline as an error.
    pub fn try_encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        match &self.encoder {
            Encoder::Tiktoken(bpe) => Ok(bpe.encode_with_special(text)),
            Encoder::HfJson(hf) => hf.encode_with_special(text),
        }
    }

    /// Encodes a rendered prompt: control pieces become their special ids, text pieces are
    /// encoded as ordinary text (a special-token string in them stays text).
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        Ok(self.encode_prompt_marked(prompt)?.ids)
    }

    fn encode_prompt_piece(&self, piece: &Piece) -> Result<Vec<u32>> {
        match piece {
            Piece::Control(name) => match self.special_id(name) {
                Some(id) => Ok(vec![id]),
                None => bail!(
                    "the tokenizer has no {name} token; the XTML chat format needs \
                     <|open|>, <|close|>, <|sep|> and <|end_of_msg|> in tokenizer_config.json"
                ),
            },
            Piece::Text(t) => self.try_encode(t),
        }
    }

    /// [`Self::encode_prompt`], with the ids before each of the prompt's marks
    /// ([`Prompt::mark_divergence`], [`Prompt::mark_boundary`]). Pieces encode one by one,
    /// so the ids before a mark are those of the pieces before it.
    pub fn encode_prompt_marked(&self, prompt: &Prompt) -> Result<MarkedIds> {
        let pieces = prompt.pieces();
        // ids_before[i]: the ids of the pieces before piece i; the last is the whole prompt.
        let mut ids = Vec::new();
        let mut ids_before = Vec::with_capacity(pieces.len() + 1);
        for piece in pieces {
            ids_before.push(ids.len());
            ids.extend(self.encode_prompt_piece(piece)?);
        }
        ids_before.push(ids.len());
        let at = |piece: usize| ids_before[piece.min(pieces.len())];
        Ok(MarkedIds {
            divergence: prompt.divergence().map(at),
            boundaries: prompt.boundaries().iter().map(|&b| at(b)).collect(),
            ids,
        })
    }

    /// Renders a conversation ([`chat_prompt`]) and encodes it ([`Self::encode_prompt`]).
    pub fn encode_chat(&self, messages: &[Message], opts: &ChatOptions) -> Result<Vec<u32>> {
        self.encode_prompt(&chat_prompt(messages, opts))
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

    /// Whether id is an added token (with tiktoken: every id from the end of the BPE ranks on).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Number of BPE tokens of the model's own vocabulary; with tiktoken also the first
    /// special id (a `tokenizer.json` may put added tokens anywhere).
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
