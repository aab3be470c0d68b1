//! Structured output, forced tool calls and log-probabilities of `k3 serve` over real HTTP:
//! the random tiny model, which left alone writes no JSON, answers `response_format`
//! with JSON that parses and validates, forced tool calls (OpenAI and Anthropic) with
//! arguments valid against the tool's schema, and reports the log-probabilities its
//! sampler drew from, streamed or not.

use crate::serve_support;
use crate::support;

use serde_json::{json, Value};
use serve_support::*;

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "strict": true, "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// The parameter schema of the declared tool `name`.
fn params_of(tools: &Value, name: &str) -> Value {
    tools
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == name)
        .unwrap_or_else(|| panic!("{name} was not declared"))["function"]["parameters"]
        .clone()
}

/// The `logprobs.content` entries of a streamed chat answer's choice `i`, in order.
fn streamed_chat_logprobs(chunks: &[Value], i: usize) -> Vec<Value> {
    let mut out = Vec::new();
    for ch in chunks {
        if let Some(c) = ch["choices"].get(0) {
            if c["index"] == i {
                if let Some(a) = c["logprobs"]["content"].as_array() {
                    out.extend(a.iter().cloned());
                }
            }
        }
    }
    out
}

#[test]
fn chat_logprobs_are_the_sampled_distribution_streamed_or_not() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let body = json!({"messages": user("Tell me a story"), "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let (st, v) = post_json(&chat, &body);
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert!(lp["refusal"].is_null(), "{lp}");
    let content = lp["content"].as_array().unwrap();
    assert_eq!(content.len(), 8, "one entry per generated token: {lp}");
    for e in content {
        let logprob = e["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "{e}");
        let bytes: Vec<u8> = e["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            e["token"].as_str().unwrap()
        );
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"], "{e}");
        assert_eq!(top[0]["logprob"], e["logprob"], "{e}");
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
    }
    // Streamed, the chunks carry the same entries.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (st, chunks) = post_stream(&chat, &streamed);
    assert_eq!(st, 200);
    assert_eq!(&streamed_chat_logprobs(&chunks, 0), content);
    // n choices: each its own entries; without `logprobs`, null.
    let mut two = body.clone();
    two["n"] = json!(2);
    two["temperature"] = json!(1.0);
    two["seed"] = json!(3);
    let (_, v) = post_json(&chat, &two);
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["logprobs"]["content"].as_array().unwrap().len(), 8, "{c}");
    }
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let (_, v) = post_json(&chat, &plain);
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
    // Under a JSON constraint the masked ids have no probability: the first token's
    // alternatives can all only open an object.
    let json_body = json!({"messages": user("A cat as JSON"), "max_tokens": 4,
        "temperature": 1.0, "seed": 5, "logprobs": true, "top_logprobs": 20,
        "response_format": {"type": "json_object"}});
    let (st, v) = post_json(&chat, &json_body);
    assert_eq!(st, 200, "{v}");
    let first = &v["choices"][0]["logprobs"]["content"][0];
    let top = first["top_logprobs"].as_array().unwrap();
    assert!(!top.is_empty(), "{first}");
    let mass: f64 = top
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap().exp())
        .sum();
    assert!(mass <= 1.0 + 1e-4, "{mass}");
    for t in top {
        assert!(t["token"].as_str().unwrap().starts_with('{'), "{first}");
    }
}

