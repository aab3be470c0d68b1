//! Splitting K3's generated ids into the think, response and tools channels of its XTML
//! chat format, hiding the structural tokens the channels consume.

use anyhow::{Context, Result};

use super::chat::{CLOSE, END_OF_MSG, OPEN, SEP};
use super::{StreamDecoder, Tokenizer};

/// The ids that end a chat reply: the checkpoint's end-of-sequence ids (`eos_ids`) and
/// `<|end_of_msg|>` when the tokenizer has it. The decode loop's stop ids and
/// [`ChatSplitter`]'s stop both follow this rule.
pub fn chat_stop_ids(tok: &Tokenizer, eos_ids: &[u32]) -> Vec<u32> {
    let mut ids = eos_ids.to_vec();
    ids.extend(tok.special_id(END_OF_MSG));
    ids
}

/// Which stream a piece of generated text belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Inside `<|open|>think<|sep|>`.
    Think,
    /// Inside `<|open|>response<|sep|>`.
    Response,
    /// Inside `<|open|>tools<|sep|>` (tool calls, shown raw).
    Tools,
    /// Outside any known section, or inside an unknown tag.
    Other,
}

/// What the splitter reports for one generated id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatEvent {
    /// Newly complete text of one channel.
    Text {
        /// The channel the text belongs to.
        channel: Channel,
        /// The text itself.
        text: String,
    },
    /// The model ended its turn (`<|end_of_msg|>` or an eos id); stop generating.
    Stop,
}

/// Longest tag text (between `<|open|>`/`<|close|>` and `<|sep|>`) the splitter waits
/// for. K3's tags (`call tool="NAME" index="N"`, `argument key="K" type="T"`) are far
/// shorter; a longer run cannot be a tag and is shown as text, so the stream never stays
/// silent behind a marker that no `<|sep|>` follows.
pub const MAX_TAG_BYTES: usize = 160;

/// A tag being read: the marker and the ids after it, kept to be shown as text if no
/// `<|sep|>` completes the tag.
struct PendingTag {
    marker: u32,
    ids: Vec<u32>,
    bytes: Vec<u8>,
}

/// Separates generated ids into channels and hides the structural tokens it consumes:
/// complete tags (`<|open|>NAME ...<|sep|>`, `<|close|>NAME<|sep|>`) and the stop token.
/// Every other id reaches the caller as text: a marker that no `<|sep|>` completes (a
/// special token inside, more than [`MAX_TAG_BYTES`], or the end of the stream) is shown
/// as written, and a special token outside a tag appears by its name.
pub struct ChatSplitter<'a> {
    open: u32,
    close: u32,
    sep: u32,
    stop_ids: Vec<u32>,
    /// Open tags, outermost first; the generation prompt leaves `message` and the
    /// first channel open.
    stack: Vec<String>,
    tag: Option<PendingTag>,
    decoder: StreamDecoder<'a>,
    tok: &'a Tokenizer,
    stopped: bool,
}

impl<'a> ChatSplitter<'a> {
    /// A splitter for a reply that follows a generation prompt rendered with `thinking`;
    /// `<|end_of_msg|>` and every id in `eos_ids` stop it.
    pub fn new(tok: &'a Tokenizer, thinking: bool, eos_ids: &[u32]) -> Result<Self> {
        let need = |name: &str| {
            tok.special_id(name).with_context(|| {
                format!(
                    "the tokenizer has no {name} token; the XTML chat format needs \
                     <|open|>, <|close|>, <|sep|> and <|end_of_msg|> in tokenizer_config.json"
                )
            })
        };
        need(END_OF_MSG)?;
        let stop_ids = chat_stop_ids(tok, eos_ids);
        Ok(Self {
            open: need(OPEN)?,
            close: need(CLOSE)?,
            sep: need(SEP)?,
            stop_ids,
            stack: vec![
                "message".to_string(),
                if thinking { "think" } else { "response" }.to_string(),
            ],
            tag: None,
            decoder: StreamDecoder::new(tok, false),
            tok,
            stopped: false,
        })
    }

    /// A splitter that never stops: end-of-turn and eos ids are shown as text, for a
    /// generation that runs past them (`ignore_eos`).
    pub fn without_stops(mut self) -> Self {
        self.stop_ids.clear();
        self
    }

    /// The channel that text generated now belongs to.
    pub fn channel(&self) -> Channel {
        self.stack
            .iter()
            .find_map(|t| match t.as_str() {
                "message" => None,
                "think" => Some(Channel::Think),
                "response" => Some(Channel::Response),
                "tools" => Some(Channel::Tools),
                _ => Some(Channel::Other),
            })
            .unwrap_or(Channel::Other)
    }

