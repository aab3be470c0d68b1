//! `input` items (messages, function calls and their outputs, reasoning passed back)
//! translated into chat messages.

use super::*;

/// One content part of an input message.
#[derive(Deserialize)]
struct PartBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
    refusal: Option<String>,
    /// Citations of an `output_text` passed back: not part of the prompt.
    #[allow(dead_code)]
    annotations: Option<Value>,
    /// Log-probabilities of an `output_text` passed back: not part of the prompt.
    #[allow(dead_code)]
    logprobs: Option<Value>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// The text of a message's `content` (a string or text parts) or of a function call's
/// `output`.
fn parts_text(v: Option<Value>, field: &str) -> R<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for (k, p) in parts.into_iter().enumerate() {
                let f = format!("{field}[{k}]");
                if !p.is_object() {
                    return Err(type_error(&f, "an object", &p));
                }
                let part: PartBody = from_value(p, &f)?;
                let text = match part.kind.as_deref() {
                    Some("input_text" | "output_text" | "text") => part.text,
                    Some("refusal") => part.refusal,
                    Some(other) => {
                        return Err(field_is(
                            &format!("{f}.type"),
                            format!("{other:?} parts are not supported (text only: input_text, output_text)"),
                        ))
                    }
                    None => return Err(field_is(&format!("{f}.type"), "is missing")),
                };
                refuse_unknown(&part.unknown, &f)?;
                match text {
                    Some(t) => out.push_str(&t),
                    None => return Err(field_is(&format!("{f}.text"), "is missing")),
                }
            }
            Ok(out)
        }
        Some(v) => Err(type_error(field, "a string or an array of text parts", &v)),
    }
}

