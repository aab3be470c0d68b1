//! The server's parsers on hand-written inputs: request bodies, the rendered prompt with
//! tools, the model's tool-call output (malformed ones included), the Anthropic
//! translation, and SSE frames.

use k3::sampling::SamplerConfig;
use k3::serve::anthropic;
use k3::serve::openai_body::chat_request;
use k3::serve::prompt::{json_sorted, render_request};
use k3::serve::reply::{parse_reply, pieces_from_ids, pieces_from_markup};
use k3::serve::request::{ApiRole, Defaults, Limits, ToolChoice};
use k3::serve::sse::SseFrame;
use k3::tokenizer::Tokenizer;
use serde_json::{json, Value};

const DEFAULTS: Defaults = Defaults {
    sampling: SamplerConfig {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: 0,
    },
    thinking: true,
};

fn req(v: Value) -> k3::serve::request::ChatRequest {
    chat_request(v.to_string().as_bytes(), &Limits::default(), &DEFAULTS).unwrap()
}

#[test]
fn a_tool_call_in_argument_form_and_in_json_form_parses() {
    let out = "Let me check.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>\
        <|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
        <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>\
        <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|>\
        <|close|>call<|sep|><|open|>call tool=\"add\" index=\"2\"<|sep|>\
        <|open|>json type=\"object\"<|sep|>{\"a\": 1, \"b\": [2]}<|close|>json<|sep|>\
        <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    let r = parse_reply(&pieces_from_markup(out), true);
    assert_eq!(r.reasoning, "Let me check.");
    assert_eq!(r.content, "Checking.");
    assert_eq!(r.unparsed_tools, "");
    assert_eq!(r.tool_calls.len(), 2);
    assert_eq!(r.tool_calls[0].name, "get_weather");
    let args: Value = serde_json::from_str(&r.tool_calls[0].arguments).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    assert_eq!(r.tool_calls[1].name, "add");
    let args: Value = serde_json::from_str(&r.tool_calls[1].arguments).unwrap();
    assert_eq!(args, json!({"a": 1, "b": [2]}));
}

#[test]
fn malformed_or_truncated_tool_calls_become_plain_content() {
    let bad = [
        // Truncated mid-argument.
        "ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"x\" type=\"number\"<|sep|>4",
        // A number that is not one.
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>argument key=\"x\" type=\"number\"<|sep|>four<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        // A call without a tool name.
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call index=\"1\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        // JSON arguments that are not an object.
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|><|open|>json type=\"object\"<|sep|>[1,2<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        // An unterminated attribute, a stray marker, text between calls.
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f<|sep|><|sep|>junk<|close|>tools<|sep|>",
        "<|close|>response<|sep|><|open|>tools<|sep|>free text<|open|>call tool=\"f\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        // Unknown tags inside tools, and a call left open.
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>weird<|sep|><|close|>weird<|sep|><|close|>tools<|sep|>",
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|>",
    ];
    for (i, out) in bad.iter().enumerate() {
        let r = parse_reply(&pieces_from_markup(out), false);
        assert!(r.tool_calls.is_empty(), "case {i}: {r:?}");
        assert!(
            r.unparsed_tools.starts_with("<|open|>tools<|sep|>"),
            "case {i}: {r:?}"
        );
    }
    // Garbage of every shape never panics.
    let markers = [
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "<|end_of_msg|>",
        "tools",
        "call tool=\"",
        "x",
        "\"",
        "json",
        " ",
    ];
    let mut seed = 7u64;
    for _ in 0..2000 {
        let mut s = String::new();
        for _ in 0..(seed % 17) {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s.push_str(markers[(seed >> 33) as usize % markers.len()]);
        }
        let _ = parse_reply(&pieces_from_markup(&s), seed % 2 == 0);
    }
}

#[test]
fn pieces_from_ids_keep_markers_as_controls_and_text_as_text() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/synthetic");
    let t = Tokenizer::from_dir(&dir).unwrap();
    let mut ids = t.encode("a <|open|> b");
    ids.push(t.special_id("<|sep|>").unwrap());
    let p = pieces_from_ids(&t, &ids);
    assert_eq!(
        p,
        vec![
            k3::tokenizer::Piece::Text("a <|open|> b".into()),
            k3::tokenizer::Piece::Control("<|sep|>")
        ]
    );
}

