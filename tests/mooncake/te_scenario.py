"""Mooncake Transfer Engine transport between two real processes, inside ``unshare -n``.

``python te_scenario.py netns <mode>`` runs as the top process of a private network namespace
(``te_netns.run_te_scenario``): it brings ``lo`` up, starts peer processes
(``python te_scenario.py peer <json>``), runs the mode, prints one JSON line and stops every
process it started by PID. Modes:

* ``exact``: for each preset (full, sliding-window, MLA and Mamba groups), a peer process
  holds a pattern; this process READs fresh (ascending), eviction-order (descending) and
  scattered tables, posted as runs and per block, then compares ALL of its KV memory with a
  reference (the pattern exactly where it read, zeros elsewhere); it WRITEs the same kinds
  into the peer, and the peer compares all of its memory the same way. Notifications ride a
  transfer and travel alone (every byte value).
* ``kill``: a 128 MiB READ is in flight (its first bytes have landed) when the peer is
  SIGKILLed: it must be reported failed within a bound; the agent then serves a new peer
  byte-exactly.
* ``badargs``: bad arguments are refused with clear errors and the agent stays usable.
* ``stopped``: a peer SIGSTOPped (stops answering): notifications to it do not hold the
  caller, a live peer is served meanwhile, the failure is reported afterwards.
* ``regrain``: a block-size remap (tests/regrain_scenarios.py worlds: two sides of one model
  with other block sizes) between two engines of this process: byte runs READ
  (``MooncakeTeAgent.read_runs``) and WRITTEN (``write_runs``, ``TeDescAgent.post_runs``),
  every byte of both sides' memory compared; bad rows refused with nothing moved; no runs:
  DONE with the notification alone; a closed peer fails the READ through ``wait``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))         # repo root
sys.path.insert(0, HERE)

from hmacore.demo.paged_memory import allocate_paged_kv, fill_pattern, verify_pattern  # noqa: E402
from hmacore.errors import TransferError  # noqa: E402
from hmacore.plan import TransferPlan  # noqa: E402
from hmacore.presets import get_preset  # noqa: E402
from hmacore.spec import GroupKind, GroupSpec, KVLayout  # noqa: E402
from hmacore.transport.base import KvTransport  # noqa: E402
from hmacore.transport.handshake import HandshakePayload, HandshakeServer, exchange_handshake  # noqa: E402
from hmacore.transport.mooncake_te import MooncakeTeAgent  # noqa: E402
from netns import master_log  # noqa: E402

PER_AREA = 6          # blocks per group per area
KINDS = ("fresh", "eviction", "scattered")
POSTINGS = ("auto", "blocks")
# every group kind: gemma (full + sliding, one shared storage), qwen3-next (Mamba states +
# full attention with kernel sub-blocks), deepseek-v4 (MLA, five unequal page sizes)
CASES = {"gemma-3-27b": 256, "qwen3-next-80b": 34 * 64, "deepseek-v4": None}
KILL_LAYOUT = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("k.0", "k.1")),))
KILL_BLOCKS, KILL_PAGE = 1024, 64 * 1024    # 128 MiB per side


def layout_of(cfg):
    if cfg["preset"] == "kill":
        return KILL_LAYOUT
    return get_preset(cfg["preset"], num_blocks=cfg["num_blocks"])


def page_of(cfg):
    if cfg["preset"] == "kill":
        return KILL_PAGE
    if cfg.get("page_bytes") is None:
        # deepseek-v4's own pages, scaled down 16x (still five unequal sizes)
        return [g.page_bytes // 16 for g in layout_of(cfg).groups]
    return cfg["page_bytes"]


def area(layout, index, kind, seed=0):
    """Per-group block ids of area ``index`` (disjoint from every other area) in ``kind``
    order; groups not transferred get no blocks."""
    ng = layout.num_groups
    out = []
    for g in range(ng):
        base = 1 + (index * ng + g) * PER_AREA
        ids = list(range(base, base + PER_AREA))
        if kind == "eviction":
            ids.reverse()
        elif kind == "scattered":
            ids = [ids[i] for i in np.random.default_rng(seed + 31 * g).permutation(PER_AREA)]
        out.append(ids if g in layout.transfer_group_ids else [])
    return out


def num_blocks_for(layout_groups: int, areas: int) -> int:
    return 1 + areas * layout_groups * PER_AREA + 1


class Side:
    """Paged KV memory, its plan and a Mooncake TE agent (one per process)."""

    def __init__(self, cfg, name):
        self.layout = layout_of(cfg)
        self.nb = cfg["num_blocks"]
        self.page = page_of(cfg)
        self.paged = allocate_paged_kv(self.layout, self.nb, page_bytes=self.page)
        plan = TransferPlan.from_kv_caches(self.layout, self.paged.kv_caches, num_blocks=self.nb)
        self.agent = MooncakeTeAgent(name, plan, posting=cfg.get("posting", "auto"))
        assert isinstance(self.agent, KvTransport)

    def mismatched_bytes(self, tables) -> int:
        """Bytes of ALL this side's KV memory that differ from the pattern at ``tables``
        (block index = position) and zeros everywhere else."""
        ref = allocate_paged_kv(self.layout, self.nb, page_bytes=self.page)
        for t in tables:
            fill_pattern(ref, t)
        return int(sum(int(np.count_nonzero(a != b)) for a, b in zip(self.paged.storages, ref.storages)))


# -- the peer process ---------------------------------------------------------------------
def peer_main(cfg) -> int:
    side = Side(cfg, cfg["name"])
    filled = [area(side.layout, i, k, seed=i) for i, k in enumerate(KINDS)]   # read areas
    for t in filled:
        fill_pattern(side.paged, t)
    pending: list[HandshakePayload] = []
    server = HandshakeServer(side.agent.handshake_payload(), on_peer=pending.append)
    print(json.dumps({"port": server.port}), flush=True)
    deadline = time.monotonic() + cfg.get("serve_s", 120)
    client = None
    seen: dict[str, list[str]] = {}
    try:
        while time.monotonic() < deadline:
            while pending:
                client = side.agent.add_peer(pending.pop(0))
            side.agent.fetch_notifs()
            for rid in list(side.agent._notifs):
                for body in side.agent.notifications(rid, fetch=False):
                    if body == b"bye":
                        return 0
                    if rid.startswith("echo") and client is not None:
                        side.agent.send_notif(client, rid, body)
                    elif body.startswith(b"check:") and client is not None:
                        written = json.loads(body[len(b"check:"):])
                        bad = side.mismatched_bytes(filled + written)
                        reply = {"bad_bytes": bad, "seen": seen}
                        side.agent.send_notif(client, rid, json.dumps(reply).encode())
                    else:
                        seen.setdefault(rid, []).append(body.decode("latin-1"))
            time.sleep(0.002)
        return 3
    finally:
        server.close()
        side.agent.close()


# -- helpers of the top process -----------------------------------------------------------
def start_peer(cfg, timeout_s=60.0):
    """Start a peer process; returns (Popen, its handshake port)."""
    with master_log(f"te_{cfg['name']}") as log:     # the engine's log, for post-mortems
        proc = subprocess.Popen([sys.executable, __file__, "peer", json.dumps(cfg)],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("{"):
        stop(proc)
        raise RuntimeError(f"peer {cfg['name']} did not start within {timeout_s} s")
    return proc, json.loads(line)["port"]


def stop(proc, timeout_s=30.0):
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def connect(side, port):
    remote = exchange_handshake("127.0.0.1", port, side.agent.handshake_payload())
    return side.agent.add_peer(remote)


def mode_exact() -> dict:
    out = {}
    for preset, page in CASES.items():
        ng = get_preset(preset).num_groups
        cfg = {"preset": preset, "num_blocks": num_blocks_for(ng, 9), "page_bytes": page}
        proc, port = start_peer({**cfg, "name": "te-peer"})
        me = Side(cfg, "te-client")
        r: dict = {"reads": [], "writes": []}
        try:
            connect(me, port)
            # READ: the peer's three read areas into six local areas
            dest, k = [], 0
            for posting in POSTINGS:
                me.agent.posting = posting
                for i, kind in enumerate(KINDS):
                    remote = area(me.layout, i, kind, seed=i)
                    local = area(me.layout, 3 + k, KINDS[(i + k) % 3], seed=50 + k)
                    t = me.agent.read(f"r{k}", "te-peer", local, remote)
                    me.agent.wait(t, timeout=60)
                    r["reads"].append({"posting": posting, "kind": kind, "state": t.state,
                                       "descriptors": t.descriptors,
                                       "block_descriptors": t.block_descriptors,
                                       "bytes": t.bytes})
                    dest.append(local)
                    k += 1
            r["read_bad_bytes"] = me.mismatched_bytes(dest)
            # WRITE: three local pattern areas into six peer areas (one carries a notif)
            srcs = [area(me.layout, i, kind, seed=i) for i, kind in enumerate(KINDS)]
            for s in srcs:
                fill_pattern(me.paged, s)
            written, k = [], 0
            for posting in POSTINGS:
                me.agent.posting = posting
                for i, kind in enumerate(KINDS):
                    remote = area(me.layout, 3 + k, KINDS[(i + k) % 3], seed=90 + k)
                    t = me.agent.write(f"w{k}", "te-peer", srcs[i], remote,
                                       notif=b"written" if k == 5 else None)
                    me.agent.wait(t, timeout=60)
                    r["writes"].append({"posting": posting, "kind": kind, "state": t.state,
                                        "descriptors": t.descriptors,
                                        "block_descriptors": t.block_descriptors})
                    written.append(remote)
                    k += 1
            me.agent.send_notif("te-peer", "check", b"check:" + json.dumps(written).encode())
            reply = json.loads(me.agent.wait_notif("check", timeout=120))
            r["write_bad_bytes"] = reply["bad_bytes"]
            r["peer_notifs"] = reply["seen"]
            every_byte = bytes(range(256)) + b":x:"
            me.agent.send_notif("te-peer", "echo1", every_byte)
            r["echo_same"] = me.agent.wait_notif("echo1", timeout=60) == every_byte
            me.agent.send_notif("te-peer", "echo2", b"who")
            until = time.monotonic() + 60
            while not me.agent.has_notifications("echo2") and time.monotonic() < until:
                me.agent.fetch_notifs()
                time.sleep(0.002)
            r["echo_from"] = [[who, body.decode()] for who, body in
                              me.agent.notifications_from("echo2", fetch=False)]
            me.agent.send_notif("te-peer", "bye", b"bye")
            r["peer_rc"] = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            me.agent.close()
        out[preset] = r
    return out


def mode_kill() -> dict:
    cfg = {"preset": "kill", "num_blocks": KILL_BLOCKS}
    me = Side(cfg, "te-survivor")
    r: dict = {"tries": 0}
    everything = [list(range(1, KILL_BLOCKS))]
    try:
        for attempt in range(5):
            proc, port = start_peer({**cfg, "name": f"te-victim{attempt}"})
            peer = connect(me, port)
            r["tries"] += 1
            for m in me.paged.storages:
                m[...] = 0
            t = me.agent.read(f"big{attempt}", peer, everything, everything)
            # kill once the first bytes have landed (the READ is really moving data)
            first = me.paged.storages[0].reshape(-1)[:1 << 20]
            until = time.monotonic() + 30
            while me.agent.poll(t) == "PROC" and not first.any() and time.monotonic() < until:
                time.sleep(0.0005)
            if me.agent.poll(t) != "PROC":      # finished before we could kill: try again
                me.agent.send_notif(peer, "bye", b"bye")
                stop(proc)
                continue
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            start = time.monotonic()
            try:
                me.agent.wait(t, timeout=120)
                r["outcome"] = "done"             # all bytes had arrived before the kill
            except TransferError as e:
                r["outcome"] = "failed"
                r["error"] = str(e)
            r["fail_s"] = time.monotonic() - start
            # how much had arrived when it failed (the pattern has few zero bytes)
            r["arrived_fraction"] = float(np.mean([np.count_nonzero(m) / m.size
                                                   for m in me.paged.storages]))
            r["failure_recorded"] = me.agent.failure(f"big{attempt}") is not None
            r["valid_after_failure"] = me.agent.valid_blocks(f"big{attempt}") is not None
            # the dead peer again: refused, bounded
            start = time.monotonic()
            try:
                me.agent.wait(me.agent.read("again", peer, [[1, 2]], [[1, 2]]), timeout=120)
                r["again"] = "done"
            except TransferError:
                r["again"] = "failed"
            r["again_s"] = time.monotonic() - start
            me.agent.remove_peer(peer)
            if r["outcome"] == "failed":
                break
        # the survivor serves a new peer byte-exactly (the peer filled its read areas)
        proc, port = start_peer({**cfg, "name": "te-fresh"})
        try:
            peer = connect(me, port)
            table = area(me.layout, 0, "fresh", seed=0)
            t = me.agent.wait(me.agent.read("after", peer, table, table), 60)
            r["after_state"] = t.state
            r["after_mismatches"] = len(verify_pattern(me.paged, table))
            me.agent.send_notif(peer, "bye", b"bye")
            stop(proc)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    finally:
        me.agent.close()
    return r


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test by type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def mode_badargs() -> dict:
    cfg = {"preset": "gemma-3-27b", "num_blocks": num_blocks_for(7, 9), "page_bytes": 256}
    proc, port = start_peer({**cfg, "name": "te-peer"})
    me = Side(cfg, "te-bad")
    plan = me.agent.plan
    r: dict = {}
    try:
        peer = connect(me, port)
        ng = me.layout.num_groups
        ok = area(me.layout, 0, "fresh")
        r["unknown_peer"] = _error(lambda: me.agent.read("a", "nobody", ok, ok))
        r["block_out_of_range"] = _error(lambda: me.agent.read(
            "b", peer, [[me.nb + 5]] + [[]] * (ng - 1), [[1]] + [[]] * (ng - 1)))
        r["negative_block"] = _error(lambda: me.agent.read(
            "c", peer, [[-1]] + [[]] * (ng - 1), [[1]] + [[]] * (ng - 1)))
        r["unequal_counts"] = _error(lambda: me.agent.read(
            "d", peer, [[1, 2]] + [[]] * (ng - 1), [[1]] + [[]] * (ng - 1)))
        r["wrong_groups"] = _error(lambda: me.agent.read("e", peer, [[1]], [[1]]))
        r["colon_request"] = _error(lambda: me.agent.read("f:g", peer, ok, ok))
        r["str_notif"] = _error(lambda: me.agent.read("h", peer, ok, ok, notif="x"))  # type: ignore[arg-type]
        r["expired"] = _error(lambda: me.agent.read("i", peer, ok, ok,
                                                    expires_at=time.monotonic() - 1))
        r["bad_posting"] = _error(lambda: MooncakeTeAgent("x", plan, posting="runs"))
        r["bad_timeout"] = _error(lambda: MooncakeTeAgent("x", plan, transfer_timeout_s=1))
        r["bad_name"] = _error(lambda: MooncakeTeAgent("a:b", plan))
        nixl_like = HandshakePayload.for_plan(plan, "nixl-peer", b"\x00binary-nixl-metadata")
        r["nixl_payload"] = _error(lambda: me.agent.add_peer(nixl_like))
        # a pair that is no TpPairPlan, for the live peer's own payload: refused, and the
        # peer already added stays usable (checked by the READ below)
        again = exchange_handshake("127.0.0.1", port, me.agent.handshake_payload())
        r["pair"] = _error(lambda: me.agent.add_peer(again, pair=object()))
        # the live peer handshaking again for notifications (P and D roles swapped): it stays
        # a transfer peer (the READ below still moves bytes)
        r["notify_same"] = me.agent.add_notify_peer(again)
        r["failures_recorded"] = sorted(k for k in "abcdei" if me.agent.failure(k) is not None)
        # still usable, byte-exact
        t = me.agent.wait(me.agent.read("good", peer, ok, ok), 60)
        r["after_state"] = t.state
        r["after_bad_bytes"] = me.mismatched_bytes([ok])
        me.agent.send_notif(peer, "bye", b"bye")
        stop(proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        me.agent.close()
    r["closed"] = _error(lambda: me.agent.read("z", "te-peer", ok, ok))
    return r


def mode_stopped() -> dict:
    """A peer that stops answering (SIGSTOP: its port still accepts, nothing replies): a
    standalone notification to it returns at once while still pending, a live peer is served
    meanwhile, the failure is reported afterwards (the engine's transfer timeout) and the
    next send to that peer raises."""
    cfg = {"preset": "gemma-3-27b", "num_blocks": num_blocks_for(7, 9), "page_bytes": 256}
    frozen, fport = start_peer({**cfg, "name": "te-frozen"})
    live, lport = start_peer({**cfg, "name": "te-live"})
    me = Side(cfg, "te-sender")
    r: dict = {}
    try:
        connect(me, fport)
        connect(me, lport)
        me.agent.send_notif("te-frozen", "echo0", b"before")      # a live round trip first
        r["echo_before"] = me.agent.wait_notif("echo0", timeout=60).decode()
        os.kill(frozen.pid, signal.SIGSTOP)
        me.agent.send_notif("te-frozen", "ping1", b"x")
        me.agent.send_notif("te-frozen", "ping2", b"x")
        # both calls returned; the first is held by the stopped peer (>= the engine timeout)
        r["pending_after_send"] = me.agent.notifs_pending("te-frozen")
        r["failures_while_pending"] = me.agent.notif_failures()
        me.agent.send_notif("te-live", "echo1", b"alive")
        r["live_echo"] = me.agent.wait_notif("echo1", timeout=60).decode()
        r["pending_after_live_echo"] = me.agent.notifs_pending("te-frozen")
        start = time.monotonic()
        failures: list = []
        while not failures and time.monotonic() - start < 120:
            failures = me.agent.notif_failures()
            time.sleep(0.01)
        r["failures"] = failures
        r["pending_after_failure"] = me.agent.notifs_pending("te-frozen")
        r["next_send"] = _error(lambda: me.agent.send_notif("te-frozen", "ping3", b"x"))
        me.agent.send_notif("te-live", "bye", b"bye")
        r["live_rc"] = live.wait(timeout=60)
    finally:
        for proc in (frozen, live):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        me.agent.close()
    return r


REGRAIN_CASES = [("gemma_p16_d32", 130, 0), ("dsv4_p1x_d4x", 200, 64),
                 ("qwen_next_p16_d64", 130, 32), ("lbhnc_p8_d32_kernel16", 77, 0)]


def _differs(storages, want) -> int:
    return int(sum(int(np.count_nonzero(a != b)) for a, b in zip(storages, want)))


def _restore(storages, before) -> None:
    for s, b in zip(storages, before):
        s[...] = b


def _notifs_until(get, n: int, timeout_s: float = 60.0) -> list:
    """Poll ``get()`` (consuming) until ``n`` items came or ``timeout_s`` passed."""
    out: list = []
    until = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < until:
        out.extend(get())
        time.sleep(0.002)
    return out


def mode_regrain() -> dict:
    sys.path.insert(0, os.path.dirname(HERE))            # tests/: regrain_scenarios
    from regrain_scenarios import World
    from hmacore.transport.mooncake_desc import TeDescAgent
    out: dict = {}
    for scenario, num_tokens, trim in REGRAIN_CASES:
        w = World(scenario, num_tokens, trim, seed=num_tokens * 7 + trim)
        want = w.expected()
        d_before = [s.copy() for s in w.dpaged.storages]
        s_before = [s.copy() for s in w.spaged.storages]
        r: dict = {}
        P = MooncakeTeAgent("rg-p", w.splan)
        D = MooncakeTeAgent("rg-d", w.dplan)
        try:
            # pull: D reads P's runs in D's grain (P's layout given: kernel blocks differ)
            pname, splan = D.add_regrain_peer(P.handshake_payload(), w.slay)
            r["peer_regions_same"] = [g.base for g in splan.regions] == \
                [g.base for g in w.splan.regions]
            runs = w.runs().as_runs("dst")
            t = D.read_runs("pull-1", pname, runs, notif=b"moved")
            D.wait(t, timeout=60)
            r["pull"] = {"state": t.state, "bytes": t.bytes, "runs_bytes": int(runs.nbytes),
                         "descriptors": t.descriptors, "rows": int(runs.local.shape[0]),
                         "bad_bytes": _differs(w.dpaged.storages, want),
                         "src_changed": _differs(w.spaged.storages, s_before),
                         "valid": D.valid_blocks("pull-1") == ()}
            r["pull_notif"] = [b.decode() for b in _notifs_until(
                lambda: P.notifications("pull-1"), 1)]
            # negative control: the same runs one byte late leave other bytes
            _restore(w.dpaged.storages, d_before)
            late, local = runs.remote.copy(), runs.local.copy()
            late[:, 0] += 1
            late[:, 1] -= 1
            local[:, 1] -= 1
            keep = local[:, 1] > 0
            D.wait(D.read_runs("pull-late", pname, type(runs)(local[keep], late[keep], None,
                                                               0, 0)), timeout=60)
            r["late_bad_bytes"] = _differs(w.dpaged.storages, want)
            # push: P writes the same token rows into D (P's grain is the source side)
            _restore(w.dpaged.storages, d_before)
            dname, dplan = P.add_regrain_peer(D.handshake_payload(), w.dlay)
            t = P.write_runs("push-1", dname, w.runs().as_runs("src"), notif=b"pushed")
            P.wait(t, timeout=60)
            r["push"] = {"state": t.state, "bad_bytes": _differs(w.dpaged.storages, want),
                         "src_changed": _differs(w.spaged.storages, s_before)}
            r["push_notif"] = [b.decode() for b in _notifs_until(
                lambda: D.notifications("push-1"), 1)]
            if scenario == "gemma_p16_d32":
                r.update(_regrain_refusals(w, D, P, pname, runs, want, d_before))
                # the descriptor driver (layer-wise push): the same runs by post_runs
                _restore(w.dpaged.storages, d_before)
                r["desc"] = _regrain_desc(TeDescAgent, w, want, d_before, s_before)
                # a peer gone (its engine closed): the READ fails through wait, recorded
                _restore(w.dpaged.storages, d_before)
                P.close()
                start = time.monotonic()
                r["closed_peer"] = _error(lambda: D.wait(D.read_runs("pull-dead", pname, runs),
                                                         timeout=120))
                r["closed_peer_s"] = time.monotonic() - start
                r["closed_peer_recorded"] = D.failure("pull-dead") is not None
                r["closed_peer_valid"] = D.valid_blocks("pull-dead") is not None
        finally:
            D.close()
            P.close()
        out[scenario] = r
    return out


def _regrain_refusals(w, D, P, pname, runs, want, d_before) -> dict:
    """Bad rows (the first rows good: a partial post would move them) refused, recorded,
    nothing moved; no runs: DONE and the notification alone; block ids to a runs peer."""
    r: dict = {}
    _restore(w.dpaged.storages, d_before)
    Runs = type(runs)
    bad_remote = runs.remote.copy()
    bad_remote[-1, 0] = 8                                   # outside P's registered memory
    bad_local = runs.local.copy()
    bad_local[-1, 0] = int(bad_local[-1, 0]) + (1 << 40)    # outside D's
    long_remote = runs.remote.copy()
    long_remote[-1, 1] += 1                                 # lengths differ from the local row
    r["bad_remote"] = _error(lambda: D.read_runs("bad-r", pname, Runs(runs.local, bad_remote,
                                                                      None, 0, 0)))
    r["bad_local"] = _error(lambda: D.read_runs("bad-l", pname, Runs(bad_local, runs.remote,
                                                                     None, 0, 0)))
    r["bad_length"] = _error(lambda: D.read_runs("bad-n", pname, Runs(runs.local, long_remote,
                                                                      None, 0, 0)))
    r["bad_unknown"] = _error(lambda: D.read_runs("bad-u", "nobody", runs))
    r["bad_blocks"] = _error(lambda: D.read("bad-b", pname, [[1]] * 2, [[1]] * 2))
    r["bad_recorded"] = sorted(k for k in ("bad-r", "bad-l", "bad-n", "bad-u", "bad-b")
                               if D.failure(k) is not None)
    time.sleep(1.0)                    # anything posted would have landed by now
    r["bad_moved_bytes"] = _differs(w.dpaged.storages, d_before)
    empty = np.zeros((0, 3), np.uint64)
    t = D.read_runs("empty", pname, Runs(empty, empty, None, 0, 0), notif=b"nothing")
    r["empty"] = {"state": t.state, "valid": D.valid_blocks("empty") == (), "bytes": t.bytes}
    r["empty_notif"] = [b.decode() for b in _notifs_until(lambda: P.notifications("empty"), 1)]
    return r


def _regrain_desc(TeDescAgent, w, want, d_before, s_before) -> dict:
    r: dict = {}
    Pd = TeDescAgent("rgd-p", w.splan.registration_ranges())
    Dd = TeDescAgent("rgd-d", w.dplan.registration_ranges())
    try:
        runs = w.runs().as_runs("src")
        name = Pd.add_remote(Dd.metadata())
        r["before_add"] = _error(lambda: Pd.post_runs("WRITE", name, runs.local, runs.remote))
        Pd.add_runs_peer(name, w.dplan.registration_ranges())
        bad = runs.remote.copy()
        bad[-1, 0] = 8
        r["bad_remote"] = _error(lambda: Pd.post_runs("WRITE", name, runs.local, bad))
        empty = np.zeros((0, 3), np.uint64)
        r["empty"] = _error(lambda: Pd.post_runs("WRITE", name, empty, empty))
        r["bad_op"] = _error(lambda: Pd.post_runs("COPY", name, runs.local, runs.remote))
        r["posted_after_refusals"] = Pd.take_posted().transfers
        time.sleep(1.0)
        r["bad_moved_bytes"] = _differs(w.dpaged.storages, d_before)
        h = Pd.post_runs("WRITE", name, runs.local, runs.remote, b"r:L0")
        Pd.wait(h, timeout=60)
        posted = Pd.take_posted()
        r["posted"] = [posted.transfers, posted.bytes, int(runs.nbytes)]
        r["last_post"] = list(Pd.last_post)
        r["bad_bytes"] = _differs(w.dpaged.storages, want)
        r["src_changed"] = _differs(w.spaged.storages, s_before)
        r["notifs"] = [[a, m.decode()] for a, m in _notifs_until(Dd.notifs_by_agent, 1)]
        # READ by runs the other way (D's agent reads P's rows)
        _restore(w.dpaged.storages, d_before)
        pname = Dd.add_remote(Pd.metadata())
        Dd.add_runs_peer(pname, w.splan.registration_ranges())
        dr = w.runs().as_runs("dst")
        Dd.wait(Dd.post_runs("READ", pname, dr.local, dr.remote), timeout=60)
        r["read_bad_bytes"] = _differs(w.dpaged.storages, want)
        Pd.remove_remote(name)
        r["after_remove"] = _error(lambda: Pd.post_runs("WRITE", name, runs.local, runs.remote))
    finally:
        Pd.close()
        Dd.close()
    return r


MODES = {"exact": mode_exact, "kill": mode_kill, "badargs": mode_badargs,
         "stopped": mode_stopped, "regrain": mode_regrain}

if __name__ == "__main__":
    os.environ.setdefault("GLOG_minloglevel", "2")
    if sys.argv[1] == "peer":
        sys.exit(peer_main(json.loads(sys.argv[2])))
    if sys.argv[1] == "netns":
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        print(json.dumps(MODES[sys.argv[2]]()), flush=True)
