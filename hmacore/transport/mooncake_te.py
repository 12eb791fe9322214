"""Mooncake Transfer Engine driver: the :class:`~hmacore.transport.base.KvTransport` interface
over ``mooncake.engine.TransferEngine`` (wheel ``mooncake-transfer-engine-non-cuda``).

``mooncake`` is imported lazily (only when an agent is created). The engine runs in P2P
handshake mode (``"P2PHANDSHAKE"``: no etcd, no metadata server): each engine listens on an
RPC port of its own and peers address it as ``"<host>:<port>"``. That session name and the
address of a small "doorbell" buffer are this transport's endpoint data, carried as the
handshake payload's ``agent_metadata`` (JSON); the region table is the same as NIXL's.

How things map onto the engine (its semantics read from Mooncake's transfer_engine_py.cpp):

* a transfer is one ``batch_transfer_sync(peer, local_addrs, remote_addrs, lengths, opcode,
  notify)`` with one entry per descriptor run (:func:`hmacore.runs.find_runs`) or per block
  (``posting="blocks"``). The call blocks with the GIL released, so it runs on a small
  worker pool and :meth:`MooncakeTeAgent.poll` stays non-blocking. The engine bounds it
  itself: ``MC_TRANSFER_TIMEOUT`` seconds (set to ``transfer_timeout_s`` here when the user
  has not set it; the engine's floor is 5 s) plus 1 ns per byte.
* ``notif=`` rides the transfer (``TransferNotify``): the peer receives it only when the
  batch completed. The Python API sends a notification only together with a transfer, so a
  standalone :meth:`send_notif` is a 1-byte write between the two agents' doorbell buffers,
  made on a per-peer sender thread (:mod:`hmacore.transport.te_notify`): a peer that stops
  answering holds that thread, never the caller.
* the engine's TCP server checks every remote address against the memory its owner
  registered; this driver also validates every block id before anything is posted.

Failure: a dead or unreachable peer, a refused address, a timeout: the request fails with
TransferError (remembered by :meth:`failure`), the agent stays usable.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import operator
import os
import time
from typing import Any

import numpy as np

from ..errors import BlockTableError, HandshakeError, HmacoreError, TransferError
from ..plan import TransferPlan
from ..spec import KVLayout
from ..runs import DescTable, desc_table, find_runs
from .base import Transfer, TransferPosting
from .handshake import HandshakePayload
from .notif_queues import NotifQueues
from .runs_peer import regrain_peer_plan, runs_transfer
from .te_notify import NotifyQueues

__all__ = ["MAX_SLICES_PER_CALL", "MooncakeTeAgent", "TE_POSTINGS", "TE_SLICE_BYTES",
           "endpoint_metadata", "parse_endpoint", "split_calls"]

#: ``"blocks"``: one TE entry per block (the baseline); every other name of
#: :data:`hmacore.transport.nixl_post.POSTINGS` posts one entry per maximal run ("dynamic"
#: and "prepped" are NIXL's two ways of handing it the runs; the engine takes plain
#: ``(addr, len)`` entries, so over TE they are the same thing)
TE_POSTINGS = ("auto", "dynamic", "prepped", "blocks")
#: the TCP transport cuts every entry into slices of this many bytes and admits at most
#: 1024 queued + 1024 pending slices per peer, failing (not queueing) the rest and the
#: connection with them (Mooncake's tcp_transport defaults; seen here as "TCP lane
#: queue-full rejection" then "Connection reset by peer" from ~2,500 entries of 256 bytes)
TE_SLICE_BYTES = 64 * 1024
#: so one engine call carries at most this many slices: ``workers`` calls in flight stay
#: inside the peer's 1024-slice queue
MAX_SLICES_PER_CALL = 256
_DOORBELL_BYTES = 64
_KIND = "mooncake-te"


def endpoint_metadata(session: str, doorbell: int) -> bytes:
    """The ``agent_metadata`` of a Mooncake TE agent: its session name and doorbell address."""
    return json.dumps({"transport": _KIND, "session": session,
                       "doorbell": int(doorbell)}).encode()


def parse_endpoint(metadata: bytes, agent: str) -> tuple[str, int]:
    """``(session, doorbell)`` from a peer's ``agent_metadata``; HandshakeError when it is not
    a Mooncake TE endpoint (e.g. a NIXL agent's metadata)."""
    try:
        d = json.loads(bytes(metadata).decode())
        if d.get("transport") != _KIND:
            raise ValueError(f"transport {d.get('transport')!r}")
        session, doorbell = d["session"], d["doorbell"]
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit() or type(doorbell) is not int or doorbell <= 0:
            raise ValueError(f"session {session!r} / doorbell {doorbell!r}")
    except Exception as e:  # noqa: BLE001 - anything unparsable is a handshake error
        raise HandshakeError(f"peer {agent!r} is not a Mooncake TE endpoint (its transport "
                             f"metadata: {type(e).__name__}: {e}); both sides must use "
                             "\"transport\": \"mooncake\"") from None
    return session, doorbell


def split_calls(local_addrs: np.ndarray, remote_addrs: np.ndarray, lengths: np.ndarray,
                max_bytes: int) -> list[tuple[list[int], list[int], list[int]]]:
    """The entries of one transfer cut into engine calls of at most ``max_bytes`` worth of
    slices each (counted in whole :data:`TE_SLICE_BYTES` slices; an entry longer than
    ``max_bytes`` is cut into pieces). Order and bytes are unchanged."""
    la = np.asarray(local_addrs, dtype=np.uint64)
    ra = np.asarray(remote_addrs, dtype=np.uint64)
    ln = np.asarray(lengths, dtype=np.uint64)
    cap = max(1, max_bytes // TE_SLICE_BYTES)
    if ln.size and int(ln.max()) > cap * TE_SLICE_BYTES:   # rare: cut long entries
        pieces = [(int(a), int(b), int(n)) for a, b, n in zip(la.tolist(), ra.tolist(),
                                                                ln.tolist())]
        step = cap * TE_SLICE_BYTES
        cut = [(a + o, b + o, min(step, n - o)) for a, b, n in pieces for o in range(0, n, step)]
        la, ra, ln = (np.array(c, dtype=np.uint64) for c in zip(*cut))
    slices = (ln + np.uint64(TE_SLICE_BYTES - 1)) // np.uint64(TE_SLICE_BYTES)
    # greedy: a new call whenever the running slice count would pass the cap
    out, start, used = [], 0, 0
    for i, s in enumerate(slices.tolist()):
        if used + s > cap and i > start:
            out.append((start, i))
            start, used = i, 0
        used += s
    if start < ln.size:
        out.append((start, int(ln.size)))
    return [(la[a:b].tolist(), ra[a:b].tolist(), ln[a:b].tolist()) for a, b in out]


def open_engine(hostname: str, protocol: str, transfer_timeout_s: int,
                ranges: list[tuple[int, int]]) -> tuple[Any, str, np.ndarray, list[int]]:
    """A TransferEngine in P2P-handshake mode on ``hostname`` with ``ranges`` ``(addr, bytes)``
    and a fresh doorbell buffer registered: ``(engine, session, doorbell, registered addrs)``.
    The doorbell is owned by the caller (it must outlive the engine)."""
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(transfer_timeout_s))
    from mooncake.engine import TransferEngine  # lazy: core never imports mooncake
    eng = TransferEngine()
    if eng.initialize(hostname, "P2PHANDSHAKE", protocol, "") != 0:
        raise TransferError(f"Mooncake TE failed to initialize on {hostname!r} with "
                            f"protocol {protocol!r} (P2P handshake)")
    session = f"{hostname}:{eng.get_rpc_port()}"
    doorbell = np.zeros(_DOORBELL_BYTES, np.uint8)
    ranges = list(ranges) + [(doorbell.ctypes.data, _DOORBELL_BYTES)]
    reg = [a for a, _ in ranges]
    rc = eng.batch_register_memory(reg, [n for _, n in ranges])
    if rc != 0:
        raise TransferError(f"Mooncake TE refused to register {len(ranges)} memory ranges "
                            f"(rc {rc})")
    return eng, session, doorbell, reg


def check_engine_args(name: Any, posting: Any, transfer_timeout_s: Any, workers: Any) -> None:
    """ValueError naming the argument and its rule (both TE drivers' constructors)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"name must be a non-empty str without ':', got {name!r}")
    if posting not in TE_POSTINGS:
        raise ValueError(f"posting must be one of {list(TE_POSTINGS)}, got {posting!r}")
    if type(transfer_timeout_s) is not int or transfer_timeout_s < 5:
        raise ValueError("transfer_timeout_s must be an int >= 5 (seconds; the engine's "
                         f"floor), got {transfer_timeout_s!r}")
    if type(workers) is not int or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")


def run_calls(engine: Any, session: str, calls, code, note) -> int:
    """The engine calls of one transfer, in order (the notification rides the last); the
    first non-zero rc ends it."""
    for i, (la, ra, ln) in enumerate(calls):
        rc = engine.batch_transfer_sync(session, la, ra, ln, code,
                                        note if i == len(calls) - 1 else None)
        if rc != 0:
            return int(rc)
    return 0


@dataclasses.dataclass
class _Peer:
    name: str
    payload: HandshakePayload
    session: str
    doorbell: int
    plan: TransferPlan | None = None
    rows: np.ndarray | None = None        # its descriptors' (addr, bytes, dev) rows
    table: DescTable | None = None
    pair: Any = None                      # a TpPairPlan (a peer of another TP size)
    local_rows: np.ndarray | None = None  # a pair's local (head-slice) descriptors
    local_table: DescTable | None = None
    runs_only: bool = False               # other block sizes: byte runs only (read_runs)


class TeEngineLifetime:
    """Open / close of one Transfer Engine that owns a memory registration (both TE drivers):
    ``close`` forgets the peers (``_forget_peers``), waits for the transfers in flight (each
    bounded by the engine's timeout), deregisters the memory and drops the engine."""

    _closed: bool
    _pool: cf.ThreadPoolExecutor
    _engine: Any
    _reg: list
    _senders: NotifyQueues      # standalone notifications, one sender thread per peer

    def _forget_peers(self) -> None:
        raise NotImplementedError

    def notif_failures(self) -> list[tuple[str, str]]:
        """``(peer, error)`` of the peers a queued notification failed to reach since the
        last call (each reported once)."""
        return self._senders.take_failures()

    def notifs_pending(self, peer: str) -> int:
        """Notifications to ``peer`` queued or being sent."""
        return self._senders.pending(peer)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the agent is closed")

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._forget_peers()
        self._pool.shutdown(wait=True)
        try:
            self._engine.batch_unregister_memory(self._reg)
        finally:
            self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MooncakeTeAgent(TeEngineLifetime, TransferPosting):
    """A Mooncake Transfer Engine (TCP, P2P handshake) over one TransferPlan's memory.

    Args:
        name: agent name (unique among peers).
        plan: the local plan; its registration ranges are registered with the engine.
        hostname: the address the engine's RPC and data servers listen on (loopback by
            default; a namespace's or host's own address across machines).
        protocol: the engine's transport (``"tcp"``; ``"rdma"`` needs RDMA devices).
        hma: HMA on/off, carried in the handshake (peers must agree).
        tp: keyword arguments of :meth:`HandshakePayload.for_tp_plan` (the TP-aware
            handshake the vLLM connector speaks); peers must still have this TP size.
        posting: ``"blocks"`` (per block) or ``"auto"`` / ``"dynamic"`` / ``"prepped"`` (one
            entry per maximal run; see :data:`TE_POSTINGS`).
        transfer_timeout_s: the engine's own transfer timeout (``MC_TRANSFER_TIMEOUT``,
            seconds, >= 5), used when the environment does not set it.
        workers: threads that carry blocking engine calls (transfers in flight at once).
    """

    def __init__(self, name: str, plan: TransferPlan, *, hostname: str = "127.0.0.1",
                 protocol: str = "tcp", hma: bool = True, tp: dict[str, Any] | None = None,
                 posting: str = "auto",
                 transfer_timeout_s: int = 10, workers: int = 4):
        check_engine_args(name, posting, transfer_timeout_s, workers)
        if plan.mem_type != "DRAM":
            raise ValueError(f"plan.mem_type must be 'DRAM' for this driver, got {plan.mem_type!r}")
        self.name = name
        self.plan = plan
        self.hma = hma
        self.tp = dict(tp) if tp is not None else None
        self.posting = posting
        self._engine, self.session, self._doorbell, self._reg = open_engine(
            hostname, protocol, transfer_timeout_s,
            [(int(a), int(n)) for a, n, _ in plan.registration_ranges()])
        self._rows = np.ascontiguousarray(plan.descriptors(), dtype=np.uint64)
        self._table = desc_table(self._rows, plan.registration_ranges())
        self._group_bytes = plan._group_block_bytes
        self._pool = cf.ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix=f"mooncake-te-{name}")
        self._peers: dict[str, _Peer] = {}
        self._valid: dict[str, tuple[np.ndarray, ...]] = {}
        self._failed: dict[str, TransferError] = {}
        self._notifs = NotifQueues()    # rid -> [(sender, body), ...]
        self._senders = NotifyQueues(self._doorbell_write, f"mooncake-te-{name}")
        self._closed = False

    # -- peers -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's endpoint data (session name, doorbell address) for the handshake."""
        return endpoint_metadata(self.session, self._doorbell.ctypes.data)

    def handshake_payload(self) -> HandshakePayload:
        if self.tp is not None:
            return HandshakePayload.for_tp_plan(self.plan, self.name, self.metadata(),
                                                hma=self.hma, **self.tp)
        return HandshakePayload.for_plan(self.plan, self.name, self.metadata(), hma=self.hma)

    def add_peer(self, payload: HandshakePayload, *, pair: Any = None) -> str:
        """Accept a peer from its handshake payload (compatibility checked, its regions laid
        over our layout). ``pair``: a :class:`~hmacore.tp.TpPairPlan` for a peer of another
        TP size (:func:`hmacore.transport.tp_peer.tp_pair_plans`): its head-slice
        descriptors pair with ours and transfers use ``pair.desc_ids`` (remote ids are the
        peer's own block ids), as in :meth:`NixlAgent.add_peer`."""
        self._check_open()
        p = self._load_peer(payload)
        try:
            if pair is None:
                plan = payload.remote_plan(self.plan.layout)
                p.rows = np.ascontiguousarray(plan.descriptors(), dtype=np.uint64)
                p.table = desc_table(p.rows, plan.registration_ranges())
                p.plan = plan
            else:
                # a pair's virtual regions lie inside each side's registered memory: their
                # own registration ranges are safe run barriers
                p.rows = np.ascontiguousarray(pair.remote.descriptors(), dtype=np.uint64)
                p.table = desc_table(p.rows, pair.remote.registration_ranges())
                p.local_rows = np.ascontiguousarray(pair.local.descriptors(), dtype=np.uint64)
                p.local_table = desc_table(p.local_rows, pair.local.registration_ranges())
                p.pair = pair
        except HmacoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed region table
            raise HandshakeError(f"peer {p.name!r}: its regions do not fit our layout: "
                                 f"{type(e).__name__}: {e}") from e
        self._peers[p.name] = p
        return p.name

    def add_notify_peer(self, payload: HandshakePayload) -> str:
        """Accept a peer only to send it notifications (transfers to it raise). A peer
        already known under the same endpoint (agent metadata) is kept as it is (P and D
        roles swapped: its transfer descriptors stay), as :meth:`NixlAgent.add_notify_peer`."""
        self._check_open()
        old = self._peers.get(payload.agent_name)
        if old is not None and old.payload.agent_metadata == payload.agent_metadata:
            self.handshake_payload().check_compatible(payload)
            return old.name
        p = self._load_peer(payload)
        self._peers[p.name] = p
        return p.name

    def add_regrain_peer(self, payload: HandshakePayload, remote_layout: KVLayout | None = None
                         ) -> tuple[str, TransferPlan]:
        """Accept a same-TP peer whose attention block sizes differ from this agent's (a
        block-size remap, :mod:`hmacore.regrain`), with :meth:`NixlAgent.add_regrain_peer
        <hmacore.transport.nixl.NixlAgent.add_regrain_peer>`'s rules
        (:func:`~hmacore.transport.runs_peer.regrain_peer_plan`). Transfers to this peer post
        byte runs (:meth:`read_runs` / :meth:`write_runs`), bounded by its registered
        regions. Returns ``(peer name, the peer's TransferPlan over its own layout)``;
        raises HandshakeError."""
        self._check_open()
        plan = regrain_peer_plan(self.handshake_payload(), payload, self.plan.layout,
                                 remote_layout)
        session, doorbell = parse_endpoint(payload.agent_metadata, payload.agent_name)
        self._peers[payload.agent_name] = _Peer(payload.agent_name, payload, session, doorbell,
                                                plan=plan, runs_only=True)
        return payload.agent_name, plan

    def _load_peer(self, payload: HandshakePayload) -> _Peer:
        self.handshake_payload().check_compatible(payload)
        session, doorbell = parse_endpoint(payload.agent_metadata, payload.agent_name)
        # a peer of that name is replaced only once the new entry is complete
        return _Peer(payload.agent_name, payload, session, doorbell)

    def remove_peer(self, name: str) -> None:
        """Forget a peer (idempotent; its queued notifications are dropped). The engine keeps
        its cached connection."""
        self._peers.pop(name, None)
        self._senders.forget(name)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # -- transfers ---------------------------------------------------------------------
    def _start(self, request_id: Any, peer: str, notif: Any) -> _Peer:
        """The checks every post starts with (the request's earlier outcome forgotten):
        the peer, TransferError (recorded) when it is unknown."""
        self._check_open()
        if not isinstance(request_id, str) or ":" in request_id:
            raise TransferError(f"request_id must be a str without ':', got {request_id!r}")
        if notif is not None and not isinstance(notif, (bytes, bytearray)):
            raise TransferError(f"notif must be bytes or None, got {type(notif).__name__}",
                                request_id=request_id)
        self._failed.pop(request_id, None)
        self._valid.pop(request_id, None)
        p = self._peers.get(peer)
        if p is None:
            raise self._fail(request_id, f"unknown peer {peer!r} (handshake first)")
        return p

    def _post(self, op, request_id, peer, local_ids, remote_ids, notif, expires_at) -> Transfer:
        p = self._start(request_id, peer, notif)
        if expires_at is not None and time.monotonic() >= expires_at:
            raise self._fail(request_id, f"the lease on peer {peer!r}'s blocks expired")
        if p.runs_only:
            raise self._fail(request_id, f"peer {peer!r} has other block sizes: post byte runs "
                                         "(read_runs / write_runs)")
        if p.rows is None or p.table is None:
            raise self._fail(request_id, f"peer {peer!r} was added for notifications only")
        if p.pair is not None:
            lids, rids, table, nbytes = self._pair_ids(request_id, p, local_ids, remote_ids)
            local_rows, local_table = p.local_rows, p.local_table
        else:
            lids, rids, table, nbytes = self._checked_ids(request_id, p, local_ids, remote_ids)
            local_rows, local_table = self._rows, self._table
        assert local_rows is not None and local_table is not None
        t = Transfer(request_id, op, peer, table, int(lids.size), nbytes,
                     posted_at=time.monotonic(), block_descriptors=int(lids.size))
        if not lids.size:   # full local hit: nothing to move
            t.state = "DONE"
            self._valid[request_id] = table
            if notif is not None:
                self.send_notif(peer, request_id, bytes(notif))
            return t
        if self.posting == "blocks":
            lrows, rrows = local_rows[lids], p.rows[rids]
            if not np.array_equal(lrows[:, 1], rrows[:, 1]):
                raise self._fail(request_id, f"descriptor lengths differ from peer {peer!r}'s")
            t.mechanism = "blocks"
        else:
            try:
                runs = find_runs(local_table, lids, p.table, rids)
            except BlockTableError as e:
                raise self._fail(request_id, f"bad descriptor pairs for {peer!r}: {e}") from None
            lrows, rrows, t.runs, t.mechanism = runs.local, runs.remote, runs.num_runs, "runs"
        t.descriptors = int(lrows.shape[0])
        return self._submit(t, p, lrows, rrows, notif)

    def _submit(self, t: Transfer, p: _Peer, lrows: np.ndarray, rrows: np.ndarray,
                notif: bytes | None) -> Transfer:
        """Hand ``t``'s paired rows to the engine (calls cut by :func:`split_calls`) on the
        worker pool; its notification rides the last call."""
        note = self._notify(t.request_id, bytes(notif)) if notif is not None else None
        from mooncake.engine import TransferOpcode
        code = TransferOpcode.Read if t.op == "READ" else TransferOpcode.Write
        calls = split_calls(lrows[:, 0], rrows[:, 0], lrows[:, 1],
                            MAX_SLICES_PER_CALL * TE_SLICE_BYTES)
        t.handle = self._pool.submit(run_calls, self._engine, p.session, calls, code, note)
        return t

    def read_runs(self, request_id: str, peer: str, runs: Any, *,
                  notif: bytes | None = None) -> Transfer:
        """Post a READ of byte runs: ``runs.local`` / ``runs.remote`` M x 3 ``(addr, bytes,
        dev)`` rows paired row by row (a :class:`hmacore.runs.Runs`, e.g.
        ``RegrainRuns.as_runs("dst")``), one engine entry per row. Every row must lie inside
        this agent's registered memory and the peer's registered regions; raises
        TransferError (recorded, nothing posted). No runs: DONE at once (``notif`` sent
        alone). Completion and failure as for :meth:`read` (:meth:`poll`, :meth:`failure`)."""
        return self._post_runs("READ", request_id, peer, runs, notif)

    def write_runs(self, request_id: str, peer: str, runs: Any, *,
                   notif: bytes | None = None) -> Transfer:
        """Post a WRITE of byte runs (``runs.local`` into ``runs.remote``); see read_runs."""
        return self._post_runs("WRITE", request_id, peer, runs, notif)

    def _post_runs(self, op: str, request_id: str, peer: str, runs: Any,
                   notif: bytes | None) -> Transfer:
        p = self._start(request_id, peer, notif)
        if p.plan is None:
            raise self._fail(request_id, f"peer {peer!r} takes no byte runs (added for "
                                         "notifications only or as a TP pair; "
                                         "add_regrain_peer takes runs)")
        t, loc, rem = runs_transfer(self, op, request_id, peer, runs, p.plan, notif,
                                    "runs")
        if t.state == "DONE":     # no runs
            return t
        return self._submit(t, p, loc, rem, notif)

    def _pair_ids(self, request_id, p: _Peer, local_ids, remote_ids):
        """A heterogeneous-TP transfer's desc ids (the pair plan validates both tables group
        by group), the private int32 local copy and the bytes moved (served groups only)."""
        try:
            lids, rids = p.pair.desc_ids(local_ids, remote_ids)
        except BlockTableError as e:
            raise self._fail(request_id, f"bad block ids for peer {p.name!r}: {e}",
                             group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        table = tuple(np.array(g, dtype=np.int32) for g in local_ids)
        served = p.pair.groups
        nbytes = p.pair.local.table_bytes([len(g) if i in served else 0
                                           for i, g in enumerate(table)])
        return (np.asarray(lids, dtype=np.int64), np.asarray(rids, dtype=np.int64), table,
                int(nbytes))

    def _checked_ids(self, request_id, p: _Peer, local_ids, remote_ids):
        """Desc ids of both sides (validated, per-group counts equal), a private int32 copy
        of the local table and the bytes moved."""
        assert p.plan is not None
        try:
            conv = self.plan._as_tuple(local_ids)
            lids = self.plan.desc_ids(conv)
        except BlockTableError as e:
            raise self._fail(request_id, f"bad local block ids: {e}",
                             group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        try:
            rids = p.plan.desc_ids(remote_ids)
        except BlockTableError as e:
            raise self._fail(request_id, f"bad remote block ids: {e}",
                             group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        lens = [len(g) for g in conv]
        rlens = [len(g) for g in remote_ids]
        if lens != rlens or lids.size != rids.size:
            raise self._fail(request_id, f"per-group block counts differ: local {lens}, "
                                         f"remote {rlens}; they must match")
        table = tuple(np.array(g, dtype=np.int32) for g in conv)
        return (np.asarray(lids, dtype=np.int64), np.asarray(rids, dtype=np.int64), table,
                sum(map(operator.mul, lens, self._group_bytes)))

    def poll(self, transfer: Transfer) -> str:
        """Non-blocking state: ``"PROC"`` or ``"DONE"``; raises TransferError on failure."""
        if transfer.state == "FAILED":
            raise self._failed.get(transfer.request_id) or TransferError(
                "transfer failed", request_id=transfer.request_id)
        if transfer.state == "DONE":
            return "DONE"
        fut: cf.Future = transfer.handle
        if not fut.done():
            return "PROC"
        self._finish(transfer, fut)
        return transfer.state

    def _finish(self, t: Transfer, fut: cf.Future) -> None:
        try:
            rc = fut.result()
        except Exception as e:  # noqa: BLE001 - the engine raises its own errors
            raise self._fail(t.request_id, f"{t.op} with peer {t.peer!r} raised "
                             f"{type(e).__name__}: {e}", transfer=t) from None
        if rc != 0:
            raise self._fail(t.request_id, f"{t.op} with peer {t.peer!r} failed (engine rc "
                             f"{rc}: peer dead or unreachable, or an address it did not "
                             "register)", transfer=t)
        t.state = "DONE"
        t.handle = None
        self._valid[t.request_id] = t.local_block_ids

    def wait(self, transfer: Transfer, timeout: float = 10.0) -> Transfer:
        """Block until DONE; TransferError on failure or after ``timeout`` seconds (the
        engine call itself ends by its own timeout; :meth:`close` waits for it)."""
        if transfer.state == "PROC":
            fut: cf.Future = transfer.handle
            try:
                fut.result(timeout=timeout)
            except cf.TimeoutError:
                raise self._fail(transfer.request_id, f"{transfer.op} with peer "
                                 f"{transfer.peer!r} did not complete within {timeout} s",
                                 transfer=transfer) from None
            except Exception:  # noqa: BLE001 - reported by _finish
                pass
        self.poll(transfer)
        return transfer

    def valid_blocks(self, request_id: str) -> tuple[np.ndarray, ...] | None:
        """Local per-group block ids that arrived for a request (None unless DONE)."""
        return self._valid.get(request_id)

    def failure(self, request_id: str) -> TransferError | None:
        return self._failed.get(request_id)

    # -- notifications -------------------------------------------------------------------
    def _notify(self, request_id: str, body: bytes) -> Any:
        from mooncake.engine import TransferNotify
        # latin-1 maps every byte to one code point: any body round-trips through the str
        return TransferNotify(self.name, request_id + ":" + bytes(body).decode("latin-1"))

    def send_notif(self, peer: str, request_id: str, msg: bytes = b"done") -> None:
        """Queue ``(request_id, msg)`` for a peer and return at once (a 1-byte doorbell write
        made on the peer's sender thread, :mod:`~hmacore.transport.te_notify`). TransferError
        when the peer is unknown, an earlier notification to it failed, or too many are
        pending; a failure of this one is reported by :meth:`notif_failures` and the next
        send."""
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"unknown peer {peer!r}", request_id=request_id)
        try:
            self._senders.send(peer, p.session, p.doorbell, self._notify(request_id, msg))
        except TransferError as e:
            raise TransferError(str(e), request_id=request_id) from None

    def _doorbell_write(self, session: str, doorbell: int, note: Any) -> int:
        from mooncake.engine import TransferOpcode
        return int(self._engine.batch_transfer_sync(session, [self._doorbell.ctypes.data],
                                                    [doorbell], [1], TransferOpcode.Write,
                                                    note))

    def drop_unclaimed_notifs(self, older_than: float, live, cap: int) -> int:
        """Drop queued messages nobody claimed (:meth:`NotifQueues.drop_unclaimed`): queues
        of requests not in ``live`` first filled before ``older_than`` (``time.monotonic()``),
        and the oldest such while more than ``cap`` queues remain. Returns messages dropped."""
        return self._notifs.drop_unclaimed(older_than, live, cap)

    def fetch_notifs(self) -> None:
        """Move the engine's new notifications into the per-request queues."""
        self._check_open()
        for n in self._engine.get_notifies():
            rid, sep, body = str(n.msg).partition(":")
            self._notifs.add(rid, str(n.name), body.encode("latin-1") if sep else b"")

    def notifications(self, request_id: str, *, fetch: bool = True) -> list[bytes]:
        """Messages received so far for a request (consumed)."""
        return [body for _, body in self.notifications_from(request_id, fetch=fetch)]

    def notifications_from(self, request_id: str, *, fetch: bool = True
                           ) -> list[tuple[str, bytes]]:
        """:meth:`notifications` with each message's sender (the peer's agent name: the
        ``TransferNotify`` name it sent)."""
        if fetch:
            self.fetch_notifs()
        return self._notifs.pop(request_id)

    def has_notifications(self, request_id: str) -> bool:
        """True when messages for ``request_id`` are queued (nothing fetched or consumed)."""
        return request_id in self._notifs

    def wait_notif(self, request_id: str, timeout: float = 10.0) -> bytes:
        """First message for ``request_id``, waiting at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.fetch_notifs()
            first = self._notifs.pop_first(request_id)
            if first is not None:
                return first[1]
            if time.monotonic() >= deadline:
                raise TransferError(f"no notification for request {request_id!r} within "
                                    f"{timeout} s", request_id=request_id)
            time.sleep(0.001)

    # -- lifetime ------------------------------------------------------------------------
    def _forget_peers(self) -> None:
        self._senders.close()
        self._peers.clear()
