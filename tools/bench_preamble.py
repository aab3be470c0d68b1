#!/usr/bin/env python3
"""A shared agent preamble: how much of it a new session reuses, and its time to first token.

  python3 tools/bench_preamble.py [MODEL_DIR | --demo] [--k3 target/release/k3]
                                  [--preamble-tokens 16000] [--flags "--backend cpu"]

Three sessions send the same tools and system prompt (about --preamble-tokens tokens) with a
different first user message, streamed, one greedy token each:
  1. cold: a fresh server with an empty prompt cache (a temporary directory);
  2. warm: the same server, a new session (the preamble's state is in RAM and on disk);
  3. restarted: a new server on the same prompt cache (the preamble's state is on disk).
Reported per session: prompt tokens, cached_tokens, and the time to first token measured by
the client (request sent to first streamed chunk), with each warm figure as a ratio of the
cold one measured in the same run. Only the standard library is used.
"""

import argparse
import http.client
import json
import re
import shlex
import subprocess
import tempfile
import time

WORDS = "read the file then edit it with the smallest change that keeps the tests green".split()


def start_server(k3, model, cache, flags):
    target = ["--demo"] if model == "--demo" else [model]
    p = subprocess.Popen(
        [k3, "serve", *target, "--port", "0", "--quiet", "--prompt-cache", cache, *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in p.stderr:
        seen.append(line)
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            return p, m.group(1)
    raise SystemExit("k3 serve did not start:\n" + "".join(seen[-20:]))


def session(addr, preamble, tools, first):
    body = {
        "messages": [
            {"role": "system", "content": preamble},
            {"role": "user", "content": first},
        ],
        "tools": tools,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=3600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:500]!r}")
    ttft, usage = None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        # The first chunk carries only the role and goes out before the prefill: the
        # first token is the first chunk with text, a tool call or a finish reason.
        ch = chunk.get("choices") or [{}]
        delta = {k for k, v in ch[0].get("delta", {}).items() if k != "role" and v}
        if ttft is None and (delta or ch[0].get("finish_reason")):
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            usage = chunk["usage"]
    c.close()
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="--demo")
    ap.add_argument("--k3", default="target/release/k3")
    ap.add_argument("--preamble-tokens", type=int, default=16000)
    ap.add_argument("--flags", default="")
    a = ap.parse_args()
    flags = shlex.split(a.flags)
    # About 1.85 tokens a word on the demo's tokenizer; the server reports the real count.
    words = int(a.preamble_tokens / 1.85)
    preamble = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    tools = [
        {"type": "function", "function": {"name": n, "description": f"{n} a file",
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                        "required": ["path"]}}}
        for n in ("read", "write", "list", "grep")
    ]
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        p, addr = start_server(a.k3, a.model, cache, flags)
        try:
            rows.append(("cold", *session(addr, preamble, tools, "Fix the typo in main.rs.")))
            rows.append(("warm", *session(addr, preamble, tools, "Why does the build fail?")))
        finally:
            p.terminate()
            p.wait()
        p, addr = start_server(a.k3, a.model, cache, flags)
        try:
            rows.append(("restarted", *session(addr, preamble, tools, "Add a parser test.")))
        finally:
            p.terminate()
            p.wait()
    cold = rows[0][1]
    print("| session | prompt tokens | cached_tokens | TTFT s | TTFT / cold |")
    print("|---|---|---|---|---|")
    for name, ttft, prompt, cached in rows:
        print(f"| {name} | {prompt} | {cached} ({100 * cached / prompt:.1f} %) | {ttft:.2f} | {ttft / cold:.3f} |")


if __name__ == "__main__":
    main()
