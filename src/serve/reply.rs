//! The model's reply read back: the think channel, the response, and tool calls in K3's
//! format (`<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>` with `argument`
//! or `json` sections). A malformed or truncated tools section is kept as its markup,
//! which the server reports as plain content.

use crate::tokenizer::{Piece, Tokenizer};
use serde_json::{Map, Value};

const MARKERS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];

/// A tool call the model made, in OpenAI's shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCallOut {
    /// The function's name.
    pub name: String,
    /// The arguments as a JSON object string.
    pub arguments: String,
}

/// A reply split into what the API reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Think-channel text.
    pub reasoning: String,
    /// Response text (and any text outside known sections).
    pub content: String,
    /// Well-formed tool calls.
    pub tool_calls: Vec<ToolCallOut>,
    /// The markup of tools sections that were malformed or cut short, as generated: plain
    /// content for the client.
    pub unparsed_tools: String,
}

/// Generated ids as pieces: the four XTML markers as control pieces, other specials
/// (end-of-sequence and the like) dropped, everything else decoded as text.
pub fn pieces_from_ids(tok: &Tokenizer, ids: &[u32]) -> Vec<Piece> {
    let control: Vec<(u32, &'static str)> = MARKERS
        .iter()
        .filter_map(|m| tok.special_id(m).map(|id| (id, *m)))
        .collect();
    let mut out = Vec::new();
    let mut bytes: Vec<u8> = Vec::new();
    let flush = |bytes: &mut Vec<u8>, out: &mut Vec<Piece>| {
        if !bytes.is_empty() {
            out.push(Piece::Text(String::from_utf8_lossy(bytes).into_owned()));
            bytes.clear();
        }
    };
    for &id in ids {
        if let Some(&(_, name)) = control.iter().find(|(c, _)| *c == id) {
            flush(&mut bytes, &mut out);
            out.push(Piece::Control(name));
        } else if !tok.is_special(id) {
            bytes.extend_from_slice(tok.token_bytes(id).unwrap_or_default());
        }
    }
    flush(&mut bytes, &mut out);
    out
}

/// Hand-written markup as pieces: the four marker strings become control pieces (for tests
/// and fuzzing of [`parse_reply`]).
pub fn pieces_from_markup(s: &str) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut rest = s;
    while !rest.is_empty() {
        let next = MARKERS
            .iter()
            .filter_map(|m| rest.find(m).map(|at| (at, *m)))
            .min_by_key(|(at, _)| *at);
        match next {
            Some((at, m)) => {
                if at > 0 {
                    out.push(Piece::Text(rest[..at].to_string()));
                }
                out.push(Piece::Control(m));
                rest = &rest[at + m.len()..];
            }
            None => {
                out.push(Piece::Text(rest.to_string()));
                break;
            }
        }
    }
    out
}

/// A tag's name and attributes from the text between `<|open|>` and `<|sep|>`.
fn parse_tag(text: &str) -> Option<(String, Vec<(String, String)>)> {
    let text = text.trim();
    let (name, mut rest) = match text.find(char::is_whitespace) {
        Some(i) => (&text[..i], text[i..].trim_start()),
        None => (text, ""),
    };
    if name.is_empty() {
        return None;
    }
    let mut attrs = Vec::new();
    while !rest.is_empty() {
        let eq = rest.find("=\"")?;
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let close = after.find('"')?;
        let value = after[..close].replace("&quot;", "\"").replace("&amp;", "&");
        attrs.push((key, value));
        rest = after[close + 1..].trim_start();
    }
    Some((name.to_string(), attrs))
}

fn attr<'a>(attrs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// One tools section being read.
#[derive(Default)]
struct ToolsSection {
    /// The section's markup as generated, for when it turns out malformed.
    raw: String,
    calls: Vec<ToolCallOut>,
    call: Option<(String, Map<String, Value>, Option<String>)>,
    /// An open `argument` (key, type) or `json` (None) and its text.
    value: Option<(Option<(String, String)>, String)>,
    malformed: bool,
    closed: bool,
}

impl ToolsSection {
    fn open(&mut self, name: &str, attrs: &[(String, String)]) {
        match (name, &self.call, &self.value) {
            ("call", None, None) => match attr(attrs, "tool") {
                Some(t) if !t.is_empty() => self.call = Some((t.to_string(), Map::new(), None)),
                _ => self.malformed = true,
            },
            ("argument", Some(_), None) => match (attr(attrs, "key"), attr(attrs, "type")) {
                (Some(k), Some(t)) => {
                    self.value = Some((Some((k.to_string(), t.to_string())), String::new()))
                }
                _ => self.malformed = true,
            },
            ("json", Some(_), None) => self.value = Some((None, String::new())),
            _ => self.malformed = true,
        }
    }

