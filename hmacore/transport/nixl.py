"""NIXL agent driver: register a TransferPlan's regions and move a request's blocks.

``nixl`` is imported lazily (only when an agent is created). Units: block ids are per group
(lists or int arrays, window-clipped, null ids stripped); descriptor ids come from the plans;
every wait is bounded in seconds.

Contract: a request's local blocks are recorded as valid only after its transfer reported
DONE. A dead peer, an expired lease, a bad block id (descriptor), a transfer error or a
timeout makes the request failed: TransferError(request_id=, group=, block_index= where
known) is raised and remembered (:meth:`NixlAgent.failure`), and the agent stays usable.
"""
from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BlockTableError, HandshakeError, HmacoreError, TransferError
from ..plan import TransferPlan
from ..spec import KVLayout
from ..runs import DescTable, desc_table
from . import DEFAULT_PROGRESS_DELAY_US, new_nixl_agent
from .base import Transfer, TransferPosting
from .handshake import HandshakePayload
from .notif_queues import NotifQueues
from .runs_peer import regrain_peer_plan, runs_transfer
from .nixl_post import check_posting, post_xfer

__all__ = ["NixlAgent", "Transfer", "registration_args"]

_INT32_MAX = 2 ** 31 - 1


def registration_args(plan: TransferPlan) -> tuple[list[tuple[int, int, int, str]], str]:
    """``(ranges, mem_type)`` for ``nixl_agent.register_memory``: one ``(addr, bytes, dev_id,
    "")`` per disjoint memory range of the plan (aliased regions registered once)."""
    return [(a, n, dev, "") for a, n, dev in plan.registration_ranges()], plan.mem_type


def _nixl_ids(ids: np.ndarray, num_descs: int) -> np.ndarray:
    """int32 when every id fits (NIXL's fast path), else int64. ``num_descs`` bounds the ids
    (they index a dlist of that length), so the common case needs no scan of the ids."""
    if num_descs <= _INT32_MAX + 1 or ids.size == 0 or int(ids.max()) <= _INT32_MAX:
        return ids.astype(np.int32)
    return ids


def _is_arrays(block_ids) -> bool:
    """True when ``block_ids`` is a tuple/list whose first group is an ndarray (the tracker /
    clip form): its ids go to the Cython fast path as they are. Anything else (lists of lists,
    mixed forms) is converted once by the plan, which validates it."""
    return (type(block_ids) is tuple or type(block_ids) is list) and len(block_ids) > 0 \
        and type(block_ids[0]) is np.ndarray


_I32 = np.dtype(np.int32)


def _int32_copy(block_ids) -> tuple[np.ndarray, ...]:
    """A private int32 copy of validated per-group ids (``desc_ids`` accepted them)."""
    return tuple([g.copy() if type(g) is np.ndarray and g.dtype == _I32 and g.ndim == 1
                  else np.array(g, dtype=np.int32) for g in block_ids])


@dataclasses.dataclass
class _Peer:
    """A peer agent. Same-shape peers: ``plan`` (its regions over our layout) and its
    ``dlist``. Heterogeneous-TP peers: a :class:`~hmacore.tp.TpPairPlan` with its own local
    and remote dlists. Notify-only peers (``add_notify_peer``): neither."""

    name: str
    payload: HandshakePayload
    plan: TransferPlan | None
    dlist: Any
    desc: Any = None     # plan._desc: its compiled desc-id plan (hmacore._fast._plan.DescPlan)
    ids32: bool = False  # both dlists (ours, its) under 2**31 descriptors: int32 ids fast path
    pair: Any = None
    local: Any = None    # local dlist of a pair (None: the agent's plan dlist)
    table: DescTable | None = None        # address table of its dlist (run search)
    local_table: DescTable | None = None  # of a pair's local dlist


