#!/usr/bin/env python3
"""Turns the table printed by `k3 bench decode` (one row per run) into the docs/tuning.md
summary (each point the minimum of its runs) and an SVG plot of s/token against
K3_EXPERT_GB, pipe on and off.

Usage: lab/sweep_report.py DECODE_TABLE.md [PLOT.svg]
"""
import os
import sys
from collections import defaultdict


def main():
    table = sys.argv[1]
    plot = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(table)[0] + ".svg"
    runs = defaultdict(list)
    for line in open(table):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 8 or not cells[0].replace(".", "").isdigit():
            continue
        gb, pipe, _run, wall, hit, gbt, eload, busy = cells
        wall, eload, busy = float(wall), float(eload), float(busy)
        compute = wall - eload
        runs[(float(gb), int(pipe))].append(dict(wall=wall, hit=float(hit), gb=float(gbt), eload=eload,
                                                 busy=busy, compute=compute,
                                                 overlap=wall / max(busy, compute, 1e-9)))
    rows = []
    print("| K3_EXPERT_GB | K3_PIPE | s/token (min of %d) | hit %% | GB read/token | eload s/token | disk busy s/token | compute s/token | wall / max(disk, compute) |" % max(len(v) for v in runs.values()))
    print("|---|---|---|---|---|---|---|---|---|")
    for key in sorted(runs):
        best = min(runs[key], key=lambda r: r["wall"])
        rows.append((key, best))
        print("| %g | %d | %.3f | %.1f | %.2f | %.3f | %.3f | %.3f | %.2f |" % (
            key[0], key[1], best["wall"], best["hit"], best["gb"], best["eload"], best["busy"],
            best["compute"], best["overlap"]))
    write_svg(plot, rows)
    print("\nplot:", plot)


def write_svg(path, rows):
    """A dependency-free line plot: s/token against K3_EXPERT_GB, pipe on and off."""
    w, h, m = 640, 360, 60
    xs = sorted({k[0] for k, _ in rows})
    ymax = max(r["wall"] for _, r in rows) * 1.1
    def px(x):
        return m + (xs.index(x) / max(len(xs) - 1, 1)) * (w - 2 * m)
    def py(y):
        return h - m - y / ymax * (h - 2 * m)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{m}" y1="{h-m}" x2="{w-m}" y2="{h-m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h-m}" stroke="black"/>',
             f'<text x="{w/2}" y="{h-15}" text-anchor="middle">K3_EXPERT_GB (cache request)</text>',
             f'<text x="15" y="{h/2}" transform="rotate(-90 15 {h/2})" text-anchor="middle">decode s/token (min of runs)</text>']
    for x in xs:
        parts.append(f'<text x="{px(x)}" y="{h-m+18}" text-anchor="middle">{x:g}</text>')
    for i in range(5):
        y = ymax * i / 4
        parts.append(f'<text x="{m-6}" y="{py(y)+4}" text-anchor="end">{y:.2f}</text>')
    for pipe, color in ((1, "#1f77b4"), (0, "#d62728")):
        pts = [(px(k[0]), py(r["wall"]), r) for k, r in rows if k[1] == pipe]
        if not pts:
            continue
        parts.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' % (
            color, " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)))
        for x, y, r in pts:
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
            parts.append(f'<text x="{x+5:.1f}" y="{y-6:.1f}" fill="{color}">{r["hit"]:.0f}%</text>')
        parts.append(f'<text x="{w-m-90}" y="{m + 15 * (2 - pipe)}" fill="{color}">K3_PIPE={pipe}</text>')
    parts.append("</svg>")
    open(path, "w").write("\n".join(parts))


if __name__ == "__main__":
    main()
