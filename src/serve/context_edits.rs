//! Anthropic's `context_management` edits, applied to a conversation's history before it is
//! rendered: `clear_tool_uses_20250919` replaces the results (and, when asked, the inputs)
//! of all but the latest tool uses once the prompt passes a trigger, and
//! `clear_thinking_20251015` drops the thinking of all but the latest assistant turns. The
//! client keeps its full history; each request is edited afresh.

use super::api_error::ApiError;
use super::request::{ApiMessage, ApiRole};
use serde_json::{Map, Value};

type R<T> = Result<T, ApiError>;

/// The text a cleared tool result is replaced with, so the model sees that a result was there.
pub(crate) const CLEARED_RESULT: &str = "[this tool result was cleared to save context]";

/// When a tool-use clearing edit applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Once the rendered prompt is longer than this many tokens.
    InputTokens(usize),
    /// Once the history holds more than this many tool uses.
    ToolUses(usize),
}

/// Which tool uses also lose their inputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClearInputs {
    /// Only the results are cleared.
    No,
    /// Every cleared use's input too.
    All,
    /// The inputs of these tools' cleared uses.
    Tools(Vec<String>),
}

/// One edit of `context_management.edits`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContextEdit {
    /// `clear_tool_uses_20250919`.
    ClearToolUses {
        /// When it applies (default: 100000 input tokens).
        trigger: Trigger,
        /// The latest tool uses kept whole (default 3).
        keep: usize,
        /// Tokens a clearing must free, or it is not done (default 0).
        clear_at_least: usize,
        /// Tools whose uses are never cleared.
        exclude: Vec<String>,
        /// Whether inputs go too.
        clear_inputs: ClearInputs,
    },
    /// `clear_thinking_20251015`: `Some(n)` keeps the thinking of the last `n` assistant
    /// turns that have any (default 1), `None` (`"all"`) keeps every one.
    ClearThinking {
        /// Turns whose thinking stays.
        keep: Option<usize>,
    },
}

/// What an applied edit cleared (Anthropic's `applied_edits` entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedEdit {
    /// The edit's `type`.
    pub kind: &'static str,
    /// Tool uses or thinking turns cleared.
    pub cleared: usize,
    /// Tokens the cleared text held.
    pub cleared_tokens: usize,
}

fn obj<'a>(v: &'a Value, field: &str) -> R<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| super::sampling_fields::type_error(field, "an object", v))
}

fn refuse_other_keys(o: &Map<String, Value>, known: &[&str], field: &str) -> R<()> {
    match o
        .iter()
        .find(|(k, v)| !known.contains(&k.as_str()) && !v.is_null())
    {
        Some((k, _)) => Err(ApiError::field(
            &format!("{field}.{k}"),
            "is not supported by this server (docs/api.md lists the fields it reads)",
        )),
        None => Ok(()),
    }
}

/// `{"type": want, "value": n}`, its count.
fn counted(v: &Value, field: &str, kinds: &[&str]) -> R<(String, usize)> {
    let o = obj(v, field)?;
    refuse_other_keys(o, &["type", "value"], field)?;
    let kind = match o.get("type").and_then(Value::as_str) {
        Some(k) if kinds.contains(&k) => k.to_string(),
        _ => {
            return Err(ApiError::field(
                &format!("{field}.type"),
                format!("must be one of {}", kinds.join(", ")),
            ))
        }
    };
    let n = o
        .get("value")
        .and_then(Value::as_u64)
        .ok_or_else(|| ApiError::field(&format!("{field}.value"), "must be a whole number >= 0"))?;
    Ok((kind, usize::try_from(n).unwrap_or(usize::MAX)))
}

fn names(v: &Value, field: &str) -> R<Vec<String>> {
    let Value::Array(a) = v else {
        return Err(super::sampling_fields::type_error(
            field,
            "an array of tool names",
            v,
        ));
    };
    a.iter()
        .enumerate()
        .map(|(i, n)| {
            n.as_str().map(str::to_string).ok_or_else(|| {
                super::sampling_fields::type_error(&format!("{field}[{i}]"), "a string", n)
            })
        })
        .collect()
}

/// Reads `context_management` (`{"edits": [...]}`); an edit type k3 does not know is a
/// 400 naming it.
pub(crate) fn parse(v: &Value) -> R<Vec<ContextEdit>> {
    let field = "context_management";
    let o = obj(v, field)?;
    refuse_other_keys(o, &["edits"], field)?;
    let edits = match o.get("edits") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(super::sampling_fields::type_error(
                "context_management.edits",
                "an array",
                v,
            ))
        }
    };
    edits
        .iter()
        .enumerate()
        .map(|(i, e)| parse_edit(e, &format!("{field}.edits[{i}]")))
        .collect()
}

