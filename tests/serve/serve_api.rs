//! The API surface of `k3 serve` over real HTTP: every field either works or is refused
//! naming it, `n` choices, seeds, reasoning switches and formats, the model and token
//! count routes, Anthropic's event shapes, the metrics histograms and the early 413.

use crate::serve_support;
use crate::support;

use serde_json::{json, Value};
use serve_support::*;
use std::io::{Read, Write};
use std::time::Duration;

/// POSTs JSON; returns (status, the `x-k3-seed` header, body).
fn post_seed(url: &str, body: &Value) -> (u16, Option<u64>, Value) {
    let mut resp = agent()
        .post(url)
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("POST");
    let seed = resp
        .headers()
        .get("x-k3-seed")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (resp.status().as_u16(), seed, v)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn fields_work_or_are_refused_naming_them() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let tools = json!([{"type": "function", "function": {"name": "f"}}]);
    for (body, field) in [
        (
            json!({"messages": user("x"), "logit_bias": {"1": 3}}),
            "logit_bias",
        ),
        (
            json!({"messages": user("x"), "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"messages": user("x"), "response_format": {"type": "json_object"},
                   "tools": tools, "tool_choice": "required"}),
            "response_format",
        ),
        (json!({"messages": user("x"), "n": 9}), "n"),
    ] {
        let (st, _, v) = post(&chat, &body.to_string(), None);
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    let (st, _, v) = post(
        &s.url("/v1/completions"),
        &json!({"prompt": "a", "suffix": "b"}).to_string(),
        None,
    );
    assert_eq!((st, &v["error"]["param"]), (400, &json!("suffix")), "{v}");
    // Each refusal leaves one log line naming the route, the status and the field.
    assert!(
        s.wait_log(
            "[K3] serve: refused POST /v1/completions: 400: suffix is not supported",
            5
        ),
        "{}",
        s.log()
    );
    assert!(
        s.wait_log(
            "[K3] serve: refused POST /v1/chat/completions: 400: n: 9",
            5
        ),
        "{}",
        s.log()
    );
    // Fields that only label, store, route or bill are accepted; a value asking for
    // something k3 lacks is still refused by name.
    let inert = json!({"messages": user("x"), "max_tokens": 2, "store": false,
        "metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "p",
        "safety_identifier": "s", "service_tier": "auto"});
    let (st, _, v) = post(&chat, &inert.to_string(), None);
    assert_eq!(st, 200, "{v}");
    let mut stored = inert.clone();
    stored["store"] = json!(true);
    stored["service_tier"] = json!("default");
    let (st, _, v) = post(&chat, &stored.to_string(), None);
    assert_eq!(st, 200, "{v}");
    let mut flex = inert.clone();
    flex["service_tier"] = json!("flex");
    let (st, _, v) = post(&chat, &flex.to_string(), None);
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("service_tier")),
        "{v}"
    );
    let (st, _, v) = post(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 2, "messages": user("x"), "service_tier": "auto",
                "metadata": {"user_id": "u"}, "inference_geo": "us",
                "cache_control": {"type": "ephemeral"}})
        .to_string(),
        None,
    );
    assert_eq!(st, 200, "{v}");
    // Anthropic refusals keep Anthropic's shape.
    let (st, _, v) = post(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 4, "messages": user("x"), "service_tier": "priority"}).to_string(),
        None,
    );
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("service_tier"),
        "{v}"
    );
}

#[test]
fn n_choices_sample_their_own_streams_from_one_prefill() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let body = json!({"messages": user("Tell me something"), "n": 3, "max_tokens": 12,
                      "temperature": 1.5, "seed": 11, "ignore_eos": true});
    let (st, seed, v) = post_seed(&chat, &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(seed, Some(11));
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    let texts: Vec<&str> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            assert_eq!(c["finish_reason"], "length");
            c["message"]["content"].as_str().unwrap()
        })
        .collect();
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "three samples are identical: {texts:?}"
    );
    assert_eq!(v["usage"]["completion_tokens"], 36, "{v}");
    // The later choices restart from the prompt's end, not from a new prefill.
    assert!(s.wait_log("generated 36", 5), "{}", s.log());
    // The same seed gives the same choices, streamed too.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let (st, chunks) = post_stream(&chat, &stream);
    assert_eq!(st, 200);
    let mut streamed = [String::new(), String::new(), String::new()];
    let mut finishes = 0;
    for ch in &chunks {
        if let Some(c) = ch["choices"].get(0) {
            let i = c["index"].as_u64().unwrap() as usize;
            if let Some(t) = c["delta"]["content"].as_str() {
                streamed[i].push_str(t);
            }
            finishes += usize::from(c["finish_reason"].is_string());
        }
    }
    assert_eq!(finishes, 3);
    assert_eq!(streamed.to_vec(), texts);
}

