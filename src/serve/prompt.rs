//! A chat request rendered in K3's format, as `Kimi-K3.jinja` does it: tool declarations,
//! the thinking-effort note, the messages (tool calls and tool results included), the
//! tool-choice note and the generation prompt. Text stays text ([`Prompt`]).

use super::api_error::ApiError;
use super::openai_body::tool_name;
use super::request::{ApiMessage, ApiRole, ChatRequest, ToolCallIn, ToolChoice};
use crate::tokenizer::{ChatOptions, Message, Prompt};
use serde_json::Value;

/// Renders `req` into prompt pieces; a tool result whose tool cannot be named is a 400.
pub fn render_request(req: &ChatRequest) -> Result<Prompt, ApiError> {
    let mut p = Prompt::default();
    let tools: Vec<&Value> = match &req.tool_choice {
        ToolChoice::Function(name) => req
            .tools
            .iter()
            .filter(|t| tool_name(t) == Some(name.as_str()))
            .collect(),
        _ => req.tools.iter().collect(),
    };
    if !tools.is_empty() {
        let list = Value::Array(tools.into_iter().cloned().collect());
        p.open_tag("message", &[("role", "system"), ("type", "tool-declare")]);
        p.push_text("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
        p.push_text(&json_sorted(&list));
        p.push_text("\n```");
        p.close_tag("message");
        p.end_of_msg();
        if req.tools_breakpoint {
            p.mark_boundary();
        }
    }
    p.thinking_effort(&ChatOptions {
        add_generation_prompt: true,
        thinking: req.thinking,
        thinking_effort: req.effort,
    });
    let msgs = &req.messages;
    let mut last_calls: &[ToolCallIn] = &[];
    let mut tool_index = 0usize;
    let mut i = 0;
    while i < msgs.len() {
        let m = &msgs[i];
        // Every session of an agent starts with the same tools and system prompt: the
        // prompt cache keeps the state where they end, so a new session prefills only
        // its own messages. A prompt with neither has no preamble worth a state.
        let preamble = i > 0 || !req.tools.is_empty();
        if preamble
            && m.role != ApiRole::System
            && msgs[..i].iter().all(|m| m.role == ApiRole::System)
        {
            p.mark_boundary();
        }
        match m.role {
            ApiRole::System | ApiRole::User => {
                let role = if m.role == ApiRole::System {
                    "system"
                } else {
                    "user"
                };
                let mut attrs = vec![("role", role)];
                if let Some(n) = m.name.as_deref().filter(|n| !n.is_empty()) {
                    attrs.push(("name", n));
                }
                p.open_tag("message", &attrs);
                p.push_text(&m.content);
                p.close_tag("message");
                p.end_of_msg();
                if m.cache_breakpoint {
                    p.mark_boundary();
                }
                i += 1;
            }
            ApiRole::Assistant => {
                last_calls = &m.tool_calls;
                tool_index = 0;
                let mut attrs = vec![("role", "assistant")];
                if let Some(n) = m.name.as_deref().filter(|n| !n.is_empty()) {
                    attrs.push(("name", n));
                }
                p.open_tag("message", &attrs);
                let body = Message::assistant(m.content.clone(), m.reasoning.clone());
                p.assistant_body(&body, req.thinking);
                if !m.tool_calls.is_empty() {
                    p.open_tag("tools", &[]);
                    for (k, c) in m.tool_calls.iter().enumerate() {
                        tool_call(&mut p, c, k + 1);
                    }
                    p.close_tag("tools");
                }
                p.close_tag("message");
                p.end_of_msg();
                if m.cache_breakpoint {
                    p.mark_boundary();
                }
                i += 1;
            }
            ApiRole::Tool => {
                let end = msgs[i..]
                    .iter()
                    .position(|t| t.role != ApiRole::Tool)
                    .map_or(msgs.len(), |n| i + n);
                tool_run(&mut p, &msgs[i..end], last_calls, &mut tool_index, i)?;
                if msgs[i..end].iter().any(|m| m.cache_breakpoint) {
                    p.mark_boundary();
                }
                i = end;
            }
        }
    }
    // The note below belongs to this turn only: the next request of the conversation
    // carries the answer there instead, so the server keeps its state before the note.
    if !req.tools.is_empty() && req.tool_choice != ToolChoice::Auto {
        p.mark_divergence();
    }
    match req.tool_choice {
        ToolChoice::Required | ToolChoice::Function(_) if !req.tools.is_empty() => {
            p.internal_system_message(
                "tool-choice",
                "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
            );
        }
        ToolChoice::None if !req.tools.is_empty() => {
            p.internal_system_message(
                "tool-choice",
                "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
            );
        }
        _ => {}
    }
    p.generation_prompt(req.thinking);
    Ok(p)
}

fn tool_call(p: &mut Prompt, c: &ToolCallIn, index: usize) {
    let index = index.to_string();
    p.open_tag("call", &[("tool", &c.name), ("index", &index)]);
    match &c.arguments {
        Value::Object(args) => {
            for (key, value) in args {
                p.open_tag("argument", &[("key", key), ("type", xtml_type(value))]);
                match value {
                    Value::String(s) => p.push_text(s),
                    v => p.push_text(&to_json(v)),
                }
                p.close_tag("argument");
            }
        }
        Value::String(s) if !s.trim().is_empty() => {
            p.open_tag("json", &[("type", "object")]);
            p.push_text(s);
            p.close_tag("json");
        }
        _ => {}
    }
    p.close_tag("call");
}

/// A run of tool results: in the order of the calls they answer when every one names its
/// call's id, else in the order sent.
fn tool_run(
    p: &mut Prompt,
    run: &[ApiMessage],
    calls: &[ToolCallIn],
    tool_index: &mut usize,
    first: usize,
) -> Result<(), ApiError> {
    fn id_of(m: &ApiMessage) -> Option<&str> {
        m.tool_call_id.as_deref()
    }
    let resolved = run
        .iter()
        .all(|m| id_of(m).is_some_and(|id| calls.iter().any(|c| c.id.as_deref() == Some(id))));
    if resolved {
        let mut seen: Vec<&str> = Vec::new();
        for c in calls {
            let Some(id) = c.id.as_deref() else { continue };
            if seen.contains(&id) {
                continue;
            }
            seen.push(id);
            for m in run.iter().filter(|m| id_of(m) == Some(id)) {
                *tool_index += 1;
                tool_message(p, m, &c.name, *tool_index);
            }
        }
        return Ok(());
    }
    for (k, m) in run.iter().enumerate() {
        *tool_index += 1;
        let name = m
            .name
            .clone()
            .or_else(|| calls.get(*tool_index - 1).map(|c| c.name.clone()))
            .ok_or_else(|| {
                ApiError::field(
                    &format!("messages[{}]", first + k),
                    "a tool result needs `name`, or a `tool_call_id` or position matching a \
                     preceding assistant tool call",
                )
            })?;
        tool_message(p, m, &name, *tool_index);
    }
    Ok(())
}

fn tool_message(p: &mut Prompt, m: &ApiMessage, name: &str, index: usize) {
    let index = index.to_string();
    p.open_tag(
        "message",
        &[("role", "tool"), ("tool", name), ("index", &index)],
    );
    p.push_text(&m.content);
    p.close_tag("message");
    p.end_of_msg();
}

fn xtml_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// Jinja's `tojson`: JSON with `<`, `>`, `&` and `'` escaped as `\u00XX`.
fn to_json(v: &Value) -> String {
    let s = serde_json::to_string(v).unwrap_or_default();
    s.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\'', "\\u0027")
}

/// The template's `json_sorted`: mappings by key (Jinja's `dictsort`, case-insensitive),
/// no spaces, arrays in order.
pub fn json_sorted(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_by(|a, b| a.to_lowercase().cmp(&b.to_lowercase()).then(a.cmp(b)));
            let items: Vec<String> = keys
                .into_iter()
                .map(|k| {
                    format!(
                        "{}:{}",
                        to_json(&Value::String(k.clone())),
                        json_sorted(&m[k])
                    )
                })
                .collect();
            format!("{{{}}}", items.join(","))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(json_sorted).collect();
            format!("[{}]", items.join(","))
        }
        scalar => to_json(scalar),
    }
}
