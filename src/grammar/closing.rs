//! The budget-aware close of a constrained reply. A grammar alone lets a reply run out of
//! tokens inside a string; so when the tokens left come near what closing the structure
//! takes, the picker narrows the grammar's allowed tokens to the one that closes fastest:
//! a frame marker that ends the think channel or the message, else the JSON character
//! that ends the innermost open string, value or container ([`JsonCursor::preferred`]).
//! Where the grammar allows none of those (a required key, an enum value, a `minLength`)
//! the model chooses among what the grammar allows, as before.

use crate::tokenizer::Tokenizer;

/// Tokens of margin over the shortest reply's length, for what the reply opened since its
/// start beyond that (nested containers, a longer tool's required keys).
const MARGIN: usize = 8;

/// The text of every id, as the cursor follows it, and the ids the close prefers.
pub(crate) struct TokenTexts {
    /// The bytes of each text id; `None` for a special token.
    texts: Vec<Option<Box<[u8]>>>,
    /// The id whose text is exactly one ASCII byte, by that byte.
    single: [Option<u32>; 128],
    /// Ids that end the think channel, the message or the text (`<|close|>`,
    /// `<|end_of_msg|>`, end of sequence).
    frame_closers: Vec<u32>,
}

impl TokenTexts {
    /// The table of `tok`'s vocabulary, whose end-of-sequence ids are `eos_ids`.
    pub(crate) fn new(tok: &Tokenizer, eos_ids: &[u32]) -> Self {
        let n = tok.vocab_size();
        let mut single = [None; 128];
        let texts = (0..n as u32)
            .map(|id| {
                if tok.is_special(id) {
                    return None;
                }
                let b = tok.token_bytes(id).unwrap_or_default();
                if let [c] = b {
                    if let Some(slot) = single.get_mut(*c as usize) {
                        slot.get_or_insert(id);
                    }
                }
                Some(b.into())
            })
            .collect();
        let mut frame_closers: Vec<u32> = ["<|close|>", "<|end_of_msg|>"]
            .iter()
            .filter_map(|m| tok.special_id(m))
            .collect();
        frame_closers.extend_from_slice(eos_ids);
        Self {
            texts,
            single,
            frame_closers,
        }
    }

    /// The bytes of `id`, or `None` for a special token (or an id past the vocabulary).
    pub(crate) fn text(&self, id: u32) -> Option<&[u8]> {
        self.texts.get(id as usize)?.as_deref()
    }

    /// The id that closes fastest among those `allowed` lets through, for a reply at
    /// `cursor`.
    pub(crate) fn closing_id(
        &self,
        cursor: &JsonCursor,
        allowed: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        if let Some(&id) = self.frame_closers.iter().find(|&&id| allowed(id)) {
            return Some(id);
        }
        cursor
            .preferred()
            .iter()
            .filter_map(|&c| self.single.get(c as usize).copied().flatten())
            .find(|&id| allowed(id))
    }
}

/// What the JSON expects next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// A value (the start, after `:` or after `,` in an array).
    Value,
    /// A value or `]` (after `[`).
    ValueOrEnd,
    /// A key or `}` (after `{`).
    KeyOrEnd,
    /// A key (after `,` in an object).
    Key,
    /// `:` after a key.
    Colon,
    /// Inside a string; `key` when it is an object's key, `escaped` after a backslash.
    Str { key: bool, escaped: bool },
    /// Inside a number or a literal (`true`, `false`, `null`).
    Scalar,
    /// After a complete value.
    After,
    /// The text is not JSON the cursor follows (think text, a frame's tag names).
    Unknown,
}

/// Where a reply's JSON stands, followed byte by byte; any special token starts it afresh
/// (the JSON of a reply always follows a marker, or starts the reply).
#[derive(Clone, Debug)]
pub(crate) struct JsonCursor {
    stack: Vec<u8>,
    expect: Expect,
}

impl Default for JsonCursor {
    fn default() -> Self {
        Self {
            stack: Vec::new(),
            expect: Expect::Value,
        }
    }
}