#[test]
fn requests_are_read_with_their_fields() {
    let r = req(json!({
        "model": "k3", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,
        "max_completion_tokens": 77, "stop": "END", "stream": true,
        "stream_options": {"include_usage": true}, "presence_penalty": 0.5, "ignore_eos": true,
        "chat_template_kwargs": {"enable_thinking": false},
        "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "reasoning_content": "hm",
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "r"}]}));
    assert_eq!(r.params.sampling.temperature, 0.5);
    assert_eq!(r.params.sampling.top_k, 40);
    assert_eq!(r.params.sampling.seed, 3);
    assert_eq!(r.params.max_tokens, 77);
    assert_eq!(r.params.stop, vec!["END".to_string()]);
    assert!(r.params.stream && r.params.include_usage && !r.thinking);
    assert_eq!(r.params.sampling.presence_penalty, 0.5);
    assert!(r.params.ignore_eos);
    assert_eq!(r.messages[0].role, ApiRole::System);
    assert_eq!(r.messages[1].content, "ab");
    assert_eq!(r.messages[2].reasoning.as_deref(), Some("hm"));
    assert_eq!(r.messages[2].tool_calls[0].name, "f");
    assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("1"));
    assert_eq!(r.tool_choice, ToolChoice::Auto);
    let r =
        req(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"}));
    assert!(!r.thinking);
    let e = chat_request(
        br#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"huge"}"#,
        &Limits::default(),
        &DEFAULTS,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("reasoning_effort"));
    let e = chat_request(
        br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
        &Limits::default(),
        &DEFAULTS,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
    let many = json!({"messages": vec![json!({"role": "user", "content": "x"}); 5]});
    let limits = Limits {
        max_messages: 4,
        ..Limits::default()
    };
    let e = chat_request(many.to_string().as_bytes(), &limits, &DEFAULTS).unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, Some("messages")));
}

#[test]
fn tools_are_declared_and_tool_turns_rendered_in_k3s_format() {
    let r = req(json!({
        "chat_template_kwargs": {"enable_thinking": false},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"City": {"type": "string"}, "a<b": {"type": "number"}}}}}],
        "tool_choice": "required",
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "x", "function": {"name": "get_weather", "arguments": "{\"City\":\"Paris\"}"}},
                {"id": "y", "function": {"name": "get_time", "arguments": {"tz": "CET", "n": 2}}}]},
            {"role": "tool", "tool_call_id": "y", "content": "noon"},
            {"role": "tool", "tool_call_id": "x", "content": "sunny"}]}));
    let text = render_request(&r).unwrap().text();
    let want = concat!(
        "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n",
        "[{\"function\":{\"name\":\"get_weather\",\"parameters\":{\"properties\":{\"a\\u003cb\":{\"type\":\"number\"},\"City\":{\"type\":\"string\"}},\"type\":\"object\"}},\"type\":\"function\"}]",
        "\n```<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"user\"<|sep|>Paris?<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
        "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{\"City\":\"Paris\"}<|close|>json<|sep|><|close|>call<|sep|>",
        // Arguments in the order sent, as the template's `arguments.items()` writes them.
        "<|open|>call tool=\"get_time\" index=\"2\"<|sep|><|open|>argument key=\"tz\" type=\"string\"<|sep|>CET<|close|>argument<|sep|>",
        "<|open|>argument key=\"n\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        "<|close|>message<|sep|><|end_of_msg|>",
        // Results in the order of the calls they answer.
        "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"tool\" tool=\"get_time\" index=\"2\"<|sep|>noon<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>",
    );
    assert_eq!(text, want);
    assert_eq!(
        json_sorted(&json!({"b": [true, null, 1.5], "A": "é'"})),
        "{\"A\":\"é\\u0027\",\"b\":[true,null,1.5]}"
    );
}

