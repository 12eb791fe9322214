"""Per-block descriptors vs maximal runs over real NIXL (UCX, DRAM, loopback, two processes).

This process is the decode side; for each (page arrangement, page size) it spawns a prefill
process (``--serve``) that registers its paged KV memory (filled with seeded random bytes)
with NIXL and answers hmacore's handshake. The decode side then READs one request's blocks
from it, the same bytes per case, with every posting mechanism of
:mod:`hmacore.transport.nixl_post`, interleaved round by round, and checks every page after
every READ. Per case it records the descriptors given to NIXL, the per-block descriptors, the
maximal runs, the post time (desc ids on both plans + run search + NIXL handle creation),
the transfer time (``transfer`` until DONE), GB/s, and a memcpy of the same byte count
between two warm buffers of this process, measured in the same rounds (the physical
reference).

Tables: ``fresh`` (vLLM's own BlockPool, fresh: consecutive ids), ``vllm`` (vLLM's BlockPool
after a random history of arrivals, finishes -- freed in vLLM's reverse order -- and prefix
hits, on each side with its own seed), ``scattered`` (random permutation). Arrangements:
``layer`` (one tensor per layer, vLLM's default) and ``block`` (one [blocks, layers, page]
allocation: a block's layer slots adjacent).

Run: ``make bench-transfer`` (or ``python bench/bench_transfer.py --json ... --md ...``).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time

import numpy as np

MECHANISMS = ("blocks", "auto", "dynamic", "prepped", "blocks-nomerge", "auto-nothread")
#: posted by a second decode agent over the same memory that runs no NIXL progress thread
#: (progress only inside its own calls): what that thread costs an initiator of READs
NO_THREAD = "auto-nothread"
TABLES = ("fresh", "vllm", "scattered")
ARRANGEMENTS = ("layer", "block")
SERVE_TIMEOUT_S = 900.0


def _layout(layers: int):
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    return KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, tuple(
        f"model.layers.{j}.self_attn" for j in range(layers))),))


def _memory(arrangement: str, nb: int, page: int, layers: int, seed: int | None):
    """``(storage, kv_caches)``; every byte written (no page is left for a first touch)."""
    names = [f"model.layers.{j}.self_attn" for j in range(layers)]
    shape = (nb, layers, page) if arrangement == "block" else (layers, nb, page)
    if seed is None:
        mem = np.ones(shape, np.uint8)
    else:
        mem = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    if arrangement == "block":
        return mem, {n: mem[:, j, :] for j, n in enumerate(names)}
    return mem, {n: mem[j] for j, n in enumerate(names)}


def serve(cfg: dict) -> int:
    """The prefill process: register memory, answer handshakes until stdin closes."""
    from hmacore.plan import TransferPlan
    from hmacore.transport import configure_ucx_env
    configure_ucx_env()
    from hmacore.transport.handshake import HandshakeServer
    from hmacore.transport.nixl import NixlAgent
    mem, kv = _memory(cfg["arrangement"], cfg["nb"], cfg["page"], cfg["layers"], cfg["seed"])
    plan = TransferPlan.from_kv_caches(_layout(cfg["layers"]), kv, num_blocks=cfg["nb"])
    with NixlAgent(cfg["name"], plan) as agent, \
            HandshakeServer(agent.handshake_payload(), host="127.0.0.1",
                            on_peer=agent.add_notify_peer) as server:
        print(json.dumps({"port": server.port}), flush=True)
        select.select([sys.stdin], [], [], SERVE_TIMEOUT_S)   # EOF when the reader is done
    return 0


# -- block tables ------------------------------------------------------------------------
def fresh_table(nb: int, n: int) -> list[int]:
    from vllm.v1.core.block_pool import BlockPool
    return [b.block_id for b in BlockPool(nb, True, 16).get_new_blocks(n)]


def vllm_table(nb: int, n: int, seed: int, steps: int = 600, hit_p: float = 0.4) -> list[int]:
    """The table vLLM's BlockPool gives a request of ``n`` blocks after a random history:
    requests arrive (up to nb/8 blocks, some reusing a cached prefix of a finished request
    with ``touch``, as the KV cache manager does on a prefix hit), finish (blocks freed in
    reverse order, as vLLM frees them), and the measured request takes a prefix hit with
    probability ``hit_p`` and new blocks for the rest."""
    from vllm.v1.core.block_pool import BlockPool
    pool = BlockPool(nb, True, 16)
    rng = np.random.default_rng(seed)
    gen = np.zeros(nb, np.int64)          # allocations per block id: cached content validity
    running: list[list] = []
    cached: list[tuple[list, list[int]]] = []

    def prefix_hit(max_blocks: int) -> list:
        if not cached or max_blocks < 1 or rng.random() >= hit_p:
            return []
        blocks, stamp = cached[int(rng.integers(len(cached)))]
        k = int(rng.integers(1, min(len(blocks), max_blocks) + 1))
        hit = []
        for b, s in zip(blocks[:k], stamp[:k]):   # a prefix is valid up to its first reuse
            if gen[b.block_id] != s:
                break
            hit.append(b)
        if hit:
            pool.touch(hit)
        return hit

    def allocate(size: int) -> list | None:
        hit = prefix_hit(size - 1)
        need = size - len(hit)
        if pool.get_num_free_blocks() < need:
            if hit:
                pool.free_blocks(reversed(hit))
            return None
        new = pool.get_new_blocks(need)
        for b in new:
            gen[b.block_id] += 1
        return hit + new

    def finish(i: int) -> None:
        req = running.pop(i)
        pool.free_blocks(reversed(req))
        cached.append((req, [int(gen[b.block_id]) for b in req]))

    for _ in range(steps):
        if rng.random() < 0.55:
            req = allocate(int(rng.integers(1, max(2, nb // 8))))
            if req is not None:
                running.append(req)
        if running and rng.random() < 0.45:
            finish(int(rng.integers(len(running))))
    while pool.get_num_free_blocks() < n and running:
        finish(int(rng.integers(len(running))))
    req = allocate(n)
    assert req is not None and len(req) == n
    return [b.block_id for b in req]


def tables(kind: str, nb: int, n: int) -> tuple[list[int], list[int]]:
    """(decode-side table, prefill-side table) of one request of ``n`` blocks."""
    if kind == "fresh":
        return fresh_table(nb, n), fresh_table(nb, n)
    if kind == "vllm":
        return vllm_table(nb, n, seed=11), vllm_table(nb, n, seed=22)
    rng = np.random.default_rng(33)
    return ([int(x) for x in rng.permutation(np.arange(1, nb))[:n]],
            [int(x) for x in rng.permutation(np.arange(1, nb))[:n]])


# -- the decode side -----------------------------------------------------------------------
class Peer:
    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                                      json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError("the prefill process did not start")
        self.port = json.loads(line)["port"]

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _pages(mem, arrangement, ids):
    ids = np.asarray(ids, dtype=np.intp)
    return mem[ids] if arrangement == "block" else mem[:, ids]


def run_config(arrangement: str, page: int, args, log) -> list[dict]:
    from hmacore.plan import TransferPlan
    from hmacore.transport.handshake import exchange_handshake
    from hmacore.transport.nixl import NixlAgent, _nixl_ids
    from hmacore.transport.nixl_post import create_xfer
    from hmacore.runs import find_runs
    from hmacore.demo.clock import Clock
    from _cma import iovecs, read_runs
    layers = args.layers
    n = max(1, (args.request_mib << 20) // (layers * page))
    nb = 4 * n + 1
    seed = 1000 + page
    cfg = {"arrangement": arrangement, "nb": nb, "page": page, "layers": layers, "seed": seed,
           "name": f"bench-prefill-{arrangement}-{page}"}
    peer_proc = Peer(cfg)
    out = []
    try:
        dmem, dkv = _memory(arrangement, nb, page, layers, None)
        src, _ = _memory(arrangement, nb, page, layers, seed)   # = the prefill side's bytes
        plan = TransferPlan.from_kv_caches(_layout(layers), dkv, num_blocks=nb)
        agent = NixlAgent(f"bench-decode-{arrangement}-{page}", plan)
        bare = NixlAgent(f"bench-decode-{arrangement}-{page}-nothread", plan,
                         progress_thread=False)
        try:
            peer = agent.add_peer(exchange_handshake("127.0.0.1", peer_proc.port,
                                                     agent.handshake_payload()))
            bare_peer = bare.add_peer(exchange_handshake("127.0.0.1", peer_proc.port,
                                                         bare.handshake_payload()))
            p = agent._peers[peer]       # the driver's prepared dlists and address tables
            nbytes = n * layers * page
            ref_src = np.ones(nbytes, np.uint8)
            ref_dst = np.ones(nbytes, np.uint8)
            for kind in TABLES:
                local, remote = tables(kind, nb, n)

                def check(what: str) -> None:   # every page, then the pages are reset
                    if not np.array_equal(_pages(dmem, arrangement, local),
                                          _pages(src, arrangement, remote)):
                        raise RuntimeError(f"{what} READ: bytes differ ({kind}, {page} B)")
                    if arrangement == "block":
                        dmem[np.asarray(local)] = 1
                    else:
                        dmem[:, np.asarray(local)] = 1
                rec = {m: {"post": [], "xfer": [], "cpu": [], "runq": []} for m in MECHANISMS}
                rec_mem: list[float] = []
                rec_mem_cpu: list[float] = []
                rec_search: list[float] = []
                rec_cma: list[float] = []
                for r in range(args.warmup + args.reps):
                    for mech in MECHANISMS:
                        ag, pn = (bare, bare_peer) if mech == NO_THREAD else (agent, peer)
                        a, pp = ag._agent, ag._peers[pn]
                        t0 = time.perf_counter()
                        lids = _nixl_ids(plan.desc_ids([local]), plan.num_descs)
                        rids = _nixl_ids(pp.plan.desc_ids([remote]), pp.plan.num_descs)
                        posted = create_xfer(
                            a, "READ", "blocks" if mech.startswith("blocks") else
                            mech.removesuffix("-nothread"), pn,
                            local_dlist=ag._local, local_ids=lids, remote_dlist=pp.dlist,
                            remote_ids=rids, local_table=ag._table, remote_table=pp.table,
                            local_mem="DRAM", remote_mem="DRAM", notif_msg=b"",
                            skip_desc_merge=mech == "blocks-nomerge")
                        t1 = time.perf_counter()
                        clock = Clock()
                        with clock:
                            st = a.transfer(posted.handle)
                            deadline = t1 + 60
                            while st == "PROC" and time.perf_counter() < deadline:
                                st = a.check_xfer_state(posted.handle)
                        a.release_xfer_handle(posted.handle)
                        if st != "DONE":
                            raise RuntimeError(f"{mech} READ ended {st}")
                        check(mech)
                        if r >= args.warmup:
                            rec[mech]["post"].append(t1 - t0)
                            rec[mech]["xfer"].append(clock.wall)
                            rec[mech]["cpu"].append(clock.cpu)
                            rec[mech]["runq"].append(clock.runq or 0.0)
                            rec[mech]["posted"] = posted.descriptors
                            rec[mech]["blocks"] = posted.block_descriptors
                            rec[mech]["runs"] = posted.runs
                            rec[mech]["mechanism"] = posted.mechanism
                    mem_clock = Clock()
                    with mem_clock:
                        np.copyto(ref_dst, ref_src)
                    t1 = time.perf_counter()
                    found = find_runs(agent._table, lids, p.table, rids, order=True)
                    t2 = time.perf_counter()
                    # the same runs straight through the kernel's cross-process copy
                    lrows, rrows = iovecs(found.local), iovecs(found.remote)
                    t3 = time.perf_counter()
                    read_runs(peer_proc.proc.pid, lrows, rrows)
                    t4 = time.perf_counter()
                    check("cma")
                    if r >= args.warmup:
                        rec_mem.append(mem_clock.wall)
                        rec_mem_cpu.append(mem_clock.cpu)
                        rec_search.append(t2 - t1)
                        rec_cma.append(t4 - t3)
                mem_s = statistics.median(rec_mem)
                mem_cpu = statistics.median(rec_mem_cpu)
                cma_s = statistics.median(rec_cma)
                for mech in MECHANISMS:
                    x = rec[mech]
                    post, xfer = statistics.median(x["post"]), statistics.median(x["xfer"])
                    row = {"arrangement": arrangement, "page": page, "table": kind,
                           "mechanism": mech, "posted_as": x["mechanism"], "bytes": nbytes,
                           "descriptors": x["posted"], "block_descriptors": x["blocks"],
                           "runs": x["runs"], "post_ms": post * 1e3, "transfer_ms": xfer * 1e3,
                           "gbps": nbytes / (post + xfer) / 1e9,
                           "transfer_gbps": nbytes / xfer / 1e9,
                           "memcpy_gbps": nbytes / mem_s / 1e9,
                           "search_ms": statistics.median(rec_search) * 1e3,
                           "transfer_cpu_ms": statistics.median(x["cpu"]) * 1e3,
                           "transfer_runq_ms": statistics.median(x["runq"]) * 1e3,
                           "memcpy_cpu_ms": mem_cpu * 1e3, "memcpy_ms": mem_s * 1e3,
                           "cma_ms": cma_s * 1e3, "cma_gbps": nbytes / cma_s / 1e9,
                           "rounds": args.reps}
                    out.append(row)
                base = next(o for o in out[-len(MECHANISMS):] if o["mechanism"] == "blocks")
                auto = next(o for o in out[-len(MECHANISMS):] if o["mechanism"] == "auto")
                log(f"{arrangement:5} {page // 1024:3} KiB {kind:9}: {base['block_descriptors']:6} "
                    f"block descs -> {auto['descriptors']:6} posted ({auto['runs']} runs); "
                    f"blocks {base['gbps']:5.2f} GB/s, runs {auto['gbps']:5.2f} GB/s, "
                    f"memcpy {auto['memcpy_gbps']:5.2f} GB/s")
        finally:
            agent.close()
            bare.close()
    finally:
        peer_proc.stop()
    return out


def markdown(rows: list[dict]) -> str:
    """Two tables: per-block (vLLM 0.32's scheme) vs runs ("auto"), and the mechanisms."""
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["arrangement"], r["page"], r["table"]), {})[r["mechanism"]] = r
    lines = ["| pages | page | table | per-block descs | runs | posted (auto) "
             "| post ms blocks / auto | run search ms (% of blocks transfer) "
             "| transfer ms blocks / auto | GB/s blocks / auto / no-merge | memcpy GB/s "
             "| auto / blocks | auto / memcpy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (arr, page, table), m in cases.items():
        b, a, nm = m["blocks"], m["auto"], m["blocks-nomerge"]
        lines.append(
            f"| {arr}-major | {page // 1024} KiB | {table} | {b['block_descriptors']:,} | "
            f"{a['runs']:,} | {a['descriptors']:,} ({a['posted_as']}) | "
            f"{b['post_ms']:.2f} / {a['post_ms']:.2f} | {a['search_ms']:.2f} "
            f"({100 * a['search_ms'] / b['transfer_ms']:.1f}%) | {b['transfer_ms']:.2f} / "
            f"{a['transfer_ms']:.2f} | {b['gbps']:.2f} / {a['gbps']:.2f} / {nm['gbps']:.2f} | "
            f"{a['memcpy_gbps']:.2f} | {a['gbps'] / b['gbps']:.2f}x | "
            f"{100 * a['gbps'] / a['memcpy_gbps']:.0f}% |")
    lines += ["", "Mechanisms (post ms / transfer ms, medians): the runs as new lists "
              "(dynamic) or the per-block ids in run order (prepped, NIXL merges them)", "",
              "| pages | page | table | per-block descs | runs | dynamic | prepped | auto chose |",
              "|---|---|---|---|---|---|---|---|"]
    for (arr, page, table), m in cases.items():
        d, p, a = m["dynamic"], m["prepped"], m["auto"]
        lines.append(f"| {arr}-major | {page // 1024} KiB | {table} | "
                     f"{d['block_descriptors']:,} | {d['runs']:,} | {d['post_ms']:.2f} / "
                     f"{d['transfer_ms']:.2f} | {p['post_ms']:.2f} / {p['transfer_ms']:.2f} | "
                     f"{a['posted_as']} |")
    lines += ["", "Where the time goes (medians; the runs posted by the decode agent with NIXL's "
              "progress thread and by one without; CPU = process CPU time during the transfer, "
              "all threads; runq = the posting thread's wait for a CPU; cma = the same runs "
              "through process_vm_readv, no NIXL; memcpy wall (CPU))", "",
              "| pages | page | table | transfer ms thread / none | CPU ms thread / none "
              "| runq ms thread / none | cma ms | memcpy ms | GB/s none / cma / memcpy "
              "| none / memcpy | none / memcpy per CPU-s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (arr, page, table), m in cases.items():
        a, n = m["auto"], m.get(NO_THREAD)
        if n is None or "cma_ms" not in a:
            continue
        lines.append(
            f"| {arr}-major | {page // 1024} KiB | {table} | {a['transfer_ms']:.2f} / "
            f"{n['transfer_ms']:.2f} | {a['transfer_cpu_ms']:.2f} / {n['transfer_cpu_ms']:.2f} | "
            f"{a['transfer_runq_ms']:.2f} / {n['transfer_runq_ms']:.2f} | {a['cma_ms']:.2f} | "
            f"{a['memcpy_ms']:.2f} ({a['memcpy_cpu_ms']:.2f}) | {n['gbps']:.2f} / "
            f"{a['cma_gbps']:.2f} / {a['memcpy_gbps']:.2f} | "
            f"{100 * n['gbps'] / a['memcpy_gbps']:.0f}% | "
            f"{100 * a['memcpy_cpu_ms'] / max(n['transfer_cpu_ms'], 1e-9):.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(ARRANGEMENTS), len(TABLES), figsize=(11, 6), sharey=True)
    for i, arr in enumerate(ARRANGEMENTS):
        for j, table in enumerate(TABLES):
            ax = axes[i][j]
            for mech, style in (("blocks", "o--"), ("blocks-nomerge", "x:"), ("auto", "s-")):
                pts = sorted((r["page"], r["gbps"]) for r in rows if r["arrangement"] == arr
                             and r["table"] == table and r["mechanism"] == mech)
                if pts:
                    ax.plot([p / 1024 for p, _ in pts], [g for _, g in pts], style, label=mech)
            mem = sorted((r["page"], r["memcpy_gbps"]) for r in rows if r["arrangement"] == arr
                         and r["table"] == table and r["mechanism"] == "auto")
            if mem:
                ax.plot([p / 1024 for p, _ in mem], [g for _, g in mem], "k-", alpha=0.3,
                        label="memcpy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{arr}-major, {table}", fontsize=9)
            if i == len(ARRANGEMENTS) - 1:
                ax.set_xlabel("page per layer (KiB)")
            if j == 0:
                ax.set_ylabel("GB/s (post + transfer)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--pages", default="1024,4096,16384,65536", help="page bytes per layer")
    ap.add_argument("--arrangements", default=",".join(ARRANGEMENTS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--request-mib", type=int, default=32, help="bytes of one request (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(json.loads(args.serve))
    from hmacore.transport import configure_ucx_env
    configure_ucx_env()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rows: list[dict] = []
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for arr in args.arrangements.split(","):
        for page in (int(x) for x in args.pages.split(",")):
            rows += run_config(arr, page, args, log)
    doc = {"command": " ".join(sys.argv), "loadavg_at_end": os.getloadavg(),
           "cpus": os.cpu_count(), "layers": args.layers,
           "request_mib": args.request_mib, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    md = markdown(rows)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
