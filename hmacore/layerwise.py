"""Layer-wise push: per-layer descriptor ids and the prefill/decode bookkeeping around them.

The decode side allocates a request's blocks (every group, windows and state clipped) and
sends its per-group block ids and agent metadata to the prefill side (vLLM push mode does it
through ``kv_transfer_params``). The prefill side WRITEs each layer's pages of the request as
soon as that layer is computed (:meth:`LayerwisePusher.save_layer`), so the transfer overlaps
the forward pass. Each layer WRITE carries the notification ``"<req>:L<k>"`` (NIXL delivers it
after that WRITE's bytes); after every layer WRITE completed the pusher sends ``"<req>:done:<n>"``
(``<req>`` is the request's tag, by default its id). A peer may bring its own local LayerPlan
(heterogeneous TP: the pair's head-slice descriptors, possibly fewer layers).
The decode side (:class:`LayerwiseReceiver`) marks the request ready only when all ``n``
per-layer notifications and the final one arrived; a peer that dies midway leaves it failed
at its deadline with nothing valid. The prefill side keeps the request's blocks until its lease
ends (``release`` callback), then forgets it.

Units: block ids are per group (int32-valued); descriptor ids index a TransferPlan's dlist
(int64); times are ``time.monotonic()`` seconds. This module imports numpy only: the transport
is any object with ``post(op, peer, local_desc_ids, remote_desc_ids, notif) -> handle``,
``state(handle) -> "PROC" | "DONE" | "ERR"``, ``release(handle)``, ``send_notif(peer, msg)`` and
``notifs() -> list[bytes]`` (hmacore.transport.nixl_desc.DescAgent is one).
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import BlockTableError, LayoutError, TrackerStateError, TransferError
from .plan import TransferPlan, layer_sort_key

__all__ = ["LayerMeta", "LayerPlan", "LayerwisePusher", "LayerwiseReceiver", "PushState",
           "layer_metadata", "runs_by_layer"]


@dataclasses.dataclass(frozen=True)
class LayerMeta:
    """Where one layer's pages live in a plan. ``regions`` index the plan's regions (K then V
    for split pages, state sub-pages in order); ``base``/``block_len``/``stride`` are per region,
    in bytes; ``group`` is the layer's group."""

    name: str
    group: int
    regions: tuple[int, ...]
    base: tuple[int, ...]
    block_len: tuple[int, ...]
    stride: tuple[int, ...]


def layer_metadata(plan: TransferPlan) -> dict[str, LayerMeta]:
    """Per-layer metadata of a plan, in numeric-aware layer order.

    Raises LayoutError if a layer's pages sit in regions owned by two different groups, or a
    layer named by a region is not in the layout."""
    l2g = plan.layout.layer_to_group
    acc: dict[str, list[int]] = {}
    for r, reg in enumerate(plan.regions):
        for name in reg.layers:
            if name not in l2g:
                raise LayoutError(f"region {r} names layer {name!r} that the layout lacks")
            g = l2g[name]
            if reg.group not in (-1, g):
                raise LayoutError(f"layer {name!r} of group {g} sits in region {r} owned by group "
                                  f"{reg.group}: a layer belongs to one group")
            acc.setdefault(name, []).append(r)
    out = {}
    for name in sorted(acc, key=layer_sort_key):
        rs = tuple(acc[name])
        out[name] = LayerMeta(name, l2g[name], rs, tuple(plan.regions[r].base for r in rs),
                              tuple(plan.regions[r].block_len for r in rs),
                              tuple(plan.regions[r].stride for r in rs))
    return out


