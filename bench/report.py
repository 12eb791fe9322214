"""Turn a pytest-benchmark JSON run into hmacore's ratio report (bench/results/latest.json).

Convention: every case is one pytest-benchmark ``group``; inside it, one benchmark per
implementation, named by ``extra_info["impl"]`` (or a parameter called ``impl``, or the test
name containing ``hmacore`` / ``oracle`` / ``vllm``). The report has one entry per case:
``name``, ``hmacore_s``, ``baseline`` ("vllm-0.32.0" when vLLM's own function ran, else
"oracle"), ``baseline_s``, ``ratio`` (baseline / hmacore; > 1 means hmacore is faster), the
oracle figures when vLLM is the baseline, and any ``extra_info`` figures (bytes per key, ...).
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


def impl_of(bench: dict) -> str | None:
    info = bench.get("extra_info") or {}
    if info.get("impl"):
        return str(info["impl"])
    params = bench.get("params") or {}
    if params.get("impl"):
        return str(params["impl"])
    name = bench.get("name", "").lower()
    for key in ("hmacore", "oracle", "vllm", "raw"):
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
        base_key = "vllm" if "vllm" in impls else ("raw" if "raw" in impls else
                                                   ("oracle" if "oracle" in impls else None))
        if base_key is None:
            continue
        entry = {
            "name": name,
            "hmacore_s": impls["hmacore"],
            "baseline": {"vllm": VLLM_LABEL, "raw": "raw-nixl", "oracle": "oracle"}[base_key],
            "baseline_s": impls[base_key],
            "ratio": impls[base_key] / impls["hmacore"] if impls["hmacore"] > 0 else None,
        }
        if base_key != "oracle" and "oracle" in impls:
            entry["oracle_s"] = impls["oracle"]
            entry["oracle_ratio"] = impls["oracle"] / impls["hmacore"]
        entry.update(extras.get(name, {}))
        entries.append(entry)
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
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("raw", help="pytest-benchmark --benchmark-json output")
    ap.add_argument("-o", "--output", default="bench/results/latest.json")
    args = ap.parse_args(argv)
    with open(args.raw) as f:
        report = build_report(json.load(f))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    for e in report["cases"]:
        print(f"{e['name']:60s} {e['baseline']:>12s} ratio {e['ratio']:8.2f}")
    print(f"{len(report['cases'])} cases -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