#[test]
fn anthropic_requests_translate_onto_chat() {
    let body = json!({
        "model": "k3", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "thinking": {"type": "enabled", "budget_tokens": 100},
        "tools": [{"name": "calc", "description": "adds", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "calc"},
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "easy"},
                {"type": "tool_use", "id": "t1", "name": "calc", "input": {"a": 1, "b": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"},
                {"type": "text", "text": "thanks"}]}]});
    let r = anthropic::messages_request(body.to_string().as_bytes(), &Limits::default(), &DEFAULTS)
        .map(|r| r.chat)
        .unwrap();
    assert!(r.thinking);
    assert_eq!(r.params.max_tokens, 9);
    assert_eq!(r.params.stop, vec!["\n\n".to_string()]);
    assert_eq!(r.tool_choice, ToolChoice::Function("calc".into()));
    assert_eq!(
        r.tools[0]["function"]["parameters"],
        json!({"type": "object"})
    );
    let roles: Vec<ApiRole> = r.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            ApiRole::System,
            ApiRole::User,
            ApiRole::Assistant,
            ApiRole::Tool,
            ApiRole::User
        ]
    );
    assert_eq!(r.messages[2].reasoning.as_deref(), Some("easy"));
    assert_eq!(r.messages[2].tool_calls[0].id.as_deref(), Some("t1"));
    let args: Value =
        serde_json::from_str(r.messages[2].tool_calls[0].arguments.as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"a": 1, "b": 1}));
    assert_eq!(r.messages[3].content, "2");
    assert_eq!(r.messages[4].content, "thanks");
    for (bad, field) in [
        (json!({"messages": []}), "max_tokens"),
        (json!({"max_tokens": 5}), "messages"),
        (
            json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            "messages[0].content[0].type",
        ),
        (
            json!({"max_tokens": 5, "thinking": {"type": "maybe"}, "messages": [{"role": "user", "content": "x"}]}),
            "thinking.type",
        ),
    ] {
        let e =
            anthropic::messages_request(bad.to_string().as_bytes(), &Limits::default(), &DEFAULTS)
                .map(|r| r.chat)
                .unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{bad}: {e:?}");
    }
}

#[test]
fn sse_frames_are_written_as_the_spec_says() {
    assert_eq!(SseFrame::done().wire(), "data: [DONE]\n\n");
    assert_eq!(
        SseFrame::named("message_stop", "{}\n{}".into()).wire(),
        "event: message_stop\ndata: {}\ndata: {}\n\n"
    );
}

#[test]
fn keys_compare_by_every_byte() {
    use k3::serve::request_guard::keys_match;
    assert!(keys_match(b"abc", b"abc"));
    for k in [&b""[..], b"ab", b"abd", b"abcd", b"Abc"] {
        assert!(!keys_match(k, b"abc"), "{k:?}");
    }
}

fn chat_err(v: Value) -> k3::serve::api_error::ApiError {
    chat_request(v.to_string().as_bytes(), &Limits::default(), &DEFAULTS).unwrap_err()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn unknown_fields_are_refused_by_name_and_null_ones_count_as_left_out() {
    for (body, field) in [
        (
            json!({"messages": user("x"), "logit_bias": {"50256": -100}}),
            "logit_bias",
        ),
        (
            json!({"messages": user("x"), "temprature": 0.5}),
            "temprature",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}),
            "messages[0].audio",
        ),
        (
            json!({"messages": user("x"), "stream_options": {"include_obfuscation": true}}),
            "stream_options.include_obfuscation",
        ),
        (
            json!({"messages": user("x"), "chat_template_kwargs": {"tools_first": true}}),
            "chat_template_kwargs.tools_first",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]}),
            "messages[0].content[0].cache",
        ),
        (
            json!({"messages": user("x"), "prompt": "also this"}),
            "prompt",
        ),
    ] {
        let e = chat_err(body.clone());
        assert_eq!(
            (e.status, e.param.as_deref()),
            (400, Some(field)),
            "{body}: {e:?}"
        );
        assert!(e.message.contains(field), "{e:?}");
    }
    let e = chat_err(json!({"messages": user("x"), "logit_bias": {"1": 2}}));
    assert!(
        e.message.starts_with("logit_bias is not supported"),
        "{e:?}"
    );
    // What the openai client sends back from an earlier answer: nulls, an echoed index.
    let r = req(json!({
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "refusal": null, "audio": null,
             "function_call": null, "annotations": null,
             "tool_calls": [{"id": "c", "index": 0, "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}],
        "logit_bias": null, "functions": null, "user": "u-1"}));
    assert_eq!(r.messages[1].tool_calls[0].name, "f");
    // A type error names its path.
    for (body, field) in [
        (
            json!({"messages": user("x"), "temperature": "hot"}),
            "temperature",
        ),
        (
            json!({"messages": user("x"), "stream_options": {"include_usage": 1}}),
            "stream_options.include_usage",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "name": 5}]}),
            "messages[0].name",
        ),
    ] {
        let e = chat_err(body.clone());
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e:?}");
    }
}

