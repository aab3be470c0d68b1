"""The official `openai` Python client against a running `k3 serve`.

Usage: python3 openai_client.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when the openai module is missing.
"""

import json
import sys

try:
    import jsonschema
    import openai
except ImportError as e:
    print(f"the `{e.name}` Python module is not installed (pip install openai jsonschema)")
    sys.exit(3)

CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "lives": {"type": "integer", "minimum": 1, "maximum": 9},
        "color": {"enum": ["black", "white", "tabby"]},
    },
    "required": ["name", "lives", "color"],
    "additionalProperties": False,
}


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models

    # Non-streaming, thinking on: the think channel arrives as reasoning_content.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice
    assert r.usage.completion_tokens >= 1, r.usage
    reasoning = getattr(choice.message, "reasoning_content", None)
    if reasoning is None and choice.message.model_extra:
        reasoning = choice.message.model_extra.get("reasoning_content")
    assert reasoning, f"no reasoning_content with thinking on: {choice.message}"

    # Streaming gives the same greedy text.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    streamed_reasoning, streamed_content, usage, finish = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            streamed_reasoning += extra.get("reasoning_content") or ""
            streamed_content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert streamed_reasoning == reasoning, (streamed_reasoning, reasoning)
    assert streamed_content == (choice.message.content or ""), streamed_content
    assert finish == choice.finish_reason, finish
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

    # Thinking off: no reasoning, the answer is content.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert not (r.choices[0].message.model_extra or {}).get("reasoning_content"), r

    # An error comes back as the client's exception type, with the field named.
    try:
        client.chat.completions.create(model=model, messages=[], max_tokens=4)
        raise AssertionError("an empty messages list was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "messages", e.body
    try:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError:
        pass

    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length"), r

    # Log-probabilities in the client's types, streamed or not.
    args = dict(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    r = client.chat.completions.create(**args)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6, r.choices[0].logprobs
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token, t
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token, t
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4, lp

    # Structured output: the random model answers JSON valid against the schema.
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a cat."}],
            max_tokens=300,
            temperature=0.8,
            seed=seed,
            response_format=fmt,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), CAT)
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object."}],
        max_tokens=300,
        temperature=0.8,
        seed=3,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    print("openai client: ok")


main()
