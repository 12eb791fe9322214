"""The demo's figures: a per-group table (HMA next to non-HMA), throughput, bookkeeping cost,
verification; as text, as a JSON document, and as a bar chart."""
from __future__ import annotations

import os
import statistics


def report_dict(sc, decode, final: dict) -> dict:
    layout = decode.layout
    groups = []
    for g, spec in enumerate(layout.groups):
        groups.append({"group": g, "name": spec.name or f"g{g}", "kind": spec.kind.name,
                       "block_size": spec.block_size, "layers": len(spec.layer_names),
                       "blocks": decode.blocks[g], "descriptors": decode.descriptors[g],
                       "bytes": decode.bytes[g]})
    moved_b, moved_d = sum(decode.bytes), sum(decode.descriptors)
    bk = decode.bookkeeping_ns
    return {
        "preset": sc.preset, "layout_file": sc.layout_file, "requests": sc.requests,
        "tokens": sc.request_lengths(), "page_bytes": sc.page_size(),
        "layout_fingerprint": layout.fingerprint(),
        "scheduler_block_size": layout.scheduler_block_size,
        "groups": groups,
        "hma": {"descriptors": moved_d, "bytes": moved_b,
                "plan_descriptors": decode.plan_hma_descriptors, "plan_bytes": decode.plan_hma_bytes},
        "non_hma": {"descriptors": decode.non_hma_descriptors, "bytes": decode.non_hma_bytes},
        "saving": {"descriptors": (1 - moved_d / decode.non_hma_descriptors
                                    if decode.non_hma_descriptors else 0.0),
                   "bytes": 1 - moved_b / decode.non_hma_bytes if decode.non_hma_bytes else 0.0},
        "transfer": {"seconds": decode.transfer_s,
                     "throughput_gib_s": moved_b / decode.transfer_s / 2**30 if decode.transfer_s else 0.0,
                     "memcpy_seconds": decode.memcpy_s,
                     "memcpy_gib_s": moved_b / decode.memcpy_s / 2**30 if decode.memcpy_s else 0.0,
                     "fraction_of_memcpy": (decode.memcpy_s / decode.transfer_s
                                            if decode.transfer_s else 0.0),
                     "on_cpu": _on_cpu(moved_b, decode.transfer_clock, decode.memcpy_clock),
                     "loadavg": _loadavg()},
        "posting": {"mechanism": decode.posting, "descriptors_posted": decode.posted_descriptors,
                    "per_block_descriptors": decode.block_descriptors,
                    "maximal_runs": decode.runs if decode.posting != "blocks" else None},
        "bookkeeping_us_per_request": {"median": statistics.median(bk) / 1e3 if bk else 0.0,
                                       "max": max(bk) / 1e3 if bk else 0.0},
        "verification": {"ok": not decode.mismatches and not decode.errors,
                         "pages_checked": decode.pages_checked, "bytes_checked": decode.bytes_checked,
                         "mismatched_pages": len(decode.mismatches),
                         "first_mismatches": [list(m) for m in decode.mismatches[:5]],
                         "errors": decode.errors[:5]},
        "prefill": {"free_blocks_after": final.get("free_blocks"), "num_blocks": final.get("num_blocks")},
    }