class LayerPlan:
    """Per-layer descriptor ids into a full plan's dlist. Built once per plan.

    For layer L of group g: the plan's regions holding L (each made owned by g, so a slot
    aliased by several groups moves only g's blocks), flattened by TransferPlan's kernel and
    mapped back to the full dlist's descriptor indices. Peers with equal region shapes get
    ids in matching order."""

    def __init__(self, plan: TransferPlan):
        self.plan = plan
        self.meta = layer_metadata(plan)
        offs = np.zeros(len(plan.regions) + 1, dtype=np.int64)
        np.cumsum([r.num_descs for r in plan.regions], out=offs[1:])
        self._sub: dict[str, tuple[TransferPlan, np.ndarray]] = {}
        for name, m in self.meta.items():
            regs = [dataclasses.replace(plan.regions[r], group=m.group) for r in m.regions]
            index = np.concatenate([np.arange(offs[r], offs[r + 1], dtype=np.int64) for r in m.regions])
            self._sub[name] = (TransferPlan(plan.layout, regs, mem_type=plan.mem_type), index)

    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names in forward order (numeric-aware sort)."""
        return tuple(self.meta)

    def desc_ids(self, layer: str, block_ids: Sequence[Any]) -> np.ndarray:
        """int64 descriptor ids (into the full plan's dlist) of one layer's pages for a
        request's per-group ``block_ids`` (only the layer's group's ids are used; empty-safe)."""
        if layer not in self._sub:
            raise LayoutError(f"layer {layer!r} is not in the plan (known: {len(self._sub)} layers)")
        sub, index = self._sub[layer]
        G = self.plan.layout.num_groups
        if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__len__") \
                or len(block_ids) != G:
            raise BlockTableError(f"block_ids must be {G} per-group id lists")
        g = self.meta[layer].group
        empty = np.empty(0, dtype=np.int32)
        ids = [block_ids[k] if k == g else empty for k in range(G)]
        return index[sub.desc_ids(ids)]


class PushState(str, enum.Enum):
    PUSHING = "pushing"
    SENT = "sent"        # every layer WRITE done, completion notification sent
    FAILED = "failed"
    READY = "ready"      # decode side: every layer arrived
    WAITING = "waiting"  # decode side: expecting layers


@dataclasses.dataclass
class _PushReq:
    peer: str
    tag: str
    local_ids: tuple[np.ndarray, ...]
    remote_ids: tuple[np.ndarray, ...]
    expires_at: float
    pending: dict[str, Any]
    saved: set[str]
    state: PushState = PushState.PUSHING
    error: str | None = None
    last_write_done: float = 0.0
    runs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None   # byte runs per layer


def runs_by_layer(src: np.ndarray, dst: np.ndarray, pair_layer: np.ndarray,
                  pairs: np.ndarray, layers: Sequence[str]
                  ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Split a request's paired byte runs (``src``/``dst`` M x 3 rows, ``pairs[i]`` the
    region pair of run i, e.g. a :class:`hmacore.regrain.RegrainRuns`) by layer:
    ``layers[pair_layer[pair]]`` -> ``(src rows, dst rows)`` in run order; layers without a
    run are left out. One stable sort, no Python object per run."""
    if src.shape[0] == 0:
        return {}
    lk = np.asarray(pair_layer, dtype=np.int64)[np.asarray(pairs, dtype=np.int64)]
    order = np.argsort(lk, kind="stable")
    lk = lk[order]
    cuts = np.flatnonzero(np.diff(lk)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [lk.shape[0]]))
    out = {}
    for a, b in zip(starts.tolist(), ends.tolist()):
        sel = order[a:b]
        out[layers[int(lk[a])]] = (src[sel], dst[sel])
    return out


def _table(name: str, ids: Sequence[Any], G: int) -> tuple[np.ndarray, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or len(ids) != G:
        raise BlockTableError(f"{name} must be {G} per-group id lists")
    out = []
    for g, x in enumerate(ids):
        a = np.asarray(x)
        if a.size == 0:
            out.append(np.empty(0, dtype=np.int32))
            continue
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise BlockTableError(f"{name}[{g}] must be a flat list of ints")
        out.append(a.astype(np.int32))
    return tuple(out)


class LayerwisePusher:
    """Prefill side: WRITE each computed layer of a request into the decode side's blocks.

    Args:
        transport: see the module docstring.
        local_layers: LayerPlan of this side's plan (the transport's local dlist order).
        remote_layers: ``peer -> LayerPlan`` of each decode peer's plan (its dlist order).
        release: ``release(request_id, local_block_ids)`` called once when a request's lease
            ends (or it finished and the lease was returned); the caller frees the blocks.
    """

    def __init__(self, transport: Any, local_layers: LayerPlan,
                 remote_layers: dict[str, LayerPlan] | None = None, *,
                 release: Callable[[str, tuple[np.ndarray, ...]], None] | None = None):
        self.transport = transport
        self.local = local_layers
        self.remote: dict[str, LayerPlan] = dict(remote_layers or {})
        self.release_cb = release
        self._reqs: dict[str, _PushReq] = {}
        self._local_of: dict[str, LayerPlan] = {}   # peer -> its pair's local LayerPlan
        self._runs_peers: set[str] = set()          # peers written by byte runs

    def add_peer(self, peer: str, remote_layers: LayerPlan,
                 local_layers: LayerPlan | None = None) -> None:
        """Register a decode peer. ``local_layers``: this side's descriptors for this peer
        only (a heterogeneous-TP pair: the transport's dlist pair of ``peer`` holds this
        side's head slices, ``hmacore.tp.TpPairPlan``); it and ``remote_layers`` may then
        cover a subset of the layers (groups the pair does not serve: those layers only get
        their notification). Default: the pusher's full local plan, every layer."""
        if local_layers is None:
            if set(remote_layers.layers) != set(self.local.layers):
                raise LayoutError(f"peer {peer!r} registers layers that differ from this side's")
        else:
            if set(remote_layers.layers) != set(local_layers.layers) \
                    or not set(local_layers.layers) <= set(self.local.layers):
                raise LayoutError(f"peer {peer!r}: pair layers differ between the sides or are "
                                  "not this side's layers")
            self._local_of[peer] = local_layers
        self.remote[peer] = remote_layers

    def start(self, request_id: str, peer: str, local_block_ids: Sequence[Any],
              remote_block_ids: Sequence[Any], *, lease_s: float = 30.0,
              tag: str | None = None) -> None:
        """Begin pushing a request: ``remote_block_ids`` came from the decode side (clipped
        per group, same per-group counts as ``local_block_ids``). Validates everything first.
        ``tag``: the prefix of the request's notifications (default ``request_id``; several
        pusher requests, e.g. one per decode rank, may share a tag when their peers differ)."""
        if request_id in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is already being pushed")
        if peer not in self.remote:
            raise TransferError(f"unknown peer {peer!r} (add_peer first)", request_id=request_id)
        G = self.local.plan.layout.num_groups
        lids = _table("local_block_ids", local_block_ids, G)
        rids = _table("remote_block_ids", remote_block_ids, G)
        for g in range(G):
            if len(lids[g]) != len(rids[g]):
                raise BlockTableError(f"group {g}: {len(lids[g])} local vs {len(rids[g])} remote "
                                      "blocks; per-group counts must match")
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise TrackerStateError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        local = self._local_of.get(peer, self.local)
        for layer in local.layers:  # validate ids once (raises before anything is posted)
            local.desc_ids(layer, lids)
            self.remote[peer].desc_ids(layer, rids)
        tag = request_id if tag is None else str(tag)
        if ":" in tag:
            raise TrackerStateError(f"notification tag must not contain ':' (got {tag!r})")
        self._reqs[request_id] = _PushReq(peer, tag, lids, rids, time.monotonic() + lease_s,
                                          {}, set())

    def add_runs_peer(self, peer: str) -> None:
        """Register a decode peer written by byte runs (:meth:`start_runs`): a block-size
        remap, whose runs come per request (the transport needs ``post_runs``)."""
        if not hasattr(self.transport, "post_runs"):
            raise TransferError(f"peer {peer!r}: this transport cannot post byte runs (a "
                                "block-size remap needs transport 'nixl')")
        self._runs_peers.add(peer)

    def start_runs(self, request_id: str, peer: str,
                   layer_runs: dict[str, tuple[np.ndarray, np.ndarray]], *,
                   lease_s: float = 30.0, tag: str | None = None) -> None:
        """Begin pushing a request as byte runs per layer (``layer -> (local rows, remote
        rows)``, :func:`runs_by_layer`); every layer of this side still gets its
        notification (a layer without runs: the notification alone)."""
        if request_id in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is already being pushed")
        if peer not in self._runs_peers:
            raise TransferError(f"peer {peer!r} takes no byte runs (add_runs_peer first)",
                                request_id=request_id)
        unknown = set(layer_runs) - set(self.local.layers)
        if unknown:
            raise LayoutError(f"runs name layers this side does not have: {sorted(unknown)}")
        if not (isinstance(lease_s, (int, float)) and lease_s > 0):
            raise TrackerStateError(f"lease_s must be a positive number of seconds, got {lease_s!r}")
        tag = request_id if tag is None else str(tag)
        if ":" in tag:
            raise TrackerStateError(f"notification tag must not contain ':' (got {tag!r})")
        self._reqs[request_id] = _PushReq(peer, tag, (), (), time.monotonic() + lease_s, {},
                                          set(), runs=dict(layer_runs))

    def save_layer(self, request_id: str, layer: str) -> None:
        """The forward pass computed ``layer``: post its WRITE (notification ``<req>:L<k>``)."""
        req = self._req(request_id)
        if req.state != PushState.PUSHING:
            return
        if layer in req.saved:
            raise TrackerStateError(f"request {request_id!r}: layer {layer!r} saved twice")
        local = self._local_of.get(req.peer, self.local)
        if layer not in self.local.meta:
            raise LayoutError(f"layer {layer!r} is not in the plan "
                              f"(known: {len(self.local.meta)} layers)")
        k = self.local.layers.index(layer)
        if req.runs is not None:              # a byte-run peer (block-size remap)
            req.saved.add(layer)
            notif = f"{req.tag}:L{k}".encode()
            rows = req.runs.get(layer)
            try:
                if rows is None:
                    self.transport.send_notif(req.peer, notif)
                else:
                    req.pending[layer] = self.transport.post_runs("WRITE", req.peer, rows[0],
                                                                  rows[1], notif)
            except Exception as e:  # noqa: BLE001 - transport errors fail the request
                self._fail(request_id, req, f"layer {layer!r} WRITE could not be posted: {e}")
            return
        if layer in local.meta:
            lids = local.desc_ids(layer, req.local_ids)
            rids = self.remote[req.peer].desc_ids(layer, req.remote_ids)
        else:                                   # a group this pair does not serve
            lids = rids = np.empty(0, dtype=np.int64)
        req.saved.add(layer)
        notif = f"{req.tag}:L{k}".encode()
        try:
            if lids.size == 0:
                self.transport.send_notif(req.peer, notif)
                return
            req.pending[layer] = self.transport.post("WRITE", req.peer, lids, rids, notif)
        except Exception as e:  # noqa: BLE001 - transport errors fail the request
            self._fail(request_id, req, f"layer {layer!r} WRITE could not be posted: {e}")

    def progress(self) -> None:
        """Poll outstanding WRITEs; send completion notifications; expire leases. A stopped or
        failed request's WRITEs still in flight are polled until they end (then released)."""
        now = time.monotonic()
        for rid, req in list(self._reqs.items()):
            if req.state != PushState.PUSHING and req.pending:
                self._drain(req)
            if req.state == PushState.PUSHING:
                for layer, h in list(req.pending.items()):
                    try:
                        st = self.transport.state(h)
                    except Exception as e:  # noqa: BLE001
                        st, why = "ERR", str(e)
                    else:
                        why = "transport reported an error (peer gone?)"
                    if st == "ERR":
                        self._fail(rid, req, f"layer {layer!r} WRITE failed: {why}")
                        break
                    if st == "DONE":
                        self.transport.release(h)
                        del req.pending[layer]
                        req.last_write_done = time.monotonic()
                if req.state == PushState.PUSHING and not req.pending \
                        and len(req.saved) == len(self.local.layers):
                    try:
                        self.transport.send_notif(req.peer,
                                                 f"{req.tag}:done:{len(req.saved)}".encode())
                        req.state = PushState.SENT
                    except Exception as e:  # noqa: BLE001
                        self._fail(rid, req, f"completion notification failed: {e}")
            if now >= req.expires_at:
                self._release(rid)

    def stop(self, request_id: str) -> None:
        """Post nothing more for the request (the decode side gave up on it): a PUSHING
        request becomes FAILED without a notification; its WRITEs already posted stay
        tracked until they end (:meth:`in_flight`)."""
        req = self._req(request_id)
        if req.state == PushState.PUSHING:
            req.state = PushState.FAILED
            req.error = "stopped"

    def in_flight(self, request_id: str) -> int:
        """The request's posted WRITEs that have not ended yet (neither DONE nor ERR)."""
        return len(self._req(request_id).pending)

    def _drain(self, req: _PushReq) -> None:
        for layer, h in list(req.pending.items()):
            try:
                st = self.transport.state(h)
            except Exception:  # noqa: BLE001 - an errored handle: it no longer moves bytes
                st = "ERR"
            if st != "PROC":
                try:
                    self.transport.release(h)
                except Exception:  # noqa: BLE001 - an errored handle may refuse release
                    pass
                del req.pending[layer]

    def finish(self, request_id: str) -> None:
        """The decode side is done with the blocks (or the request was aborted): release now."""
        self._req(request_id)
        self._release(request_id)

    def state(self, request_id: str) -> PushState:
        return self._req(request_id).state

    def error(self, request_id: str) -> str | None:
        return self._req(request_id).error

    def last_write_done(self, request_id: str) -> float:
        """``time.monotonic()`` when the request's last layer WRITE was seen DONE (0 if none)."""
        return self._req(request_id).last_write_done

    def _req(self, request_id: str) -> _PushReq:
        if request_id not in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is not being pushed")
        return self._reqs[request_id]

    def _fail(self, rid: str, req: _PushReq, msg: str) -> None:
        req.state = PushState.FAILED
        req.error = msg
        # ended WRITEs are released now; those still in flight stay pending until they end
        # (releasing a handle does not recall bytes already on their way)
        self._drain(req)
        try:
            self.transport.send_notif(req.peer, f"{req.tag}:failed".encode())
        except Exception:  # noqa: BLE001 - the peer may be gone; its deadline fails it
            pass

    def _release(self, rid: str) -> None:
        req = self._reqs.pop(rid)
        for h in req.pending.values():
            try:
                self.transport.release(h)
            except Exception:  # noqa: BLE001
                pass
        if self.release_cb is not None:
            self.release_cb(rid, req.local_ids)

    @property
    def requests(self) -> tuple[str, ...]:
        return tuple(self._reqs)


@dataclasses.dataclass
class _RecvReq:
    block_ids: tuple[np.ndarray, ...]
    deadline: float
    layers: set[int]
    done_count: int | None = None
    state: PushState = PushState.WAITING
    error: str | None = None
    ready_at: float = 0.0


class LayerwiseReceiver:
    """Decode side: a request is READY only when every layer's notification and the final
    ``done:<n>`` arrived (n = number of layers); FAILED on ``failed``, a count mismatch, or
    its deadline. Only READY requests have valid blocks.

    Args:
        transport: needs ``notifs() -> list[bytes]`` (messages ``b"<req>:<body>"``).
        num_layers: layers every request must receive.
    """

    def __init__(self, transport: Any, num_layers: int):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise LayoutError(f"num_layers must be an int >= 1, got {num_layers!r}")
        self.transport = transport
        self.num_layers = num_layers
        self._reqs: dict[str, _RecvReq] = {}

    def expect(self, request_id: str, block_ids: Sequence[Any], *, timeout_s: float = 30.0) -> None:
        """Blocks ``block_ids`` (per group) were handed to the prefill side for ``request_id``."""
        if request_id in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is already expected")
        if ":" in request_id:
            raise TrackerStateError(f"request_id must not contain ':' (got {request_id!r})")
        table = tuple(np.asarray(g, dtype=np.int32).reshape(-1) for g in block_ids)
        self._reqs[request_id] = _RecvReq(table, time.monotonic() + timeout_s, set())

    def poll(self) -> None:
        """Consume notifications; settle requests whose deadline passed."""
        for m in self.transport.notifs():
            rid, _, body = bytes(m).decode(errors="replace").partition(":")
            req = self._reqs.get(rid)
            if req is None or req.state != PushState.WAITING:
                continue
            if body.startswith("L") and body[1:].isdigit():
                req.layers.add(int(body[1:]))
            elif body.startswith("done:"):
                req.done_count = int(body[5:]) if body[5:].isdigit() else -1
            elif body == "failed":
                req.state, req.error = PushState.FAILED, "prefill side reported a failed WRITE"
        now = time.monotonic()
        for req in self._reqs.values():
            if req.state != PushState.WAITING:
                continue
            if req.done_count is not None:
                if req.done_count != self.num_layers:
                    req.state = PushState.FAILED
                    req.error = f"prefill pushed {req.done_count} layers, {self.num_layers} expected"
                elif req.layers == set(range(self.num_layers)):
                    req.state, req.ready_at = PushState.READY, now
            if req.state == PushState.WAITING and now >= req.deadline:
                req.state = PushState.FAILED
                req.error = (f"deadline passed with {len(req.layers)}/{self.num_layers} layers "
                             "arrived (prefill peer gone?)")

    def state(self, request_id: str) -> PushState:
        return self._get(request_id).state

    def error(self, request_id: str) -> str | None:
        return self._get(request_id).error

    def layers_arrived(self, request_id: str) -> int:
        return len(self._get(request_id).layers)

    def ready_at(self, request_id: str) -> float:
        return self._get(request_id).ready_at

    def valid_blocks(self, request_id: str) -> tuple[np.ndarray, ...] | None:
        """The request's per-group block ids once READY; None otherwise (nothing is valid)."""
        req = self._get(request_id)
        return req.block_ids if req.state == PushState.READY else None

    def forget(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def _get(self, request_id: str) -> _RecvReq:
        if request_id not in self._reqs:
            raise TrackerStateError(f"request {request_id!r} is not expected")
        return self._reqs[request_id]
