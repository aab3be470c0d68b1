#!/usr/bin/env python3
"""Server overhead of `k3 serve`, measured against `k3 run` on the same model in one run.

  python3 tools/bench_serve.py MODEL_DIR [--k3 target/release/k3] [--ngen 64] [--rounds 3] [--no-ttft]
                               [--no-grammar] [--grammar-only]
                               [--flags "--backend gpu"]   (flags for both run and serve)

1. Decode rate: `k3 run --chat PROMPT --think 0 --ignore-eos --ngen N` (its `[K3] decode`
   line) against the same greedy turn streamed through /v1/chat/completions (client side:
   tokens after the first over the time from the first token's chunk to `[DONE]`). The
   ratio server/run is the overhead figure (target >= 0.95). Best of --rounds each, the
   rounds of the two alternating so a load that comes and goes hits both alike, and each
   round's server fresh, so its expert cache starts as cold as `k3 run`'s. Also the CPU
   time the server's HTTP threads took per streamed token (Linux: /proc).
2. Time to first token on a resent conversation: the same multi-turn request answered by a
   server that holds its prefix (prefix reuse), by one that answered the previous turn
   differently from the history the client resends (the held tokens diverge: a state
   snapshot is restored), and by one whose state was reset first.
3. Constrained decoding: the same streamed greedy turn on one server, unconstrained
   (`ignore_eos`) and under `response_format` `json_schema` (one string property, which the
   greedy demo model keeps open to the budget's close), rounds alternating. Reported: the
   client-side rate of each, the engine's own decode rate of each (its log line), their
   ratios, and the constraint's compile time (`timings.constraint_compile_s`: the grammar
   and the first mask, and the shortest-reply run), the time choosing a token took with
   and without the constraint (`timings.pick_s`), and the trie the server builds once at
   startup.

Only the standard library is used.
"""

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import time

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def start_server(k3, model, extra):
    p = subprocess.Popen(
        [k3, "serve", model, "--port", "0", "--quiet", "--think", "0", *extra],
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in p.stderr:
        seen.append(line)
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            p.startup_log = "".join(seen)
            return p, m.group(1)
    raise SystemExit("k3 serve did not start:\n" + "".join(seen[-20:]))


def post(addr, body, stream):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=3600)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()!r}")
    if not stream:
        return json.loads(r.read())
    return r