class NixlAgent(TransferPosting):
    """A NIXL agent (UCX backend) over one TransferPlan's memory.

    Args:
        name: agent name (unique among peers).
        plan: the local plan; its regions are registered and a local dlist prepared.
        backends: NIXL backends (default UCX).
        hma: HMA on/off, carried in the handshake (peers must agree).
        tp: keyword arguments of :meth:`HandshakePayload.for_tp_plan` (``tp_size``,
            ``tp_rank``, ``shardings``, ``kv_dtype``, ``head_dim``, ``page_layout``): the agent
            then speaks the TP-aware handshake and can take heterogeneous-TP peers
            (``add_peer(payload, pair=...)``). None: same-TP payloads only.
        progress_thread, progress_delay_us: NIXL's UCX progress thread and its poll delay
            in microseconds (see :func:`hmacore.transport.new_nixl_agent`: NIXL's own default
            spins a core; ours sleeps on events).
        posting: how descriptors reach NIXL (:mod:`hmacore.transport.nixl_post`): ``"auto"``
            (default: one descriptor per maximal run), ``"dynamic"``, ``"prepped"``, or
            ``"blocks"`` (per block, vLLM 0.32's scheme).
    """

    def __init__(self, name: str, plan: TransferPlan, *, backends: Sequence[str] = ("UCX",),
                 hma: bool = True, tp: dict[str, Any] | None = None,
                 progress_thread: bool = True,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US, posting: str = "auto"):
        self.name = name
        self.plan = plan
        self.hma = hma
        self.tp = dict(tp) if tp is not None else None
        self.posting = check_posting(posting)
        self._agent = new_nixl_agent(name, backends, progress_thread=progress_thread,
                                     progress_delay_us=progress_delay_us)
        ranges, mem = registration_args(plan)
        self._reg = self._agent.register_memory(ranges, mem)
        rows = plan.descriptors()
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem)
        self._table = self._rows_table(rows, plan.registration_ranges())
        self._ids32 = plan.num_descs <= _INT32_MAX + 1
        self._group_bytes = plan._group_block_bytes   # bytes one block of group g moves
        self._pair_ids32 = plan._desc.pair_ids32
        self._peers: dict[str, _Peer] = {}
        self._valid: dict[str, tuple[np.ndarray, ...]] = {}
        self._failed: dict[str, TransferError] = {}
        self._notifs = NotifQueues()    # rid -> [(sender, body), ...]
        self._closed = False

    def _rows_table(self, rows: np.ndarray, ranges) -> DescTable | None:
        """The address table of a dlist (None when posting per block: never searched)."""
        return None if self.posting == "blocks" else desc_table(rows, ranges)

    # -- peers -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (bytes) for the handshake."""
        return self._agent.get_agent_metadata()

    def handshake_payload(self) -> HandshakePayload:
        if self.tp is not None:
            return HandshakePayload.for_tp_plan(self.plan, self.name, self.metadata(),
                                                hma=self.hma, **self.tp)
        return HandshakePayload.for_plan(self.plan, self.name, self.metadata(), hma=self.hma)

    def add_peer(self, payload: HandshakePayload, *, pair: Any = None) -> str:
        """Accept a peer from its handshake payload: check compatibility, load its agent
        metadata, prepare its dlist from its region table. Returns the peer name.

        ``pair``: a :class:`~hmacore.tp.TpPairPlan` for a peer of another TP size (built by
        :func:`hmacore.transport.tp_peer.tp_pair_plans` from this payload): its sub-block
        descriptors get their own local and remote dlists and reads to this peer use
        ``pair.desc_ids`` (remote ids are the peer's own block ids)."""
        name = self._load_peer(payload)
        try:
            if pair is None:
                plan = payload.remote_plan(self.plan.layout)
                rows = plan.descriptors()
                dlist = self._agent.prep_xfer_dlist(name, rows, plan.mem_type)
                self._peers[name] = _Peer(name, payload, plan, dlist, plan._desc,
                                          self._ids32 and plan.num_descs <= _INT32_MAX + 1,
                                          table=self._rows_table(rows,
                                                                 plan.registration_ranges()))
            else:
                # a pair's virtual regions lie inside each side's registered memory, and
                # touching regions are registered as one range: their own spans are safe
                # run barriers
                lrows, rrows = pair.local.descriptors(), pair.remote.descriptors()
                local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows,
                                                    pair.local.mem_type)
                dlist = self._agent.prep_xfer_dlist(name, rrows, pair.remote.mem_type)
                self._peers[name] = _Peer(
                    name, payload, None, dlist, pair=pair, local=local,
                    table=self._rows_table(rrows, pair.remote.registration_ranges()),
                    local_table=self._rows_table(lrows, pair.local.registration_ranges()))
        except HmacoreError:
            self._forget_remote(name)
            raise
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            self._forget_remote(name)
            raise HandshakeError(f"peer {name!r}: NIXL could not prepare its descriptors: "
                                 f"{type(e).__name__}: {e}") from e
        return name

    def add_regrain_peer(self, payload: HandshakePayload, remote_layout: KVLayout | None = None
                         ) -> tuple[str, TransferPlan]:
        """Accept a same-TP peer whose attention block sizes differ from this agent's (a
        block-size remap, :mod:`hmacore.regrain`).

        ``remote_layout``: the peer's layout; default: this layout with the peer's block size
        per attention group and page bytes scaled by the same ratio (kernel block sizes and
        everything else equal). Its fingerprint must equal the payload's; HMA and version
        must agree; block sizes must be integer multiples of one another per group (Mamba:
        equal). The group structure itself is checked when the RegrainPlan is built. No dlist
        is prepared: transfers to this peer post byte runs (:meth:`read_runs`). Returns
        ``(peer name, the peer's TransferPlan over its own layout)``; raises HandshakeError."""
        plan = regrain_peer_plan(self.handshake_payload(), payload, self.plan.layout,
                                 remote_layout)
        name = self._load_raw(payload)    # no dlist: runs only
        self._peers[name] = _Peer(name, payload, plan, None)
        return name, plan

    def read_runs(self, request_id: str, peer: str, runs: Any, *,
                  notif: bytes | None = None) -> Transfer:
        """Post a READ of byte runs: ``runs.local`` / ``runs.remote`` M x 3 ``(addr, bytes,
        dev)`` rows paired row by row (a :class:`hmacore.runs.Runs`, e.g.
        ``RegrainRuns.as_runs("dst")``). Every row must lie inside this agent's registered
        memory and the peer's registered regions; raises TransferError (nothing posted)."""
        return self._post_runs("READ", request_id, peer, runs, notif)

    def write_runs(self, request_id: str, peer: str, runs: Any, *,
                   notif: bytes | None = None) -> Transfer:
        """Post a WRITE of byte runs (``runs.local`` into ``runs.remote``); see read_runs."""
        return self._post_runs("WRITE", request_id, peer, runs, notif)

    def _post_runs(self, op, request_id, peer, runs, notif) -> Transfer:
        if self._closed:
            raise TransferError("the agent is closed")
        self._failed.pop(request_id, None)
        self._valid.pop(request_id, None)
        p = self._peers.get(peer)
        if p is None or p.plan is None:
            raise self._fail(request_id, f"unknown peer {peer!r} (handshake first)")
        t, loc, rem = runs_transfer(self, op, request_id, peer, runs, p.plan, notif,
                                    "dynamic")
        if t.state == "DONE":     # no runs
            return t
        msg = b"" if notif is None else request_id.encode() + b":" + bytes(notif)
        agent = self._agent
        try:
            h = agent.initialize_xfer(op, agent.get_xfer_descs(loc, self.plan.mem_type),
                                      agent.get_xfer_descs(rem, p.plan.mem_type), peer, msg)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            raise self._fail(request_id, f"{op} to {peer!r} could not be created: {e}",
                             transfer=t) from None
        t.handle = h
        try:
            state = agent.transfer(h)
        except Exception as e:  # noqa: BLE001
            raise self._fail(request_id, f"{op} to {peer!r} could not be posted: {e}",
                             transfer=t) from None
        if state == "DONE":
            self._done(t)
        elif state == "ERR":
            raise self._fail(request_id, f"{op} to {peer!r} failed when posted", transfer=t)
        return t

    def _forget_remote(self, name: str) -> None:
        """Drop a remote agent whose peer entry was never completed (best effort)."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - nothing more to undo
            pass

    def add_notify_peer(self, payload: HandshakePayload) -> str:
        """Accept a peer only to send it notifications (no dlist: transfers to it raise).
        The payload must still be compatible. Returns the peer name. A peer already known
        under the same agent metadata (e.g. an engine this one reads from, now handshaking
        to read from this one: P and D roles swapped) is kept as it is: replacing it would
        drop the dlist this agent's reads from it use."""
        old = self._peers.get(payload.agent_name)
        if old is not None and old.payload.agent_metadata == payload.agent_metadata:
            self.handshake_payload().check_compatible(payload)
            return old.name
        name = self._load_peer(payload)
        self._peers[name] = _Peer(name, payload, None, None)
        return name

    def _load_peer(self, payload: HandshakePayload) -> str:
        self.handshake_payload().check_compatible(payload)
        return self._load_raw(payload)

    def _load_raw(self, payload: HandshakePayload) -> str:
        if payload.agent_name in self._peers:
            self.remove_peer(payload.agent_name)
        try:
            name = self._agent.add_remote_agent(payload.agent_metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            raise HandshakeError(f"NIXL refused peer {payload.agent_name!r}'s agent metadata: "
                                 f"{type(e).__name__}: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != payload.agent_name:
            raise HandshakeError(f"agent metadata names {name!r}, payload says {payload.agent_name!r}")
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer: release its dlist and remote agent entry (idempotent)."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        try:
            for dl in (peer.dlist, peer.local):
                if dl is not None:
                    self._agent.release_dlist_handle(dl)
        finally:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - a dead peer may already be gone from UCX
                pass

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    # -- transfers ---------------------------------------------------------------------
    def _release_failed(self, transfer: Transfer) -> None:
        self._release(transfer)

    def _post(self, op, request_id, peer, local_ids, remote_ids, notif, expires_at) -> Transfer:
        # The common path is kept lean (it runs once per request, next to a NIXL post that
        # takes a few hundred us): no per-block Python objects, no extra NIXL calls, and a
        # transfer NIXL completes inside the post is finished here; errors take _checked_ids.
        if self._closed:
            raise TransferError("the agent is closed")
        self._failed.pop(request_id, None)
        self._valid.pop(request_id, None)
        p = self._peers.get(peer)
        if p is None:
            raise self._fail(request_id, f"unknown peer {peer!r} (handshake first)")
        if expires_at is not None:
            now = time.monotonic()
            if now >= expires_at:
                raise self._fail(request_id, f"the lease on peer {peer!r}'s blocks expired "
                                             f"{now - expires_at:.3f} s ago")
        if p.pair is not None:
            return self._post_pair(op, request_id, p, local_ids, remote_ids, notif)
        if p.plan is None:
            raise self._fail(request_id, f"peer {peer!r} was added for notifications only")
        if p.dlist is None:
            raise self._fail(request_id, f"peer {peer!r} has other block sizes: post byte runs "
                                         "(read_runs / write_runs)")
        # int32-array tables (the tracker / clip form): one Cython call computes both sides'
        # int32 desc ids, the private local copy and the byte count; anything else (lists,
        # other dtypes, bad ids, unequal groups) returns None and takes the checked path
        fast = self._pair_ids32(p.desc, local_ids, remote_ids, self._group_bytes) \
            if p.ids32 else None
        if fast is None:
            lids, rids, table, nbytes = self._checked_ids(request_id, p, local_ids, remote_ids)
        else:
            lids, rids, table, nbytes = fast
        t = Transfer(request_id, op, peer, table, lids.size, nbytes, posted_at=time.monotonic())
        return self._submit(t, self._local, lids, p.dlist, rids, notif, self._table, p.table,
                            p.plan.mem_type)

    def _submit(self, t: Transfer, local_dlist, lids, remote_dlist, rids, notif,
                local_table: DescTable | None, remote_table: DescTable | None,
                remote_mem: str) -> Transfer:
        """Post ``t``: NIXL desc ids (int32 / int64 arrays) into the two prepared dlists, as
        runs or per block (:attr:`posting`)."""
        request_id, op, peer = t.request_id, t.op, t.peer
        if not lids.size:  # full local hit: nothing to move
            t.state = "DONE"
            self._valid[request_id] = t.local_block_ids
            if notif is not None:
                self.send_notif(peer, request_id, notif)
            return t
        agent = self._agent
        t.block_descriptors = int(lids.size)
        try:
            posted = post_xfer(
                agent, op, self.posting, peer, local_dlist=local_dlist, local_ids=lids,
                remote_dlist=remote_dlist, remote_ids=rids, local_table=local_table,
                remote_table=remote_table, local_mem=self.plan.mem_type, remote_mem=remote_mem,
                notif_msg=b"" if notif is None else request_id.encode() + b":" + bytes(notif))
        except BlockTableError as e:   # the run search refused the pairs: nothing posted
            raise self._fail(request_id, f"bad descriptor pairs for {peer!r}: {e}",
                             transfer=t) from None
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            raise self._fail(request_id, f"{op} to {peer!r} could not be posted: {e}",
                             transfer=t) from None
        t.handle = h = posted.handle
        state = posted.state
        t.descriptors, t.runs, t.mechanism = posted.descriptors, posted.runs, posted.mechanism
        if state == "DONE":   # NIXL finished it inside the post (typical for DRAM)
            t.state = "DONE"
            self._valid[request_id] = t.local_block_ids
            t.handle = None
            try:
                agent.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - as in _release
                pass
        elif state == "ERR":
            raise self._fail(request_id, f"{op} to {peer!r} failed when posted", transfer=t)
        return t

    def _checked_ids(self, request_id, p, local_ids, remote_ids):
        """The general path of :meth:`_post`: validate and convert any accepted block-id form;
        raises (and records) TransferError with group/block_index where known. Returns NIXL
        desc ids for both sides, the private int32 local copy and the bytes moved."""
        plan = self.plan
        try:
            if _is_arrays(local_ids):
                lids = plan.desc_ids(local_ids)
                table = _int32_copy(local_ids)          # the caller may reuse its arrays
            else:                                       # lists: convert once, use for both
                conv = plan._as_tuple(local_ids)
                lids = plan.desc_ids(conv)
                # conversions are fresh arrays; an int32 group comes back as the caller's own
                table = tuple([c if c.base is None and c is not x else c.copy()
                               for c, x in zip(conv, local_ids)])
        except BlockTableError as e:
            raise self._fail(request_id, f"bad local block ids: {e}", group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        try:
            rids = p.plan.desc_ids(remote_ids)
        except BlockTableError as e:
            raise self._fail(request_id, f"bad remote block ids: {e}", group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        # pairing is positional per group: equal totals with unequal groups would mispair blocks
        lens = [len(g) for g in table]
        rlens = [len(g) for g in remote_ids]
        if lens != rlens or lids.size != rids.size:
            g = next((g for g in range(len(lens)) if lens[g] != rlens[g]), None)
            raise self._fail(request_id, f"group {g}: {lens[g] if g is not None else '?'} "
                                         f"local vs {rlens[g] if g is not None else '?'} "
                                         f"remote blocks ({lids.size} vs {rids.size} descriptors); "
                                         "per-group block counts must match", group=g)
        return (_nixl_ids(lids, plan.num_descs), _nixl_ids(rids, p.plan.num_descs), table,
                sum(map(operator.mul, lens, self._group_bytes)))

    def _post_pair(self, op, request_id, p: _Peer, local_ids, remote_ids, notif) -> Transfer:
        """A heterogeneous-TP transfer: the pair plan pairs head slices of the local blocks
        with the peer's (it validates both tables, group by group, before anything moves)."""
        try:
            lids, rids = p.pair.desc_ids(local_ids, remote_ids)
        except BlockTableError as e:
            raise self._fail(request_id, f"bad block ids for peer {p.name!r}: {e}",
                             group=getattr(e, "group", None),
                             block_index=getattr(e, "block_index", None)) from None
        table = _int32_copy(local_ids)
        served = p.pair.groups
        t = Transfer(request_id, op, p.name, table, int(lids.size),
                     p.pair.local.table_bytes([len(g) if i in served else 0
                                               for i, g in enumerate(table)]),
                     posted_at=time.monotonic())
        return self._submit(t, p.local, _nixl_ids(lids, p.pair.local.num_descs), p.dlist,
                            _nixl_ids(rids, p.pair.remote.num_descs), notif, p.local_table,
                            p.table, p.pair.remote.mem_type)

    def poll(self, transfer: Transfer) -> str:
        """Non-blocking state: ``"PROC"`` or ``"DONE"``; raises TransferError on failure."""
        if transfer.state != "PROC":
            if transfer.state == "FAILED":
                raise self._failed.get(transfer.request_id) or TransferError(
                    "transfer failed", request_id=transfer.request_id)
            return transfer.state
        try:
            state = self._agent.check_xfer_state(transfer.handle)
        except Exception as e:  # noqa: BLE001
            raise self._fail(transfer.request_id, f"{transfer.op} from {transfer.peer!r} failed: {e}",
                             transfer=transfer) from None
        if state == "ERR":
            raise self._fail(transfer.request_id, f"{transfer.op} with peer {transfer.peer!r} "
                             "reported an error (peer dead or unreachable?)", transfer=transfer)
        if state == "DONE":
            self._done(transfer)
        return transfer.state

    def wait(self, transfer: Transfer, timeout: float = 10.0) -> Transfer:
        """Poll until DONE; raises TransferError on error or after ``timeout`` seconds.

        Spins for the first 2 ms (small transfers finish within that), then sleeps with a
        backoff capped at 1 ms between polls."""
        if transfer.state == "DONE":   # finished inside the post: nothing to poll
            return transfer
        start = time.monotonic()
        deadline = start + timeout
        nap = 0.0
        while self.poll(transfer) == "PROC":
            now = time.monotonic()
            if now >= deadline:
                raise self._fail(transfer.request_id, f"{transfer.op} with peer {transfer.peer!r} "
                                 f"did not complete within {timeout} s", transfer=transfer)
            if now - start > 0.002:
                nap = min(0.001, nap * 2 or 0.00005)
                time.sleep(nap)
        return transfer

    def _done(self, t: Transfer) -> None:
        t.state = "DONE"
        self._valid[t.request_id] = t.local_block_ids
        self._release(t)

    def _release(self, t: Transfer) -> None:
        if t.handle is not None:
            try:
                self._agent.release_xfer_handle(t.handle)
            except Exception:  # noqa: BLE001 - an errored handle may refuse release; drop it
                pass
            t.handle = None

    def valid_blocks(self, request_id: str) -> tuple[np.ndarray, ...] | None:
        """Local per-group block ids (int32 arrays) that arrived for a request (None unless its
        transfer is DONE)."""
        return self._valid.get(request_id)

    def failure(self, request_id: str) -> TransferError | None:
        """The error a request failed with, if it failed."""
        return self._failed.get(request_id)

    # -- notifications -------------------------------------------------------------------
    def send_notif(self, peer: str, request_id: str, msg: bytes = b"done") -> None:
        """Send ``b"<request_id>:<msg>"`` to a peer."""
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}", request_id=request_id)
        try:
            self._agent.send_notif(peer, request_id.encode() + b":" + bytes(msg))
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            # e.g. nixlRemoteDisconnectError when the peer's process is gone
            raise TransferError(f"notification to {peer!r} not sent: {type(e).__name__}: {e}",
                                request_id=request_id) from e

    def _drain_notifs(self) -> None:
        try:
            new = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error classes
            raise TransferError(f"reading notifications failed: {type(e).__name__}: {e}") from e
        for sender, msgs in new.items():
            name = sender.decode(errors="replace") if isinstance(sender, bytes) else str(sender)
            for m in msgs:
                rid, sep, body = bytes(m).partition(b":")
                self._notifs.add(rid.decode(errors="replace"), name, body if sep else b"")

    def notifications(self, request_id: str, *, fetch: bool = True) -> list[bytes]:
        """Messages received so far for a request (consumed). ``fetch=False`` skips asking
        NIXL for new ones (call :meth:`fetch_notifs` once, then this for many requests)."""
        return [body for _, body in self.notifications_from(request_id, fetch=fetch)]

    def notifications_from(self, request_id: str, *, fetch: bool = True
                           ) -> list[tuple[str, bytes]]:
        """:meth:`notifications` with each message's sender (the peer's agent name), so an
        answer can go back to it."""
        if fetch:
            self._drain_notifs()
        return self._notifs.pop(request_id)

    def has_notifications(self, request_id: str) -> bool:
        """True when messages for ``request_id`` are queued (nothing fetched or consumed)."""
        return request_id in self._notifs

    def drop_unclaimed_notifs(self, older_than: float, live, cap: int) -> int:
        """Drop queued messages nobody claimed (:meth:`NotifQueues.drop_unclaimed`): queues
        of requests not in ``live`` first filled before ``older_than`` (``time.monotonic()``),
        and the oldest such while more than ``cap`` queues remain. Returns messages dropped."""
        return self._notifs.drop_unclaimed(older_than, live, cap)

    def fetch_notifs(self) -> None:
        """Move NIXL's new notifications into the per-request queues."""
        self._drain_notifs()

    def wait_notif(self, request_id: str, timeout: float = 10.0) -> bytes:
        """First message for ``request_id`` (request ids must not contain ``:``), waiting at most
        ``timeout`` s; raises TransferError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain_notifs()
            first = self._notifs.pop_first(request_id)
            if first is not None:
                return first[1]
            if time.monotonic() >= deadline:
                raise TransferError(f"no notification for request {request_id!r} within {timeout} s",
                                    request_id=request_id)
            time.sleep(0.001)

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the agent is closed")

    def close(self) -> None:
        """Release dlists, forget peers, deregister memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            try:
                self.remove_peer(name)
            except Exception:  # noqa: BLE001 - keep tearing down
                pass
        try:
            self._agent.release_dlist_handle(self._local)
        finally:
            self._agent.deregister_memory(self._reg)

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
