//! The K3 vocabulary as llguidance sees it: a token trie over every id's bytes, special
//! tokens written the way llguidance names them (`0xFF` then the name, so a grammar says
//! `<|open|>`). Masks need only the trie; the text llguidance tokenizes itself (forced
//! tokens, which k3 does not use) is split greedily, so the env says it is not canonical.

use std::sync::Arc;

use anyhow::{bail, Result};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

/// llguidance's view of a [`Tokenizer`], with the ids that end a constrained reply.
pub(crate) struct K3TokEnv {
    trie: TokTrie,
}

impl K3TokEnv {
    /// Builds the trie of `tok`'s vocabulary; `eos_ids` (at least one) are the ids a finished
    /// grammar allows next.
    pub(crate) fn new(tok: &Tokenizer, eos_ids: &[u32]) -> Result<Self> {
        let Some(&first) = eos_ids.first() else {
            bail!("a grammar needs an end-of-sequence id; the model's config names none (eos_token_id)");
        };
        let n = tok.vocab_size();
        if let Some(&bad) = eos_ids.iter().find(|&&id| id as usize >= n) {
            bail!("eos_token_id {bad} is outside the tokenizer's {n} ids");
        }
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                if tok.is_special(id) {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, first);
        info.tok_bos = tok.special_id("[BOS]");
        info.tok_pad = tok.special_id("[PAD]");
        info.tok_unk = tok.special_id("[UNK]");
        info.tok_end_of_turn = tok.special_id("<|end_of_msg|>");
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_ids);
        Ok(Self { trie })
    }

    /// As the shared handle llguidance's factory takes.
    pub(crate) fn into_env(self) -> TokEnv {
        Arc::new(self)
    }
}

impl TokenizerEnv for K3TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