def stream_turn(addr, messages, ngen, extra=None, timings=None):
    """Returns (tokens, seconds from the first token's chunk to the end of the stream,
    seconds to the first token's chunk, cached prompt tokens). `extra` adds request fields;
    `timings`, a dict, receives the answer's `timings`."""
    t0 = time.perf_counter()
    body = {"messages": messages, "max_tokens": ngen, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    r = post(addr, body, True)
    first = last = None
    usage = None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().strip()
        if line == "data: [DONE]":
            last = time.perf_counter()
            continue
        if not line.startswith("data: "):
            continue
        msg = json.loads(line[6:])
        if msg.get("usage"):
            usage = msg["usage"]
        if timings is not None and msg.get("timings"):
            timings.update(msg["timings"])
        ch = msg.get("choices") or []
        if ch and (ch[0]["delta"].get("content") or ch[0]["delta"].get("reasoning_content")):
            first = first or time.perf_counter()
    tokens = usage["completion_tokens"]
    return tokens, (last - first) if first else 0.0, (first - t0) if first else 0.0, \
        usage["prompt_tokens_details"]["cached_tokens"]


def thread_cpu(pid):
    """CPU seconds of a process's threads by name (Linux schedstat, in ns; empty elsewhere)."""
    out = {}
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                ns = int(f.read().split()[0])
            out[name] = out.get(name, 0.0) + ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return out


def http_cpu(pid):
    return sum(v for k, v in thread_cpu(pid).items() if k.startswith("k3-http"))


def run_rate(k3, model, ngen, extra):
    o = subprocess.run(
        [k3, "run", model, "--chat", PROMPT, "--think", "0", "--ignore-eos", "--ngen", str(ngen),
         "--quiet", *extra],
        capture_output=True, text=True, check=True)
    m = re.search(r"\[K3\] decode (\d+) tokens in [\d.]+s \(([\d.]+) tok/s\)", o.stderr)
    return float(m.group(2))


def engine_rates(log):
    """The engine's own decode rate of each request in a server log, in order."""
    return [int(g) / float(d) if float(d) > 0 else 0.0
            for g, d in re.findall(r"generated (\d+) \|.*\| decode ([\d.]+)s", log)]


def grammar_cost(a):
    """Streamed greedy turns with and without a JSON-schema constraint, alternating."""
    schema = {"type": "object", "properties": {"story": {"type": "string"}},
              "required": ["story"], "additionalProperties": False}
    fmt = {"response_format": {"type": "json_schema",
                               "json_schema": {"name": "story", "schema": schema, "strict": True}}}
    msgs = [{"role": "user", "content": PROMPT}]
    server, addr = start_server(a.k3, a.model, a.extra)
    free, constrained, compile_s, lengths, picks = [], [], [], [], ([], [])
    try:
        stream_turn(addr, msgs, 4)  # warm-up
        for _ in range(a.rounds):
            t = {}
            tokens, secs, _, _ = stream_turn(addr, msgs, a.ngen, None, t)
            free.append((tokens - 1) / secs if secs > 0 else 0.0)
            picks[0].append(t.get("pick_s", 0.0) / tokens * 1e6)
            t = {}
            tokens, secs, _, _ = stream_turn(addr, msgs, a.ngen, fmt, t)
            lengths.append(tokens)
            picks[1].append(t.get("pick_s", 0.0) / tokens * 1e6)
            constrained.append((tokens - 1) / secs if secs > 0 else 0.0)
            compile_s.append(t.get("constraint_compile_s", float("nan")))
    finally:
        server.terminate()
        log = server.stderr.read()
        server.wait()
    rates = engine_rates(log)[1:]  # the warm-up first
    e_free, e_con = max(rates[0::2], default=0.0), max(rates[1::2], default=0.0)
    trie = re.search(r"output constraints: a trie of (\d+) tokens in ([\d.]+) ms",
                     server.startup_log)
    print(f"grammar: streamed unconstrained {max(free):.2f} tok/s | json_schema {max(constrained):.2f}"
          f" tok/s | ratio {max(constrained) / max(free):.3f} | the engine's own decode"
          f" {e_free:.2f} / {e_con:.2f} tok/s, ratio {e_con / e_free if e_free else 0:.3f}"
          f" (best of {a.rounds}, {a.ngen} tokens; constrained {min(lengths)}-{max(lengths)})")
    print(f"grammar: choosing a token (timings.pick_s per token, best of {a.rounds}): unconstrained"
          f" {min(picks[0]):.1f} us | json_schema {min(picks[1]):.1f} us"
          f" | the constraint's share {min(picks[1]) - min(picks[0]):.1f} us a token")
    print(f"grammar: compile (grammar + first mask) median {sorted(compile_s)[len(compile_s) // 2] * 1e3:.2f} ms"
          + (f" | trie of {trie.group(1)} tokens built once at startup in {trie.group(2)} ms" if trie else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--k3", default="target/release/k3")
    ap.add_argument("--ngen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flags", default="", help="model/backend flags for both commands")
    ap.add_argument("--no-ttft", action="store_true", help="skip the resent-conversation TTFT")
    ap.add_argument("--no-grammar", action="store_true", help="skip the constrained-decoding cost")
    ap.add_argument("--grammar-only", action="store_true", help="measure the constrained cost only")
    a = ap.parse_args()
    a.extra = a.flags.split()
    if a.grammar_only:
        return grammar_cost(a)

    msgs = [{"role": "user", "content": PROMPT}]
    serve_best = run_best = engine_best = 0.0
    streamed, http_s = 0, 0.0
    for _ in range(a.rounds):
        run_best = max(run_best, run_rate(a.k3, a.model, a.ngen, a.extra))
        server, addr = start_server(a.k3, a.model, a.extra)
        try:
            http0 = http_cpu(server.pid)
            tokens, secs, _, _ = stream_turn(addr, msgs, a.ngen)
            http_s += http_cpu(server.pid) - http0
        finally:
            server.terminate()
            log = server.stderr.read()
            server.wait()
        # The engine's own decode time of the streamed request, from its log line.
        m = re.search(r"generated (\d+) \|.*\| decode ([\d.]+)s", log)
        if m and float(m.group(2)) > 0:
            engine_best = max(engine_best, int(m.group(1)) / float(m.group(2)))
        streamed += tokens
        if secs > 0:
            serve_best = max(serve_best, (tokens - 1) / secs)
    http_us = http_s / max(streamed, 1) * 1e6
    print(f"decode: k3 run {run_best:.2f} tok/s | k3 serve (streaming) {serve_best:.2f} tok/s"
          f" | ratio {serve_best / run_best:.3f} (best of {a.rounds}, {a.ngen} tokens)"
          f" | HTTP threads {http_us:.0f} us CPU per streamed token"
          f" | the engine's own decode {engine_best:.2f} tok/s")
    if not a.no_grammar:
        grammar_cost(a)
    if a.no_ttft:
        return
    server, addr = start_server(a.k3, a.model, a.extra)
    try:

        # A conversation of a few turns, then one more turn: with and without the prefix held.
        conv = [{"role": "user", "content": PROMPT}]
        for turn in range(3):
            r = post(addr, {"messages": conv, "max_tokens": 1, "temperature": 0}, False)
            conv.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            conv.append({"role": "user", "content": f"Go on with part {turn + 2}, please. " * 8})
        reuse, diverged, fresh = [], [], []
        for _ in range(a.rounds):
            # The previous turn answered with one token: the held tokens are a prefix.
            post(addr, {"messages": conv[:-2], "max_tokens": 1, "temperature": 0}, False)
            _, _, ttft, cached = stream_turn(addr, conv, 2)
            reuse.append((ttft, cached))
            # Answered with more than the history keeps: the held tokens diverge from it.
            post(addr, {"messages": conv[:-2], "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True}, False)
            _, _, ttft, cached = stream_turn(addr, conv, 2)
            diverged.append((ttft, cached))
            post(addr, {"messages": [{"role": "user", "content": "reset"}], "max_tokens": 1}, False)
            _, _, ttft, cached0 = stream_turn(addr, conv, 2)
            fresh.append((ttft, cached0))
        r_t = min(t for t, _ in reuse)
        d_t = min(t for t, _ in diverged)
        f_t = min(t for t, _ in fresh)
        print(f"ttft on a resent conversation: with prefix reuse {r_t * 1e3:.1f} ms "
              f"(cached {reuse[0][1]} tokens) | diverged, from a snapshot {d_t * 1e3:.1f} ms "
              f"(cached {diverged[0][1]}) | without {f_t * 1e3:.1f} ms (cached {fresh[0][1]}) | "
              f"ratios {r_t / f_t:.3f} and {d_t / f_t:.3f}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
