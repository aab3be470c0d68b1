"""Several official clients at once against a running `k3 serve --parallel 4`.

Three `openai` chats and two `anthropic` messages, greedy, first each alone and then all
five at once from threads: every reply must equal its reply alone. Then one streaming
client closes its stream part-way while the others stream to their end: theirs must still
equal their replies alone, and the engine must end idle.

Usage: python3 concurrent_clients.py BASE_URL MODEL
Exit 0 when every check passes; exit 3 (and a message) when a client module is missing.
"""

import json
import sys
import threading
import time
import urllib.request

try:
    import anthropic
    import openai
except ImportError as e:
    print(f"a client module is not installed ({e.name}; pip install openai anthropic)")
    sys.exit(3)

OPENAI_PROMPTS = ["Tell me about the sea", "Write a short poem", "Count to ten"]
ANTHROPIC_PROMPTS = ["Describe a cat", "Name three colors"]
TOKENS = 24
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
# Newer `anthropic` clients take no `temperature` argument; the field still goes in the body.
GREEDY = {"temperature": 0}


def openai_chat(client, model, prompt, stream=False):
    """One greedy chat's text, streamed or not."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=TOKENS, temperature=0,
            extra_body=NO_THINKING,
        )
        assert r.choices[0].finish_reason == "length", r
        return r.choices[0].message.content
    text = ""
    with client.chat.completions.create(
        model=model, messages=messages, max_tokens=TOKENS, temperature=0, stream=True,
        extra_body=NO_THINKING,
    ) as s:
        for chunk in s:
            for c in chunk.choices:
                text += c.delta.content or ""
    return text


def anthropic_message(client, model, prompt, stream=False):
    """One greedy message's text, streamed or not."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        m = client.messages.create(
            model=model, messages=messages, max_tokens=TOKENS, extra_body=GREEDY,
        )
        return "".join(b.text for b in m.content if b.type == "text")
    with client.messages.stream(
        model=model, messages=messages, max_tokens=TOKENS, extra_body=GREEDY,
    ) as s:
        return "".join(s.text_stream)


def at_once(calls):
    """Runs every call on a thread of its own, released together; their results in order."""
    results = [None] * len(calls)
    errors = []
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        try:
            results[i] = call()
        except Exception as e:  # noqa: BLE001 - reported below with its call
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def metric(base, name):
    """A value of `/metrics` by its series name."""
    with urllib.request.urlopen(base + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def health(base):
    with urllib.request.urlopen(base + "/health") as r:
        return json.loads(r.read())


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)

    calls = [lambda p=p: openai_chat(oa, model, p) for p in OPENAI_PROMPTS]
    calls += [lambda p=p: anthropic_message(an, model, p) for p in ANTHROPIC_PROMPTS]
    alone = [c() for c in calls]
    assert all(alone), alone
    shared_before = metric(base, "k3_batch_size_count") - metric(base, 'k3_batch_size_bucket{le="1"}')
    assert shared_before == 0, "requests sent one at a time shared a step"

    together = at_once(calls)
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a == t, f"request {i}: alone {a!r}, together {t!r}"
    shared = metric(base, "k3_batch_size_count") - metric(base, 'k3_batch_size_bucket{le="1"}')
    assert shared > 0, "the five requests never shared a step"

    # One streaming client leaves part-way; the others stream on to their end.
    left = threading.Event()

    def leaver():
        s = oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Go on and on"}],
            max_tokens=20000, temperature=0, stream=True, extra_body=NO_THINKING,
        )
        pieces = 0
        for chunk in s:
            if any(c.delta.content for c in chunk.choices):
                pieces += 1
            if pieces == 3:
                break
        s.close()
        left.set()
        return pieces

    streams = [
        leaver,
        lambda: openai_chat(oa, model, OPENAI_PROMPTS[0], stream=True),
        lambda: openai_chat(oa, model, OPENAI_PROMPTS[1], stream=True),
        lambda: anthropic_message(an, model, ANTHROPIC_PROMPTS[0], stream=True),
    ]
    got = at_once(streams)
    assert left.is_set() and got[0] == 3, got
    want = [alone[0], alone[1], alone[3]]
    for i, (w, g) in enumerate(zip(want, got[1:])):
        assert w == g, f"stream {i}: alone {w!r}, beside a client that left {g!r}"

    # The client that left frees its slot: the engine ends idle, nothing left running.
    deadline = time.time() + 30
    while True:
        h = health(base)
        if h["state"] == "idle" and not h["sequences"]:
            break
        assert time.time() < deadline, f"the engine never went idle: {h}"
        time.sleep(0.05)
    print("concurrent clients: ok")


if __name__ == "__main__":
    main()
