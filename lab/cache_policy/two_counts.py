#!/usr/bin/env python3
"""Prototype replay of a two-count LFU (a short decayed count plus w times a long one) against
LRU, on traces written by `k3 bench cache --layers 4 [--routing ...] --write-trace FILE`.

Engine order per chunk and layer: every distinct expert looked up, then the misses offered;
an offered expert used less than every held one is not kept (as lfu-decay). Half-lives are in
lookups of the layer (a decode token makes 16). Prints points over LRU at 11, 46 and 116
slots (the 64, 128 and 256 GB machines' budgets). Slow (pure Python): minutes per trace.

    python3 lab/cache_policy/two_counts.py fitted.jsonl drifting.jsonl
"""
import collections
import json
import sys


def load(path):
    with open(path) as f:
        json.loads(f.readline())
        recs = collections.defaultdict(list)
        for line in f:
            r = json.loads(line)
            recs[r["layer"]].append(r["load"])
    return recs


def lru(recs, slots):
    lookups = hits = 0
    for chunks in recs.values():
        held = collections.OrderedDict()
        for c in chunks:
            miss = []
            for e in c:
                lookups += 1
                if e in held:
                    hits += 1
                    held.move_to_end(e)
                else:
                    miss.append(e)
            for e in miss:
                if slots == 0:
                    continue
                if len(held) >= slots:
                    held.popitem(last=False)
                held[e] = True
    return 100 * hits / lookups


def two_counts(recs, slots, short_hl, long_hl, w):
    lookups = hits = 0
    for chunks in recs.values():
        short, long_, held, t = {}, {}, set(), 0

        def decayed(d, e, hl):
            v, t0 = d.get(e, (0.0, t))
            return v * 2 ** (-(t - t0) / hl)

        def score(e):
            return decayed(short, e, short_hl) + w * decayed(long_, e, long_hl)

        for c in chunks:
            miss = []
            for e in c:
                lookups += 1
                t += 1
                short[e] = (decayed(short, e, short_hl) + 1, t)
                long_[e] = (decayed(long_, e, long_hl) + 1, t)
                if e in held:
                    hits += 1
                else:
                    miss.append(e)
            for e in miss:
                if slots == 0:
                    continue
                if len(held) >= slots:
                    victim = min(held, key=score)
                    if score(e) < score(victim):
                        continue
                    held.remove(victim)
                held.add(e)
    return 100 * hits / lookups


if __name__ == "__main__":
    for path in sys.argv[1:]:
        recs = load(path)
        for slots in (11, 46, 116):
            base = lru(recs, slots)
            row = [path, str(slots), "lru %.1f" % base]
            for short_hl, long_hl, w in [(64, 64, 0), (64, 4096, 0.25), (64, 4096, 1.0)]:
                got = two_counts(recs, slots, short_hl, long_hl, w)
                row.append("%d/%d/%.2f %+.1f" % (short_hl, long_hl, w, got - base))
            print(" | ".join(row), flush=True)
