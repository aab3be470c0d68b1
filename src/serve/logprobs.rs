//! Token log-probabilities as the OpenAI API reports them — chat's `logprobs.content`
//! entries and legacy completions' parallel arrays — from what the sampler recorded for
//! each generated token ([`crate::sampling::TokenLogprobs`]).

use crate::sampling::TokenLogprobs;
use crate::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// OpenAI's stand-in for a log-probability of minus infinity (JSON has no infinities).
const FLOOR: f32 = -9999.0;

/// One token with its log-probability.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (its bytes decoded, invalid UTF-8 replaced; a special token's name).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its natural-log probability.
    pub logprob: f32,
}

/// One generated token's entry: the token, the most likely alternatives, and where its
/// text starts in the choice's text.
#[derive(Clone, Debug, PartialEq)]
pub struct LogprobEntry {
    /// The generated token.
    pub chosen: TokenLogprob,
    /// The most likely tokens at that step, most likely first.
    pub top: Vec<TokenLogprob>,
    /// Characters of generated text before this token (special tokens add none).
    pub text_offset: usize,
}

/// Turns the sampler's records into entries, counting the text offset as it goes.
pub(crate) struct LogprobWriter<'t> {
    tok: &'t Tokenizer,
    offset: usize,
}

impl<'t> LogprobWriter<'t> {
    /// A writer for one choice's tokens.
    pub(crate) fn new(tok: &'t Tokenizer) -> Self {
        Self { tok, offset: 0 }
    }

    fn token(&self, id: u32, logprob: f32) -> TokenLogprob {
        let bytes = self.tok.token_bytes(id).unwrap_or_default().to_vec();
        TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: if logprob.is_finite() { logprob } else { FLOOR },
        }
    }

    /// The entry of the next generated token.
    pub(crate) fn entry(&mut self, lp: &TokenLogprobs) -> LogprobEntry {
        let chosen = self.token(lp.id, lp.logprob);
        let text_offset = self.offset;
        if !self.tok.is_special(lp.id) {
            self.offset += chosen.token.chars().count();
        }
        LogprobEntry {
            chosen,
            top: lp.top.iter().map(|&(id, l)| self.token(id, l)).collect(),
            text_offset,
        }
    }
}

fn token_json(t: &TokenLogprob) -> Value {
    json!({"token": t.token, "logprob": t.logprob, "bytes": t.bytes})
}

/// A chat choice's (or chunk's) `logprobs`: `{"content": [...], "refusal": null}`.
pub(crate) fn chat_json(entries: &[LogprobEntry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = token_json(&e.chosen);
            v["top_logprobs"] = Value::Array(e.top.iter().map(token_json).collect());
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// A text completion's (or chunk's) `logprobs`: `tokens`, `token_logprobs`,
/// `top_logprobs` (one object of token → log-probability per token) and `text_offset`.
pub(crate) fn completion_json(entries: &[LogprobEntry]) -> Value {
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut m = Map::new();
            for t in &e.top {
                // Two ids may decode to the same text: the likelier one (listed first) stays.
                m.entry(t.token.clone()).or_insert(json!(t.logprob));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.chosen.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.chosen.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": entries.iter().map(|e| e.text_offset).collect::<Vec<_>>(),
    })
}