#[test]
fn completions_refuse_chat_fields_and_several_prompts() {
    let comp = |v: Value| {
        k3::serve::openai_body::completion_request(
            v.to_string().as_bytes(),
            &Limits::default(),
            &DEFAULTS,
        )
    };
    for (body, field) in [
        (json!({"prompt": "a", "messages": user("x")}), "messages"),
        (
            json!({"prompt": "a", "reasoning_effort": "low"}),
            "reasoning_effort",
        ),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": "a", "echo": true}), "echo"),
        (json!({"prompt": "a", "logprobs": 9}), "logprobs"),
    ] {
        let e = comp(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e:?}");
    }
    let r = comp(json!({"prompt": ["one"], "n": 3, "logprobs": 2})).unwrap();
    assert_eq!((r.prompt.as_str(), r.params.n), ("one", 3));
    assert_eq!(r.params.logprobs, Some(2));
}

#[test]
fn seeds_are_random_unless_given() {
    let a = req(json!({"messages": user("x"), "temperature": 1}));
    let b = req(json!({"messages": user("x"), "temperature": 1}));
    assert!(!a.params.seed_given && !b.params.seed_given);
    assert_ne!(a.params.sampling.seed, b.params.sampling.seed);
    let c = req(json!({"messages": user("x"), "seed": -1}));
    assert!(c.params.seed_given);
    assert_eq!(c.params.sampling.seed, u64::MAX);
}

#[test]
fn reasoning_effort_switches_thinking_and_names_the_effort() {
    use k3::tokenizer::ThinkingEffort;
    let off = Defaults {
        thinking: false,
        ..DEFAULTS
    };
    let read = |v: Value, d: &Defaults| {
        chat_request(v.to_string().as_bytes(), &Limits::default(), d).unwrap()
    };
    for (effort, thinking, named) in [
        ("none", false, None),
        ("minimal", false, None),
        ("low", true, Some(ThinkingEffort::Low)),
        ("medium", true, Some(ThinkingEffort::Medium)),
        ("high", true, Some(ThinkingEffort::High)),
    ] {
        for d in [&DEFAULTS, &off] {
            let r = read(
                json!({"messages": user("x"), "reasoning_effort": effort}),
                d,
            );
            assert_eq!(r.thinking, thinking, "{effort}");
            if let Some(e) = named {
                assert_eq!(r.effort, Some(e), "{effort}");
            }
        }
    }
    let r = read(json!({"messages": user("x")}), &off);
    assert!(!r.thinking);
}

#[test]
fn n_is_bounded_and_logprobs_and_formats_are_read() {
    use k3::serve::request::{ResponseFormat, MAX_CHOICES};
    let r = req(json!({"messages": user("x"), "n": MAX_CHOICES}));
    assert_eq!(r.params.n, MAX_CHOICES);
    for n in [0, MAX_CHOICES + 1] {
        let e = chat_err(json!({"messages": user("x"), "n": n}));
        assert_eq!(e.param.as_deref(), Some("n"), "{e:?}");
    }
    let r = req(json!({"messages": user("x"), "logprobs": true, "top_logprobs": 5}));
    assert_eq!(r.params.logprobs, Some(5));
    let e = chat_err(json!({"messages": user("x"), "logprobs": true, "top_logprobs": 21}));
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    let e = chat_err(json!({"messages": user("x"), "top_logprobs": 2}));
    assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    let r = req(
        json!({"messages": user("x"), "response_format": {"type": "json_schema",
        "json_schema": {"name": "p", "strict": true, "schema": {"type": "object"}}}}),
    );
    assert_eq!(
        r.response_format,
        ResponseFormat::JsonSchema {
            name: "p".into(),
            schema: json!({"type": "object"}),
            strict: true
        }
    );
    let e = chat_err(json!({"messages": user("x"), "response_format": {"type": "yaml"}}));
    assert_eq!(e.param.as_deref(), Some("response_format.type"));
}

