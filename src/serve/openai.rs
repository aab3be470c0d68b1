//! OpenAI response bodies: chat completions, their streamed chunks, text completions,
//! the model list and usage.

use super::engine::{Field, Outcome};
use super::reply::ToolCallOut;
use serde_json::{json, Value};

/// Seconds since the Unix epoch (`created`).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `usage`, with the cached prompt tokens.
pub fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

/// The per-answer timings the web page shows (an extension field).
pub fn timings(o: &Outcome) -> Value {
    let decode_tps = if o.completion_tokens > 1 && o.decode_secs > 0.0 {
        (o.completion_tokens - 1) as f64 / o.decode_secs
    } else {
        0.0
    };
    json!({
        "ttft_s": o.ttft_secs,
        "prefill_s": o.prefill_secs,
        "decode_s": o.decode_secs,
        "decode_tokens_per_s": decode_tps,
        "expert_hit_percent": o.stats.hit_percent(),
        "gb_streamed": o.stats.bytes_streamed as f64 / 1e9,
    })
}

fn tool_calls_json(calls: &[ToolCallOut], id: &str, with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": format!("call_{id}_{i}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// A whole `chat.completion`.
pub fn chat_completion(id: &str, model: &str, o: &Outcome) -> Value {
    let mut message = json!({"role": "assistant", "content": o.content});
    if !o.reasoning.is_empty() {
        message["reasoning_content"] = json!(o.reasoning);
    }
    if !o.tool_calls.is_empty() {
        message["tool_calls"] = tool_calls_json(&o.tool_calls, id, false);
    }
    json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": o.finish.as_str()}],
        "usage": usage(o),
        "timings": timings(o),
    })
}

/// One `chat.completion.chunk` with `delta` and `finish_reason`.
pub fn chat_chunk(id: &str, model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion.chunk",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })
}

/// The delta of a piece of streamed text.
pub fn text_delta(field: Field, text: &str) -> Value {
    match field {
        Field::Reasoning => json!({"reasoning_content": text}),
        Field::Content => json!({"content": text}),
    }
}

/// The chunks that end a streamed chat answer: tool calls (if any), the finish reason,
/// and the usage chunk when asked for.
pub fn chat_final_chunks(id: &str, model: &str, o: &Outcome, include_usage: bool) -> Vec<Value> {
    let mut out = Vec::new();
    if !o.tool_calls.is_empty() {
        out.push(chat_chunk(
            id,
            model,
            json!({"tool_calls": tool_calls_json(&o.tool_calls, id, true)}),
            None,
        ));
    }
    let mut last = chat_chunk(id, model, json!({}), Some(o.finish.as_str()));
    last["timings"] = timings(o);
    out.push(last);
    if include_usage {
        let mut u = json!({
            "id": format!("chatcmpl-{id}"),
            "object": "chat.completion.chunk",
            "created": now_secs(),
            "model": model,
            "choices": [],
        });
        u["usage"] = usage(o);
        out.push(u);
    }
    out
}

/// A whole `text_completion`.
pub fn completion(id: &str, model: &str, o: &Outcome) -> Value {
    json!({
        "id": format!("cmpl-{id}"),
        "object": "text_completion",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": 0, "text": o.content, "logprobs": null, "finish_reason": o.finish.as_str()}],
        "usage": usage(o),
    })
}

/// One streamed `text_completion` chunk.
pub fn completion_chunk(id: &str, model: &str, text: &str, finish: Option<&str>) -> Value {
    json!({
        "id": format!("cmpl-{id}"),
        "object": "text_completion",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
    })
}

/// `/v1/models`.
pub fn models(model: &str) -> Value {
    json!({
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "k3"}],
    })
}