#[test]
fn each_request_without_a_seed_gets_its_own_and_reports_it() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let body = json!({"messages": user("Pick a word"), "max_tokens": 16,
                      "temperature": 2, "ignore_eos": true});
    let (_, a, va) = post_seed(&chat, &body);
    let (_, b, vb) = post_seed(&chat, &body);
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_ne!(a, b);
    assert_eq!(va["system_fingerprint"], format!("k3-seed-{a}"));
    let text = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_ne!(text(&va), text(&vb), "two unseeded samples are the same");
    // Sending the reported seed back replays the answer.
    let mut again = body.clone();
    again["seed"] = json!(a);
    let (_, c, vc) = post_seed(&chat, &again);
    assert_eq!(c, Some(a));
    assert_eq!(text(&vc), text(&va));
}

#[test]
fn reasoning_effort_and_the_inline_reasoning_format() {
    let dir = support::tiny(0);
    let separate = Server::start(&dir, &["--think", "0"]);
    let inline = Server::start(&dir, &["--think", "0", "--reasoning-format", "inline"]);
    let body = json!({"messages": user("Why is the sky blue?"), "max_tokens": 24,
                      "temperature": 0, "reasoning_effort": "high"});
    let (st, v) = post_json(&separate.url("/v1/chat/completions"), &body);
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().unwrap_or("").to_string();
    let content = m["content"].as_str().unwrap().to_string();
    assert!(
        !reasoning.is_empty(),
        "reasoning_effort high opens the think channel: {v}"
    );
    let usage = &v["usage"];
    let think = usage["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        think > 0 && think <= usage["completion_tokens"].as_u64().unwrap_or(0),
        "reasoning_tokens counts the think channel: {v}"
    );
    let (st, v) = post_json(&inline.url("/v1/chat/completions"), &body);
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(m["reasoning_content"].is_null(), "{v}");
    assert_eq!(
        m["content"].as_str().unwrap(),
        format!("<think>{reasoning}</think>{content}")
    );
    // none turns thinking off again.
    let mut off = body.clone();
    off["reasoning_effort"] = json!("none");
    let (_, v) = post_json(&separate.url("/v1/chat/completions"), &off);
    assert!(
        v["choices"][0]["message"]["reasoning_content"].is_null(),
        "{v}"
    );
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"], 0,
        "{v}"
    );
}