#[test]
fn completion_logprobs_are_parallel_arrays_streamed_or_not() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &[]);
    let url = s.url("/v1/completions");
    let body = json!({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true, "logprobs": 2});
    let (st, v) = post_json(&url, &body);
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let token_lps = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    let offsets = lp["text_offset"].as_array().unwrap();
    assert_eq!(
        (tokens.len(), token_lps.len(), top.len(), offsets.len()),
        (6, 6, 6, 6),
        "{lp}"
    );
    assert_eq!(offsets[0], 0, "{lp}");
    assert!(
        offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()),
        "{lp}"
    );
    for i in 0..6 {
        let alts = top[i].as_object().unwrap();
        assert!(!alts.is_empty() && alts.len() <= 2, "{lp}");
        // Greedy: the chosen token is the likeliest alternative.
        let best = alts
            .values()
            .map(|l| l.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(token_lps[i].as_f64().unwrap(), best, "{lp}");
        assert_eq!(alts[tokens[i].as_str().unwrap()], token_lps[i], "{lp}");
    }
    // The offsets point into the text (checked over its ASCII-only start).
    let text = v["choices"][0]["text"].as_str().unwrap();
    for (t, o) in tokens.iter().zip(offsets) {
        let t = t.as_str().unwrap();
        let o = o.as_u64().unwrap() as usize;
        if !t.is_ascii() || !text[..o.min(text.len())].is_ascii() {
            break;
        }
        assert!(text[o..].starts_with(t), "{t:?} at {o} of {text:?}");
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (st, chunks) = post_stream(&url, &streamed);
    assert_eq!(st, 200);
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for ch in &chunks {
        if let Some(l) = ch["choices"][0]["logprobs"].as_object() {
            for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let items = l[k].as_array().unwrap().clone();
                joined[k].as_array_mut().unwrap().extend(items);
            }
        }
    }
    assert_eq!(&joined, lp);
}

