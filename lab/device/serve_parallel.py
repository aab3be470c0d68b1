#!/usr/bin/env python3
"""k3 serve with several clients at once (issue 44): aggregate tok/s of N concurrent greedy
streams against one, and a short chat's TTFT while a long prompt prefills, each under
--parallel P and under --parallel 1 (one at a time), with ratios. Standard library only.

  python3 lab/device/serve_parallel.py MODEL_DIR --k3 target/release/k3 --flags "--backend cpu"
"""
import argparse, os, json, subprocess, threading, time, urllib.request, re, sys, shlex


def start(k3, model, flags):
    cmd = [k3, "serve", model, "--port", "0", "--quiet"] + flags
    # No prompt cache: every prompt is prefilled, in every run.
    env = dict(os.environ, K3_NO_PROMPT_CACHE="1")
    env.pop("K3_PROMPT_CACHE", None)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=env)
    for line in p.stderr:
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, "http://" + m.group(1)
    raise SystemExit("k3 serve did not start: " + " ".join(cmd))


# Sampling temperature of every chat (--temperature; 0 = greedy).
TEMPERATURE = 0.0


def chat(url, content, max_tokens):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": TEMPERATURE, "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def stream(url, body, out):
    """Streams one chat; out gets t0, first (first token), end, tokens."""
    out["t0"] = time.time()
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    n = 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("usage"):
                out["usage_tokens"] = msg["usage"]["completion_tokens"]
            d = msg["choices"]
            if d and (d[0]["delta"].get("content") or d[0]["delta"].get("reasoning_content")):
                n += 1
                out.setdefault("first", time.time())
    out["end"] = time.time()
    out["tokens"] = out.get("usage_tokens", n)


def health(url):
    return json.load(urllib.request.urlopen(url + "/health", timeout=10))


def aggregate(url, n, ngen):
    outs = [{} for _ in range(n)]
    ts = [threading.Thread(target=stream, args=(url, chat(url, f"Story {i}", ngen), outs[i]))
          for i in range(n)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # Tokens as the usage counts them (streamed pieces where there is none).
    return sum(o["tokens"] for o in outs) / (time.time() - t0)


def interleave(url, words, short_tokens):
    # Prompts that share no prefix, so no slot's held state shortens a prefill.
    alone_long, alone_short = {}, {}
    stream(url, chat(url, "alpha " + "word " * words, 2), alone_long)
    stream(url, chat(url, "Hi there", short_tokens), alone_short)
    long, short = {}, {}
    t = threading.Thread(target=stream, args=(url, chat(url, "beta " + "word " * words, 2), long))
    t.start()
    # Send the short chat once the long one is in the engine (prefilling).
    while not health(url).get("state") == "busy":
        time.sleep(0.005)
    time.sleep(0.2)
    stream(url, chat(url, "Good day", short_tokens), short)
    t.join()
    return {
        "long_alone_s": alone_long["end"] - alone_long["t0"],
        "short_ttft_alone_s": alone_short["first"] - alone_short["t0"],
        "short_ttft_beside_long_s": short["first"] - short["t0"],
        "long_beside_short_s": long["end"] - long["t0"],
        "short_first_before_long_first": short["first"] < long.get("first", 1e18),
    }


def main():
    a = argparse.ArgumentParser()
    a.add_argument("model")
    a.add_argument("--k3", default="target/release/k3")
    a.add_argument("--flags", default="--backend cpu")
    a.add_argument("--parallel", type=int, default=4)
    a.add_argument("--streams", default="1,4")
    a.add_argument("--ngen", type=int, default=64)
    a.add_argument("--words", type=int, default=4000)
    a.add_argument("--context", type=int, default=32768)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--aggregate-only", action="store_true",
                   help="only the aggregate tok/s under --parallel P, no long prefill")
    a = a.parse_args()
    global TEMPERATURE
    TEMPERATURE = a.temperature
    flags = shlex.split(a.flags) + ["--max-tokens", str(a.context)]
    res = {}
    for par in (a.parallel, 1):
        p, url = start(a.k3, a.model, flags + ["--parallel", str(par)])
        try:
            aggregate(url, 1, 8)  # warm-up
            rates = {n: aggregate(url, n, a.ngen) for n in map(int, a.streams.split(","))}
            if a.aggregate_only:
                print(f"--parallel {par}: aggregate tok/s by streams {rates}")
                return 0
            il = interleave(url, a.words, 8)
        finally:
            p.kill()
        res[par] = (rates, il)
        print(f"--parallel {par}: aggregate tok/s by streams {rates}")
        print(f"--parallel {par}: {json.dumps(il)}")
        base = rates[min(rates)]
        for n, r in rates.items():
            print(f"--parallel {par}: {n} streams / 1 stream aggregate: {r / base:.2f}x")
        print(f"--parallel {par}: short TTFT beside the long prefill / alone: "
              f"{il['short_ttft_beside_long_s'] / il['short_ttft_alone_s']:.2f}x; "
              f"long request beside / alone: {il['long_beside_short_s'] / il['long_alone_s']:.2f}x")
    p4, p1 = res[a.parallel][1], res[1][1]
    print(f"short TTFT beside the long prefill, --parallel {a.parallel} / --parallel 1: "
          f"{p4['short_ttft_beside_long_s'] / p1['short_ttft_beside_long_s']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
