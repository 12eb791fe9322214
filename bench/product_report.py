"""Markdown tables of bench/bench_product.py results (``product.json``).

``python bench/product_report.py bench/results/product.json`` prints the tables.

Times are thread CPU ms per step (the process's wall clock loses whole time slices to other
processes on a shared machine; wall medians are in table 3).

Table 1 (step time): one row per cell (layout x running requests x prompt x step kind); the
no-connector median ms per step of ``schedule()`` + ``update_from_output()`` (a cell run in
variant groups for memory shows each group's no-connector median, in group order), then per
variant its median ms and its overhead over no connector in % (difference of the medians,
within the variant's group).
Table 2 (hmacore vs vLLM): per hmacore variant, the ratio of its median step to the median
step of vLLM's connector of the same kind (HmaNixl pull/push P vs NixlConnector P, D vs D,
HmaStore vs OffloadingConnector); < 1 means hmacore's step is faster. Skipped cells and
variants that could not run are listed with their reason.
"""
from __future__ import annotations

import json
import sys

__all__ = ["render"]


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.0f}%"


def _cell_name(rec: dict) -> str:
    return f"{rec['layout']} | {rec['requests']} | {rec['prompt'] // 1024}k | {rec['kind']}"


def _variant_names(records: list[dict], order: list[str] | None = None) -> list[str]:
    names: list[str] = list(order or [])
    for rec in records:
        for n in rec.get("variants", {}):
            if n not in names:
                names.append(n)
    return names


def _none_ms(rec: dict) -> str:
    """The no-connector median; a cell run in variant groups shows each group's (a / b / c)."""
    groups = rec.get("none_per_group")
    if groups:
        return " / ".join(_ms(g.get("median_ms")) for g in groups)
    return _ms(rec["variants"]["none"].get("median_ms"))


def step_table(records: list[dict], order: list[str] | None = None) -> list[str]:
    """Median ms per step and overhead % over no connector, per variant."""
    names = [n for n in _variant_names(records, order) if n != "none"]
    head = "| layout | reqs | prompt | step | none ms | " + " | ".join(
        f"{n} ms (ovh)" for n in names) + " |"
    lines = [head, "|" + "---|" * (5 + len(names))]
    for rec in records:
        if rec.get("status") != "ran":
            continue
        vs = rec["variants"]
        cols = [_none_ms(rec)]
        for n in names:
            row = vs.get(n, {})
            if row.get("status") != "ran":
                cols.append("n/a")
                continue
            cols.append(f"{_ms(row['median_ms'])} ({_pct(row.get('overhead_pct'))})")
        lines.append(f"| {_cell_name(rec)} | " + " | ".join(cols) + " |")
    return lines


def ratio_table(records: list[dict], order: list[str] | None = None) -> list[str]:
    """hmacore median step / vLLM same-kind connector median step, and both overheads."""
    hma = [n for n in _variant_names(records, order) if n.startswith("hma_")]
    lines = ["| layout | reqs | prompt | step | " + " | ".join(
        f"{n} ratio (ovh ms vs vLLM ovh ms)" for n in hma) + " |",
             "|" + "---|" * (4 + len(hma))]
    for rec in records:
        if rec.get("status") != "ran":
            continue
        vs = rec["variants"]
        cols = []
        for n in hma:
            row = vs.get(n, {})
            if "ratio" not in row:
                cols.append("n/a")
                continue
            b = vs[row["ratio_vs"]]
            cols.append(f"{row['ratio']:.2f}x ({_ms(row.get('overhead_ms'))} vs "
                        f"{_ms(b.get('overhead_ms'))})")
        lines.append(f"| {_cell_name(rec)} | " + " | ".join(cols) + " |")
    return lines


def notes(records: list[dict]) -> list[str]:
    """Skipped cells, cells run in variant groups, variants that did not run, failed checks."""
    out = []
    for rec in records:
        if rec.get("status") != "ran":
            out.append(f"- {rec['cell']}: {rec.get('status')}")
            continue
        for n, row in rec["variants"].items():
            if row.get("status") != "ran" and "D loads its prompt" not in row.get("status", ""):
                out.append(f"- {rec['cell']} {n}: {row.get('status')}")
            if rec.get("groups") and n == "none":
                out.append(f"- {rec['cell']}: {rec.get('note')}")
            if row.get("sched_mismatch_steps"):
                out.append(f"- {rec['cell']} {n}: scheduling differed from no connector in "
                           f"{row['sched_mismatch_steps']} timed steps")
            tc = row.get("table_check")
            if tc not in (None, "equal"):
                out.append(f"- {rec['cell']} {n}: table check: {tc}")
    return out