#[test]
fn response_format_json_parses_and_validates_streamed_or_not() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    // The premise: left alone, the random model writes no JSON.
    let (_, v) = post_json(
        &chat,
        &json!({"messages": user("A cat as JSON"), "max_tokens": 48, "temperature": 0}),
    );
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");

    // Free-form JSON (keys and strings unbounded) closes before the budget ends.
    for seed in [1, 2, 5] {
        let body = json!({"messages": user("A cat as JSON"), "max_tokens": 400,
            "temperature": 0.8, "seed": seed, "response_format": {"type": "json_object"}});
        let (st, v) = post_json(&chat, &body);
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "stop", "{v}");
        let text = c["message"]["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(parsed.is_object(), "{parsed}");
        assert!(
            v["usage"]["completion_tokens"].as_u64().unwrap() <= 400,
            "{v}"
        );
        assert!(
            v["timings"]["constraint_compile_s"].as_f64().unwrap() > 0.0,
            "{v}"
        );
    }

    let schema = support::cat_schema();
    let format = json!({"type": "json_schema",
        "json_schema": {"name": "cat", "schema": schema, "strict": true}});
    let body = json!({"messages": user("A cat as JSON"), "max_tokens": 400, "temperature": 0.8,
        "seed": 4, "n": 2, "response_format": format});
    let (st, v) = post_json(&chat, &body);
    assert_eq!(st, 200, "{v}");
    let mut texts = Vec::new();
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "stop", "{v}");
        let text = c["message"]["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        support::assert_valid(&schema, &parsed);
        texts.push(text.to_string());
    }
    // Streamed, the same seed gives the same JSON.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(1);
    let (st, chunks) = post_stream(&chat, &streamed);
    assert_eq!(st, 200);
    let (_, content, finish, _) = join_chat(&chunks);
    assert_eq!(
        (content.as_str(), finish.as_str()),
        (texts[0].as_str(), "stop")
    );

    // With thinking on, the think channel comes first and closes; the answer is the JSON.
    let mut thinking = body.clone();
    thinking["n"] = json!(1);
    thinking["reasoning_effort"] = json!("high");
    thinking["max_tokens"] = json!(120);
    thinking["response_format"]["json_schema"]["strict"] = json!(false);
    let (st, v) = post_json(&chat, &thinking);
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert!(
        !m["reasoning_content"].as_str().unwrap_or("").is_empty(),
        "{v}"
    );
    let text = m["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    support::assert_valid(&schema, &parsed);

    // A budget that leaves room for the shortest valid reply gets a closed, valid one, the
    // model's own choices cut short; below that the JSON is cut where the budget ends,
    // and the answer says so.
    for seed in [1, 2, 3] {
        let short = json!({"messages": user("A cat as JSON"), "max_tokens": 72,
            "temperature": 1.0, "seed": seed, "response_format": format});
        let (_, v) = post_json(&chat, &short);
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        support::assert_valid(&schema, &parsed);
    }
    let short = json!({"messages": user("A cat as JSON"), "max_tokens": 8, "temperature": 0,
        "response_format": format});
    let (_, v) = post_json(&chat, &short);
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

#[test]
fn forced_tool_calls_validate_against_the_tools_schema() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let tools = tools();
    for (choice, seed, want) in [
        (json!("required"), 1, None),
        (json!("required"), 2, None),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            3,
            Some("get_time"),
        ),
    ] {
        let body = json!({"messages": user("What is the weather in Paris?"), "tools": tools,
            "tool_choice": choice, "max_tokens": 300, "temperature": 0.8, "seed": seed});
        let (st, v) = post_json(&chat, &body);
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        let f = &calls[0]["function"];
        let name = f["name"].as_str().unwrap();
        if let Some(w) = want {
            assert_eq!(name, w, "{v}");
        }
        let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
        support::assert_valid(&params_of(&tools, name), &args);
        // Streamed: the same call in the tool_calls chunk.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, chunks) = post_stream(&chat, &streamed);
        let call = chunks
            .iter()
            .find_map(|ch| ch["choices"][0]["delta"]["tool_calls"].get(0).cloned())
            .unwrap_or_else(|| panic!("no tool_calls chunk: {chunks:?}"));
        assert_eq!(call["function"], *f);
    }
    // Anthropic: `any` and `tool`.
    let a_tools: Vec<Value> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(
            |t| json!({"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}),
        )
        .collect();
    for (choice, want) in [
        (json!({"type": "any"}), None),
        (
            json!({"type": "tool", "name": "get_weather"}),
            Some("get_weather"),
        ),
    ] {
        let body = json!({"max_tokens": 300, "temperature": 0.8, "messages": user("Weather?"),
            "tools": a_tools, "tool_choice": choice});
        let (st, v) = post_json(&s.url("/v1/messages"), &body);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let uses: Vec<&Value> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert_eq!(uses.len(), 1, "{v}");
        let name = uses[0]["name"].as_str().unwrap();
        if let Some(w) = want {
            assert_eq!(name, w);
        }
        support::assert_valid(&params_of(&tools, name), &uses[0]["input"]);
    }
}

#[test]
fn constraints_that_cannot_hold_are_refused_naming_the_field() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let tools = tools();
    let bad_ref = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}});
    let string_args = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "string"}}}]);
    for (body, field) in [
        (
            json!({"messages": user("x"), "response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": bad_ref, "strict": true}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"messages": user("x"), "tools": tools, "tool_choice": "required",
                   "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"messages": user("x"), "tools": string_args, "tool_choice": "required"}),
            "tools[0].function.parameters.type",
        ),
        (
            json!({"messages": user("x"), "tools": [tools[0].clone(), {"type": "function",
                "function": {"name": "g", "parameters": bad_ref}}], "tool_choice": "required"}),
            "tools[1].function.parameters",
        ),
    ] {
        let (st, v) = post_json(&chat, &body);
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], field, "{body}: {v}");
    }
    let (st, v) = post_json(
        &s.url("/v1/messages"),
        &json!({"max_tokens": 8, "messages": user("x"), "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "input_schema": {"type": "array"}}]}),
    );
    assert_eq!((st, v["type"].as_str()), (400, Some("error")), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tools[0].input_schema.type"),
        "{v}"
    );
}

#[test]
fn the_turn_after_a_forced_call_resumes_before_the_tool_choice_note() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let tools = tools();
    // The same turn without the note: its prompt is the forced one's but for the note.
    let plain = json!({"messages": user("What is the weather in Paris?"), "tools": tools,
        "max_tokens": 1});
    let (st, v) = post_json(&chat, &plain);
    assert_eq!(st, 200, "{v}");
    let without_note = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let first = json!({"messages": user("What is the weather in Paris?"), "tools": tools,
        "tool_choice": "required", "max_tokens": 300, "temperature": 0.8, "seed": 5});
    let (st, v) = post_json(&chat, &first);
    assert_eq!(st, 200, "{v}");
    let prompt1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let msg = v["choices"][0]["message"].clone();
    let call_id = msg["tool_calls"][0]["id"].clone();
    // The next turn carries the call and its result where the first carried the note.
    let second = json!({"messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            msg,
            {"role": "tool", "tool_call_id": call_id, "content": "{\"temp_c\": 18}"}
        ], "tools": tools, "max_tokens": 8, "temperature": 0});
    let (st, v) = post_json(&chat, &second);
    assert_eq!(st, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Everything before the note (the tool declarations and the question) is reused: what
    // the note-less prompt has beyond it is only the generation prompt (24 tokens in the
    // tiny model's small vocabulary).
    assert!(
        cached < without_note && without_note - cached <= 32 && prompt1 > without_note,
        "cached {cached}; prompt tokens {prompt1} with the note, {without_note} without: {v}"
    );
}