fn parse_edit(e: &Value, f: &str) -> R<ContextEdit> {
    let o = obj(e, f)?;
    match o.get("type").and_then(Value::as_str) {
        Some("clear_tool_uses_20250919") => {
            refuse_other_keys(
                o,
                &[
                    "type",
                    "trigger",
                    "keep",
                    "clear_at_least",
                    "exclude_tools",
                    "clear_tool_inputs",
                ],
                f,
            )?;
            let trigger = match o.get("trigger").filter(|v| !v.is_null()) {
                None => Trigger::InputTokens(100_000),
                Some(t) => match counted(t, &format!("{f}.trigger"), &["input_tokens", "tool_uses"])? {
                    (k, n) if k == "input_tokens" => Trigger::InputTokens(n),
                    (_, n) => Trigger::ToolUses(n),
                },
            };
            let keep = match o.get("keep").filter(|v| !v.is_null()) {
                None => 3,
                Some(k) => counted(k, &format!("{f}.keep"), &["tool_uses"])?.1,
            };
            let clear_at_least = match o.get("clear_at_least").filter(|v| !v.is_null()) {
                None => 0,
                Some(c) => counted(c, &format!("{f}.clear_at_least"), &["input_tokens"])?.1,
            };
            let exclude = match o.get("exclude_tools").filter(|v| !v.is_null()) {
                None => Vec::new(),
                Some(v) => names(v, &format!("{f}.exclude_tools"))?,
            };
            let clear_inputs = match o.get("clear_tool_inputs") {
                None | Some(Value::Null) | Some(Value::Bool(false)) => ClearInputs::No,
                Some(Value::Bool(true)) => ClearInputs::All,
                Some(v) => ClearInputs::Tools(names(v, &format!("{f}.clear_tool_inputs"))?),
            };
            Ok(ContextEdit::ClearToolUses {
                trigger,
                keep,
                clear_at_least,
                exclude,
                clear_inputs,
            })
        }
        Some("clear_thinking_20251015") => {
            refuse_other_keys(o, &["type", "keep"], f)?;
            let keep = match o.get("keep") {
                None | Some(Value::Null) => Some(1),
                Some(Value::String(s)) if s == "all" => None,
                Some(k) => Some(counted(k, &format!("{f}.keep"), &["thinking_turns"])?.1),
            };
            Ok(ContextEdit::ClearThinking { keep })
        }
        Some(other) => Err(ApiError::field(
            &format!("{f}.type"),
            format!(
                "{other:?} is not supported (clear_tool_uses_20250919 and clear_thinking_20251015 are)"
            ),
        )),
        None => Err(ApiError::field(&format!("{f}.type"), "is missing")),
    }
}

/// One tool use of the history: the assistant message and call index, and its name.
struct ToolUse {
    message: usize,
    call: usize,
    name: String,
    id: Option<String>,
}

