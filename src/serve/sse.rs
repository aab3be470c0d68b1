//! Server-sent events of one job: each engine event becomes zero or more frames
//! (`event:` name optional, `data:` payload); the stream ends when the framer says so.
//! Dropping the stream drops `guard` with it, which is how a client that leaves
//! cancels its job.

use super::api_error::ApiError;
use super::job::Event;
use axum::response::sse::Event as SseEvent;
use futures_util::stream::{self, Stream};
use std::collections::VecDeque;
use std::convert::Infallible;
use tokio::sync::mpsc::Receiver;

/// One server-sent event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseFrame {
    /// The `event:` name (Anthropic's streams name theirs; OpenAI's do not).
    pub event: Option<&'static str>,
    /// The `data:` payload.
    pub data: String,
}

impl SseFrame {
    /// A frame with a name.
    pub fn named(event: &'static str, data: String) -> Self {
        Self {
            event: Some(event),
            data,
        }
    }

    /// OpenAI's end-of-stream frame.
    pub fn done() -> Self {
        Self::from("[DONE]".to_string())
    }

    /// The frame on the wire: `event:` and `data:` lines, a blank line after.
    pub fn wire(&self) -> String {
        let mut out = String::new();
        if let Some(e) = self.event {
            out.push_str("event: ");
            out.push_str(e);
            out.push('\n');
        }
        for line in self.data.split('\n') {
            out.push_str("data: ");
            out.push_str(line);
            out.push('\n');
        }
        out.push('\n');
        out
    }
}

impl From<String> for SseFrame {
    fn from(data: String) -> Self {
        Self { event: None, data }
    }
}

struct State<G, F> {
    pending: VecDeque<SseFrame>,
    rx: Receiver<Event>,
    _guard: G,
    done: bool,
    frame: F,
}

/// The events of a job: `first`, then `frame`'s frames for each engine event until it
/// returns true (the stream's end).
pub fn event_stream<G, F>(
    first: Vec<SseFrame>,
    rx: Receiver<Event>,
    guard: G,
    frame: F,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send
where
    G: Send + 'static,
    F: FnMut(Event) -> (Vec<SseFrame>, bool) + Send + 'static,
{
    let state = State {
        pending: VecDeque::from(first),
        rx,
        _guard: guard,
        done: false,
        frame,
    };
    stream::unfold(state, |mut s| async move {
        loop {
            if let Some(f) = s.pending.pop_front() {
                let ev = match f.event {
                    Some(name) => SseEvent::default().event(name),
                    None => SseEvent::default(),
                };
                return Some((Ok(ev.data(f.data)), s));
            }
            if s.done {
                return None;
            }
            match s.rx.recv().await {
                Some(ev) => {
                    let (out, end) = (s.frame)(ev);
                    s.pending.extend(out);
                    s.done = end;
                }
                None => {
                    let e = ApiError::status(500, "the engine dropped the request");
                    s.pending.push_back(SseFrame::from(e.body().to_string()));
                    s.pending.push_back(SseFrame::done());
                    s.done = true;
                }
            }
        }
    })
}
