"""``hmacore demo --store embedded|mooncake``: the offload path.

A prefill instance computes each request's block hashes, writes the byte pattern into its
blocks and saves the blocks the store mask keeps (per group, per rank namespace keys). A decode
instance with its own paged memory then looks each request up (one bulk existence probe, the
cross-group longest hit), allocates its table, loads the hit's blocks into it and checks every
byte. Both instances share one store client: the embedded in-process store by default, or a
Mooncake store whose master the user runs (``--master HOST:PORT``).
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

from ..hits import HitFinder
from ..keys import KeyBuilder
from .paged_memory import allocate_paged_kv, verify_pattern, fill_pattern
from ..spec import GroupKind
from ..transport.store import (EmbeddedStore, GroupSegments, load_blocks, lookup_hit,
                               save_blocks, save_state)
from .scenario import BlockPool, Scenario


def block_hashes(token_ids: np.ndarray, hash_block_size: int) -> np.ndarray:
    """Chained sha256 over every complete ``hash_block_size``-token block: (N, 32) uint8."""
    n = token_ids.size // hash_block_size
    out = np.empty((n, 32), dtype=np.uint8)
    parent = b"hmacore-demo-none-hash"
    for i in range(n):
        chunk = token_ids[i * hash_block_size:(i + 1) * hash_block_size].astype("<i4").tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        out[i] = np.frombuffer(parent, dtype=np.uint8)
    return out


def group_segments(paged) -> list[GroupSegments | None]:
    """Each group's OWN layers' memory (never another group's layers)."""
    layout = paged.layout
    out: list[GroupSegments | None] = []
    for g, spec in enumerate(layout.groups):
        if not spec.transfer:
            out.append(None)
            continue
        bases = []
        for name in spec.layer_names:
            arr = paged.kv_caches[name]
            first = arr[0] if isinstance(arr, tuple) else arr
            bases.append(int(first.__array_interface__["data"][0]))
        out.append(GroupSegments(tuple(bases), (paged.page_bytes[g],) * len(bases), paged.num_blocks))
    return out


class _Instance:
    def __init__(self, sc: Scenario, layout):
        self.num_blocks = sc.num_blocks(one_full_request=True)
        self.layout = layout.with_num_blocks(self.num_blocks)
        self.paged = allocate_paged_kv(self.layout, self.num_blocks, page_bytes=sc.page_size(),
                                       kv_split=False, state_parts=1)
        self.pool = BlockPool(self.num_blocks)
        self.segments = group_segments(self.paged)


def run_store_demo(sc: Scenario, store_kind: str, master: str | None) -> dict:
    layout = sc.layout()
    finder = HitFinder(layout)
    keys = KeyBuilder("hmacore-demo")
    prefill, decode = _Instance(sc, layout), _Instance(sc, layout)
    if store_kind == "mooncake":
        from ..transport.mooncake import MooncakeStore
        store = MooncakeStore(master or "127.0.0.1:50051", global_segment_size=256 << 20)
    else:
        store = EmbeddedStore(capacity_bytes=4 << 30)
    for inst in (prefill, decode):
        for storage in inst.paged.storages:
            store.register(int(storage.ctypes.data), int(storage.nbytes))
    G = layout.num_groups
    rows = []
    mismatches, pages_checked, bytes_checked = [], 0, 0
    loaded_blocks, loaded_bytes = [0] * G, [0] * G
    t_save = t_lookup = t_load = 0.0
    for r, n in enumerate(sc.request_lengths()):
        tokens = (np.arange(n, dtype=np.int64) + 1_000_003 * (r + 1)) % 50_000
        hashes = block_hashes(tokens, finder.hash_block_size)
        # the prefill instance saves blocks as they are computed (all still live)
        table_p = prefill.pool.allocate_table(prefill.layout, n, computed_tokens=0)
        fill_pattern(prefill.paged, table_p)
        t0 = time.perf_counter()
        rep = save_blocks(finder, keys, store, hashes, n, table_p, prefill.segments)
        for g in finder.group_ids:   # Mamba: one boundary state, at the last aligned boundary
            if layout.groups[g].kind == GroupKind.MAMBA:
                k = finder.align_length(n) // layout.groups[g].block_size
                if k > 0:
                    save_state(finder, keys, store, hashes, n, g, table_p[g][k - 1],
                               prefill.segments[g])
        t1 = time.perf_counter()
        hit = lookup_hit(finder, keys, store, hashes, n)
        t2 = time.perf_counter()
        # vLLM's allocation with hit.tokens external tokens: skipped head nulled, rest real
        table_d = decode.pool.allocate_table(decode.layout, n, computed_tokens=hit.tokens)
        ok = load_blocks(finder, keys, store, hashes, hit, table_d, decode.segments)
        t3 = time.perf_counter()
        t_save, t_lookup, t_load = t_save + t1 - t0, t_lookup + t2 - t1, t_load + t3 - t2
        if not ok:
            mismatches.append((f"req-{r}", "*", -1, -1))
        loaded = [np.flatnonzero(hit.masks[g]) for g in range(G)]
        ids = [np.asarray(table_d[g], dtype=np.int64)[loaded[g]] if loaded[g].size else
               np.empty(0, np.int64) for g in range(G)]
        for layer, g, j in verify_pattern(decode.paged, ids, loaded):
            mismatches.append((f"req-{r}", layer, g, j))
        for g in range(G):
            nl = len(layout.groups[g].layer_names)
            loaded_blocks[g] += int(loaded[g].size)
            loaded_bytes[g] += int(loaded[g].size) * nl * decode.paged.page_bytes[g]
            pages_checked += int(loaded[g].size) * nl
        rows.append({"request": f"req-{r}", "tokens": n, "hit_tokens": hit.tokens,
                     "keys_written": rep.written, "no_space": rep.no_space})
        prefill.pool.free(table_p)
        decode.pool.free(table_d)
    bytes_checked = sum(loaded_bytes)
    close = getattr(store, "close", None)
    if close is not None:
        close()
    return {
        "store": store_kind, "preset": sc.preset, "layout_file": sc.layout_file,
        "requests": rows, "groups": [
            {"group": g, "name": layout.groups[g].name or f"g{g}", "kind": layout.groups[g].kind.name,
             "block_size": layout.groups[g].block_size, "blocks_loaded": loaded_blocks[g],
             "bytes_loaded": loaded_bytes[g]} for g in range(G)],
        "seconds": {"save": t_save, "lookup": t_lookup, "load": t_load},
        "verification": {"ok": not mismatches, "pages_checked": pages_checked,
                         "bytes_checked": bytes_checked, "mismatched_pages": len(mismatches),
                         "first_mismatches": [list(m) for m in mismatches[:5]]},
    }


def format_store_report(rep: dict) -> str:
    lines = [f"hmacore demo (store: {rep['store']}): {rep['preset'] or rep['layout_file']}, "
             f"{len(rep['requests'])} requests saved by a prefill instance, looked up and loaded "
             "by a decode instance", ""]
    lines.append(f"{'request':<8} {'tokens':>8} {'hit tokens':>11} {'keys written':>13}")
    for r in rep["requests"]:
        lines.append(f"{r['request']:<8} {r['tokens']:>8,} {r['hit_tokens']:>11,} {r['keys_written']:>13,}")
    lines.append("")
    lines.append(f"{'group':<12} {'kind':<15} {'bs':>5} {'blocks loaded':>14} {'MiB':>9}")
    for g in rep["groups"]:
        lines.append(f"{str(g['group']) + ' ' + g['name']:<12} {g['kind'].lower():<15} "
                     f"{g['block_size']:>5} {g['blocks_loaded']:>14,} {g['bytes_loaded'] / 2**20:>9.2f}")
    s, v = rep["seconds"], rep["verification"]
    lines.append("")
    lines.append(f"time: save {s['save'] * 1e3:.1f} ms, lookup {s['lookup'] * 1e3:.1f} ms, "
                 f"load {s['load'] * 1e3:.1f} ms")
    lines.append(f"verification: OK, {v['pages_checked']:,} pages / {v['bytes_checked'] / 2**20:.2f} MiB "
                 "checked byte for byte" if v["ok"] else
                 f"verification: FAILED, {v['mismatched_pages']} pages differ: {v['first_mismatches']}")
    return "\n".join(lines)