impl JsonCursor {
    /// Starts over: a value is expected.
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// Follows the bytes of one token.
    pub(crate) fn push_bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.push(b);
        }
    }

    fn close(&mut self, b: u8) {
        let open = if b == b'}' { b'{' } else { b'[' };
        self.expect = if self.stack.pop() == Some(open) {
            Expect::After
        } else {
            Expect::Unknown
        };
    }

    fn after_comma(&self) -> Expect {
        match self.stack.last() {
            Some(b'{') => Expect::Key,
            Some(_) => Expect::Value,
            None => Expect::Unknown,
        }
    }

    fn start_value(&mut self, b: u8) {
        self.expect = match b {
            b'"' => Expect::Str {
                key: false,
                escaped: false,
            },
            b'{' => {
                self.stack.push(b);
                Expect::KeyOrEnd
            }
            b'[' => {
                self.stack.push(b);
                Expect::ValueOrEnd
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => Expect::Scalar,
            _ => Expect::Unknown,
        };
    }

    fn push(&mut self, b: u8) {
        if let Expect::Str { key, escaped } = self.expect {
            self.expect = match (escaped, b) {
                (true, _) => Expect::Str {
                    key,
                    escaped: false,
                },
                (false, b'\\') => Expect::Str { key, escaped: true },
                (false, b'"') if key => Expect::Colon,
                (false, b'"') => Expect::After,
                _ => self.expect,
            };
            return;
        }
        if b.is_ascii_whitespace() {
            if self.expect == Expect::Scalar {
                self.expect = Expect::After;
            }
            return;
        }
        match self.expect {
            Expect::Value => self.start_value(b),
            Expect::ValueOrEnd if b == b']' => self.close(b),
            Expect::ValueOrEnd => self.start_value(b),
            Expect::KeyOrEnd | Expect::Key if b == b'"' => {
                self.expect = Expect::Str {
                    key: true,
                    escaped: false,
                }
            }
            Expect::KeyOrEnd if b == b'}' => self.close(b),
            Expect::Colon if b == b':' => self.expect = Expect::Value,
            Expect::Scalar | Expect::After => match b {
                b',' => self.expect = self.after_comma(),
                b'}' | b']' => self.close(b),
                _ if self.expect == Expect::Scalar => {}
                _ => self.expect = Expect::Unknown,
            },
            _ => self.expect = Expect::Unknown,
        }
    }

    /// The characters that close fastest from here, best first.
    pub(crate) fn preferred(&self) -> &'static [u8] {
        let in_object = self.stack.last() == Some(&b'{');
        match self.expect {
            Expect::Value => b"0\"[{n-",
            Expect::ValueOrEnd => b"]0\"[{n-",
            Expect::KeyOrEnd => b"}\"",
            Expect::Key => b"\"",
            Expect::Colon => b":",
            Expect::Str { escaped: true, .. } => b"n",
            Expect::Str { .. } => b"\"",
            Expect::Scalar | Expect::After if self.stack.is_empty() => b"",
            Expect::Scalar | Expect::After if in_object => b"},",
            Expect::Scalar | Expect::After => b"],",
            Expect::Unknown => b"",
        }
    }

    /// Tokens to keep for closing from here on top of the shortest reply's length: about
    /// two per open level and a margin.
    pub(crate) fn reserve(&self) -> usize {
        MARGIN + 2 * self.stack.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> JsonCursor {
        let mut c = JsonCursor::default();
        c.push_bytes(text.as_bytes());
        c
    }

    #[test]
    fn the_cursor_prefers_what_closes_the_innermost_open_part() {
        assert_eq!(at("").preferred(), b"0\"[{n-");
        assert_eq!(at("{").preferred(), b"}\"");
        assert_eq!(at("{\"ke").preferred(), b"\"");
        assert_eq!(at("{\"k\\").preferred(), b"n");
        assert_eq!(at("{\"k\"").preferred(), b":");
        assert_eq!(at("{\"k\":").preferred(), b"0\"[{n-");
        assert_eq!(at("{\"k\":[1,").preferred(), b"0\"[{n-");
        assert_eq!(at("{\"k\":[12").preferred(), b"],");
        assert_eq!(at("{\"k\":[\"a]}\"").preferred(), b"],");
        assert_eq!(at("{\"k\":[]").preferred(), b"},");
        assert_eq!(at("{\"k\":{}},").preferred(), b"");
        assert_eq!(at("{\"k\":true ,").preferred(), b"\"");
        assert_eq!(at("{}").preferred(), b"");
        assert_eq!(at("call tool=").preferred(), b"");
        assert_eq!(at("{\"a\":{\"b\":[").reserve(), at("").reserve() + 6);
    }
}