def _per_variant_table(records: list[dict], order: list[str] | None, cell) -> list[str]:
    """One row per cell that ran, one column per variant: ``cell(variant_row)`` where the
    variant ran, n/a elsewhere."""
    names = _variant_names(records, order)
    lines = ["| layout | reqs | prompt | step | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(names))]
    for rec in records:
        if rec.get("status") != "ran":
            continue
        vs = rec["variants"]
        cols = [cell(vs[n]) if vs.get(n, {}).get("status") == "ran" else "n/a" for n in names]
        lines.append(f"| {_cell_name(rec)} | " + " | ".join(cols) + " |")
    return lines


def wall_table(records: list[dict], order: list[str] | None = None) -> list[str]:
    """Wall-clock median ms per step, per variant (noisy on a shared machine)."""
    return _per_variant_table(records, order, lambda row: _ms(row.get("wall_median_ms")))


def alloc_table(records: list[dict], order: list[str] | None = None) -> list[str]:
    """Python object growth: median ``sys.getallocatedblocks()`` delta per step, per variant."""
    return _per_variant_table(records, order,
                              lambda row: f"{row['alloc_blocks_per_step']:+.0f}")


def hook_table(records: list[dict], order: list[str] | None = None) -> list[str]:
    """Thread CPU ms per step inside the connector's own scheduler-side hooks (mean over the
    timed steps; median and p90 in brackets): the connector's work measured directly."""
    return _per_variant_table(records, order, lambda row: (
        f"{row['hook_mean_ms']:.3f} ({row['hook_median_ms']:.3f}"
        + (f" / {row['hook_p90_ms']:.3f})" if "hook_p90_ms" in row else ")")
        if "hook_mean_ms" in row else "n/a"))


def target_rows(records: list[dict]) -> list[str]:
    """Issue 15's targets per cell on the directly measured hook time: an HmaNixl variant's
    hooks <= its vLLM NixlConnector counterpart's + 2% of the no-connector step; the store's
    hooks <= 0.5x the OffloadingConnector's."""
    lines = ["| layout | reqs | prompt | step | variant | hook ms | vLLM same kind hook ms | "
             "bound ms | met |", "|" + "---|" * 9]
    for rec in records:
        if rec.get("status") != "ran":
            continue
        vs = rec["variants"]
        none = vs.get("none", {}).get("median_ms")
        for n, row in vs.items():
            base = vs.get(row.get("ratio_vs") or "", {})
            if not n.startswith("hma_") or "hook_mean_ms" not in row \
                    or "hook_mean_ms" not in base or none is None:
                continue
            if n == "hma_store":
                bound = 0.5 * base["hook_mean_ms"]
            else:
                bound = base["hook_mean_ms"] + 0.02 * none
            met = "yes" if row["hook_mean_ms"] <= bound else "**no**"
            lines.append(f"| {_cell_name(rec)} | {n} | {row['hook_mean_ms']:.3f} | "
                         f"{base['hook_mean_ms']:.3f} ({row['ratio_vs']}) | {bound:.3f} | {met} |")
    return lines if len(lines) > 2 else []


def worker_table(records: list[dict]) -> list[str]:
    """Worker-side bookkeeping ms per step (if the run measured it)."""
    rows = [r for r in records if r.get("worker")]
    if not rows:
        return []
    names = _variant_names([{"variants": r["worker"]} for r in rows])
    lines = ["| layout | reqs | prompt | step | " + " | ".join(
        f"{n} ms (median / p90)" for n in names) + " |", "|" + "---|" * (4 + len(names))]
    for rec in rows:
        cols = []
        for n in names:
            w = rec["worker"].get(n, {})
            cols.append(f"{_ms(w.get('median_ms'))} / {_ms(w.get('p90_ms'))}"
                        if w.get("status") == "ran" else w.get("status", "n/a"))
        lines.append(f"| {_cell_name(rec)} | " + " | ".join(cols) + " |")
    return lines


def render(doc: dict) -> str:
    """The whole markdown report of a product.json document."""
    records = doc["cells"]
    meta = doc.get("meta", {})
    out = ["# Product benchmark: KV connectors inside vLLM's Scheduler", ""]
    if meta:
        out.append("Run: " + ", ".join(f"{k}={v}" for k, v in meta.items() if k != "variants"))
        out.append("")
    order = meta.get("variants")
    sections = [
        ("Scheduler step (schedule() + update_from_output()), thread CPU ms per step, median "
         "(overhead over no connector)", step_table(records, order)),
        ("hmacore vs vLLM connector of the same kind (median step ratio; < 1: hmacore faster)",
         ratio_table(records, order)),
        ("Connector hooks: thread CPU ms per step inside the connector's scheduler-side hooks, "
         "mean (median / p90)", hook_table(records, order)),
        ("Targets on hook time (HmaNixl: <= vLLM NixlConnector + 2% of the no-connector step; "
         "store: <= 0.5x OffloadingConnector)", target_rows(records)),
        ("Wall-clock median ms per step (shared machine: noisy)", wall_table(records, order)),
        ("Python allocated blocks per step (median sys.getallocatedblocks() delta across "
         "schedule() + update_from_output())", alloc_table(records, order)),
        ("Worker-side bookkeeping per step (store transport stubbed), thread CPU ms",
         worker_table(records)),
        ("Skipped, n/a and failed checks", notes(records)),
    ]
    for title, lines in sections:      # a section with nothing to show is left out
        if lines:
            out += ([""] if out and out[-1] != "" else []) + [f"## {title}", ""] + lines
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "bench/results/product.json"
    with open(path) as f:
        print(render(json.load(f)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