/// The thinking block of an Anthropic answer.
fn thinking_text(v: &Value) -> String {
    v["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "thinking")
        .map(|b| b["thinking"].as_str().unwrap_or("").to_string())
        .collect()
}

#[test]
fn claude_code_requests_are_served() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let name = dir.file_name().unwrap().to_str().unwrap();
    // A body as Claude Code sends it (its long texts shortened): system entries inside
    // `messages`, adaptive thinking, output_config.effort, context_management,
    // cache_control on blocks and metadata.
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/claude_code_messages.json"
    );
    let mut body: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    assert_eq!(body["messages"][1]["role"], "system", "the fixture's shape");
    body["model"] = json!(name);
    body["max_tokens"] = json!(6);
    let (st, events) = post_stream(&s.url("/v1/messages?beta=true"), &body);
    assert_eq!(st, 200, "{events:?}");
    assert_eq!(events.last().unwrap()["type"], "message_stop", "{events:?}");
    let (st, _, v) = post(
        &s.url("/v1/messages/count_tokens?beta=true"),
        &json!({"model": name, "messages": body["messages"], "system": body["system"],
                "tools": body["tools"], "thinking": body["thinking"],
                "context_management": body["context_management"]})
        .to_string(),
        None,
    );
    assert_eq!(st, 200, "{v}");

    // A system entry renders as a system turn where it stands.
    let count = |messages: Value| {
        let (st, _, v) = post(
            &s.url("/v1/messages/count_tokens"),
            &json!({"messages": messages}).to_string(),
            None,
        );
        assert_eq!(st, 200, "{v}");
        v["input_tokens"].as_u64().unwrap_or(0)
    };
    let plain = count(json!([{"role": "user", "content": "hi"}]));
    let with_system = count(json!([{"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "again"}]));
    assert!(with_system > plain + 6, "{plain} {with_system}");

    // thinking.budget_tokens closes the think channel once spent: greedy, the budgeted
    // thinking is the unbudgeted one cut short.
    let ask = |thinking: Value| {
        let body = json!({"max_tokens": 24, "temperature": 0, "thinking": thinking,
                          "messages": user("Why is the sky blue?")});
        let (st, v) = post_json(&s.url("/v1/messages"), &body);
        assert_eq!(st, 200, "{v}");
        v
    };
    let free = thinking_text(&ask(json!({"type": "enabled", "budget_tokens": 1000})));
    let adaptive = thinking_text(&ask(json!({"type": "adaptive"})));
    assert_eq!(free, adaptive, "adaptive thinks as enabled does");
    let short = thinking_text(&ask(json!({"type": "enabled", "budget_tokens": 2})));
    assert!(
        free.starts_with(&short) && short.len() < free.len(),
        "budget 2: {short:?}, unbounded: {free:?}"
    );

    // output_config.format goes through the grammar; effort alone turns thinking on.
    let (st, v) = post_json(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 60, "messages": user("Name a color."),
                "output_config": {"format": {"type": "json_schema", "schema":
                    {"type": "object", "properties": {"c": {"type": "string"}},
                     "required": ["c"], "additionalProperties": false}}}}),
    );
    assert_eq!(st, 200, "{v}");
    let text: String = v["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap_or("").to_string())
        .collect();
    if v["stop_reason"] == "end_turn" {
        let parsed: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(parsed["c"].is_string(), "{v}");
    }
    let effort = ask(Value::Null);
    assert!(
        thinking_text(&effort).is_empty(),
        "no thinking unless asked: {effort}"
    );
    let (st, v) = post_json(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 24, "temperature": 0, "messages": user("Why is the sky blue?"),
                "output_config": {"effort": "low"}}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(!thinking_text(&v).is_empty(), "{v}");
    for (body, field) in [
        (
            json!({"output_config": {"effort": "extreme"}}),
            "output_config.effort",
        ),
        (
            json!({"output_config": {"format": {"type": "json_object"}}}),
            "output_config.format.type",
        ),
        (
            json!({"context_management": {"edits": [{"type": "compact"}]}}),
            "context_management.edits[0].type",
        ),
        (
            json!({"thinking": {"type": "enabled", "budget_tokens": 0}}),
            "thinking.budget_tokens",
        ),
    ] {
        let mut b = body.clone();
        b["max_tokens"] = json!(4);
        b["messages"] = user("x");
        let (st, _, v) = post(&s.url("/v1/messages"), &b.to_string(), None);
        assert_eq!(st, 400, "{body}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .starts_with(field),
            "{body}: {v}"
        );
    }

    // Tool results past the trigger are cleared before rendering, and reported.
    let mut history = vec![json!({"role": "user", "content": "read the files"})];
    for i in 0..4 {
        history.push(json!({"role": "assistant", "content": [{"type": "tool_use",
            "id": format!("t{i}"), "name": "Read", "input": {"path": format!("/f{i}")}}]}));
        history.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": format!("t{i}"), "content": "lorem ipsum dolor sit amet ".repeat(20),
            "cache_control": {"type": "ephemeral"}}]}));
    }
    let tools = json!([{"name": "Read", "input_schema": {"type": "object"}}]);
    let edits = json!({"edits": [{"type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 10}, "keep": {"type": "tool_uses", "value": 1}}]});
    let whole = {
        let (_, _, v) = post(
            &s.url("/v1/messages/count_tokens"),
            &json!({"messages": history, "tools": tools}).to_string(),
            None,
        );
        v["input_tokens"].as_u64().unwrap_or(0)
    };
    let edited = {
        let (_, _, v) = post(
            &s.url("/v1/messages/count_tokens"),
            &json!({"messages": history, "tools": tools, "context_management": edits}).to_string(),
            None,
        );
        v["input_tokens"].as_u64().unwrap_or(0)
    };
    assert!(edited + 100 < whole, "cleared: {edited} of {whole}");
    let (st, v) = post_json(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 2, "messages": history, "tools": tools, "context_management": edits}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["context_management"]["applied_edits"][0]["cleared_tool_uses"], 3,
        "{v}"
    );
}

#[test]
fn model_and_token_count_routes_and_anthropic_shapes() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "1"]);
    let name = dir.file_name().unwrap().to_str().unwrap();
    let (st, body) = get(&s.url(&format!("/v1/models/{name}")), None);
    assert_eq!(st, 200, "{body}");
    let m: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (m["id"].as_str(), m["object"].as_str()),
        (Some(name), Some("model"))
    );
    let (st, body) = get(&s.url("/v1/models/gpt-4o"), None);
    assert_eq!(st, 404, "{body}");
    assert!(body.contains("not_found_error"), "{body}");

    let msg = json!({"max_tokens": 6, "temperature": 0, "system": "Be brief.",
                     "messages": user("Good morning")});
    let (st, _, counted) = post(
        &s.url("/v1/messages/count_tokens"),
        &json!({"system": "Be brief.", "messages": user("Good morning")}).to_string(),
        None,
    );
    assert_eq!(st, 200, "{counted}");
    let input = counted["input_tokens"].as_u64().unwrap();
    assert!(input > 5, "{counted}");
    // Without `thinking` the answer has no thinking block, although --think 1.
    let (st, v) = post_json(&s.url("/v1/messages"), &msg);
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["usage"]["input_tokens"].as_u64().unwrap()
            + v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        input,
        "{v}"
    );
    for block in v["content"].as_array().unwrap() {
        assert_ne!(block["type"], "thinking", "{v}");
    }
    // message_start reports the prompt's tokens.
    let mut stream = msg.clone();
    stream["stream"] = json!(true);
    let (st, events) = post_stream(&s.url("/v1/messages"), &stream);
    assert_eq!(st, 200);
    assert_eq!(events[0]["type"], "message_start", "{events:?}");
    assert_eq!(events[0]["message"]["usage"]["input_tokens"], input);
    assert_eq!(events.last().unwrap()["type"], "message_stop");
    let (st, _, v) = post(
        &s.url("/v1/messages/count_tokens"),
        &json!({"messages": []}).to_string(),
        None,
    );
    assert_eq!((st, v["type"].as_str()), (400, Some("error")), "{v}");
}

