//! `tools` (functions and namespaces of them) in the chat shape, and `tool_choice`.

use super::*;

/// One declared tool in the Responses shape.
#[derive(Deserialize)]
struct ToolBody {
    name: Option<String>,
    description: Option<Value>,
    parameters: Option<Value>,
    strict: Option<bool>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// A `namespace` tool: function tools grouped under a name (Codex declares its sub-agent
/// tools so). Its functions are offered as they are; a call of one names the namespace.
#[derive(Deserialize)]
struct NamespaceBody {
    name: Option<String>,
    /// What the group is for; each function keeps its own description.
    #[allow(dead_code)]
    description: Option<Value>,
    tools: Option<Vec<Value>>,
    #[serde(flatten)]
    unknown: Unknown,
}

/// One function tool (at `f`) in the chat shape.
fn function_tool(mut t: Value, f: &str) -> R<Value> {
    let Value::Object(o) = &mut t else {
        return Err(type_error(f, "an object", &t));
    };
    match o.remove("type") {
        Some(Value::String(k)) if k == "function" => {}
        Some(Value::String(k)) => {
            return Err(field_is(
                &format!("{f}.type"),
                format!(
                    "{k:?} tools are not supported by this server (function tools only){}",
                    if k == "web_search" {
                        "; Codex CLI declares it unless its config.toml sets web_search = \"disabled\""
                    } else {
                        ""
                    }
                ),
            ))
        }
        Some(v) => return Err(type_error(&format!("{f}.type"), "a string", &v)),
        None => return Err(field_is(&format!("{f}.type"), "is missing")),
    }
    let t: ToolBody = from_value(t, f)?;
    refuse_unknown(&t.unknown, f)?;
    let name = t
        .name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
    let mut func = json!({"name": name});
    if let Some(d) = t.description.filter(|d| !d.is_null()) {
        func["description"] = d;
    }
    if let Some(p) = t.parameters.filter(|p| !p.is_null()) {
        func["parameters"] = p;
    }
    if let Some(s) = t.strict {
        func["strict"] = json!(s);
    }
    Ok(json!({"type": "function", "function": func}))
}

/// Declared tools: `tools` in the chat shape (a namespace's functions in its place), and
/// the namespace of each function declared in one.
pub(super) struct Tools {
    pub(super) chat: Vec<Value>,
    pub(super) namespaces: HashMap<String, String>,
}

/// Reads `tools`: function tools and namespaces of them; a tool of any other type is
/// refused naming it, and so is a function name declared twice.
pub(super) fn tools(v: Option<Value>) -> R<Tools> {
    let mut out = Tools {
        chat: Vec::new(),
        namespaces: HashMap::new(),
    };
    let a = match v {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(type_error("tools", "an array", &v)),
    };
    let add = |out: &mut Tools, tool: Value, f: &str| -> R<()> {
        let name = openai_body::tool_name(&tool)
            .unwrap_or_default()
            .to_string();
        if out
            .chat
            .iter()
            .any(|t| openai_body::tool_name(t) == Some(name.as_str()))
        {
            return Err(field_is(
                &format!("{f}.name"),
                format!("{name:?} is declared twice"),
            ));
        }
        out.chat.push(tool);
        Ok(())
    };
    for (i, t) in a.into_iter().enumerate() {
        let f = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("namespace") {
            let tool = function_tool(t, &f)?;
            add(&mut out, tool, &f)?;
            continue;
        }
        let mut t = t;
        if let Value::Object(o) = &mut t {
            o.remove("type");
        }
        let ns: NamespaceBody = from_value(t, &f)?;
        refuse_unknown(&ns.unknown, &f)?;
        let name = ns
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| field_is(&format!("{f}.name"), "is missing"))?;
        for (k, inner) in ns.tools.unwrap_or_default().into_iter().enumerate() {
            let fk = format!("{f}.tools[{k}]");
            let tool = function_tool(inner, &fk)?;
            if let Some(n) = openai_body::tool_name(&tool) {
                out.namespaces.insert(n.to_string(), name.clone());
            }
            add(&mut out, tool, &fk)?;
        }
    }
    Ok(out)
}

/// `tool_choice`: `auto`, `none`, `required`, or `{"type": "function", "name": ...}`.
pub(super) fn tool_choice(v: Option<&Value>, tools: &[Value]) -> R<ToolChoice> {
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(field_is(
                    "tool_choice",
                    format!("{other:?} is not one of auto, none, required"),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("function") => {
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| field_is("tool_choice.name", "is missing"))?;
                openai_body::named_tool(name, tools, "tool_choice.name")?
            }
            Some(other) => {
                return Err(field_is(
                    "tool_choice.type",
                    format!("{other:?} is not supported (auto, none, required or a function)"),
                ))
            }
            None => return Err(field_is("tool_choice.type", "is missing")),
        },
        Some(v) => return Err(type_error("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() && choice == ToolChoice::Required {
        return Err(field_is(
            "tool_choice",
            "\"required\" needs at least one tool in `tools`",
        ));
    }
    Ok(choice)
}
