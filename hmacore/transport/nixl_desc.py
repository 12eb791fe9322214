"""A descriptor-level NIXL driver: several local/remote dlist pairs per agent, transfers by
descriptor ids. Used for heterogeneous TP (one dlist pair per (local rank, remote rank):
hmacore.tp.TpPairPlan) and layer-wise push (hmacore.layerwise), where one plan per agent and
one dlist per peer (hmacore.transport.nixl.NixlAgent) do not fit.

``nixl`` is imported lazily. Units: descriptor rows are N x 3 uint64 ``(addr, bytes, dev)``;
descriptor ids int64; every wait is bounded in seconds.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BlockTableError, TransferError
from ..runs import desc_table, span_ranges
from . import DEFAULT_PROGRESS_DELAY_US, new_nixl_agent
from .base import PostCounts
from .nixl_post import check_posting, post_xfer
from .runs_peer import desc_runs

__all__ = ["DescAgent"]

_INT32_MAX = 2 ** 31 - 1


def _ids(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    return a.astype(np.int32) if a.size == 0 or int(a.max()) <= _INT32_MAX else a


class DescAgent:
    """A NIXL (UCX) agent over registered memory ranges, with named dlist pairs.

    Args:
        name: agent name.
        ranges: ``(addr, bytes, dev_id)`` memory to register (e.g. ``plan.registration_ranges()``).
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        progress_thread, progress_delay_us: NIXL's UCX progress thread and its poll delay
            in microseconds (see :func:`hmacore.transport.new_nixl_agent`: NIXL's own default
            spins a core; ours sleeps on events).
        posting: how descriptors reach NIXL (:mod:`hmacore.transport.nixl_post`; default
            ``"auto"``: one descriptor per maximal run).
    """

    def __init__(self, name: str, ranges: Sequence[tuple[int, int, int]], *, mem_type: str = "DRAM",
                 backends: Sequence[str] = ("UCX",), progress_thread: bool = True,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US, posting: str = "auto"):
        self.name = name
        self.mem_type = mem_type
        self.posting = check_posting(posting)
        self._ranges = [(int(a), int(n), int(d)) for a, n, d in ranges]
        self._agent = new_nixl_agent(name, backends, progress_thread=progress_thread,
                                     progress_delay_us=progress_delay_us)
        self._reg = self._agent.register_memory([(a, n, d, "") for a, n, d in ranges], mem_type)
        self._pairs: dict[str, tuple[str, Any, Any, int, int]] = {}
        self._tables: dict[str, tuple[Any, Any]] = {}     # pair key -> (local, remote) tables
        self._lens: dict[str, np.ndarray] = {}    # pair key -> its local descriptors' bytes
        self._posted = PostCounts()
        #: per posted transfer: (descriptors given to NIXL, per-block descriptors, runs)
        self.last_post: tuple[int, int, int] = (0, 0, 0)
        self._remotes: set[str] = set()
        self._run_ranges: dict[str, list[tuple[int, int, int]]] = {}   # byte-run peers
        self._closed = False

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (the peer loads it with :meth:`add_remote`)."""
        return self._agent.get_agent_metadata()

    def add_remote(self, agent_metadata: bytes) -> str:
        """Load a peer's NIXL metadata; returns its agent name."""
        name = self._agent.add_remote_agent(agent_metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def prep_pair(self, key: str, remote: str, local_descs: np.ndarray,
                  remote_descs: np.ndarray,
                  remote_ranges: Sequence[tuple[int, int, int]] | None = None) -> None:
        """Prepare the local and the remote dlist of one pairing (``key`` names it in
        :meth:`post`). Rows: ``(addr, bytes, dev)``. ``remote_ranges``: the peer's registered
        memory (runs never cross from one range into another); default: the spans of its
        rows, touching ones merged (what an hmacore peer registers)."""
        if remote not in self._remotes:
            raise TransferError(f"unknown remote agent {remote!r} (add_remote first)")
        if key in self._pairs:
            raise TransferError(f"dlist pair {key!r} already prepared")
        lrows = np.asarray(local_descs, np.uint64)
        rrows = np.asarray(remote_descs, np.uint64)
        if self.posting != "blocks":
            self._tables[key] = (desc_table(lrows, self._ranges), desc_table(
                rrows, span_ranges(rrows) if remote_ranges is None else remote_ranges))
        ld = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, self.mem_type)
        rd = self._agent.prep_xfer_dlist(remote, rrows, self.mem_type)
        self._pairs[key] = (remote, ld, rd, len(local_descs), len(remote_descs))
        self._lens[key] = np.ascontiguousarray(lrows.reshape(-1, 3)[:, 1])

    def add_runs_peer(self, remote: str, remote_ranges: Sequence[tuple[int, int, int]]) -> None:
        """Allow byte-run transfers (:meth:`post_runs`) with ``remote`` inside its registered
        memory ``remote_ranges`` (``(addr, bytes, dev)``, e.g. its plan's
        ``registration_ranges()``): a block-size remap has no per-block dlist to prepare."""
        if remote not in self._remotes:
            raise TransferError(f"unknown remote agent {remote!r} (add_remote first)")
        self._run_ranges[remote] = [(int(a), int(n), int(d)) for a, n, d in remote_ranges]

    def post_runs(self, op: str, remote: str, local_rows: np.ndarray, remote_rows: np.ndarray,
                  notif: bytes = b"") -> Any:
        """Post a READ/WRITE of byte runs: row i of ``local_rows`` pairs with row i of
        ``remote_rows`` (M x 3 uint64 ``(addr, bytes, dev)``, equal lengths per row), every row
        inside this agent's registered memory and the peer's (:meth:`add_runs_peer`); the
        descriptor lists are built for this transfer. Returns a handle for :meth:`state`.
        Raises TransferError (nothing posted) for an unknown peer or a row out of range."""
        loc, rem = desc_runs(op, remote, self._run_ranges, self._ranges, local_rows,
                             remote_rows)
        agent = self._agent
        try:
            h = agent.initialize_xfer(op, agent.get_xfer_descs(loc, self.mem_type),
                                      agent.get_xfer_descs(rem, self.mem_type), remote,
                                      bytes(notif))
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            raise TransferError(f"{op} to {remote!r} could not be created: {e}") from None
        self.last_post = (int(loc.shape[0]), int(loc.shape[0]), int(loc.shape[0]))
        try:
            state = agent.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            self.release(h)
            raise TransferError(f"{op} to {remote!r} could not be posted: {e}") from None
        if state == "ERR":
            self.release(h)
            raise TransferError(f"{op} to {remote!r} failed when posted")
        return h

    def post(self, op: str, key: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             notif: bytes = b"") -> Any:
        """Post a READ/WRITE between the pair's dlists; returns a handle for :meth:`state`.

        Raises TransferError for an unknown pair, unequal lengths, out-of-range ids or a post
        NIXL refuses."""
        if op not in ("READ", "WRITE"):
            raise TransferError(f"op must be 'READ' or 'WRITE', got {op!r}")
        if key not in self._pairs:
            raise TransferError(f"unknown dlist pair {key!r}")
        remote, ld, rd, nl, nr = self._pairs[key]
        li, ri = np.asarray(local_ids), np.asarray(remote_ids)
        if li.shape != ri.shape or li.ndim != 1:
            raise TransferError(f"{li.size} local vs {ri.size} remote descriptor ids")
        for name, a, n in (("local", li, nl), ("remote", ri, nr)):
            if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
                raise TransferError(f"{name} descriptor ids must lie in [0, {n})")
        lt, rt = self._tables.get(key, (None, None))
        try:
            posted = post_xfer(self._agent, op, self.posting, remote, local_dlist=ld,
                               local_ids=_ids(li), remote_dlist=rd, remote_ids=_ids(ri),
                               local_table=lt, remote_table=rt, local_mem=self.mem_type,
                               remote_mem=self.mem_type, notif_msg=bytes(notif))
        except BlockTableError as e:
            raise TransferError(f"{op} on {key!r}: {e}") from None
        self.last_post = (posted.descriptors, posted.block_descriptors, posted.runs)
        if posted.state == "ERR":
            self.release(posted.handle)
            raise TransferError(f"{op} on {key!r} failed when posted")
        self._posted.add(int(self._lens[key][li].sum()), posted.descriptors,
                         posted.block_descriptors)
        return posted.handle

    def take_posted(self) -> PostCounts:
        """What was posted since the last call (transfers, bytes, descriptors)."""
        out, self._posted = self._posted, PostCounts()
        return out

    def state(self, handle: Any) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"``."""
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - an errored handle may refuse release
            pass

    def wait(self, handle: Any, timeout: float = 10.0) -> None:
        """Wait until DONE (then release); TransferError on error or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state(handle)
            if st == "DONE":
                self.release(handle)
                return
            if st == "ERR" or time.monotonic() >= deadline:
                self.release(handle)
                raise TransferError("transfer failed" if st == "ERR"
                                    else f"transfer did not complete within {timeout} s")
            time.sleep(0.0005)

    def send_notif(self, remote: str, msg: bytes) -> None:
        self._agent.send_notif(remote, bytes(msg))

    def notif_failures(self) -> list[tuple[str, str]]:
        """Always empty: NIXL reports a peer it cannot notify at the send itself."""
        return []

    def notifs(self) -> list[bytes]:
        """New notification messages (from every peer), consumed."""
        return [m for _, m in self.notifs_by_agent()]

    def notifs_by_agent(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(sender agent name, message)``, consumed. The sender name is
        what NIXL reports (map it to a TP rank with what that peer's handshake said)."""
        out: list[tuple[str, bytes]] = []
        for agent, msgs in self._agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def remove_remote(self, name: str) -> None:
        """Forget a peer agent that has no dlist pair (a push decode side's prefill peers,
        which it only notifies), so a restarted peer of the same name can be added again.
        TransferError if a pair still uses it; unknown names are ignored."""
        if any(r == name for r, *_ in self._pairs.values()):
            raise TransferError(f"remote agent {name!r} still has a prepared dlist pair")
        if name not in self._remotes:
            return
        self._remotes.discard(name)
        self._run_ranges.pop(name, None)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - a dead peer may already be gone from UCX
            pass

    def close(self) -> None:
        """Release dlists, forget remotes, deregister memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _, ld, rd, _, _ in self._pairs.values():
            for h in (ld, rd):
                try:
                    self._agent.release_dlist_handle(h)
                except Exception:  # noqa: BLE001
                    pass
        for r in self._remotes:
            try:
                self._agent.remove_remote_agent(r)
            except Exception:  # noqa: BLE001
                pass
        self._agent.deregister_memory(self._reg)
