"""Turn a pytest-benchmark JSON run into hmacore's ratio report (bench/results/latest.json).

Convention: every case is one pytest-benchmark ``group``; inside it, one benchmark per
implementation, named by ``extra_info["impl"]`` (or a parameter called ``impl``, or the test
name containing ``hmacore`` / ``oracle`` / ``vllm``). The report has one entry per case:
``name``, ``hmacore_s``, ``baseline`` ("vllm-0.32.0" when vLLM's own function ran, "raw-nixl",
"numpy-memwrite" (a same-size buffer fill), else "oracle"), ``baseline_s``, ``ratio``
(baseline / hmacore; > 1 means hmacore is faster), the
oracle figures when vLLM is the baseline, and any ``extra_info`` figures (bytes per key, ...).
Groups whose benchmarks carry ``objects_per_block`` go to the ``memory`` list (Python objects
allocated per call / per block on a hot path, bench/bench_memory.py).
Times are medians in seconds.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from collections import defaultdict

VLLM_LABEL = "vllm-0.32.0"
BASELINE_LABELS = {"vllm": VLLM_LABEL, "raw": "raw-nixl", "oracle": "oracle",
                   "memwrite": "numpy-memwrite"}


def impl_of(bench: dict) -> str | None:
    info = bench.get("extra_info") or {}
    if info.get("impl"):
        return str(info["impl"])
    params = bench.get("params") or {}
    if params.get("impl"):
        return str(params["impl"])
    name = bench.get("name", "").lower()
    for key in ("hmacore", "oracle", "vllm", "raw", "memwrite"):
        if re.search(rf"(^|[_\[\-]){key}", name):
            return key
    return None


def build_report(raw: dict) -> dict:
    cases: dict[str, dict] = defaultdict(dict)
    extras: dict[str, dict] = defaultdict(dict)
    for b in raw.get("benchmarks", []):
        impl = impl_of(b)
        group = b.get("group") or b.get("fullname")
        if impl is None:
            continue
        cases[group][impl] = b["stats"]["median"]
        for k, v in (b.get("extra_info") or {}).items():
            if k != "impl":
                extras[group][k] = v
    entries = []
    for name in sorted(cases):
        impls = cases[name]
        if "hmacore" not in impls:
            continue
        base_key = next((k for k in ("vllm", "raw", "memwrite", "oracle") if k in impls), None)
        if base_key is None:
            continue
        entry = {
            "name": name,
            "hmacore_s": impls["hmacore"],
            "baseline": BASELINE_LABELS[base_key],
            "baseline_s": impls[base_key],
            "ratio": impls[base_key] / impls["hmacore"] if impls["hmacore"] > 0 else None,
        }
        if base_key != "oracle" and "oracle" in impls:
            entry["oracle_s"] = impls["oracle"]
            entry["oracle_ratio"] = impls["oracle"] / impls["hmacore"]
        entry.update(extras.get(name, {}))
        if name.startswith("sched_step"):
            entry["fraction_of_vllm_step"] = impls["hmacore"] / impls[base_key]
        entries.append(entry)
    memory = [dict(name=g, **{k: v for k, v in extras[g].items()})
              for g in sorted(extras) if "objects_per_block" in extras[g]]
    mi = raw.get("machine_info", {})
    return {
        "machine": {
            "python": platform.python_version(),
            "processor": mi.get("cpu", {}).get("brand_raw") or platform.processor(),
            "cores": mi.get("cpu", {}).get("count"),
            "system": platform.platform(),
        },
        "datetime": raw.get("datetime"),
        "cases": entries,
        "memory": memory,
    }


def markdown(report: dict) -> str:
    """A Markdown table of every case (for docs/performance.md)."""
    lines = ["| case | hmacore | baseline | baseline time | speed-up |",
             "|---|---:|---|---:|---:|"]
    for e in report["cases"]:
        extra = f" (oracle x{e['oracle_ratio']:.1f})" if "oracle_ratio" in e else ""
        lines.append(f"| {e['name']} | {_t(e['hmacore_s'])} | {e['baseline']} | "
                     f"{_t(e['baseline_s'])} | x{e['ratio']:.1f}{extra} |")
    if report.get("memory"):
        lines += ["", "| hot path (memory) | objects per call | objects per block | blocks |",
                  "|---|---:|---:|---:|"]
        for m in report["memory"]:
            lines.append(f"| {m['name']} | {m['objects_per_call']:.1f} | "
                         f"{m['objects_per_block']:.5f} | {m['blocks']} |")
    return "\n".join(lines)


def _t(s: float) -> str:
    return f"{s * 1e6:,.1f} us" if s < 1e-3 else f"{s * 1e3:,.2f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("raw", help="pytest-benchmark --benchmark-json output")
    ap.add_argument("-o", "--output", default="bench/results/latest.json")
    ap.add_argument("--markdown", default=None, help="also write a Markdown table here")
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        report = build_report(json.load(f))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report) + "\n")
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    for e in report["cases"]:
        print(f"{e['name']:60s} {e['baseline']:>12s} ratio {e['ratio']:8.2f}")
    print(f"{len(report['cases'])} cases -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