#[test]
fn metrics_are_histograms_and_an_oversized_body_is_refused_at_once() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--max-body-mb", "1"]);
    let (st, v) = post_json(
        &s.url("/v1/chat/completions"),
        &json!({"messages": user("hi"), "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    // A declared Content-Length over the limit: 413 before any body byte is sent.
    let mut c = std::net::TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
          Content-Length: 5000000\r\n\r\n",
        s.addr
    )
    .unwrap();
    let t = std::time::Instant::now();
    let mut head = [0u8; 12];
    c.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 413");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let (_, m) = get(&s.url("/metrics"), None);
    for name in [
        "k3_time_to_first_token_seconds",
        "k3_time_per_output_token_seconds",
        "k3_queue_wait_seconds",
        "k3_request_duration_seconds",
    ] {
        assert!(
            m.contains(&format!("# TYPE {name} histogram")),
            "{name}\n{m}"
        );
        assert!(
            m.contains(&format!("{name}_bucket{{le=\"0.5\"}}")),
            "{name}\n{m}"
        );
        assert!(
            m.contains(&format!("{name}_bucket{{le=\"+Inf\"}} 1\n")),
            "{name}\n{m}"
        );
        assert!(m.contains(&format!("{name}_count 1\n")), "{name}\n{m}");
    }
    assert!(m.contains("k3_requests_total{status=\"413\"} 1\n"), "{m}");
}

/// Sends `head` (request line and headers, without the blank line) and `body` on a raw
/// connection; returns the status, the headers as one lower-case string and the body.
fn raw(addr: &str, head: &str, body: &str) -> (u16, String, String) {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        c,
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (headers, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, headers.to_ascii_lowercase(), body.to_string())
}

#[test]
fn web_pages_of_other_origins_and_rebound_hosts_are_refused() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &[]);
    let port = s.addr.rsplit(':').next().unwrap().to_string();
    let chat = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    // A cross-site form or fetch: text/plain needs no preflight, but carries its Origin.
    let (st, _, body) = raw(
        &s.addr,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nOrigin: http://evil.example\r\nContent-Type: text/plain",
            s.addr
        ),
        &chat,
    );
    assert_eq!(st, 403, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--allow-origin"),
        "{v}"
    );
    let (st, _, body) = raw(
        &s.addr,
        &format!(
            "POST /v1/messages HTTP/1.1\r\nHost: {}\r\nOrigin: null\r\nContent-Type: text/plain",
            s.addr
        ),
        &chat,
    );
    assert_eq!(st, 403, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    // DNS rebinding: the page's own name in Host, no Origin on a simple GET.
    for path in ["/health", "/", "/v1/models"] {
        let (st, _, body) = raw(
            &s.addr,
            &format!("GET {path} HTTP/1.1\r\nHost: evil.example:{port}"),
            "",
        );
        assert_eq!(st, 403, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--allow-host"),
            "{v}"
        );
    }
    // The server's own page, under each loopback name, and clients that send no Origin.
    for host in [
        format!("localhost:{port}"),
        s.addr.clone(),
        format!("[::1]:{port}"),
    ] {
        let (st, _, body) = raw(
            &s.addr,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nOrigin: http://{host}\r\nContent-Type: application/json"
            ),
            &chat,
        );
        assert_eq!(st, 200, "{host}: {body}");
        let (st, _, _) = raw(&s.addr, &format!("GET / HTTP/1.1\r\nHost: {host}"), "");
        assert_eq!(st, 200, "{host}");
    }
    let (st, v) = post_json(
        &s.url("/v1/chat/completions"),
        &json!({"messages": user("hi"), "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
    let (_, m) = get(&s.url("/metrics"), None);
    assert!(m.contains("k3_requests_total{status=\"403\"} 5\n"), "{m}");
}

#[test]
fn allowed_origins_and_hosts_get_cors_answers() {
    let dir = support::tiny(0);
    let s = Server::start(
        &dir,
        &[
            "--allow-origin",
            "https://app.example,http://other.example:3000",
            "--allow-host",
            "k3.box",
        ],
    );
    let port = s.addr.rsplit(':').next().unwrap().to_string();
    let (st, headers, _) = raw(
        &s.addr,
        &format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nOrigin: https://app.example\r\n\
             Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type, authorization",
            s.addr
        ),
        "",
    );
    assert_eq!(st, 204, "{headers}");
    assert!(
        headers.contains("access-control-allow-origin: https://app.example"),
        "{headers}"
    );
    assert!(
        headers.contains("access-control-allow-headers: content-type, authorization"),
        "{headers}"
    );
    let chat = json!({"messages": user("hi"), "max_tokens": 2}).to_string();
    let (st, headers, body) = raw(
        &s.addr,
        &format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: k3.box:{port}\r\nOrigin: http://other.example:3000\r\nContent-Type: application/json"
        ),
        &chat,
    );
    assert_eq!(st, 200, "{body}");
    assert!(
        headers.contains("access-control-allow-origin: http://other.example:3000"),
        "{headers}"
    );
    let (st, _, body) = raw(
        &s.addr,
        &format!(
            "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nOrigin: https://evil.example\r\nAccess-Control-Request-Method: POST",
            s.addr
        ),
        "",
    );
    assert_eq!(st, 403, "{body}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["serve", "--demo", "--allow-origin", "evil.example"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--allow-origin"),
        "{err}"
    );
}

