"""Plots for docs/performance.md from bench/results/latest.json: hmacore's speed-up (baseline
time / hmacore time) versus request length, one panel per operation, one line per preset.

Case names are ``<operation>-<preset>-<tokens>`` (pytest-benchmark groups); cases that do not
follow it are skipped. Run: python bench/plot.py bench/results/latest.json -o docs/img
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

CASE = re.compile(r"^(?P<op>[A-Za-z_]+)-(?P<rest>.+)-(?P<tokens>\d+)(?P<k>k?)(tok)?$")


def parse(name: str):
    m = CASE.match(name)
    if not m:
        return None
    tokens = int(m["tokens"]) * (1024 if m["k"] else 1)
    return m["op"], m["rest"], tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results")
    ap.add_argument("-o", "--outdir", default="docs/img")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        rep = json.load(f)
    series: dict[str, dict[tuple[str, str], list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for c in rep["cases"]:
        p = parse(c["name"])
        if p is None or not c.get("ratio"):
            continue
        op, label, tokens = p
        series[op][(label, c["baseline"])].append((tokens, c["ratio"]))
    os.makedirs(args.outdir, exist_ok=True)
    ops = sorted(series)
    if not ops:
        print("no plottable cases")
        return 0
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        for (label, base), pts in sorted(series[op].items()):
            pts.sort()
            ax.plot([t for t, _ in pts], [r for _, r in pts], marker="o",
                    label=f"{label} vs {base}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="#999999", lw=0.8)
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("request tokens")
        ax.set_ylabel("speed-up (x)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle("hmacore speed-up over the baseline (higher is better; 1 = equal)", fontsize=11)
    fig.tight_layout()
    path = os.path.join(args.outdir, "bench_ratios.png")
    fig.savefig(path, dpi=100)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
