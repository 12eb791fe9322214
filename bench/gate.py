"""Regression gate on benchmark RATIOS (baseline time / hmacore time), never absolute times.

Two kinds of floor, both in ``bench/baseline.json``:

* ``targets``: the project's stated targets, as ``{"pattern": floor}`` (``fnmatch``
  patterns over case names, e.g. ``"longest_hit-*-32768": 10`` = "a store lookup from vLLM's
  list[bytes] is >= 10x vLLM's at 32k"). A case a target covers fails below the target
  itself, whatever it measured before.
* ``ratios``: every other case's recorded ratio; it fails below ``fraction x`` that ratio
  (a regression guard where no target is stated).

A case of the baseline that did not run fails the gate (``--allow-missing`` to opt out);
``--select REGEX`` restricts the gate to the cases a short run is meant to produce. Exit code
1 on any failure, 0 otherwise. Use it from another project's CI:

    python -m pytest bench --benchmark-only --benchmark-json raw.json
    python bench/report.py raw.json -o latest.json
    python bench/gate.py --baseline bench/baseline.json --results latest.json --fraction 0.5
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re


def target_of(name: str, targets: dict) -> float | None:
    """The highest stated target whose pattern matches ``name`` (None: no target)."""
    hits = [float(v) for pat, v in targets.items() if fnmatch.fnmatchcase(name, pat)]
    return max(hits) if hits else None


def gate(baseline: dict, results: dict, fraction: float, require_all: bool = True,
         only: str | None = None, select: str | None = None) -> tuple[list[str], list[str]]:
    """Return (failures, lines). ``baseline``: ``{"ratios": {case: ratio}, "targets":
    {pattern: floor}}``."""
    got = {c["name"]: c for c in results.get("cases", [])}
    targets = baseline.get("targets", {})
    pick = re.compile(select) if select else None
    failures, lines = [], []
    for name, base_ratio in sorted(baseline.get("ratios", {}).items()):
        if (only and only not in name) or (pick and not pick.search(name)):
            continue
        case = got.get(name)
        if case is None or case.get("ratio") is None:
            msg = f"MISSING {name} (in the baseline, not in the results: the case did not run)"
            lines.append(msg)
            if require_all:
                failures.append(msg)
            continue
        target = target_of(name, targets)
        floor = target if target is not None else fraction * base_ratio
        kind = f"target {target:g}" if target is not None else f"baseline {base_ratio:.2f}"
        ok = case["ratio"] >= floor
        line = (f"{'ok  ' if ok else 'FAIL'} {name:60s} ratio {case['ratio']:8.2f} "
                f"({kind}, floor {floor:.2f})")
        lines.append(line)
        if not ok:
            failures.append(line)
    return failures, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="bench/baseline.json")
    ap.add_argument("--results", default="bench/results/latest.json")
    ap.add_argument("--fraction", type=float, default=0.5,
                    help="cases without a stated target fail when ratio < fraction * baseline "
                         "ratio (default 0.5)")
    ap.add_argument("--allow-missing", action="store_true",
                    help="a baseline case absent from the results is reported, not failed")
    ap.add_argument("--select", default=None,
                    help="regex: only baseline cases whose name matches (a short run's cases)")
    ap.add_argument("--only", default=None, help="only cases whose name contains this")
    args = ap.parse_args(argv)
    with open(args.baseline) as f:
        baseline = json.load(f)
    with open(args.results) as f:
        results = json.load(f)
    failures, lines = gate(baseline, results, args.fraction, not args.allow_missing, args.only,
                           args.select)
    print("\n".join(lines))
    missing = sum(line.startswith("MISSING") for line in lines)
    ok = sum(line.startswith("ok") for line in lines)
    print(f"bench-gate: {ok} ok, {len(failures)} failed ({missing} not run), "
          f"fraction {args.fraction} where no target is stated")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