#[test]
fn every_error_is_json_and_quotes_client_data_short() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &[]);
    let (st, body) = get(&s.url("/v1/models/%ff"), None);
    assert_eq!(st, 404, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    assert!(
        v["error"]["message"].as_str().unwrap().contains("UTF-8"),
        "{v}"
    );
    let long = "m".repeat(1 << 20);
    for body in [
        json!({"messages": user("hi"), "model": long}),
        json!({"messages": user("hi"), long.clone(): 1}),
    ] {
        let (st, _, v) = post(&s.url("/v1/chat/completions"), &body.to_string(), None);
        assert!(st == 400 || st == 404, "{st}");
        let text = v.to_string();
        assert!(text.len() < 4096, "{} bytes: {}", text.len(), &text[..200]);
        assert!(v["error"]["message"].is_string(), "{}", &text[..200]);
    }
}

/// A `/v1/responses` body: `input`, greedy, thinking off, a small budget, and `extra`.
fn responses_body(input: Value, extra: Value) -> Value {
    let mut b = json!({"input": input, "max_output_tokens": 8, "temperature": 0,
                       "reasoning": {"effort": "none"}});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

const WEATHER_TOOL: &str = r#"[{"type": "function", "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": false}, "strict": true}]"#;

fn weather_tool() -> Value {
    serde_json::from_str(WEATHER_TOOL).unwrap()
}

#[test]
fn responses_refuse_what_they_do_not_implement_naming_it() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let url = s.url("/v1/responses");
    for (extra, field) in [
        (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
        (
            json!({"tools": [weather_tool()[0].clone(), {"type": "file_search", "vector_store_ids": []}]}),
            "tools[1].type",
        ),
        (
            json!({"tools": [{"type": "mcp", "server_label": "x"}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
        ),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"conversation": "conv_1"}), "conversation"),
        (json!({"truncation": "auto"}), "truncation"),
        (json!({"service_tier": "flex"}), "service_tier"),
        (json!({"background": true}), "background"),
        (json!({"text": {"verbosity": "low"}}), "text.verbosity"),
        (json!({"reasoning": {"effort": "huge"}}), "reasoning.effort"),
        (
            json!({"stream_options": {"chunking": 1}}),
            "stream_options.chunking",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": weather_tool(), "tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice.name",
        ),
        (
            json!({"tools": weather_tool(), "tool_choice": "required",
                   "text": {"format": {"type": "json_object"}}}),
            "text.format",
        ),
        (
            json!({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}],
                   "tool_choice": "required"}),
            "tools[0].parameters.type",
        ),
        (json!({"metadata": {"k": 1}}), "metadata.k"),
    ] {
        let body = responses_body(json!("x"), extra);
        let (st, _, v) = post(&url, &body.to_string(), None);
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
    }
    for (input, field) in [
        (
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input[0].content[0].type",
        ),
        (
            json!([{"type": "item_reference", "id": "msg_1"}]),
            "input[0].type",
        ),
        (
            json!([{"type": "web_search_call", "id": "ws_1"}]),
            "input[0].type",
        ),
        (
            json!([{"type": "function_call_output", "call_id": "c9", "output": "x"}]),
            "input[0].call_id",
        ),
        (json!([{"role": "tool", "content": "x"}]), "input[0].role"),
        (json!([]), "input"),
        (json!(7), "input"),
    ] {
        let body = responses_body(input, json!({}));
        let (st, _, v) = post(&url, &body.to_string(), None);
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
    }
    // Fields that only label, route or bill are accepted, and echoed where the API does.
    let body = responses_body(
        json!("x"),
        json!({"metadata": {"run": "7"}, "user": "u", "prompt_cache_key": "k",
               "safety_identifier": "s", "service_tier": "auto", "store": true,
               "include": ["reasoning.encrypted_content"], "truncation": "disabled",
               "parallel_tool_calls": false, "instructions": "Be brief.",
               "stream_options": {"include_obfuscation": false}}),
    );
    let (st, _, v) = post(&url, &body.to_string(), None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["metadata"], json!({"run": "7"}), "{v}");
    assert_eq!(v["instructions"], "Be brief.", "{v}");
    assert_eq!(v["parallel_tool_calls"], false, "{v}");
}

