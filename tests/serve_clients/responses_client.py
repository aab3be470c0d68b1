"""The official `openai` Python client's Responses API (`client.responses`) against a
running `k3 serve`: a whole and a streamed answer, and a function-tool loop whose first call
is forced by `tool_choice`, continued once with the items passed back and once through
`previous_response_id`.

Usage: python3 responses_client.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when a client module is missing.
"""

import json
import sys

try:
    import jsonschema
    import openai
except ImportError as e:
    print(f"the `{e.name}` Python module is not installed (pip install openai jsonschema)")
    sys.exit(3)

if not hasattr(openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9"), "responses"):
    print(f"openai {openai.__version__} has no Responses API (pip install -U openai)")
    sys.exit(3)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER, "strict": True}]


def whole_and_streamed(client, **args):
    """One greedy answer, whole and streamed; the stream's events must rebuild it."""
    r = client.responses.create(**args)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status in ("completed", "incomplete"), r
    assert r.usage.output_tokens >= 1, r.usage
    assert 0 <= r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens, r.usage
    assert 0 <= r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens

    seq, text, reasoning, args_delta, final, added = [], "", "", {}, None, []
    for ev in client.responses.create(stream=True, **args):
        seq.append(ev.sequence_number)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            reasoning += ev.delta
        elif ev.type == "response.function_call_arguments.delta":
            args_delta[ev.item_id] = args_delta.get(ev.item_id, "") + ev.delta
        elif ev.type == "response.output_item.added":
            added.append(ev.item.type)
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert seq == list(range(len(seq))), seq
    assert final is not None, "no response.completed"
    assert text == r.output_text == final.output_text, (text, r.output_text, final.output_text)
    assert [i.type for i in final.output] == [i.type for i in r.output] == added, (final, r)
    for item in final.output:
        if item.type == "function_call":
            assert args_delta[item.id] == item.arguments, (args_delta, item)
        if item.type == "reasoning":
            parts = item.content or item.summary
            assert "".join(p.text for p in parts) == reasoning, (item, reasoning)
    return r


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    # Thinking on: a reasoning item first, its text in the think channel.
    r = whole_and_streamed(client, model=model, input="Hello", max_output_tokens=8,
                           temperature=0, reasoning={"effort": "low"})
    assert r.output[0].type == "reasoning", r.output
    assert r.usage.output_tokens_details.reasoning_tokens >= 1, r.usage
    # As a summary when one is asked for.
    whole_and_streamed(client, model=model, input="Hello", max_output_tokens=8, temperature=0,
                       reasoning={"effort": "low", "summary": "auto"})

    # A forced function call, then the loop continued with the items passed back.
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    base_args = dict(model=model, tools=TOOLS, temperature=0, reasoning={"effort": "none"},
                     instructions="Answer briefly.")
    r = whole_and_streamed(client, input=ask, max_output_tokens=200,
                           tool_choice={"type": "function", "name": "get_weather"}, **base_args)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1, r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}
    passed_back = ask + [i.model_dump(exclude_none=True) for i in r.output] + [result]
    a = whole_and_streamed(client, input=passed_back, max_output_tokens=16, store=False,
                           **base_args)
    # The same turn through the store: the same prompt, resumed from the kept state.
    b = client.responses.create(input=[result], previous_response_id=r.id,
                                max_output_tokens=16, **base_args)
    assert b.usage.input_tokens == a.usage.input_tokens, (a.usage, b.usage)
    assert b.output_text == a.output_text, (a.output_text, b.output_text)
    assert b.usage.input_tokens_details.cached_tokens > 0, b.usage
    # The answer can be fetched, then deleted.
    assert client.responses.retrieve(b.id).output_text == b.output_text
    client.responses.delete(b.id)
    try:
        client.responses.retrieve(b.id)
        raise AssertionError("a deleted response was still returned")
    except openai.NotFoundError:
        pass
    # A refused tool surfaces as a BadRequestError naming it.
    try:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
        raise AssertionError("a web_search tool was accepted")
    except openai.BadRequestError as e:
        assert "web_search" in str(e), e
    print("responses client: ok")


if __name__ == "__main__":
    main()