/// A `message` input item (with or without `"type": "message"`).
#[derive(Deserialize)]
struct MessageItem {
    role: Option<String>,
    content: Option<Value>,
    /// The item's id, when passed back from an earlier output.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status, when passed back from an earlier output.
    #[allow(dead_code)]
    status: Option<String>,
    /// Commentary or final answer, a label of OpenAI's own models' turns.
    #[allow(dead_code)]
    phase: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `function_call` input item: a call an earlier answer made.
#[derive(Deserialize)]
struct FunctionCallItem {
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    /// The namespace of a function declared in one: function names are unique anyway.
    #[allow(dead_code)]
    namespace: Option<String>,
    /// The item's id, when passed back from an earlier output.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status, when passed back from an earlier output.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `function_call_output` input item: a call's result.
#[derive(Deserialize)]
struct FunctionOutputItem {
    call_id: Option<String>,
    output: Option<Value>,
    /// The function's name; the call with `call_id` names it anyway.
    #[allow(dead_code)]
    name: Option<String>,
    /// The item's id.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// One text part of a reasoning item (`summary_text` or `reasoning_text`).
#[derive(Deserialize)]
struct ReasoningPart {
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    text: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `reasoning` input item: an earlier answer's thinking, passed back.
#[derive(Deserialize)]
struct ReasoningItem {
    summary: Option<Vec<Value>>,
    content: Option<Vec<Value>>,
    /// OpenAI's encrypted reasoning: opaque to any other server, so not read. This
    /// server's own reasoning items carry their text in `content` or `summary`.
    #[allow(dead_code)]
    encrypted_content: Option<String>,
    /// The item's id.
    #[allow(dead_code)]
    id: Option<String>,
    /// The item's status.
    #[allow(dead_code)]
    status: Option<String>,
    #[serde(flatten)]
    unknown: Unknown,
}

fn reasoning_text(parts: Option<Vec<Value>>, field: &str) -> R<String> {
    let mut out = String::new();
    for (k, p) in parts.unwrap_or_default().into_iter().enumerate() {
        let f = format!("{field}[{k}]");
        if !p.is_object() {
            return Err(type_error(&f, "an object", &p));
        }
        let part: ReasoningPart = from_value(p, &f)?;
        refuse_unknown(&part.unknown, &f)?;
        out.push_str(&part.text.unwrap_or_default());
    }
    Ok(out)
}

/// The call ids and names of the tool calls in chat messages.
fn calls_of(messages: &[Value]) -> Vec<(String, String)> {
    messages
        .iter()
        .filter_map(|m| m.get("tool_calls")?.as_array())
        .flatten()
        .filter_map(|c| {
            let id = c.get("id")?.as_str()?.to_string();
            let name = c.get("function")?.get("name")?.as_str()?.to_string();
            Some((id, name))
        })
        .collect()
}

/// Appends `input` (a string, or a list of items) to `out` as chat messages.
pub(super) fn translate_input(input: Value, out: &mut Vec<Value>) -> R<()> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(a) => a,
        v => return Err(type_error("input", "a string or an array of items", &v)),
    };
    let mut calls = calls_of(out);
    let mut reasoning: Option<String> = None;
    for (i, mut item) in items.into_iter().enumerate() {
        let f = format!("input[{i}]");
        let Value::Object(o) = &mut item else {
            return Err(type_error(&f, "an object", &item));
        };
        // The type picks the struct the item is read into.
        let kind = match o.remove("type") {
            None | Some(Value::Null) => "message".to_string(),
            Some(Value::String(s)) => s,
            Some(v) => return Err(type_error(&format!("{f}.type"), "a string", &v)),
        };
        match kind.as_str() {
            "message" => {
                let m: MessageItem = from_value(item, &f)?;
                let role = match m.role.as_deref() {
                    Some(r @ ("user" | "system" | "developer" | "assistant")) => r.to_string(),
                    Some(other) => {
                        return Err(field_is(
                            &format!("{f}.role"),
                            format!("{other:?} is not one of user, system, developer, assistant"),
                        ))
                    }
                    None => return Err(field_is(&format!("{f}.role"), "is missing")),
                };
                refuse_unknown(&m.unknown, &f)?;
                let text = parts_text(m.content, &format!("{f}.content"))?;
                let mut msg = json!({"role": role, "content": text});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        msg["reasoning_content"] = json!(r);
                    }
                } else {
                    // Thinking passed back belongs to the assistant turn after it.
                    reasoning = None;
                }
                out.push(msg);
            }
            "function_call" => {
                let c: FunctionCallItem = from_value(item, &f)?;
                refuse_unknown(&c.unknown, &f)?;
                let call_id = c
                    .call_id
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.call_id"), "is missing"))?;
                let name = c
                    .name
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
                let arguments = c.arguments.unwrap_or_default();
                calls.push((call_id.clone(), name.clone()));
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                // Calls of one answer join its assistant message.
                let joins = out
                    .last()
                    .is_some_and(|m| m["role"] == "assistant" && reasoning.is_none());
                if !joins {
                    let mut msg = json!({"role": "assistant", "content": ""});
                    if let Some(r) = reasoning.take() {
                        msg["reasoning_content"] = json!(r);
                    }
                    out.push(msg);
                }
                if let Some(Value::Object(last)) = out.last_mut() {
                    match last.get_mut("tool_calls") {
                        Some(Value::Array(a)) => a.push(call),
                        _ => {
                            last.insert("tool_calls".into(), Value::Array(vec![call]));
                        }
                    }
                }
            }
            "function_call_output" => {
                let r: FunctionOutputItem = from_value(item, &f)?;
                refuse_unknown(&r.unknown, &f)?;
                let call_id = r
                    .call_id
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| field_is(&format!("{f}.call_id"), "is missing"))?;
                let Some((_, name)) = calls.iter().rev().find(|(id, _)| *id == call_id) else {
                    return Err(field_is(
                        &format!("{f}.call_id"),
                        format!("{call_id:?} answers no function_call before it (in input or the previous response)"),
                    ));
                };
                let text = parts_text(r.output, &format!("{f}.output"))?;
                reasoning = None;
                out.push(json!({"role": "tool", "tool_call_id": call_id, "name": name,
                                "content": text}));
            }
            "reasoning" => {
                let r: ReasoningItem = from_value(item, &f)?;
                refuse_unknown(&r.unknown, &f)?;
                let content = reasoning_text(r.content, &format!("{f}.content"))?;
                let text = if content.is_empty() {
                    reasoning_text(r.summary, &format!("{f}.summary"))?
                } else {
                    content
                };
                reasoning.get_or_insert_with(String::new).push_str(&text);
            }
            "item_reference" => {
                return Err(field_is(
                    &format!("{f}.type"),
                    "item_reference is not supported; send the item itself, or previous_response_id",
                ))
            }
            other => {
                return Err(field_is(
                    &format!("{f}.type"),
                    format!("{other:?} items are not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(())
}
