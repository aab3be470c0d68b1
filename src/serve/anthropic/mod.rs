//! Anthropic's `POST /v1/messages` on the same engine: the typed body becomes the one
//! internal chat request (text, thinking, tool_use and tool_result blocks, tools,
//! tool_choice), the outcome a `message` or its stream of events, errors Anthropic's shape.
//! `request.rs` reads the body, `reply.rs` writes the answer; neither names the other.

mod reply;
mod request;

pub use reply::{applied_edits, error_response, message, StreamEvents};
pub use request::{messages_request, read_request, MessagesRequest, MessagesRoute};