def _on_cpu(nbytes: int, xfer, mem) -> dict:
    """The same comparison per CPU-second (process CPU time, all threads), and the time the
    timing thread waited runnable for a CPU (seconds, ``None`` where unknown): on a loaded
    machine the READs, longer than a time slice, wait; a short memcpy often does not."""
    return {"transfer_cpu_seconds": xfer.cpu, "memcpy_cpu_seconds": mem.cpu,
            "transfer_thread_cpu_seconds": xfer.thread_cpu,
            "transfer_runqueue_seconds": xfer.runq, "memcpy_runqueue_seconds": mem.runq,
            "longest_transfer_seconds": xfer.longest,
            "transfer_gib_s": nbytes / xfer.cpu / 2**30 if xfer.cpu > 0 else 0.0,
            "memcpy_gib_s": nbytes / mem.cpu / 2**30 if mem.cpu > 0 else 0.0,
            "fraction_of_memcpy": mem.cpu / xfer.cpu if xfer.cpu > 0 else 0.0}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_line(t: dict) -> str:
    c = t["on_cpu"]
    rq = c["transfer_runqueue_seconds"]
    waited = "" if rq is None else (f"; the READs waited {rq * 1e3:.1f} ms of their "
                                    f"{t['seconds'] * 1e3:.1f} ms for a CPU")
    load = "" if not t.get("loadavg") else f" (load average {t['loadavg'][0]:.1f})"
    return (f"on CPU: transfer {c['transfer_cpu_seconds'] * 1e3:.1f} ms ({c['transfer_gib_s']:.2f} "
            f"GiB/s per CPU-second), memcpy {c['memcpy_gib_s']:.2f} GiB/s: transfer at "
            f"{100 * c['fraction_of_memcpy']:.0f}% of memcpy{waited}{load}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def format_report(rep: dict) -> str:
    rows = [("group", "kind", "bs", "layers", "blocks", "descriptors", "MiB moved")]
    for g in rep["groups"]:
        rows.append((f"{g['group']} {g['name']}", g["kind"].lower(), str(g["block_size"]),
                     str(g["layers"]), f"{g['blocks']:,}", f"{g['descriptors']:,}", _mib(g["bytes"])))
    rows.append(("HMA total", "", "", "", "", f"{rep['hma']['descriptors']:,}", _mib(rep["hma"]["bytes"])))
    rows.append(("non-HMA", "", "", "", "", f"{rep['non_hma']['descriptors']:,}",
                 _mib(rep["non_hma"]["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]
    v, t, bk = rep["verification"], rep["transfer"], rep["bookkeeping_us_per_request"]
    who = rep["preset"] or rep["layout_file"]
    lines = [f"hmacore demo: {who}, {rep['requests']} requests of up to {max(rep['tokens']):,} tokens, "
             f"{rep['page_bytes']} B pages, prefill -> decode over NIXL (UCX, DRAM)", ""] + lines + [
        "",
        f"HMA moves {100 * rep['saving']['bytes']:.1f}% fewer bytes and "
        f"{100 * rep['saving']['descriptors']:.1f}% fewer descriptors than a non-HMA connector",
        _posting_line(rep["posting"]),
        f"transfer: {_mib(rep['hma']['bytes'])} MiB in {t['seconds'] * 1e3:.1f} ms "
        f"({t['throughput_gib_s']:.2f} GiB/s); memcpy of the same bytes in this run "
        f"{t['memcpy_gib_s']:.2f} GiB/s (transfer at {100 * t['fraction_of_memcpy']:.0f}% of memcpy)",
        _cpu_line(t),
        f"bookkeeping (tracker, select, clip, trim, descriptor ids): median {bk['median']:.1f} us "
        f"per request (max {bk['max']:.1f} us)",
        (f"verification: OK, {v['pages_checked']:,} pages / {_mib(v['bytes_checked'])} MiB checked "
         "byte for byte" if v["ok"] else
         f"verification: FAILED, {v['mismatched_pages']} pages differ, first: {v['first_mismatches']} "
         f"{v['errors']}"),
    ]
    return "\n".join(lines)


def _posting_line(p: dict) -> str:
    runs = "" if p["maximal_runs"] is None else f", {p['maximal_runs']:,} maximal runs"
    return (f"descriptors: {p['descriptors_posted']:,} posted to NIXL for "
            f"{p['per_block_descriptors']:,} per-block descriptors (posting {p['mechanism']}{runs})")


def plot_bytes(rep: dict, path: str) -> None:
    """Per-group bytes moved, HMA next to what a non-HMA connector moves (grouped bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [g["name"] for g in rep["groups"]]
    hma = [g["bytes"] / 2**20 for g in rep["groups"]]
    # non-HMA (as the plan counts it): one group at the lcm block size, no clip; every layer
    # of the group moves every token of the request rounded up to that block size
    lcm = rep["scheduler_block_size"]
    non = []
    for g in rep["groups"]:
        per_block = g["bytes"] / g["blocks"] if g["blocks"] else 0
        full = sum(-(-n // lcm) * lcm // g["block_size"] for n in rep["tokens"])
        non.append(per_block * full / 2**20)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names) + 2), 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], non, width=0.4, label="non-HMA connector", color="#bbbbbb")
    ax.bar([i + 0.2 for i in x], hma, width=0.4, label="HMA (hmacore)", color="#2b6cb0")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB moved")
    ax.set_title(f"{rep['preset'] or rep['layout_file']}: bytes moved per KV cache group\n"
                 f"{rep['requests']} requests of up to {max(rep['tokens']):,} tokens", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