#[test]
fn output_constraints_come_from_response_format_and_forced_tool_choice() {
    use k3::grammar::{OutputConstraint, ToolSchema};
    use k3::serve::constrain::{output_constraint, Api};
    let g_params = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let tools = json!([{"type": "function", "function": {"name": "f"}},
        {"type": "function", "function": {"name": "g", "strict": true, "parameters": g_params}}]);
    let of = |body: Value| output_constraint(&req(body), Api::OpenAi);
    // Nothing constrains a plain request, nor tools the model may leave uncalled.
    assert!(of(json!({"messages": user("x"), "tools": tools}))
        .unwrap()
        .is_none());
    assert_eq!(
        of(json!({"messages": user("x"), "response_format": {"type": "json_object"}})).unwrap(),
        Some((OutputConstraint::JsonObject, "response_format".to_string()))
    );
    let schema = json!({"type": "array"});
    assert_eq!(
        of(
            json!({"messages": user("x"), "response_format": {"type": "json_schema",
            "json_schema": {"name": "n", "schema": schema}}})
        )
        .unwrap(),
        Some((
            OutputConstraint::JsonSchema {
                schema,
                strict: false
            },
            "response_format.json_schema.schema".to_string()
        ))
    );
    let f = ToolSchema {
        name: "f".into(),
        parameters: json!({"type": "object"}),
        strict: false,
    };
    let g = ToolSchema {
        name: "g".into(),
        parameters: g_params,
        strict: true,
    };
    let forced = |tools: Vec<ToolSchema>| {
        Some((
            OutputConstraint::ToolCall { tools },
            "tool_choice".to_string(),
        ))
    };
    assert_eq!(
        of(json!({"messages": user("x"), "tools": tools, "tool_choice": "required"})).unwrap(),
        forced(vec![f.clone(), g.clone()])
    );
    assert_eq!(
        of(json!({"messages": user("x"), "tools": tools,
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}))
        .unwrap(),
        forced(vec![g])
    );
    let e = of(
        json!({"messages": user("x"), "tools": tools, "tool_choice": "required",
                      "response_format": {"type": "json_object"}}),
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("response_format"), "{e:?}");
    // Anthropic's `any` forces a call too; a schema error names Anthropic's field.
    let any = json!({"max_tokens": 5, "messages": user("x"), "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]});
    let r = anthropic::messages_request(any.to_string().as_bytes(), &Limits::default(), &DEFAULTS)
        .map(|r| r.chat)
        .unwrap();
    assert_eq!(
        output_constraint(&r, Api::Anthropic).unwrap(),
        forced(vec![f])
    );
    let mut bad = any.clone();
    bad["tools"][0]["input_schema"] = json!({"type": "string"});
    let r = anthropic::messages_request(bad.to_string().as_bytes(), &Limits::default(), &DEFAULTS)
        .map(|r| r.chat)
        .unwrap();
    let e = output_constraint(&r, Api::Anthropic).unwrap_err();
    assert_eq!(
        e.param.as_deref(),
        Some("tools[0].input_schema.type"),
        "{e:?}"
    );
}

#[test]
fn anthropic_fields_are_typed_and_thinking_is_off_unless_asked() {
    let read = |v: Value| {
        anthropic::messages_request(v.to_string().as_bytes(), &Limits::default(), &DEFAULTS)
            .map(|r| r.chat)
    };
    // The server default thinks (DEFAULTS.thinking); Anthropic's API does not unless asked.
    let r = read(json!({"max_tokens": 5, "messages": user("x")})).unwrap();
    assert!(!r.thinking);
    for (body, field) in [
        (
            json!({"max_tokens": 5, "messages": user("x"), "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            json!({"max_tokens": 5, "messages": user("x"), "thinking": {"type": "enabled", "budget": 3}}),
            "thinking.budget",
        ),
        (
            json!({"max_tokens": 5, "messages": user("x"), "tools": [{"name": "web", "type": "web_search_20250305"}]}),
            "tools[0].type",
        ),
        (
            json!({"max_tokens": 5, "messages": user("x"), "tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": "g"}}),
            "tool_choice.name",
        ),
        (
            json!({"max_tokens": "5", "messages": user("x")}),
            "max_tokens",
        ),
    ] {
        let e = read(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e:?}");
    }
    let r = read(
        json!({"max_tokens": 5, "messages": user("x"), "metadata": {"user_id": "u"},
        "tools": [{"name": "f", "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
    )
    .unwrap();
    assert!(r.single_tool_call);
    // count_tokens takes the same body without max_tokens.
    let r = anthropic::read_request(
        json!({"messages": user("x")}).to_string().as_bytes(),
        &Limits::default(),
        &DEFAULTS,
        anthropic::MessagesRoute::CountTokens,
    )
    .unwrap();
    assert_eq!(r.chat.messages.len(), 1);
}