/// The `type`s of a stream's events, checking each `sequence_number` counts from 0.
fn event_types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .enumerate()
        .map(|(i, e)| {
            assert_eq!(e["sequence_number"], i, "{e}");
            e["type"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn a_responses_stream_is_typed_events_in_order_and_matches_the_whole_answer() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let url = s.url("/v1/responses");
    for summary in [false, true] {
        let mut reasoning = json!({"effort": "low"});
        if summary {
            reasoning["summary"] = json!("auto");
        }
        let body = json!({"input": "Hello", "max_output_tokens": 6, "temperature": 0,
                          "reasoning": reasoning});
        let (st, _, whole) = post(&url, &body.to_string(), None);
        assert_eq!(st, 200, "{whole}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let (st, events) = post_stream(&url, &sb);
        assert_eq!(st, 200);
        let types = event_types(&events);
        let (delta, done) = if summary {
            (
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
            )
        } else {
            (
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
            )
        };
        // Thinking on with a 6-token budget: the think channel takes it all.
        let opened = if summary {
            "response.reasoning_summary_part.added"
        } else {
            "response.content_part.added"
        };
        assert_eq!(
            &types[..4],
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                opened
            ],
            "{types:?}"
        );
        assert_eq!(types[4], delta, "{types:?}");
        assert!(types.contains(&done.to_string()), "{types:?}");
        assert_eq!(types.last().unwrap(), "response.incomplete", "{types:?}");
        let last = &events.last().unwrap()["response"];
        let text = |r: &Value| -> String {
            r["output"][0][if summary { "summary" } else { "content" }][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        let joined: String = events
            .iter()
            .filter(|e| e["type"] == delta)
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert!(!joined.is_empty());
        assert_eq!(joined, text(last), "{last}");
        assert_eq!(text(&whole), text(last), "{whole}\n{last}");
        assert_eq!(whole["status"], "incomplete");
        assert_eq!(
            whole["incomplete_details"]["reason"], "max_output_tokens",
            "{whole}"
        );
        let u = &last["usage"];
        assert_eq!(u["output_tokens"], 6, "{u}");
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 6, "{u}");
        assert!(u["input_tokens_details"]["cached_tokens"].is_u64(), "{u}");
        assert_eq!(
            u["total_tokens"].as_u64(),
            Some(u["input_tokens"].as_u64().unwrap() + 6),
            "{u}"
        );
    }
    // Thinking off: a message item whose text deltas add up to the answer.
    let body = responses_body(json!("Hello"), json!({"stream": true}));
    let (_, events) = post_stream(&url, &body);
    let types = event_types(&events);
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap_or_else(|| panic!("{types:?}"));
    assert_eq!(done["text"], json!(text), "{types:?}");
    let last = &events.last().unwrap()["response"];
    assert_eq!(last["output"][0]["type"], "message", "{last}");
    assert_eq!(last["output"][0]["content"][0]["text"], json!(text));
    assert_eq!(
        last["usage"]["output_tokens_details"]["reasoning_tokens"],
        0
    );
}

#[test]
fn responses_chain_through_previous_response_id_and_the_store() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let url = s.url("/v1/responses");
    // A forced call: the grammar makes the tiny model call the named function.
    let body = responses_body(
        json!("What is the weather in Paris?"),
        json!({"tools": weather_tool(), "max_output_tokens": 200,
               "tool_choice": {"type": "function", "name": "get_weather"}}),
    );
    let (st, _, first) = post(&url, &body.to_string(), None);
    assert_eq!(st, 200, "{first}");
    let call = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no call: {first}"))
        .clone();
    assert_eq!(call["name"], "get_weather");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{args}");
    let id = first["id"].as_str().unwrap().to_string();
    // GET returns it as it was answered.
    let (st, got) = get(&s.url(&format!("/v1/responses/{id}")), None);
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&got).unwrap(), first);
    // The next turn sends only the call's output; the conversation comes from the store,
    // and the engine resumes from the state it kept.
    let next = responses_body(
        json!([{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]),
        json!({"previous_response_id": id, "tools": weather_tool()}),
    );
    let (st, _, second) = post(&url, &next.to_string(), None);
    assert_eq!(st, 200, "{second}");
    assert_eq!(second["previous_response_id"], json!(id));
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{second}");
    // The same turn sent whole renders the same prompt.
    let whole = responses_body(
        json!([{"role": "user", "content": "What is the weather in Paris?"}, call,
               {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]),
        json!({"tools": weather_tool(), "store": false}),
    );
    let (st, _, third) = post(&url, &whole.to_string(), None);
    assert_eq!(st, 200, "{third}");
    assert_eq!(
        third["usage"]["input_tokens"], second["usage"]["input_tokens"],
        "{third}\n{second}"
    );
    // store: false keeps nothing, and says so when referenced.
    let unstored = third["id"].as_str().unwrap();
    let (st, msg) = get(&s.url(&format!("/v1/responses/{unstored}")), None);
    assert_eq!(st, 404);
    assert!(msg.contains("store: false"), "{msg}");
    let refer = responses_body(json!("and?"), json!({"previous_response_id": unstored}));
    let (st, _, v) = post(&url, &refer.to_string(), None);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "previous_response_id", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("store: false"));
    // DELETE forgets a response; a later reference is a 400 naming the field.
    let del = |id: &str| {
        let mut r = agent()
            .delete(&s.url(&format!("/v1/responses/{id}")))
            .call()
            .unwrap();
        let text = r.body_mut().read_to_string().unwrap_or_default();
        (r.status().as_u16(), text)
    };
    let (st, text) = del(&id);
    assert_eq!(st, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["deleted"],
        true
    );
    assert_eq!(del(&id).0, 404);
    let (st, _, v) = post(&url, &next.to_string(), None);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "previous_response_id", "{v}");
    let (st, _) = get(&s.url("/v1/responses/resp_nothing"), None);
    assert_eq!(st, 404);
}

