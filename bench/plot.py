"""Plots for docs/performance.md from bench/results/latest.json: hmacore's speed-up (baseline
time / hmacore time) versus request length, one panel per operation, one line per preset.

Case names are ``<operation>-<label parts>-<size>[-<label parts>]`` (pytest-benchmark
groups); the size is the one part that is a number with an optional unit (``4096``, ``32k``,
``2048tok`` tokens; ``256req`` requests), the other parts name the line. Every case with a
ratio is plotted; the script fails on a name it cannot place, so a new case cannot drop out
of the figure unseen. Run: python bench/plot.py bench/results/latest.json -o docs/img
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict

SIZE = re.compile(r"^(?P<n>\d+)(?P<unit>k|tok|req)?$")


def parse(name: str) -> tuple[str, str, int, str]:
    """``(operation, line label, size, x-axis unit)`` of a case name; ValueError if the name
    has no size part."""
    op, *parts = name.split("-")
    for i in range(len(parts) - 1, -1, -1):
        m = SIZE.match(parts[i])
        if m:
            n = int(m["n"]) * (1024 if m["unit"] == "k" else 1)
            label = "-".join(parts[:i] + parts[i + 1:]) or op
            return op, label, n, "requests" if m["unit"] == "req" else "request tokens"
    raise ValueError(f"bench case {name!r} has no size part (e.g. 4096, 32k, 2048tok, 256req)")


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
    units: dict[str, str] = {}
    for c in rep["cases"]:
        if not c.get("ratio"):
            continue
        op, label, size, unit = parse(c["name"])
        units[op] = unit
        series[op][(label, c["baseline"])].append((size, c["ratio"]))
    os.makedirs(args.outdir, exist_ok=True)
    ops = sorted(series)
    if not ops:
        print("no plottable cases")
        return 0
    cols = min(4, len(ops))
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
        ax.set_xlabel(units[op])
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
