//! Kimi K3's XTML chat format: rendering a conversation to prompt text (the splitting of
//! generated ids into channels is `chat_splitter.rs`).
//!
//! The rendering follows llama.cpp's `models/templates/Kimi-K3.jinja` (kept as a test
//! oracle in `tools/templates/`) for system, user and assistant messages, with and
//! without thinking; [`Prompt`]'s pieces let the server add tools and tool results.
//! Control tokens come only from the template: message text is encoded as ordinary
//! text, so a typed `<|open|>` stays text. Images, `name` attributes and
//! `response_format` are not rendered.

use super::bpe::python_isspace;

/// Who speaks a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Instructions from the operator.
    System,
    /// The person chatting.
    User,
    /// The model.
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// The visible text (the response channel for the assistant).
    pub content: String,
    /// An assistant turn's thinking; rendered only when thinking is on.
    pub reasoning: Option<String>,
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self {
            role: Role::System,
            content: content.into(),
            reasoning: None,
        }
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: Role::User,
            content: content.into(),
            reasoning: None,
        }
    }

    /// An earlier assistant turn, with its thinking if it had any.
    pub fn assistant(content: impl Into<String>, reasoning: Option<String>) -> Self {
        Self {
            role: Role::Assistant,
            content: content.into(),
            reasoning,
        }
    }
}

/// The template's `thinking_effort` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinkingEffort {
    /// `low`
    Low,
    /// `medium`
    Medium,
    /// `high`
    High,
    /// `max` (the template's default)
    Max,
}

impl ThinkingEffort {
    /// Every level, lowest first.
    const ALL: [ThinkingEffort; 4] = [
        ThinkingEffort::Low,
        ThinkingEffort::Medium,
        ThinkingEffort::High,
        ThinkingEffort::Max,
    ];

    /// The level named `s` (`low`, `medium`, `high`, `max`), as the template spells it.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == s)
    }

    fn as_str(self) -> &'static str {
        match self {
            ThinkingEffort::Low => "low",
            ThinkingEffort::Medium => "medium",
            ThinkingEffort::High => "high",
            ThinkingEffort::Max => "max",
        }
    }
}

/// Rendering switches, named after the template's variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatOptions {
    /// End with the assistant's opening so the model writes the next turn.
    pub add_generation_prompt: bool,
    /// Open the think channel (and keep earlier turns' thinking).
    pub thinking: bool,
    /// The effort announced in a system message when thinking; `None` announces none.
    pub thinking_effort: Option<ThinkingEffort>,
}

impl ChatOptions {
    /// A prompt that ends with the assistant's opening, at the template's default effort.
    pub fn generation(thinking: bool) -> Self {
        Self {
            add_generation_prompt: true,
            thinking,
            thinking_effort: Some(ThinkingEffort::Max),
        }
    }
}

/// Renders a conversation exactly as `Kimi-K3.jinja` does with the given switches and
/// the template's default `thinking_effort=max`.
pub fn render_chat(messages: &[Message], add_generation_prompt: bool, thinking: bool) -> String {
    render_chat_with(
        messages,
        &ChatOptions {
            add_generation_prompt,
            thinking,
            thinking_effort: Some(ThinkingEffort::Max),
        },
    )
}

/// Renders a conversation exactly as `Kimi-K3.jinja` does with these options.
pub fn render_chat_with(messages: &[Message], opts: &ChatOptions) -> String {
    chat_prompt(messages, opts).text()
}

/// The conversation as template pieces: what [`render_chat_with`] writes and
/// [`Tokenizer::encode_chat`](super::Tokenizer::encode_chat) encodes.
pub fn chat_prompt(messages: &[Message], opts: &ChatOptions) -> Prompt {
    let mut p = Prompt::default();
    p.thinking_effort(opts);
    for m in messages {
        p.message(m, opts.thinking);
    }
    if opts.add_generation_prompt {
        p.generation_prompt(opts.thinking);
    }
    p
}

/// One piece of a rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// A control token the template inserts (`<|open|>`, `<|sep|>`, ...).
    Control(&'static str),
    /// Text, encoded as ordinary text whatever it contains.
    Text(String),
}

/// A prompt under construction: control tokens where the template puts them, and text,
/// kept apart so text can never become a control token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    pieces: Vec<Piece>,
    /// Pieces before the point where the next request is expected to diverge
    /// ([`Self::mark_divergence`]).
    divergence: Option<usize>,
    /// Pieces before each message boundary worth keeping a state at
    /// ([`Self::mark_boundary`]), ascending.
    boundaries: Vec<usize>,
}

impl Prompt {
    /// The pieces, in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// The prompt as one string, control tokens written by name (the template's output).
    pub fn text(&self) -> String {
        let mut out = String::new();
        for p in &self.pieces {
            match p {
                Piece::Control(c) => out.push_str(c),
                Piece::Text(t) => out.push_str(t),
            }
        }
        out
    }