#[test]
fn a_responses_json_schema_format_is_followed() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": false});
    let body = responses_body(
        json!("A number?"),
        json!({"max_output_tokens": 60,
               "text": {"format": {"type": "json_schema", "name": "num", "schema": schema,
                                   "strict": true}}}),
    );
    let (st, _, v) = post(&s.url("/v1/responses"), &body.to_string(), None);
    assert_eq!(st, 200, "{v}");
    let text = v["output"][0]["content"][0]["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(parsed["n"].is_i64() || parsed["n"].is_u64(), "{parsed}");
    assert_eq!(v["text"]["format"]["type"], "json_schema", "{v}");
}

/// The body Codex CLI sends (`codex exec "say hi"` with a `wire_api = "responses"` provider
/// and `web_search = "disabled"`), captured, its ids replaced and its long texts cut.
fn codex_request() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/codex/responses_request.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn a_codex_cli_request_is_answered_and_its_web_search_tool_named() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let url = s.url("/v1/responses");
    let mut body = codex_request();
    let model = dir.file_name().unwrap().to_str().unwrap();
    body["model"] = json!(model);
    body["max_output_tokens"] = json!(4);
    let (st, events) = post_stream(&url, &body);
    assert_eq!(st, 200, "{events:?}");
    let types = event_types(&events);
    let last = types.last().unwrap();
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "{types:?}"
    );
    let r = &events.last().unwrap()["response"];
    assert_eq!(r["store"], false, "{r}");
    // Codex asks for a reasoning summary: the think channel is reported as one.
    assert_eq!(r["reasoning"]["summary"], "auto", "{r}");
    // store: false: nothing to fetch afterwards.
    let (st, _) = get(
        &s.url(&format!("/v1/responses/{}", r["id"].as_str().unwrap())),
        None,
    );
    assert_eq!(st, 404);
    // Codex's default configuration adds its web_search tool: refused, naming it.
    body["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "web_search", "external_web_access": false}));
    let (st, _, v) = post(&url, &body.to_string(), None);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools[8].type", "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("web_search"));
}

#[test]
fn a_namespace_tools_functions_are_offered_and_their_calls_name_it() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let tools = json!([{"type": "namespace", "name": "agents", "description": "Sub-agents.",
                        "tools": weather_tool()}]);
    let body = responses_body(
        json!("Weather?"),
        json!({"tools": tools, "max_output_tokens": 200, "tool_choice": "required"}),
    );
    let (st, _, v) = post(&s.url("/v1/responses"), &body.to_string(), None);
    assert_eq!(st, 200, "{v}");
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(call["name"], "get_weather", "{v}");
    assert_eq!(call["namespace"], "agents", "{v}");
    // A namespace holds function tools only, and a name is declared once.
    for (tools, field) in [
        (
            json!([{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]),
            "tools[0].tools[0].type",
        ),
        (
            json!([weather_tool()[0].clone(),
                   {"type": "namespace", "name": "n", "tools": weather_tool()}]),
            "tools[1].tools[0].name",
        ),
    ] {
        let body = responses_body(json!("x"), json!({"tools": tools}));
        let (st, _, v) = post(&s.url("/v1/responses"), &body.to_string(), None);
        assert_eq!((st, &v["error"]["param"]), (400, &json!(field)), "{v}");
    }
}
