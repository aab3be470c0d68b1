//! OpenAI response bodies: chat completions, their streamed chunks, text completions,
//! the model list and usage.

use super::job::{ChoiceOut, Delta, Field, Outcome};
use super::logprobs::{chat_json, completion_json};
use super::reply::ToolCallOut;
use serde_json::{json, Value};

/// Seconds since the Unix epoch (`created`).
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `usage`, with the cached prompt tokens.
pub(crate) fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
    })
}

/// The per-answer timings the web page shows (an extension field).
pub(crate) fn timings(o: &Outcome) -> Value {
    let decode_tps = if o.completion_tokens > 1 && o.decode_secs > 0.0 {
        (o.completion_tokens - 1) as f64 / o.decode_secs
    } else {
        0.0
    };
    let mut t = json!({
        "ttft_s": o.ttft_secs,
        "prefill_s": o.prefill_secs,
        "decode_s": o.decode_secs,
        "decode_tokens_per_s": decode_tps,
        "expert_hit_percent": o.stats.hit_percent(),
        "gb_streamed": o.stats.bytes_streamed as f64 / 1e9,
        "pick_s": o.pick_secs,
    });
    if let Some(s) = o.constraint_compile_secs {
        t["constraint_compile_s"] = json!(s);
    }
    t
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

fn chat_message(id: &str, c: &ChoiceOut, choice: usize) -> Value {
    let mut message = json!({"role": "assistant", "content": c.content});
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = json!(c.reasoning);
    }
    if !c.tool_calls.is_empty() {
        message["tool_calls"] = tool_calls_json(&c.tool_calls, &choice_id(id, choice), false);
    }
    message
}

/// The id tool calls of a choice are named after (choice 0 keeps the answer's id).
fn choice_id(id: &str, choice: usize) -> String {
    if choice == 0 {
        id.to_string()
    } else {
        format!("{id}_{choice}")
    }
}

/// A whole `chat.completion`.
pub(crate) fn chat_completion(id: &str, model: &str, o: &Outcome) -> Value {
    let choices: Vec<Value> = o
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "message": chat_message(id, c, i),
                   "logprobs": c.logprobs.as_deref().map(chat_json),
                   "finish_reason": c.finish.as_str()})
        })
        .collect();
    json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion",
        "created": now_secs(),
        "model": model,
        "system_fingerprint": fingerprint(o.seed),
        "choices": choices,
        "usage": usage(o),
        "timings": timings(o),
    })
}

/// `system_fingerprint`: names the sampler's seed, so a client can replay an answer by
/// sending it back as `seed`.
pub(crate) fn fingerprint(seed: u64) -> String {
    format!("k3-seed-{seed}")
}

/// One `chat.completion.chunk` of choice `index` with `delta` and `finish_reason`.
pub(crate) fn chat_chunk(
    id: &str,
    model: &str,
    index: usize,
    delta: Value,
    finish: Option<&str>,
) -> Value {
    json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion.chunk",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}],
    })
}

/// The delta of a piece of streamed text.
pub(crate) fn text_delta(field: Field, text: &str) -> Value {
    match field {
        Field::Reasoning => json!({"reasoning_content": text}),
        Field::Content => json!({"content": text}),
    }
}

/// The chunk of a streamed piece: its text, and the log-probabilities of the tokens since
/// the previous chunk when the request asked for them (a piece may carry only those).
pub(crate) fn chat_delta_chunk(id: &str, model: &str, d: &Delta) -> Value {
    let delta = if d.text.is_empty() {
        json!({})
    } else {
        text_delta(d.field, &d.text)
    };
    let mut c = chat_chunk(id, model, d.choice, delta, None);
    if !d.logprobs.is_empty() {
        c["choices"][0]["logprobs"] = chat_json(&d.logprobs);
    }
    c
}

/// The `text_completion` chunk of a streamed piece, with its tokens' log-probabilities.
pub(crate) fn completion_delta_chunk(id: &str, model: &str, d: &Delta) -> Value {
    let mut c = completion_chunk(id, model, d.choice, &d.text, None);
    if !d.logprobs.is_empty() {
        c["choices"][0]["logprobs"] = completion_json(&d.logprobs);
    }
    c
}

/// The chunks that end a streamed chat answer: per choice its tool calls (if any) and
/// finish reason, then the usage chunk when asked for.
pub(crate) fn chat_final_chunks(
    id: &str,
    model: &str,
    o: &Outcome,
    include_usage: bool,
) -> Vec<Value> {
    let mut out = Vec::new();
    for (i, c) in o.choices.iter().enumerate() {
        if !c.tool_calls.is_empty() {
            out.push(chat_chunk(
                id,
                model,
                i,
                json!({"tool_calls": tool_calls_json(&c.tool_calls, &choice_id(id, i), true)}),
                None,
            ));
        }
        let mut last = chat_chunk(id, model, i, json!({}), Some(c.finish.as_str()));
        if i + 1 == o.choices.len() {
            last["timings"] = timings(o);
            last["system_fingerprint"] = json!(fingerprint(o.seed));
        }
        out.push(last);
    }
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
pub(crate) fn completion(id: &str, model: &str, o: &Outcome) -> Value {
    let choices: Vec<Value> = o
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "text": c.content,
                   "logprobs": c.logprobs.as_deref().map(completion_json),
                   "finish_reason": c.finish.as_str()})
        })
        .collect();
    json!({
        "id": format!("cmpl-{id}"),
        "object": "text_completion",
        "created": now_secs(),
        "model": model,
        "system_fingerprint": fingerprint(o.seed),
        "choices": choices,
        "usage": usage(o),
    })
}

/// One streamed `text_completion` chunk of choice `index`.
pub(crate) fn completion_chunk(
    id: &str,
    model: &str,
    index: usize,
    text: &str,
    finish: Option<&str>,
) -> Value {
    json!({
        "id": format!("cmpl-{id}"),
        "object": "text_completion",
        "created": now_secs(),
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": finish}],
    })
}

/// One entry of `/v1/models`, also `/v1/models/{id}`.
pub(crate) fn model_entry(model: &str) -> Value {
    json!({"id": model, "object": "model", "created": 0, "owned_by": "k3"})
}

/// `/v1/models`.
pub(crate) fn models(model: &str) -> Value {
    json!({
        "object": "list",
        "data": [model_entry(model)],
    })
}