/// Applies `edits` in order to `messages`, whose rendered prompt is `prompt_tokens` long;
/// `count` gives a text's tokens. Returns what each applied edit cleared (edits that did
/// not trigger are left out).
pub(crate) fn apply(
    edits: &[ContextEdit],
    messages: &mut [ApiMessage],
    prompt_tokens: usize,
    count: &mut dyn FnMut(&str) -> usize,
) -> Vec<AppliedEdit> {
    let mut applied = Vec::new();
    for e in edits {
        match e {
            ContextEdit::ClearThinking { keep } => {
                let Some(keep) = *keep else { continue };
                let with: Vec<usize> = (0..messages.len())
                    .filter(|&i| {
                        messages[i].role == ApiRole::Assistant
                            && messages[i]
                                .reasoning
                                .as_deref()
                                .is_some_and(|r| !r.is_empty())
                    })
                    .collect();
                let drop_n = with.len().saturating_sub(keep);
                let mut tokens = 0;
                for &i in &with[..drop_n] {
                    if let Some(r) = messages[i].reasoning.take() {
                        tokens += count(&r);
                    }
                }
                if drop_n > 0 {
                    applied.push(AppliedEdit {
                        kind: "clear_thinking_20251015",
                        cleared: drop_n,
                        cleared_tokens: tokens,
                    });
                }
            }
            ContextEdit::ClearToolUses {
                trigger,
                keep,
                clear_at_least,
                exclude,
                clear_inputs,
            } => {
                let uses: Vec<ToolUse> = messages
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.role == ApiRole::Assistant)
                    .flat_map(|(i, m)| {
                        m.tool_calls.iter().enumerate().map(move |(k, c)| ToolUse {
                            message: i,
                            call: k,
                            name: c.name.clone(),
                            id: c.id.clone(),
                        })
                    })
                    .collect();
                let fired = match trigger {
                    Trigger::InputTokens(n) => prompt_tokens > *n,
                    Trigger::ToolUses(n) => uses.len() > *n,
                };
                if !fired {
                    continue;
                }
                let candidates: Vec<&ToolUse> = uses[..uses.len().saturating_sub(*keep)]
                    .iter()
                    .filter(|u| !exclude.contains(&u.name))
                    .collect();
                // What clearing would free, before anything changes: under `clear_at_least`
                // nothing is cleared.
                let mut plan = Vec::new();
                let mut tokens = 0;
                for u in &candidates {
                    let result = u.id.as_deref().and_then(|id| {
                        messages.iter().position(|m| {
                            m.role == ApiRole::Tool
                                && m.tool_call_id.as_deref() == Some(id)
                                && m.content != CLEARED_RESULT
                        })
                    });
                    if let Some(r) = result {
                        tokens += count(&messages[r].content);
                    }
                    let input = match clear_inputs {
                        ClearInputs::No => false,
                        ClearInputs::All => true,
                        ClearInputs::Tools(t) => t.contains(&u.name),
                    };
                    let args = &messages[u.message].tool_calls[u.call].arguments;
                    let input = input && args.as_object().is_none_or(|o| !o.is_empty());
                    if input {
                        tokens += count(&args.to_string());
                    }
                    if result.is_some() || input {
                        plan.push((u.message, u.call, result, input));
                    }
                }
                if plan.is_empty() || tokens < *clear_at_least {
                    continue;
                }
                for &(m, c, result, input) in &plan {
                    if let Some(r) = result {
                        messages[r].content = CLEARED_RESULT.to_string();
                    }
                    if input {
                        messages[m].tool_calls[c].arguments = Value::Object(Map::new());
                    }
                }
                applied.push(AppliedEdit {
                    kind: "clear_tool_uses_20250919",
                    cleared: plan.len(),
                    cleared_tokens: tokens,
                });
            }
        }
    }
    applied
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::request::ToolCallIn;
    use serde_json::json;

    fn history(uses: usize) -> Vec<ApiMessage> {
        let mut m = vec![ApiMessage::text(ApiRole::User, "go")];
        for i in 0..uses {
            let mut a = ApiMessage::text(ApiRole::Assistant, "");
            a.reasoning = Some(format!("thought {i}"));
            a.tool_calls.push(ToolCallIn {
                id: Some(format!("t{i}")),
                name: if i == 0 { "Keep".into() } else { "Read".into() },
                arguments: json!({"path": format!("/f{i}")}),
            });
            m.push(a);
            let mut r = ApiMessage::text(ApiRole::Tool, format!("result {i} ").repeat(10));
            r.tool_call_id = Some(format!("t{i}"));
            m.push(r);
        }
        m
    }

    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    #[test]
    fn tool_uses_past_the_trigger_lose_their_results_oldest_first() {
        let edits = parse(&json!({"edits": [{"type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 50}, "keep": {"type": "tool_uses", "value": 1},
            "exclude_tools": ["Keep"], "clear_tool_inputs": true}]}))
        .unwrap_or_default();
        let mut m = history(4);
        let applied = apply(&edits, &mut m, 40, &mut words);
        assert!(applied.is_empty(), "under the trigger nothing changes");
        let applied = apply(&edits, &mut m, 60, &mut words);
        assert_eq!(applied.len(), 1);
        assert_eq!(applied[0].cleared, 2, "uses 1 and 2: 0 is excluded, 3 kept");
        assert!(m[2].content.starts_with("result 0"));
        assert_eq!(m[4].content, CLEARED_RESULT);
        assert_eq!(m[6].content, CLEARED_RESULT);
        assert!(m[8].content.starts_with("result 3"));
        assert_eq!(m[3].tool_calls[0].arguments, json!({}));
        assert_eq!(m[7].tool_calls[0].arguments, json!({"path": "/f3"}));
    }

    #[test]
    fn clear_at_least_holds_a_clearing_that_frees_too_little() {
        let edits = parse(&json!({"edits": [{"type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 1},
            "clear_at_least": {"type": "input_tokens", "value": 1000}}]}))
        .unwrap_or_default();
        let mut m = history(5);
        let before = m.clone();
        assert!(apply(&edits, &mut m, 0, &mut words).is_empty());
        assert_eq!(m, before);
    }

    #[test]
    fn thinking_is_kept_for_the_last_turns_only() {
        let edits = parse(&json!({"edits": [{"type": "clear_thinking_20251015",
            "keep": {"type": "thinking_turns", "value": 2}}]}))
        .unwrap_or_default();
        let mut m = history(3);
        let applied = apply(&edits, &mut m, 0, &mut words);
        assert_eq!(applied[0].cleared, 1);
        assert_eq!(m[1].reasoning, None);
        assert_eq!(m[3].reasoning.as_deref(), Some("thought 1"));
        let all = parse(&json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}))
            .unwrap_or_default();
        let mut m = history(3);
        assert!(apply(&all, &mut m, 0, &mut words).is_empty());
        assert_eq!(m[1].reasoning.as_deref(), Some("thought 0"));
    }

    #[test]
    fn unknown_edits_and_fields_are_named() {
        for (v, field) in [
            (
                json!({"edits": [{"type": "compact_20260112"}]}),
                "context_management.edits[0].type",
            ),
            (
                json!({"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}),
                "context_management.edits[0].keep",
            ),
            (
                json!({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1}, "x": 1}]}),
                "context_management.edits[0].x",
            ),
            (json!({"edits": {}}), "context_management.edits"),
        ] {
            let e = parse(&v).err().and_then(|e| e.param);
            assert_eq!(e.as_deref(), Some(field), "{v}");
        }
    }
}
