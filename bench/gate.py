"""Regression gate on benchmark RATIOS (baseline time / hmacore time), never absolute times.

A case fails when ``ratio < fraction * baseline_ratio``. Use it from another project's CI:

    python -m pytest bench --benchmark-only --benchmark-json raw.json
    python bench/report.py raw.json -o latest.json
    python bench/gate.py --baseline bench/baseline.json --results latest.json --fraction 0.5

Cases missing from the results are reported (and fail with --require-all). Exit code 1 on any
failure, 0 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys


def gate(baseline: dict, results: dict, fraction: float, require_all: bool = False,
         only: str | None = None) -> tuple[list[str], list[str]]:
    """Return (failures, lines). Baseline maps case name -> ratio."""
    got = {c["name"]: c for c in results.get("cases", [])}
    failures, lines = [], []
    for name, base_ratio in sorted(baseline.get("ratios", {}).items()):
        if only and only not in name:
            continue
        case = got.get(name)
        if case is None or case.get("ratio") is None:
            msg = f"MISSING {name}"
            lines.append(msg)
            if require_all:
                failures.append(msg)
            continue
        floor = fraction * base_ratio
        ok = case["ratio"] >= floor
        line = (f"{'ok  ' if ok else 'FAIL'} {name:60s} ratio {case['ratio']:8.2f} "
                f"(baseline {base_ratio:.2f}, floor {floor:.2f})")
        lines.append(line)
        if not ok:
            failures.append(line)
    return failures, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="bench/baseline.json")
    ap.add_argument("--results", default="bench/results/latest.json")
    ap.add_argument("--fraction", type=float, default=0.5,
                    help="fail when ratio < fraction * baseline ratio (default 0.5)")
    ap.add_argument("--require-all", action="store_true", help="a missing case fails the gate")
    ap.add_argument("--only", default=None, help="only cases whose name contains this")
    args = ap.parse_args(argv)
    with open(args.baseline) as f:
        baseline = json.load(f)
    with open(args.results) as f:
        results = json.load(f)
    failures, lines = gate(baseline, results, args.fraction, args.require_all, args.only)
    print("\n".join(lines))
    missing = sum(line.startswith("MISSING") for line in lines)
    ok = sum(line.startswith("ok") for line in lines)
    print(f"bench-gate: {ok} ok, {len(failures)} failed, {missing} not run "
          f"(fraction {args.fraction})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