    /// Whether a stop token has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds one generated id; returns what it completed. After a stop, ids are ignored.
    pub fn push(&mut self, id: u32) -> Result<Vec<ChatEvent>> {
        let mut events = Vec::new();
        if self.stopped {
            return Ok(events);
        }
        if self.stop_ids.contains(&id) {
            self.abandon_tag(&mut events)?;
            self.flush(&mut events);
            events.push(ChatEvent::Stop);
            self.stopped = true;
        } else if id == self.open || id == self.close {
            self.abandon_tag(&mut events)?;
            self.flush(&mut events);
            self.tag = Some(PendingTag {
                marker: id,
                ids: Vec::new(),
                bytes: Vec::new(),
            });
        } else if id == self.sep && self.tag.is_some() {
            if let Some(tag) = self.tag.take() {
                self.enter(&tag);
            }
        } else if self.tok.is_special(id) {
            // Not part of any tag: shown by name, after what came before it.
            self.abandon_tag(&mut events)?;
            self.flush(&mut events);
            self.literal(id, &mut events)?;
        } else if let Some(tag) = self.tag.as_mut() {
            tag.ids.push(id);
            tag.bytes.extend_from_slice(self.tok.piece(id, true)?);
            if tag.bytes.len() > MAX_TAG_BYTES {
                self.abandon_tag(&mut events)?;
            }
        } else {
            let text = self.decoder.push(id)?;
            self.text(text, &mut events);
        }
        Ok(events)
    }

    /// Ends the stream (at a length limit, a stop string, a cancel): an unfinished tag and
    /// held-back bytes are flushed as text.
    pub fn finish(&mut self) -> Vec<ChatEvent> {
        let mut events = Vec::new();
        // Ids of a pending tag were decoded once already, so this cannot fail.
        let _ = self.abandon_tag(&mut events);
        self.flush(&mut events);
        events
    }

    /// Ends a stream whose markup a grammar wrote (a constrained reply): an unfinished tag
    /// there is the grammar's frame cut by the budget, not text, and is dropped; held-back
    /// bytes are flushed as text.
    pub fn finish_framed(&mut self) -> Vec<ChatEvent> {
        self.tag = None;
        self.finish()
    }

    /// A completed tag opens or closes a section.
    fn enter(&mut self, tag: &PendingTag) {
        let text = String::from_utf8_lossy(&tag.bytes);
        let name = text.split_whitespace().next().unwrap_or("").to_string();
        if tag.marker == self.close {
            if let Some(pos) = self.stack.iter().rposition(|t| *t == name) {
                self.stack.truncate(pos);
            }
        } else {
            self.stack.push(name);
        }
    }

    /// A pending tag that cannot complete: its marker and ids become text.
    fn abandon_tag(&mut self, events: &mut Vec<ChatEvent>) -> Result<()> {
        let Some(tag) = self.tag.take() else {
            return Ok(());
        };
        self.literal(tag.marker, events)?;
        for id in tag.ids {
            let text = self.decoder.push(id)?;
            self.text(text, events);
        }
        Ok(())
    }

    /// A special token's name as text.
    fn literal(&mut self, id: u32, events: &mut Vec<ChatEvent>) -> Result<()> {
        let name = String::from_utf8_lossy(self.tok.piece(id, true)?).into_owned();
        self.text(name, events);
        Ok(())
    }

    fn text(&self, text: String, events: &mut Vec<ChatEvent>) {
        if !text.is_empty() {
            events.push(ChatEvent::Text {
                channel: self.channel(),
                text,
            });
        }
    }

    fn flush(&mut self, events: &mut Vec<ChatEvent>) {
        let text = self.decoder.finish();
        self.text(text, events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::synthetic::write_synthetic_tokenizer;

    #[test]
    fn chat_stop_ids_are_the_eos_ids_and_end_of_msg() {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic_tokenizer(dir.path(), 4096, 3840, 3842, 4095).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let end = tok.special_id(END_OF_MSG).unwrap();
        assert_eq!(chat_stop_ids(&tok, &[7, 9]), vec![7, 9, end]);
        // The splitter stops on exactly these ids.
        for id in [7, 9, end] {
            let mut s = ChatSplitter::new(&tok, false, &[7, 9]).unwrap();
            assert_eq!(s.push(id).unwrap().last(), Some(&ChatEvent::Stop), "{id}");
        }
        let mut s = ChatSplitter::new(&tok, false, &[7, 9]).unwrap();
        s.push(8).unwrap();
        assert!(!s.stopped());
    }
}