#[test]
fn a_budget_that_ends_in_the_frame_leaves_the_json_alone() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let mut complete = 0;
    for max_tokens in [2, 3, 4, 5, 6, 8, 16] {
        for stream in [false, true] {
            let body = json!({"messages": user("A cat as JSON"), "max_tokens": max_tokens,
                "temperature": 0, "stream": stream, "response_format": {"type": "json_object"}});
            let (content, finish) = if stream {
                let (st, chunks) = post_stream(&chat, &body);
                assert_eq!(st, 200);
                let (_, content, finish, _) = join_chat(&chunks);
                (content, finish)
            } else {
                let (st, v) = post_json(&chat, &body);
                assert_eq!(st, 200, "{v}");
                let c = &v["choices"][0];
                (
                    c["message"]["content"].as_str().unwrap().to_string(),
                    c["finish_reason"].as_str().unwrap().to_string(),
                )
            };
            assert!(
                !content.contains("<|") && !content.contains("response"),
                "max_tokens {max_tokens}: {content:?} ({finish})"
            );
            if serde_json::from_str::<Value>(&content).is_ok() {
                complete += 1;
            }
        }
    }
    assert!(complete > 0, "no budget closed the JSON");
}

#[test]
fn schemas_the_grammar_cannot_enforce_are_refused_naming_the_schema_path() {
    let dir = support::tiny(0);
    let s = Server::start(&dir, &["--think", "0"]);
    let chat = s.url("/v1/chat/completions");
    let format = |schema: &str| {
        let schema: Value = serde_json::from_str(schema).unwrap();
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}})
    };
    let big_tool: Value = serde_json::from_str(
        r#"{"type": "function", "function": {"name": "g", "parameters": {"type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1e29}}}}}"#,
    )
    .unwrap();
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    for (body, field) in [
        (
            json!({"messages": user("x"), "response_format":
                format(r#"{"type":"object","properties":{"n":{"type":"integer","minimum":1e29}}}"#)}),
            "response_format.json_schema.schema.properties.n.minimum",
        ),
        (
            json!({"messages": user("x"), "response_format":
                format(r#"{"type":"integer","const":18446744073709551616}"#)}),
            "response_format.json_schema.schema.const",
        ),
        (
            json!({"messages": user("x"), "response_format":
                format(r#"{"type":"object","minProperties":3}"#)}),
            "response_format.json_schema.schema.minProperties",
        ),
        (
            json!({"messages": user("x"), "tools": [tools()[0].clone(), big_tool],
                "tool_choice": "required"}),
            "tools[1].function.parameters.properties.n.minimum",
        ),
        (
            json!({"messages": user("x"), "tools": many, "tool_choice": "required"}),
            "tools",
        ),
    ] {
        let (st, v) = post_json(&chat, &body);
        assert_eq!(st, 400, "{field}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(!msg.contains('\n') && !msg.contains("backtrace"), "{msg}");
    }
}