    fn close(&mut self, name: &str) {
        match (name, self.value.take()) {
            ("argument", Some((Some((key, kind)), text))) => {
                let v = if kind == "string" {
                    Some(Value::String(text))
                } else {
                    serde_json::from_str::<Value>(&text)
                        .ok()
                        .filter(|v| type_matches(&kind, v))
                };
                match (v, self.call.as_mut()) {
                    (Some(v), Some((_, args, _))) => {
                        args.insert(key, v);
                    }
                    _ => self.malformed = true,
                }
            }
            ("json", Some((None, text))) => {
                match (serde_json::from_str::<Value>(&text), self.call.as_mut()) {
                    (Ok(Value::Object(o)), Some((_, _, json))) => {
                        *json = Some(Value::Object(o).to_string())
                    }
                    _ => self.malformed = true,
                }
            }
            ("call", None) => match self.call.take() {
                Some((name, args, json)) => self.calls.push(ToolCallOut {
                    name,
                    arguments: json.unwrap_or_else(|| Value::Object(args).to_string()),
                }),
                None => self.malformed = true,
            },
            ("tools", None) if self.call.is_none() => self.closed = true,
            _ => self.malformed = true,
        }
    }

    fn text(&mut self, t: &str) {
        match self.value.as_mut() {
            Some((_, v)) => v.push_str(t),
            // Whitespace between tags is allowed; other text there is not.
            None if t.trim().is_empty() => {}
            None => self.malformed = true,
        }
    }
}

fn type_matches(kind: &str, v: &Value) -> bool {
    matches!(
        (kind, v),
        ("number", Value::Number(_))
            | ("boolean", Value::Bool(_))
            | ("null", Value::Null)
            | ("object", Value::Object(_))
            | ("array", Value::Array(_))
    )
}

/// Splits a reply that follows a generation prompt rendered with `thinking`.
pub fn parse_reply(pieces: &[Piece], thinking: bool) -> Reply {
    let mut reply = Reply::default();
    let mut stack: Vec<String> = vec![
        "message".into(),
        if thinking { "think" } else { "response" }.into(),
    ];
    let mut tools: Option<ToolsSection> = None;
    let mut i = 0;
    while i < pieces.len() {
        // A tag: a marker, its text, `<|sep|>`.
        if let Piece::Control(c @ ("<|open|>" | "<|close|>")) = &pieces[i] {
            let text = match pieces.get(i + 1) {
                Some(Piece::Text(t)) => t.as_str(),
                _ => "",
            };
            let sep_at = if text.is_empty() { i + 1 } else { i + 2 };
            if pieces.get(sep_at) == Some(&Piece::Control("<|sep|>")) {
                let raw = format!("{c}{text}<|sep|>");
                let closing = *c == "<|close|>";
                i = sep_at + 1;
                if let Some(t) = tools.as_mut() {
                    t.raw.push_str(&raw);
                    let tag = parse_tag(text);
                    if t.malformed {
                        // Past the fault only the section's end matters.
                        t.closed = closing && tag.is_some_and(|(n, _)| n == "tools");
                    } else {
                        match tag {
                            Some((name, attrs)) if !closing => t.open(&name, &attrs),
                            Some((name, _)) => t.close(&name),
                            None => t.malformed = true,
                        }
                    }
                    if t.closed {
                        finish_tools(&mut reply, tools.take());
                    }
                    continue;
                }
                let name = parse_tag(text).map(|(n, _)| n).unwrap_or_default();
                if closing {
                    if let Some(pos) = stack.iter().rposition(|t| *t == name) {
                        stack.truncate(pos);
                    }
                } else if name == "tools" {
                    tools = Some(ToolsSection {
                        raw,
                        ..ToolsSection::default()
                    });
                } else {
                    stack.push(name);
                }
                continue;
            }
        }
        match &pieces[i] {
            Piece::Control("<|end_of_msg|>") => break,
            Piece::Control(c) => {
                // A stray marker: as text, wherever it is.
                match tools.as_mut() {
                    Some(t) => {
                        t.raw.push_str(c);
                        t.malformed = true;
                    }
                    None => reply.content.push_str(c),
                }
            }
            Piece::Text(t) => match tools.as_mut() {
                Some(sec) => {
                    sec.raw.push_str(t);
                    if !sec.malformed {
                        sec.text(t);
                    }
                }
                None => {
                    if stack.iter().any(|s| s == "think") {
                        reply.reasoning.push_str(t);
                    } else {
                        reply.content.push_str(t);
                    }
                }
            },
        }
        i += 1;
    }
    if let Some(mut t) = tools.take() {
        // Truncated: whatever calls completed are kept only if nothing is left open.
        t.malformed |= t.call.is_some() || t.value.is_some();
        finish_tools(&mut reply, Some(t));
    }
    reply
}

fn finish_tools(reply: &mut Reply, t: Option<ToolsSection>) {
    let Some(t) = t else { return };
    if t.malformed {
        reply.unparsed_tools.push_str(&t.raw);
    } else {
        reply.tool_calls.extend(t.calls);
    }
}
