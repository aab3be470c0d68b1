//! Prints generated tokens as the user asked for them: ids, plain text, or the chat's
//! labelled think/response streams with the structural tokens hidden.

use anyhow::Result;
use k3::tokenizer::{Channel, ChatEvent, ChatSplitter, StreamDecoder};
use std::io::Write;

/// Where generated tokens go.
pub(crate) enum TokenOutput<'t> {
    /// Comma-separated ids.
    Ids { first: bool },
    /// Decoded text, streamed (unfinished UTF-8 held back).
    Text(StreamDecoder<'t>),
    /// `[think] ` and `[response] ` streams.
    Chat {
        splitter: ChatSplitter<'t>,
        shown: Option<Channel>,
    },
}

impl TokenOutput<'_> {
    /// Prints one token; returns true when the chat format says the message ended.
    pub(crate) fn push(&mut self, id: u32) -> Result<bool> {
        let mut out = std::io::stdout().lock();
        let stop = match self {
            TokenOutput::Ids { first } => {
                write!(out, "{}{id}", if *first { "" } else { "," })?;
                *first = false;
                false
            }
            TokenOutput::Text(d) => {
                write!(out, "{}", d.push(id)?)?;
                false
            }
            TokenOutput::Chat { splitter, shown } => {
                let mut stop = false;
                for ev in splitter.push(id)? {
                    match ev {
                        ChatEvent::Text { channel, text } => {
                            if *shown != Some(channel) {
                                let label = match channel {
                                    Channel::Think => "[think] ",
                                    Channel::Response => "[response] ",
                                    Channel::Tools => "[tools] ",
                                    Channel::Other => "",
                                };
                                write!(out, "{}{label}", if shown.is_some() { "\n" } else { "" })?;
                                *shown = Some(channel);
                            }
                            write!(out, "{text}")?;
                        }
                        ChatEvent::Stop => stop = true,
                    }
                }
                stop
            }
        };
        out.flush()?;
        Ok(stop)
    }

    /// Flushes held-back bytes and ends the line.
    pub(crate) fn finish(&mut self) -> Result<()> {
        let mut out = std::io::stdout().lock();
        match self {
            TokenOutput::Ids { .. } => {}
            TokenOutput::Text(d) => write!(out, "{}", d.finish())?,
            TokenOutput::Chat { splitter, .. } => {
                for ev in splitter.finish() {
                    if let ChatEvent::Text { text, .. } = ev {
                        write!(out, "{text}")?;
                    }
                }
            }
        }
        writeln!(out)?;
        Ok(())
    }
}
