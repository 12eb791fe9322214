"""A descriptor-level Mooncake Transfer Engine driver: the
:class:`~hmacore.transport.base.DescTransport` interface (named local/remote descriptor-list
pairs, transfers by descriptor ids) over ``mooncake.engine.TransferEngine``, as
:class:`hmacore.transport.nixl_desc.DescAgent` is over NIXL. Layer-wise push
(:mod:`hmacore.layerwise`) and its heterogeneous-TP pairs run on it.

The engine runs in P2P-handshake mode (:func:`~hmacore.transport.mooncake_te.open_engine`);
:meth:`TeDescAgent.metadata` is JSON with the session, the doorbell address and the agent
name. A WRITE/READ is the same engine calls as :class:`MooncakeTeAgent`'s (one entry per
maximal run or per descriptor, cut by :func:`~hmacore.transport.mooncake_te.split_calls`), run
on a small worker pool so :meth:`state` stays non-blocking; its notification rides the last
call (delivered after the data). A standalone notification is a 1-byte doorbell write, made
on a per-peer sender thread (:mod:`~hmacore.transport.te_notify`). A dead peer: the engine
call returns a non-zero rc (``"ERR"``), or a queued notification fails (reported by
:meth:`TeDescAgent.notif_failures`, and the next :meth:`~TeDescAgent.send_notif` raises).
Units: rows N x 3 uint64 ``(addr, bytes, dev)``; descriptor ids int64; seconds.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BlockTableError, HandshakeError, TransferError
from ..runs import DescTable, desc_table, find_runs, span_ranges
from .base import PostCounts
from .runs_peer import desc_runs
from .te_notify import NotifyQueues
from .mooncake_te import (_KIND, MAX_SLICES_PER_CALL, TE_SLICE_BYTES, TeEngineLifetime,
                          check_engine_args, open_engine, parse_endpoint, run_calls,
                          split_calls)

__all__ = ["TeDescAgent"]


class _Pair:
    __slots__ = ("remote", "lrows", "rrows", "ltable", "rtable")

    def __init__(self, remote: str, lrows: np.ndarray, rrows: np.ndarray,
                 ltable: DescTable | None, rtable: DescTable | None):
        self.remote, self.lrows, self.rrows = remote, lrows, rrows
        self.ltable, self.rtable = ltable, rtable


class TeDescAgent(TeEngineLifetime):
    """A Mooncake TE (TCP, P2P handshake) over registered memory, with named descriptor pairs.

    Args:
        name: agent name (non-empty, no ``:``).
        ranges: ``(addr, bytes, dev_id)`` memory to register (``plan.registration_ranges()``).
        mem_type: ``"DRAM"`` only (the TCP transport moves host memory).
        hostname: the address the engine listens on (and peers reach it at).
        protocol: the engine's transport (``"tcp"``).
        posting: ``"blocks"`` (one engine entry per descriptor) or ``"auto"`` / ``"dynamic"``
            / ``"prepped"`` (one per maximal run, :data:`~hmacore.transport.mooncake_te.TE_POSTINGS`).
        transfer_timeout_s: the engine's transfer timeout (``MC_TRANSFER_TIMEOUT``, >= 5).
        workers: threads carrying blocking engine calls (transfers in flight at once).
    """

    def __init__(self, name: str, ranges: Sequence[tuple[int, int, int]], *,
                 mem_type: str = "DRAM", hostname: str = "127.0.0.1", protocol: str = "tcp",
                 posting: str = "auto", transfer_timeout_s: int = 10, workers: int = 4):
        check_engine_args(name, posting, transfer_timeout_s, workers)
        if mem_type != "DRAM":
            raise ValueError(f"mem_type must be 'DRAM' for this driver, got {mem_type!r}")
        self.name = name
        self.mem_type = mem_type
        self.posting = posting
        self._ranges = [(int(a), int(n), int(d)) for a, n, d in ranges]
        self._engine, self.session, self._doorbell, self._reg = open_engine(
            hostname, protocol, transfer_timeout_s, [(a, n) for a, n, _ in self._ranges])
        self._pool = cf.ThreadPoolExecutor(max_workers=workers,
                                           thread_name_prefix=f"mooncake-desc-{name}")
        self._remotes: dict[str, tuple[str, int]] = {}     # name -> (session, doorbell)
        self._pairs: dict[str, _Pair] = {}
        self._run_ranges: dict[str, list[tuple[int, int, int]]] = {}   # byte-run peers
        #: per posted transfer: (entries given to the engine, per-block descriptors, runs)
        self.last_post: tuple[int, int, int] = (0, 0, 0)
        self._posted = PostCounts()
        self._senders = NotifyQueues(self._doorbell_write, f"mooncake-desc-{name}")
        self._closed = False

    # -- peers ---------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's endpoint data: session, doorbell address and agent name (JSON)."""
        return json.dumps({"transport": _KIND, "session": self.session,
                           "doorbell": int(self._doorbell.ctypes.data),
                           "name": self.name}).encode()

    def add_remote(self, agent_metadata: bytes) -> str:
        """Load a peer's endpoint data (:meth:`metadata`); returns its agent name.
        HandshakeError when it is not a Mooncake TE descriptor agent's."""
        self._check_open()
        try:
            name = json.loads(bytes(agent_metadata).decode()).get("name")
        except Exception:  # noqa: BLE001 - parse_endpoint below names the problem
            name = None
        session, doorbell = parse_endpoint(agent_metadata, str(name))
        if not isinstance(name, str) or not name or ":" in name:
            raise HandshakeError(f"Mooncake TE endpoint {session!r} names no agent "
                                 f"(got {name!r}); both sides must use \"transport\": "
                                 "\"mooncake\" in push mode")
        self._remotes[name] = (session, doorbell)
        return name

    def prep_pair(self, key: str, remote: str, local_descs: np.ndarray,
                  remote_descs: np.ndarray,
                  remote_ranges: Sequence[tuple[int, int, int]] | None = None) -> None:
        """Keep the local and remote descriptor rows of one pairing (``key`` names it in
        :meth:`post`). ``remote_ranges``: the peer's registered memory (runs never cross
        ranges); default: the spans of its rows, touching ones merged."""
        self._check_open()
        if remote not in self._remotes:
            raise TransferError(f"unknown remote agent {remote!r} (add_remote first)")
        if key in self._pairs:
            raise TransferError(f"descriptor pair {key!r} already prepared")
        lrows = np.ascontiguousarray(local_descs, dtype=np.uint64).reshape(-1, 3)
        rrows = np.ascontiguousarray(remote_descs, dtype=np.uint64).reshape(-1, 3)
        lt = rt = None
        if self.posting != "blocks":
            lt = desc_table(lrows, self._ranges)
            rt = desc_table(rrows, span_ranges(rrows) if remote_ranges is None
                            else remote_ranges)
        self._pairs[key] = _Pair(remote, lrows, rrows, lt, rt)

    def remove_remote(self, name: str) -> None:
        """Forget a peer that has no descriptor pair (TransferError if one still uses it;
        unknown names are ignored). The engine keeps its cached connection."""
        if any(p.remote == name for p in self._pairs.values()):
            raise TransferError(f"remote agent {name!r} still has a prepared descriptor pair")
        self._remotes.pop(name, None)
        self._run_ranges.pop(name, None)
        self._senders.forget(name)

    def add_runs_peer(self, remote: str, remote_ranges: Sequence[tuple[int, int, int]]) -> None:
        """Allow byte-run transfers (:meth:`post_runs`) with ``remote`` inside its registered
        memory ``remote_ranges`` (``(addr, bytes, dev)``, e.g. its plan's
        ``registration_ranges()``): a block-size remap has no descriptor pair to keep."""
        self._check_open()
        if remote not in self._remotes:
            raise TransferError(f"unknown remote agent {remote!r} (add_remote first)")
        self._run_ranges[remote] = [(int(a), int(n), int(d)) for a, n, d in remote_ranges]

    # -- transfers -----------------------------------------------------------------------
    def post(self, op: str, key: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             notif: bytes = b"") -> cf.Future:
        """Post a READ/WRITE between the pair's descriptors; returns a handle for
        :meth:`state`. TransferError (nothing posted) for an unknown pair, unequal lengths,
        out-of-range ids or descriptors of unequal lengths."""
        self._check_open()
        if op not in ("READ", "WRITE"):
            raise TransferError(f"op must be 'READ' or 'WRITE', got {op!r}")
        pair = self._pairs.get(key)
        if pair is None:
            raise TransferError(f"unknown descriptor pair {key!r}")
        li = np.asarray(local_ids, dtype=np.int64)
        ri = np.asarray(remote_ids, dtype=np.int64)
        if li.shape != ri.shape or li.ndim != 1:
            raise TransferError(f"{li.size} local vs {ri.size} remote descriptor ids")
        for side, a, n in (("local", li, len(pair.lrows)), ("remote", ri, len(pair.rrows))):
            if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
                raise TransferError(f"{side} descriptor ids must lie in [0, {n})")
        if self.posting == "blocks" or pair.ltable is None or pair.rtable is None:
            lrows, rrows, runs = pair.lrows[li], pair.rrows[ri], -1
            if not np.array_equal(lrows[:, 1], rrows[:, 1]):
                raise TransferError(f"{op} on {key!r}: descriptor lengths differ between "
                                    "the sides")
        else:
            try:
                r = find_runs(pair.ltable, li, pair.rtable, ri)
            except BlockTableError as e:
                raise TransferError(f"{op} on {key!r}: {e}") from None
            lrows, rrows, runs = r.local, r.remote, r.num_runs
        self.last_post = (int(lrows.shape[0]), int(li.size), runs)
        session = self._remotes[pair.remote][0]
        note = self._note(bytes(notif)) if notif else None
        from mooncake.engine import TransferOpcode
        code = TransferOpcode.Read if op == "READ" else TransferOpcode.Write
        if not lrows.shape[0]:   # nothing to move: only the notification
            return self._pool.submit(self._doorbell_write, session,
                                     self._remotes[pair.remote][1], note)
        calls = split_calls(lrows[:, 0], rrows[:, 0], lrows[:, 1],
                            MAX_SLICES_PER_CALL * TE_SLICE_BYTES)
        handle = self._pool.submit(run_calls, self._engine, session, calls, code, note)
        self._posted.add(int(lrows[:, 1].sum()), int(lrows.shape[0]), int(li.size))
        return handle

    def post_runs(self, op: str, remote: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                  notif: bytes = b"") -> cf.Future:
        """Post a READ/WRITE of byte runs: row i of ``local_rows`` pairs with row i of
        ``remote_rows`` (M x 3 uint64 ``(addr, bytes, dev)``, equal lengths per row, M >= 1),
        every row inside this agent's registered memory and the peer's
        (:meth:`add_runs_peer`); one engine entry per row, cut into calls by
        :func:`~hmacore.transport.mooncake_te.split_calls`. Returns a handle for
        :meth:`state`. TransferError (nothing posted) for an unknown peer or a row out of
        range."""
        self._check_open()
        loc, rem = desc_runs(op, remote, self._run_ranges, self._ranges, local_rows,
                             remote_rows)
        m = int(loc.shape[0])
        self.last_post = (m, m, m)
        note = self._note(bytes(notif)) if notif else None
        from mooncake.engine import TransferOpcode
        code = TransferOpcode.Read if op == "READ" else TransferOpcode.Write
        calls = split_calls(loc[:, 0], rem[:, 0], loc[:, 1], MAX_SLICES_PER_CALL * TE_SLICE_BYTES)
        handle = self._pool.submit(run_calls, self._engine, self._remotes[remote][0], calls,
                                   code, note)
        self._posted.add(int(loc[:, 1].sum()), m, m)
        return handle

    def take_posted(self) -> PostCounts:
        """What was posted since the last call (transfers, bytes, entries)."""
        out, self._posted = self._posted, PostCounts()
        return out

    @staticmethod
    def state(handle: cf.Future) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"`` (non-blocking)."""
        if not handle.done():
            return "PROC"
        try:
            return "DONE" if handle.result() == 0 else "ERR"
        except Exception:  # noqa: BLE001 - the engine raised: the transfer failed
            return "ERR"

    def release(self, handle: Any) -> None:
        """Nothing to give back: an engine call in flight ends by the engine's own timeout
        (:meth:`close` waits for it)."""

    def wait(self, handle: cf.Future, timeout: float = 10.0) -> None:
        """Wait until DONE; TransferError on error or after ``timeout`` s."""
        try:
            rc = handle.result(timeout=timeout)
        except cf.TimeoutError:
            raise TransferError(f"transfer did not complete within {timeout} s") from None
        except Exception as e:  # noqa: BLE001 - the engine raised
            raise TransferError(f"transfer failed: {type(e).__name__}: {e}") from None
        if rc != 0:
            raise TransferError(f"transfer failed (engine rc {rc}: peer dead or unreachable?)")

    # -- notifications -------------------------------------------------------------------
    def _note(self, msg: bytes) -> Any:
        from mooncake.engine import TransferNotify
        # latin-1 maps every byte to one code point: any message round-trips through the str
        return TransferNotify(self.name, msg.decode("latin-1"))

    def _doorbell_write(self, session: str, doorbell: int, note: Any) -> int:
        from mooncake.engine import TransferOpcode
        return int(self._engine.batch_transfer_sync(session, [self._doorbell.ctypes.data],
                                                    [doorbell], [1], TransferOpcode.Write,
                                                    note))

    def send_notif(self, remote: str, msg: bytes) -> None:
        """Queue ``msg`` for a peer and return at once (:mod:`~hmacore.transport.te_notify`:
        a peer that stops answering costs the caller nothing). TransferError when the peer
        is unknown, an earlier notification to it failed, or too many are pending; a failure
        of this one is reported by :meth:`notif_failures` and by the next send."""
        self._check_open()
        ep = self._remotes.get(remote)
        if ep is None:
            raise TransferError(f"unknown remote agent {remote!r} (add_remote first)")
        self._senders.send(remote, ep[0], ep[1], self._note(bytes(msg)))

    def notifs(self) -> list[bytes]:
        """New notification messages (from every peer), consumed."""
        return [m for _, m in self.notifs_by_agent()]

    def notifs_by_agent(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(sender agent name, message)``, consumed."""
        self._check_open()
        return [(str(n.name), str(n.msg).encode("latin-1")) for n in self._engine.get_notifies()]

    # -- lifetime ------------------------------------------------------------------------
    def _forget_peers(self) -> None:
        self._senders.close()
        self._pairs.clear()
        self._run_ranges.clear()
        self._remotes.clear()

    def __repr__(self) -> str:
        return f"TeDescAgent({self.name!r}, session={self.session!r}, " \
               f"{len(self._pairs)} pairs, {len(self._remotes)} remotes)"
