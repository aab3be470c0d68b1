#!/usr/bin/env python3
"""Locality figures of a routing trace, next to the published real-K3 ones.

Written for issue 33 item 4 (`k3 synth --routing local`): reads a `--route-trace` file
(JSON lines, src/model/route_trace.rs) of text a model wrote and prints

1. distinct / selected experts of 32-token chunks (the C engine's docs/kimi_k3.md, chunked
   prefill: 2.7x on real text), overall and per MoE layer (does the topic survive depth?);
2. the hit rate of the C engine's cache-size sweep (alipex/colibri-cuda-builds-win,
   docs/kimi_k3_metal_tuning.md: 4 % at K3_EXPERT_GB 8 up to 53 % at 96, flattening near 44),
   replayed as that engine counts it: a per-layer LRU of floor(GB*1e9 / (17,547,264 * 92))
   slots (4, 27, 59 of 896), cold at the start of each run; a 13-token prompt prefilled as one
   chunk (its distinct experts looked up once, misses then inserted in order), then 16
   decoded tokens; hits over every lookup of the run, prompt included (the engine's
   `expert hit` line). Every window of 29 consecutive tokens of the trace is one such run.
   Slots scale with the trace's experts per layer (same fraction of the experts).

Pure Python, no dependencies: python3 lab/locality/measure.py TRACE [TRACE ...]
Several traces (different texts) are pooled.
"""

import json
import sys
from collections import OrderedDict, defaultdict

K3_EXPERT_BYTES = 17_547_264
K3_MOE_LAYERS = 92
K3_EXPERTS = 896
SWEEP_GB = [8, 16, 32, 44, 64, 96]
PUBLISHED = {8: "4", 44: "~52 (flat)", 96: "53"}
CHUNK = 32
PROMPT = 13
DECODE = 16


def read(path):
    """Header and, per MoE layer, each token's experts in position order."""
    with open(path) as f:
        header = json.loads(f.readline())
        rows = defaultdict(dict)
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for i, e in enumerate(r["experts"]):
                rows[r["layer"]][r["pos"] + i] = e
    tokens = {l: [v[p] for p in sorted(v)] for l, v in rows.items()}
    return header, tokens


def dedup(tokens_by_layer):
    """Selected and distinct experts over whole 32-token chunks, per layer."""
    out = {}
    for layer, toks in tokens_by_layer.items():
        sel = dist = 0
        for s in range(0, len(toks) - CHUNK + 1, CHUNK):
            chunk = toks[s : s + CHUNK]
            sel += sum(len(t) for t in chunk)
            dist += len({e for t in chunk for e in t})
        out[layer] = (sel, dist)
    return out


def lru_run(prompt, decode, slots):
    """Hits and lookups of one cold run: the prompt as one chunk, then one token a step."""
    cache = OrderedDict()
    hits = lookups = 0
    for step in [sorted({e for t in prompt for e in t})] + [sorted(t) for t in decode]:
        misses = []
        for e in step:
            lookups += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                misses.append(e)
        for e in misses:
            if slots == 0:
                break
            cache[e] = True
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits, lookups


def k3_slots(gb):
    return int(gb * 1e9 / (K3_EXPERT_BYTES * K3_MOE_LAYERS))


def main(paths):
    pooled_dedup = defaultdict(lambda: [0, 0])
    hits = defaultdict(int)
    lookups = defaultdict(int)
    experts = top_k = None
    ntok = 0
    for p in paths:
        header, tokens = read(p)
        experts, top_k = header["experts"], header["top_k"]
        ntok += len(next(iter(tokens.values())))
        for layer, (s, d) in dedup(tokens).items():
            pooled_dedup[layer][0] += s
            pooled_dedup[layer][1] += d
        for gb in SWEEP_GB:
            slots = max(1, round(k3_slots(gb) * experts / K3_EXPERTS))
            for toks in tokens.values():
                for s in range(0, len(toks) - PROMPT - DECODE + 1):
                    h, n = lru_run(
                        toks[s : s + PROMPT], toks[s + PROMPT : s + PROMPT + DECODE], slots
                    )
                    hits[gb] += h
                    lookups[gb] += n
    sel = sum(v[0] for v in pooled_dedup.values())
    dist = sum(v[1] for v in pooled_dedup.values())
    random = CHUNK * top_k / (experts * (1 - (1 - top_k / experts) ** CHUNK))
    print(f"traces: {len(paths)}, {ntok} tokens, {len(pooled_dedup)} MoE layers, "
          f"{experts} experts, top {top_k}")
    print(f"32-token chunks: selected / distinct = {sel / max(dist, 1):.2f}x "
          f"(real K3 text 2.7x; independent routing {random:.2f}x)")
    per_layer = " ".join(
        f"{l}:{s / max(d, 1):.2f}" for l, (s, d) in sorted(pooled_dedup.items())
    )
    print(f"  per layer: {per_layer}")
    print("| K3_EXPERT_GB | K3 slots of 896 | share of experts | slots here | hit % here | published hit % |")
    print("|---|---|---|---|---|---|")
    for gb in SWEEP_GB:
        slots = max(1, round(k3_slots(gb) * experts / K3_EXPERTS))
        print(f"| {gb} | {k3_slots(gb)} | {100 * k3_slots(gb) / K3_EXPERTS:.2f} % | {slots} | "
              f"{100 * hits[gb] / max(lookups[gb], 1):.1f} | {PUBLISHED.get(gb, '')} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
