"""A scripted agent session through the official `openai` and `anthropic` Python clients
against a running `k3 serve`: user -> tool call -> tool result -> answer.

Usage: python3 tool_loop.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when a client module is missing.

The tool call of the second step is forced (`tool_choice` required / Anthropic `any`) when
the server implements forcing; while it refuses that with a 400 naming `tool_choice`, the
agent takes the model's own call if it made one, else a scripted one, as an agent replaying
a recorded session would. Every turn is also streamed, and the stream must carry exactly
the text, reasoning and tool calls of the whole answer: nothing generated is lost.
"""

import json
import sys

try:
    import anthropic
    import openai
except ImportError as e:
    print(f"a client module is not installed ({e.name}; pip install openai anthropic)")
    sys.exit(3)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def extra(obj, key):
    v = getattr(obj, key, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(key)
    return v


def openai_turn(client, model, messages, tool_choice):
    """One greedy turn, whole and streamed; returns the whole answer's message."""
    args = dict(
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=24,
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
        assert isinstance(json.loads(c.function.arguments), dict), c
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
    forced = True
    try:
        msg, cached = openai_turn(client, model, messages, "required")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tool_choice", e.body
        forced = False
        msg, cached = openai_turn(client, model, messages, "auto")
    calls = msg.tool_calls or []
    assert calls or not forced, "a forced tool choice returned no call"
    if calls:
        call = {"id": calls[0].id, "type": "function",
                "function": {"name": calls[0].function.name,
                             "arguments": calls[0].function.arguments}}
    else:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages.append({"role": "assistant", "content": msg.content, "tool_calls": [call]})
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"})
    answer, cached2 = openai_turn(client, model, messages, "none")
    assert not answer.tool_calls, answer
    if cached is not None and cached2 is not None:
        assert cached2 > 0, "the second turn reused none of the first turn's prompt"
    return forced


def anthropic_turn(client, model, messages, tool_choice):
    args = dict(
        model=model,
        max_tokens=24,
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
    forced = True
    try:
        m, uses = anthropic_turn(client, model, messages, {"type": "any"})
    except anthropic.BadRequestError as e:
        assert "tool_choice" in str(e), e
        forced = False
        m, uses = anthropic_turn(client, model, messages, {"type": "auto"})
    assert uses or not forced, "a forced tool choice returned no tool_use"
    if uses:
        use = {"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}
    else:
        use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
               "input": {"city": "Paris"}}
    content = [{"type": "text", "text": b.text} for b in m.content if b.type == "text" and b.text]
    messages.append({"role": "assistant", "content": content + [use]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny, 21 C"}]})
    answer, uses = anthropic_turn(client, model, messages, {"type": "none"})
    assert not uses, answer
    return forced


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    forced_openai = openai_loop(base, model)
    forced_anthropic = anthropic_loop(base, model)
    print(f"tool loop: ok (forced calls: openai {forced_openai}, anthropic {forced_anthropic})")


if __name__ == "__main__":
    main()
