//! Token-by-token decoding that never prints half a UTF-8 character.

use anyhow::Result;

use super::Tokenizer;

/// Turns a stream of ids into text as soon as it is complete. Bytes of an unfinished
/// UTF-8 character are held back; invalid bytes become U+FFFD exactly where
/// `String::from_utf8_lossy` of the whole stream would put them, so the concatenated
/// output equals `Tokenizer::decode` of all ids.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    show_special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder over tok; special tokens print as their names only when `show_special`.
    pub fn new(tok: &'a Tokenizer, show_special: bool) -> Self {
        Self {
            tok,
            show_special,
            pending: Vec::new(),
        }
    }

    /// Adds one id; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let piece = self.tok.piece(id, self.show_special)?;
        Ok(self.push_bytes(piece))
    }

    /// Adds raw bytes; returns the text that became complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&self.pending[start..valid]) {
                        out.push_str(s);
                    }
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                        None => {
                            // An incomplete character at the end: wait for more bytes.
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whether bytes of an unfinished character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: held-back bytes that never completed become U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
