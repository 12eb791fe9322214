"""The same request's bytes over NIXL (UCX) and over Mooncake TE (TCP), side by side.

Runs inside a private network namespace with only ``lo`` up (it re-executes itself under
``unshare -n`` unless ``--in-netns``). For each (table, page size) a prefill process
(``--serve``) fills paged KV memory with seeded random bytes and exposes it through BOTH a
NIXL agent and a Mooncake TE agent (hmacore's two :class:`~hmacore.transport.base.KvTransport`
drivers, same plan, same memory). This process READs one request's blocks, interleaved round
by round: NIXL per block (vLLM 0.32's scheme), NIXL coalesced runs, TE per block, TE runs,
and a memcpy of the same byte count between two warm buffers here (the physical reference).
Every page is checked after every READ (outside the timing). Times are post-to-DONE medians.

Caveat printed with the results: on one host UCX picks shared-memory transports (the bytes
never touch a socket) while Mooncake TE's TCP transport goes through loopback sockets;
``--ucx-tls tcp`` forces UCX onto TCP as well for a like-for-like socket comparison.

Run: ``make bench-te`` (or ``python bench/bench_te.py --json ... --md ...``).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MECHANISMS = ("nixl-blocks", "nixl-runs", "te-blocks", "te-runs", "memcpy")
SERVE_TIMEOUT_S = 900.0


def _layout(layers: int):
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    return KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, tuple(
        f"model.layers.{j}.self_attn" for j in range(layers))),))


def _memory(nb: int, page: int, layers: int, seed: int | None):
    """``(storage, kv_caches)``: one tensor per layer (vLLM's default arrangement)."""
    shape = (layers, nb, page)
    mem = np.ones(shape, np.uint8) if seed is None else \
        np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return mem, {f"model.layers.{j}.self_attn": mem[j] for j in range(layers)}


def _plan(cfg, kv):
    from hmacore.plan import TransferPlan
    return TransferPlan.from_kv_caches(_layout(cfg["layers"]), kv, num_blocks=cfg["nb"])


def serve(cfg: dict) -> int:
    """The prefill process: both drivers over one memory, until stdin closes."""
    from hmacore.transport.handshake import HandshakeServer
    from hmacore.transport.mooncake_te import MooncakeTeAgent
    from hmacore.transport.nixl import NixlAgent
    mem, kv = _memory(cfg["nb"], cfg["page"], cfg["layers"], cfg["seed"])
    plan = _plan(cfg, kv)
    with NixlAgent("prefill-nixl", plan) as nixl, MooncakeTeAgent("prefill-te", plan) as te, \
            HandshakeServer(nixl.handshake_payload(), on_peer=nixl.add_notify_peer) as s1, \
            HandshakeServer(te.handshake_payload(), on_peer=te.add_notify_peer) as s2:
        print(json.dumps({"nixl": s1.port, "te": s2.port}), flush=True)
        select.select([sys.stdin], [], [], SERVE_TIMEOUT_S)
    return 0


def table(kind: str, nb: int, n: int, seed: int) -> list[int]:
    if kind == "fresh":
        return list(range(1, n + 1))
    return (np.random.default_rng(seed).permutation(np.arange(1, nb))[:n] + 0).tolist()


def run_case(kind: str, page: int, args) -> dict:
    from hmacore.transport.handshake import exchange_handshake
    from hmacore.transport.mooncake_te import MooncakeTeAgent
    from hmacore.transport.nixl import NixlAgent
    cfg = {"nb": args.blocks, "page": page, "layers": args.layers, "seed": 1234}
    prefill = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(cfg)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([prefill.stdout], [], [], 120)
        if not ready:
            raise RuntimeError("prefill process did not start within 120 s")
        ports = json.loads(prefill.stdout.readline())
        src, _ = _memory(args.blocks, page, args.layers, 1234)      # what the peer holds
        mem, kv = _memory(args.blocks, page, args.layers, None)
        plan = _plan(cfg, kv)
        remote = table(kind, args.blocks, args.request_blocks, 7)
        local = table(kind, args.blocks, args.request_blocks, 8)
        nbytes = args.layers * len(local) * page
        ref_a = np.ones(nbytes, np.uint8)
        ref_b = np.zeros(nbytes, np.uint8)
        agents = {"nixl-blocks": NixlAgent("decode-nixl-b", plan, posting="blocks"),
                  "nixl-runs": NixlAgent("decode-nixl-r", plan, posting="auto"),
                  "te": MooncakeTeAgent("decode-te", plan)}
        peer = {}
        try:
            for key, agent in agents.items():
                port = ports["te"] if key == "te" else ports["nixl"]
                peer[key] = agent.add_peer(exchange_handshake(
                    "127.0.0.1", port, agent.handshake_payload(), timeout=30))
            times: dict[str, list[float]] = {m: [] for m in MECHANISMS}
            descs: dict[str, int] = {}
            bad = 0
            for rnd in range(args.rounds):
                for mech in MECHANISMS:
                    if mech == "memcpy":
                        t0 = time.perf_counter()
                        np.copyto(ref_b, ref_a)
                        times[mech].append(time.perf_counter() - t0)
                        continue
                    key = "te" if mech.startswith("te") else mech
                    agent = agents[key]
                    if key == "te":
                        agent.posting = "blocks" if mech == "te-blocks" else "auto"
                    mem[...] = 0
                    rid = f"{mech}-{rnd}"
                    t0 = time.perf_counter()
                    t = agent.wait(agent.read(rid, peer[key], [local], [remote]), 120)
                    times[mech].append(time.perf_counter() - t0)
                    descs[mech] = t.descriptors
                    bad += int(np.count_nonzero(mem[:, local] != src[:, remote]))
        finally:
            for a in agents.values():
                a.close()
        med = {m: statistics.median(v) for m, v in times.items()}
        return {"table": kind, "page": page, "bytes": nbytes, "bad_bytes": bad,
                "block_descriptors": args.layers * len(local), "descriptors": descs,
                "median_s": med, "gbps": {m: nbytes / s / 1e9 for m, s in med.items()},
                "of_memcpy": {m: med["memcpy"] / s for m, s in med.items()}}
    finally:
        try:
            prefill.stdin.close()
            prefill.wait(timeout=60)
        except subprocess.TimeoutExpired:
            prefill.kill()
            prefill.wait(timeout=10)


def markdown(results: list[dict], argv: str, ucx_tls: str) -> str:
    lines = [f"`{argv}` (UCX_TLS={ucx_tls or 'default'}); medians; GB/s and share of the "
             "memcpy rate of the same bytes measured in the same rounds", "",
             "| table | page | MiB | " + " | ".join(MECHANISMS[:-1]) + " | memcpy GB/s |",
             "|---|---|---|" + "---|" * (len(MECHANISMS) - 1) + "---|"]
    for r in results:
        cells = [f"{r['gbps'][m]:.2f} GB/s ({r['of_memcpy'][m]:.0%}, {r['descriptors'][m]} d)"
                 for m in MECHANISMS[:-1]]
        lines.append(f"| {r['table']} | {r['page']} | {r['bytes'] / 2**20:.0f} | "
                     + " | ".join(cells) + f" | {r['gbps']['memcpy']:.2f} |")
    lines.append("")
    lines.append("d = descriptors given to the transport (per-block: "
                 + ", ".join(f"{r['block_descriptors']}" for r in results[:1]) + ").")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pages", default="4096,16384", help="page sizes in bytes per layer")
    ap.add_argument("--tables", default="fresh,scattered")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=2048, help="blocks per layer (pool)")
    ap.add_argument("--request-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for both NIXL sides (e.g. tcp)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    if args.serve:
        return serve(json.loads(args.serve))
    if not args.in_netns:
        cmd = ["unshare", "-n", "--", sys.executable, os.path.abspath(__file__), "--in-netns",
               *sys.argv[1:]]
        return subprocess.call(cmd)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    from hmacore.transport import configure_ucx_env
    configure_ucx_env()
    results = []
    for kind in args.tables.split(","):
        for page in [int(p) for p in args.pages.split(",")]:
            r = run_case(kind, page, args)
            print(json.dumps(r), flush=True)
            if r["bad_bytes"]:
                print(f"FAILED: {r['bad_bytes']} bytes differ", file=sys.stderr)
                return 1
            results.append(r)
    argv = "python bench/bench_te.py " + " ".join(
        a for a in sys.argv[1:] if a != "--in-netns")
    md = markdown(results, argv, args.ucx_tls)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "ucx_tls": args.ucx_tls, "results": results}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