    /// Marks the current end as where the next request of the conversation is expected to
    /// part from this one (before a note only this turn carries), so a server can keep its
    /// state there. Text pushed next does not merge across the mark.
    pub fn mark_divergence(&mut self) {
        self.divergence = Some(self.pieces.len());
    }

    /// The pieces before [`Self::mark_divergence`]'s mark, if one was set.
    pub fn divergence(&self) -> Option<usize> {
        self.divergence
    }

    /// Marks the current end as a message boundary that later prompts are likely to share
    /// (the end of the system prompt and tools, a client's cache breakpoint), so the prompt
    /// cache keeps the state there. Text pushed next does not merge across the mark.
    pub fn mark_boundary(&mut self) {
        let at = self.pieces.len();
        if at > 0 && self.boundaries.last() != Some(&at) {
            self.boundaries.push(at);
        }
    }

    /// The pieces before each [`Self::mark_boundary`] mark, ascending.
    pub fn boundaries(&self) -> &[usize] {
        &self.boundaries
    }

    /// Appends text; adjacent texts merge, as they would in the rendered string.
    pub fn push_text(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        let at_mark = self.divergence == Some(self.pieces.len())
            || self.boundaries.last() == Some(&self.pieces.len());
        if let (false, Some(Piece::Text(t))) = (at_mark, self.pieces.last_mut()) {
            t.push_str(text);
        } else {
            self.pieces.push(Piece::Text(text.to_string()));
        }
    }

    /// `<|open|>tag k="v"...<|sep|>`, attribute values escaped as the template does.
    pub fn open_tag(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.pieces.push(Piece::Control(OPEN));
        let mut t = tag.to_string();
        for (k, v) in attrs {
            t.push(' ');
            t.push_str(k);
            t.push_str("=\"");
            t.push_str(&v.replace('&', "&amp;").replace('"', "&quot;"));
            t.push('"');
        }
        self.push_text(&t);
        self.pieces.push(Piece::Control(SEP));
    }

    /// `<|close|>tag<|sep|>`.
    pub fn close_tag(&mut self, tag: &str) {
        self.pieces.push(Piece::Control(CLOSE));
        self.push_text(tag);
        self.pieces.push(Piece::Control(SEP));
    }

    /// `<|end_of_msg|>`.
    pub fn end_of_msg(&mut self) {
        self.pieces.push(Piece::Control(END_OF_MSG));
    }

    /// A system message the template writes itself (`type` = `kind`), body trimmed.
    pub fn internal_system_message(&mut self, kind: &str, body: &str) {
        self.open_tag("message", &[("role", "system"), ("type", kind)]);
        self.push_text(python_trim(body));
        self.close_tag("message");
        self.end_of_msg();
    }

    /// The thinking-effort announcement, when thinking with an effort.
    pub fn thinking_effort(&mut self, opts: &ChatOptions) {
        if let (true, Some(effort)) = (opts.thinking, opts.thinking_effort) {
            let body = format!(
                "`thinking_effort` guides on how much to think in your thinking channel (not \
                 including the response channel), supported values include `low`, `medium`, \
                 `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.",
                effort.as_str()
            );
            self.internal_system_message("thinking-effort", &body);
        }
    }

    /// One system, user or assistant message (the assistant's think channel when thinking).
    pub fn message(&mut self, m: &Message, thinking: bool) {
        self.open_tag("message", &[("role", m.role.as_str())]);
        if m.role == Role::Assistant {
            self.assistant_body(m, thinking);
        } else {
            self.push_text(&m.content);
        }
        self.close_tag("message");
        self.end_of_msg();
    }

    /// An assistant message's think (when thinking) and response sections.
    pub fn assistant_body(&mut self, m: &Message, thinking: bool) {
        if thinking {
            self.open_tag("think", &[]);
            if let Some(r) = m.reasoning.as_deref() {
                // The template tests the trimmed text but writes the untrimmed one.
                if !python_trim(r).is_empty() {
                    self.push_text(r);
                }
            }
            self.close_tag("think");
        }
        self.open_tag("response", &[]);
        self.push_text(&m.content);
        self.close_tag("response");
    }

    /// The assistant's opening, so the model writes the next turn.
    pub fn generation_prompt(&mut self, thinking: bool) {
        self.open_tag("message", &[("role", "assistant")]);
        self.open_tag(if thinking { "think" } else { "response" }, &[]);
    }
}

pub(super) const OPEN: &str = "<|open|>";
pub(super) const CLOSE: &str = "<|close|>";
pub(super) const SEP: &str = "<|sep|>";
pub(super) const END_OF_MSG: &str = "<|end_of_msg|>";

/// Jinja's `trim` is Python's `str.strip()`.
pub(crate) fn python_trim(s: &str) -> &str {
    s.trim_matches(python_isspace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effort_names_read_back_and_others_are_none() {
        for e in ThinkingEffort::ALL {
            assert_eq!(ThinkingEffort::from_name(e.as_str()), Some(e));
        }
        for bad in ["extreme", "none", "Low", ""] {
            assert_eq!(ThinkingEffort::from_name(bad), None, "{bad}");
        }
    }
}
