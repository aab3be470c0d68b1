"""A scripted agent session through the official `openai` and `anthropic` Python clients
against a running `k3 serve`: user -> tool call -> tool result -> answer.

Usage: python3 tool_loop.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when a client module is missing.

The tool call of the first answer is forced (`tool_choice` required / Anthropic `any`): the
server constrains sampling to a call in K3's format, so even the random demo model calls
the tool, with arguments valid against its JSON schema. Every turn is also streamed, and the
stream must carry exactly the text, reasoning and tool calls of the whole answer: nothing
generated is lost.
"""

import json
import sys

try:
    import anthropic
    import jsonschema
    import openai
except ImportError as e:
    print(f"a client module is not installed ({e.name}; pip install openai anthropic jsonschema)")
    sys.exit(3)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def extra(obj, key):
    v = getattr(obj, key, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(key)
    return v


# A forced call's budget: its K3 framing and arguments in the tiny model's short tokens.
CALL_TOKENS = 200


def openai_turn(client, model, messages, tool_choice, max_tokens=24):
    """One greedy turn, whole and streamed; returns the whole answer's message."""
    args = dict(
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    if tool_choice is not None:
        args["tool_choice"] = tool_choice
    r = client.chat.completions.create(**args)
    assert r.object == "chat.completion", r
    assert len(r.choices) == 1, r
    choice = r.choices[0]
    assert choice.message.role == "assistant", choice
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    calls = choice.message.tool_calls or []
    assert (choice.finish_reason == "tool_calls") == bool(calls), choice
    for c in calls:
        assert c.type == "function" and c.id, c
        assert c.function.name == "get_weather", c
        jsonschema.validate(json.loads(c.function.arguments), TOOLS[0]["function"]["parameters"])
    assert r.usage.completion_tokens >= 1, r.usage
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    assert cached is None or 0 <= cached <= r.usage.prompt_tokens, r.usage
    text = choice.message.content or ""
    assert text or calls or choice.finish_reason == "stop", f"tokens came, nothing shown: {r}"

    streamed, stream_calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                stream_calls.setdefault(tc.index, [None, ""])
                if tc.function.name:
                    stream_calls[tc.index][0] = tc.function.name
                stream_calls[tc.index][1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert streamed == text, (streamed, text)
    assert finish == choice.finish_reason, (finish, choice.finish_reason)
    assert [tuple(v) for _, v in sorted(stream_calls.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ], (stream_calls, calls)
    return choice.message, cached


def openai_loop(base, model):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg, cached = openai_turn(client, model, messages, "required", CALL_TOKENS)
    calls = msg.tool_calls or []
    assert len(calls) == 1, f"a forced tool choice returned {len(calls)} calls: {msg}"
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": calls[0].function.name,
                         "arguments": calls[0].function.arguments}}
    messages.append({"role": "assistant", "content": msg.content, "tool_calls": [call]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"})
    # The forced turn's prompt ends in the template's tool-choice note, where this turn has
    # the call: the server kept its state before the note, so this turn resumes there.
    answer, cached2 = openai_turn(client, model, messages, "auto")
    if cached2 is not None:
        assert cached2 > 0, "the turn after a forced call reused none of its prompt"
    messages.append({"role": "assistant", "content": answer.content or ""})
    for i, c in enumerate(answer.tool_calls or []):
        messages[-1].setdefault("tool_calls", []).append(
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}})
        messages.append({"role": "tool", "tool_call_id": c.id, "content": f"result {i}"})
    messages.append({"role": "user", "content": "And tomorrow?"})
    final, cached3 = openai_turn(client, model, messages, "none")
    assert not final.tool_calls, final
    if cached3 is not None:
        assert cached3 > 0, "the third turn reused none of the second turn's prompt"


def anthropic_turn(client, model, messages, tool_choice, max_tokens=24):
    args = dict(
        model=model,
        max_tokens=max_tokens,
        # Sent as an extra field: recent clients no longer take `temperature` as an argument.
        extra_body={"temperature": 0},
        messages=messages,
        tools=[{"name": "get_weather", "description": "The weather in a city.",
                "input_schema": TOOLS[0]["function"]["parameters"]}],
        tool_choice=tool_choice,
    )
    m = client.messages.create(**args)
    assert m.type == "message" and m.role == "assistant", m
    assert m.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert (m.stop_reason == "tool_use") == bool(uses), m
    for b in uses:
        assert b.name == "get_weather", b
        jsonschema.validate(b.input, TOOLS[0]["function"]["parameters"])
    assert all(b.type != "thinking" for b in m.content), "thinking without `thinking`"
    assert m.usage.output_tokens >= 1, m.usage
    text = "".join(b.text for b in m.content if b.type == "text")

    streamed, stream_uses, start = "", [], None
    with client.messages.stream(**args) as s:
        for ev in s:
            if ev.type == "message_start":
                start = ev.message.usage.input_tokens
            elif ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                streamed += ev.delta.text
        final = s.get_final_message()
    stream_uses = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == text, (streamed, text)
    assert stream_uses == [(b.name, b.input) for b in uses], (stream_uses, uses)
    assert start is not None and start > 0, "message_start without input_tokens"
    counted = client.messages.count_tokens(
        model=model, messages=messages, tools=args["tools"], tool_choice=tool_choice,
    ).input_tokens
    assert counted == start, (counted, start)
    return m, uses


def anthropic_loop(base, model):
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    m, uses = anthropic_turn(client, model, messages, {"type": "any"}, CALL_TOKENS)
    assert len(uses) == 1, f"a forced tool choice returned {len(uses)} tool_use blocks: {m}"
    use = {"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}
    content = [{"type": "text", "text": b.text} for b in m.content if b.type == "text" and b.text]
    messages.append({"role": "assistant", "content": content + [use]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny, 21 C"}]})
    answer, uses = anthropic_turn(client, model, messages, {"type": "auto"})
    # Resumed from the state the server kept before the forced turn's tool-choice note.
    assert answer.usage.cache_read_input_tokens > 0, "the turn after a forced call reused none"
    content = [{"type": "text", "text": b.text} for b in answer.content if b.type == "text" and b.text]
    uses = [{"type": "tool_use", "id": u.id, "name": u.name, "input": u.input} for u in uses]
    messages.append({"role": "assistant", "content": (content + uses) or "(nothing)"})
    results = [{"type": "tool_result", "tool_use_id": u["id"], "content": "ok"} for u in uses]
    messages.append({"role": "user", "content": results + [{"type": "text", "text": "And tomorrow?"}]})
    final, uses = anthropic_turn(client, model, messages, {"type": "none"})
    assert not uses, final
    assert final.usage.cache_read_input_tokens > 0, "the third turn reused none of the second's"


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    openai_loop(base, model)
    anthropic_loop(base, model)
    print("tool loop: ok (forced calls through both clients)")


if __name__ == "__main__":
    main()
