"""Worker side of :class:`HmaNixlConnector` in layer-wise push mode, one worker per TP rank.

Built on :mod:`hmacore.layerwise` (LayerPlan, LayerwisePusher, LayerwiseReceiver) over a
:class:`~hmacore.transport.base.DescTransport` (NIXL's DescAgent or Mooncake TE's
TeDescAgent, ``kv_connector_extra_config.transport``) whose agent is named
``<engine_id>#tp<rank>@push`` (``<engine_id>@push`` at TP = 1; a peer in pull mode is
recognised at handshake and refused with a clear error). A TP-aware :class:`HandshakeServer`
on ``side_channel_host:port + rank`` answers decode ranks.

* D (``start_load_kv``): for each :class:`PushRegistration` handshake once per prefill engine
  with every one of its ranks (rank r at ``port + r``; rank 0 tells the TP size), send each
  ``b"<push_id>:REG:<json>"`` (D's agent name, positional per-group ids, this rank and TP
  size) and expect one push per *source* rank (equal TP: the same rank; else the
  :class:`~hmacore.tp.TpMapping` of this rank), each under the tag :func:`push_tag`
  (LayerwiseReceiver, deadline ``push_recv_timeout`` s). Every layer's notification plus
  ``done`` from every source -> ``finished_recving``; a failure notification, a count
  mismatch, the deadline or a handshake error of any source -> ``finished_recving`` and
  ``failed_recving`` (nothing valid), reported once every source settled.
  Handshakes run on a background thread (the engine loop never waits for one; registrations
  to that address are parked meanwhile). While a push is awaited, D pings its prefill engine
  every :data:`PEER_CHECK_INTERVAL_S` s over NIXL: a dead agent fails every push awaited
  from it at once and drops the address, so the next registration handshakes afresh (a
  restarted prefill engine, new engine id or not). A registration NIXL cannot deliver to a
  known address is retried once after a fresh handshake. A push that failed is cancelled on
  P (``<push_id>:CANCEL:<D agent>``) and its registered blocks stay held (``holding`` in the
  worker metadata: the scheduler pins them in vLLM's block pool) until every P rank answered
  ``<push_id>:CANCELLED:<P agent>``, the source is lost, or ``cancel_ack_timeout`` s passed
  (``released``); the request itself is reported failed at once.
  No hook raises into vLLM: every failure ends the requests it concerns.
* P: a rank reports a push id (worker metadata ``registered``: the id and this rank; D's
  table stays on the worker) once every *consumer* decode rank
  (:func:`hmacore.tp.consumer_ranks`; equal TP: the same rank)
  registered; a registration whose rank / TP claim contradicts its sender's handshake, or
  that disagrees with the push's earlier ones, is refused. Each step (``start_load_kv``, else
  the first ``save_kv_layer``) the worker follows its pushing requests' tables from the
  :class:`PushSave` new ids (a ``full`` table replaces: first step, or resumed after a
  preemption) and pairs the step's tokens with D's registration (:meth:`_plan_step`, one
  ``TrackerSet.step_pairs`` call; a step it cannot plan fails that push alone). In
  ``save_kv_layer`` the layer's WRITE (its group's pairs of the planned step) is posted at once to every
  consumer: whole pages at equal TP, else this rank's head slices / replicated pages from the
  :class:`~hmacore.tp.TpPairPlan` seen from that decode rank, used in the WRITE direction.
  One LayerwisePusher request per (push, step, consumer), all of a step under one tag: the
  prompt's last step under :func:`push_tag` (its per-layer notifications and ``done`` reach
  D's receiver), earlier steps under ``<tag>.<step>`` (D ignores those). A step starts only
  after the previous step's WRITEs of the same push completed (bounded), so a partly filled
  block re-written later is never overtaken by its stale copy. When the final step is sent
  or any step failed, the request is reported in ``finished_sending`` once (a rank without
  consumers: when the final step comes); vLLM's KVOutputAggregator waits for every rank.
  A failed or cancelled push posts nothing more, and ends only once none of its WRITEs is in
  flight (handles are released when NIXL reports them DONE or ERR, never while PROC); a
  CANCEL is answered then (at once when nothing was posted or the push already ended).

Units: block ids per group; descriptor ids from LayerPlan; times ``time.monotonic()`` seconds.
PP = 1. Other block sizes (``block_size_remap``, default on), at equal or different TP
sizes: P writes each layer as byte runs (:mod:`hmacore.regrain`) of the step's tokens D
needs, planned in token ranges by this worker (``PushSave.regrain``); across TP sizes the
plan of each (P rank, consumer D rank) pairs only the chunks of the heads that D rank takes
from this P rank (``RegrainPlan(tp=(mapping seen from D, P rank))``, as pull's per source
rank). D checks at the handshake that a remap with each of its source ranks can be planned
(HandshakeError naming the rank otherwise, e.g. head-sliced ``NHD`` pages). Mamba groups (TP
1): D's registration carries its state bytes (``state``), refused by name unless equal to
P's; the step that ends P's prompt moves P's state at its state point into D's registered
slot, unpadded state bytes only (:meth:`HmaPushWorker._state_pair`).
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from typing import Any

from ....errors import ConfigError, HandshakeError, HmacoreError
from .._metrics import StatsCounter
from ....layerwise import LayerPlan, LayerwisePusher, LayerwiseReceiver, PushState
from ....plan import TransferPlan
from ....tables import TrackerSet
from ....tp import TpMapping, consumer_ranks
from ....transport import DEFAULT_PROGRESS_DELAY_US, configure_ucx_env
from ....transport.base import check_transport, make_desc_transport
from ....transport.handshake import HandshakePayload, HandshakeServer
from .._roles import close_transport
from .push_metadata import PUSH_AGENT_SUFFIX, HmaPushConnectorMetadata, HmaPushWorkerMeta, \
    PushSave
from .. import _compat as C
from .push_common import _CANCEL, _Cancel, _CANCELLED, _Inbox, \
    _PING, _Push, push_tag, _REG, _Reg, _Source
# re-exported: tests and bench import these from here
from .push_common import FIRST_CONTACT_TIMEOUT_S, PEER_CHECK_INTERVAL_S, _regrain_plan_with  # noqa: F401
from .push_decode import DecodeSide
from .push_prefill import PrefillSide

logger = C.get_logger(__name__)

__all__ = ["HmaPushWorker"]


class HmaPushWorker(PrefillSide, DecodeSide):
    """Per-rank push state of one engine. Created by the connector in the WORKER role.

    Args:
        layout, num_blocks, engine_id, host, port: as :class:`HmaNixlWorker` (rank r listens
            on ``port + r``).
        recv_timeout: D, seconds from registration until the push must be complete.
        lease_s: P, seconds a push may take at most (the scheduler's lease).
        gate_timeout: P, seconds a step waits for the previous step's WRITEs of a push.
        tp: this rank's :class:`~._tp.WorkerTp` (None: rank 0 of TP 1).
        progress_delay_us: the NIXL agent's progress-thread poll delay (microseconds).
        posting: how a WRITE's descriptors reach NIXL (:mod:`hmacore.transport.nixl_post`).
        transport: ``"nixl"`` or ``"mooncake"``: the descriptor-level driver
            (:func:`hmacore.transport.base.make_desc_transport`); Mooncake TE listens on
            ``host``, which must then be routable.
    """

    def __init__(self, layout, num_blocks: int, engine_id: str, host: str, port: int, *,
                 recv_timeout: float = 60.0, lease_s: float = 30.0,
                 cancel_ack_timeout: float = 60.0,
                 gate_timeout: float = 5.0, tp: Any = None,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
                 posting: str = "auto", transport: str = "nixl",
                 block_size_remap: bool = True, state_bytes: Any = None) -> None:
        self.transport = check_transport(transport)
        #: per group the unpadded bytes of one layer's Mamba state (None: not a Mamba group;
        #: all None: unknown, a remap with Mamba groups of other block sizes is refused)
        self.state_bytes = None if state_bytes is None else [
            None if b is None else int(b) for b in state_bytes]
        self.block_size_remap = block_size_remap   # other block sizes: hmacore.regrain
        if self.transport == "mooncake" and host in ("0.0.0.0", "::", ""):
            raise ConfigError("transport 'mooncake' advertises the address its engine listens "
                              "on: set side_channel_listen_host to a routable address, not "
                              f"{host!r}")
        configure_ucx_env()
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.tp = tp
        self.rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        base = tp.agent_name(engine_id) if tp is not None else engine_id
        self.name = f"{base}{PUSH_AGENT_SUFFIX}"
        self.host, self.port = host, (tp.port(port) if tp is not None else port)
        self.recv_timeout, self.lease_s, self.gate_timeout = recv_timeout, lease_s, gate_timeout
        self.agent = None
        self.progress_delay_us = progress_delay_us
        self.posting = posting
        self.server: HandshakeServer | None = None
        self.plan: TransferPlan | None = None
        self.layers: LayerPlan | None = None
        self.pusher: LayerwisePusher | None = None
        self.receiver: LayerwiseReceiver | None = None
        self._inbox = _Inbox()
        self._new_peers: queue.Queue = queue.Queue()
        self._sources: dict[tuple[str, int], _Source] = {}
        self.errors: list[str] = []           # handshake / registration problems (bounded)
        self._server_seen = 0                 # the server's refusals recorded in errors
        # D side
        # push id -> (request id, receiver keys, source address)
        self._expect: dict[str, tuple[str, tuple[str, ...], tuple[str, int]]] = {}
        self._connecting: dict[tuple[str, int], list[Any]] = {}   # address -> parked regs
        self._hs_jobs: queue.Queue = queue.Queue()     # addresses for the handshake thread
        self._hs_done: queue.Queue = queue.Queue()     # (address, result, error) back
        self._hs_thread: threading.Thread | None = None
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self.counters = StatsCounter()        # vLLM's stats / /metrics (_metrics.py)
        self.cancel_ack_timeout = cancel_ack_timeout
        self._cancels: dict[str, _Cancel] = {}    # push id -> cancel awaiting P's answer
        self._holding: set[str] = set()           # request ids newly held (to report)
        self._released: set[str] = set()          # request ids whose hold ended (to report)
        # P side
        self._dpeers: dict[str, tuple[int, int]] = {}   # D agent -> (its rank, its TP size)
        # D agents refused at acceptance (Mamba across TP sizes it cannot pair) -> why
        self._refused_peers: dict[str, str] = {}
        # D agent of other block sizes -> (RegrainPlan P -> D, layer index of each region pair)
        self._regrain: dict[str, tuple[Any, Any]] = {}
        self._consumers_of: dict[int, tuple[int, ...]] = {}   # D TP size -> consumer ranks
        self._regs: dict[str, _Reg] = {}
        self._new_regs: dict[str, None] = {}     # push ids to report, in order
        self._withdrawn: set[str] = set()         # reported registrations cancelled since
        self._pending_regs: list[tuple[float, str, dict]] = []
        self._pushes: dict[str, _Push] = {}
        self._dead: deque[str] = deque(maxlen=4096)
        self._sending: set[str] = set()
        self._step_meta: Any = None
        self._step_saves: list[tuple[str, list[str], bool]] = []  # (push id, subs, final)
        # P's own tables of the requests it pushes (design (b) of issue 15: fed by each
        # step's PushSave.new_block_ids, sparse as TrackerSet.step_pairs keeps them)
        self.tables = TrackerSet(layout)
        self._block_sizes = tuple(g.block_size for g in layout.groups)
        self._followed: dict[str, str] = {}       # push id -> request id with a table here
        #: the last step's planned saves (request id -> PushSave with its WRITE pairs)
        self.planned: dict[str, PushSave] = {}
        self._stats: deque[dict] = deque(maxlen=1024)
        self._need_fwd_end: dict[str, dict] = {}   # ended in this step's forward pass

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> TransferPlan:
        plan = TransferPlan.from_kv_caches(self.layout, kv_caches, num_blocks=self.num_blocks)
        self.plan = plan
        self.layers = LayerPlan(plan)
        self.agent = make_desc_transport(self.transport, self.name, plan.registration_ranges(),
                                         mem_type=plan.mem_type, hostname=self.host,
                                         posting=self.posting,
                                         progress_delay_us=self.progress_delay_us)
        self.pusher = LayerwisePusher(self.agent, self.layers)
        self.receiver = LayerwiseReceiver(self._inbox, len(self.layers.layers))
        self._me = self._payload()
        self.server = HandshakeServer(self._me, host=self.host, port=self.port,
                                      on_peer=self._new_peers.put,
                                      check=self._check_decode_peer)
        return plan

    def _payload(self) -> HandshakePayload:
        if self.tp is not None:
            return HandshakePayload.for_tp_plan(self.plan, self.name, self.agent.metadata(),
                                                **self.tp.handshake_args())
        return HandshakePayload.for_plan(self.plan, self.name, self.agent.metadata())

    def _error(self, msg: str) -> None:
        logger.error("%s", msg)
        self.errors = (self.errors + [msg])[-64:]

    def _tag(self, push_id: str) -> str:
        return push_tag(push_id, self.rank, self.tp_size)

    def _consumers(self, dtp: int) -> tuple[int, ...]:
        """P: the ranks of a TP-``dtp`` decode engine that read from this rank (equal TP: the
        same rank, whole pages; else hmacore.tp.consumer_ranks). LayoutError if the sizes do
        not pair."""
        if dtp not in self._consumers_of:
            if dtp == self.tp_size:
                self._consumers_of[dtp] = (self.rank,)
            elif self.tp is None:
                raise HandshakeError(f"a TP-{dtp} decode engine needs the TP-aware handshake; "
                                     "this worker has no TP description")
            else:
                self._consumers_of[dtp] = consumer_ranks(
                    self.layout, self.tp.shardings, local_tp=dtp, remote_tp=self.tp_size,
                    remote_rank=self.rank)
        return self._consumers_of[dtp]

    def _mapping_of(self, d: int, dtp: int, page_layout: str) -> Any:
        """P: the TpMapping of decode rank ``d`` of a TP-``dtp`` engine (None at equal TP)."""
        if dtp == self.tp_size:
            return None
        assert self.tp is not None
        return TpMapping(self.layout, self.tp.shardings, local_tp=dtp, local_rank=d,
                         remote_tp=self.tp_size, page_layout=page_layout)

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: HmaPushConnectorMetadata) -> None:
        """D: send registrations and expect pushes. P: aborts, expiries, then the step's
        plan (:meth:`_prepare_step`; else the first ``save_kv_layer`` makes it). Never raises
        once registered: a failure ends the request it concerns."""
        if self.agent is None:
            raise RuntimeError("register_kv_caches must run before start_load_kv")
        self._take_server_refusals()
        self._guard("adopting handshakes", self._poll_connects)
        for reg in getattr(meta, "push_regs", {}).values():
            self._register(reg)
        for pid in getattr(meta, "push_aborts", ()):
            self._guard(f"abort of push {pid!r}", self._abort, pid,
                        "the prefill request was aborted")
        for rid in meta.expired | meta.reqs_not_processed:
            for pid, p in list(self._pushes.items()):
                if p.request_id == rid:
                    self._guard(f"lease end of push {pid!r}", self._abort, pid,
                                "the prefill lease expired")
                    for sub in p.subs:       # P's blocks are freed: drop what is left
                        try:
                            self.pusher.finish(sub)
                        except HmacoreError:
                            pass
                    if p.subs and p.cancelled_by:
                        logger.warning("push %s: cancel not acknowledged (its lease ended "
                                       "with WRITEs in flight)", pid)
                    p.subs.clear()
                    self._pushes.pop(pid, None)
                    self._regs.pop(pid, None)
                    self._unfollow(pid)
                    self._dead.append(pid)
        if getattr(meta, "push_saves", None):
            # P: plan the step now (tables followed, pairs made, pushes started), so every
            # step's new block ids reach this worker's tables even without a saved layer
            self._guard("step preparation", self._prepare_step, meta)

    def _guard(self, what: str, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)``; an exception is logged and counted, never raised into vLLM's
        engine loop (the requests concerned settle by their own failure paths)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a connector hook must not raise
            self.counters.add("transfer_failures")
            self._error(f"push worker (rank {self.rank}): {what} failed: "
                        f"{type(e).__name__}: {e}")
            logger.debug("traceback", exc_info=True)
            return None

    def _route_notifs(self) -> None:
        for m in self.agent.notifs():
            if m == _PING:
                continue
            pid, _, body = m.partition(b":")
            if body.startswith(_CANCEL):
                self._on_cancel(pid.decode(errors="replace"),
                                body[len(_CANCEL):].decode(errors="replace"))
                continue
            if body.startswith(_CANCELLED):
                self._on_cancelled(pid.decode(errors="replace"),
                                   body[len(_CANCELLED):].decode(errors="replace"))
                continue
            if body.startswith(_REG):
                try:
                    doc = json.loads(body[len(_REG):])
                    ids = doc["ids"]
                    if not isinstance(doc["agent"], str) or len(ids) != self.layout.num_groups:
                        raise ValueError(f"needs 'agent' and {self.layout.num_groups} id lists")
                    ids = [[int(x) for x in g] for g in ids]
                    rank, tp = doc.get("rank", 0), doc.get("tp", 1)
                    if isinstance(rank, bool) or isinstance(tp, bool) or not isinstance(
                            rank, int) or not isinstance(tp, int) or not 0 <= rank < tp:
                        raise ValueError(f"rank {rank!r} of TP {tp!r} is not a TP rank")
                    start, n = doc.get("start", 0), doc.get("n", 0)
                    if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, n)) \
                            or not 0 <= start <= n:
                        raise ValueError(f"token range [{start!r}, {n!r}) is not one")
                    state = doc.get("state")
                    if state is not None and (not isinstance(state, list) or len(
                            state) != self.layout.num_groups or any(
                            v is not None and (isinstance(v, bool) or not isinstance(v, int))
                            for v in state)):
                        raise ValueError(f"'state' must be None or {self.layout.num_groups} "
                                         f"entries of int or None, got {state!r}")
                except (ValueError, KeyError, TypeError) as e:
                    self._error(f"malformed push registration for {pid!r}: {e}")
                    continue
                self._pending_regs.append((time.monotonic(), pid.decode(errors="replace"),
                                           {"agent": doc["agent"], "ids": ids, "rank": rank,
                                            "tp": tp, "start": start, "n": n,
                                            "state": state}))
            else:
                self._inbox.msgs.append(m)
        if self._pending_regs:
            self._accept_peers()
            keep = []
            for t, pid, doc in self._pending_regs:
                if doc["agent"] in self._dpeers:
                    self._add_reg(pid, doc)
                elif doc["agent"] in self._refused_peers:
                    self._refuse_peer_reg(pid, doc["agent"])
                elif time.monotonic() - t < self.gate_timeout:
                    keep.append((t, pid, doc))       # its handshake is still being accepted
                else:
                    self._error(f"push registration {pid!r} names unknown peer {doc['agent']!r}")
            self._pending_regs = keep

    # -- P: layer-wise writes ---------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: Any) -> None:
        """The forward pass computed ``layer_name``: post its WRITE for every push request of
        this step (layers the plan does not know are ignored)."""
        if self.pusher is None or meta is None:
            return
        self._guard("step preparation", self._prepare_step, meta)
        if not self._step_saves or layer_name not in self.layers.meta:
            return
        for pid, subs, _ in self._step_saves:
            p = self._pushes.get(pid)
            if p is None or p.failed is not None:
                continue
            for sub in subs:
                try:
                    self.pusher.save_layer(sub, layer_name)
                except Exception as e:  # noqa: BLE001 - fail this push, not the engine
                    self._fail_push(pid, p, f"layer {layer_name!r}: {type(e).__name__}: {e}")
                    break
        self._guard("polling WRITEs", self._progress)

    def wait_for_save(self, meta: Any) -> None:
        """Forward pass over: record its end for final steps (overlap figure); poll WRITEs."""
        now = time.monotonic()
        if meta is not None and meta is self._step_meta:
            for pid, _, final in self._step_saves:
                p = self._pushes.get(pid)
                if p is not None and final:
                    p.forward_end = now
                elif final and pid in self._need_fwd_end:   # done before the pass ended
                    rec = self._need_fwd_end[pid]
                    rec["forward_end"] = now
                    if rec["last_write_done"]:
                        rec["write_after_forward_ms"] = (rec["last_write_done"] - now) * 1e3
        self._need_fwd_end.clear()
        if self.pusher is not None:
            self._guard("polling WRITEs", self._progress)

    # -- results ----------------------------------------------------------------------------
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` of this rank since the
        last call. D: a request is finished once the push of every source rank settled
        (failed if any did not arrive whole)."""
        if self.agent is None:
            return set(), set(), set()
        # each stage guarded: nothing raises into vLLM, and what one stage settled is kept
        self._guard("adopting handshakes", self._poll_connects)
        self._guard("accepting decode peers", self._accept_peers)
        self._guard("reading notifications", self._route_notifs)
        self._guard("checking notifications sent", self._notif_failures)
        self._guard("polling WRITEs", self._progress)
        self._guard("polling pushes", self.receiver.poll)
        self._guard("settling pushes", self._settle)
        if self._expect or self._cancels:
            self._guard("checking prefill peers", self._check_sources)
        if self._cancels:
            self._guard("checking cancels", self._check_cancels)
        self._guard("counting WRITEs", self._count_posts)
        recving, failed = self._recving, self._failed
        self._recving, self._failed = set(), set()
        sending, self._sending = self._sending, set()
        return sending, recving, failed

    def _count_posts(self) -> None:
        """P: the layer WRITEs posted since the last step into the stats (transfers, bytes,
        descriptors given to the transport, per-block descriptors they stand for)."""
        posted = self.agent.take_posted()
        if posted.transfers:
            c = self.counters
            c.add("transfers", posted.transfers)
            c.add("transfer_bytes", posted.bytes)
            c.add("transfer_descriptors", posted.descriptors)
            c.add("transfer_block_descriptors", posted.block_descriptors)

    def _settle(self) -> None:
        """D: a request whose pushes from every source rank settled is finished (failed if any
        did not arrive whole; then its prefill ranks are told to stop, in case they still
        push after D's deadline)."""
        for pid, (rid, keys, key) in list(self._expect.items()):
            states = [self.receiver.state(k) for k in keys]
            if PushState.WAITING in states:
                continue
            ok = True
            for k, st in zip(keys, states):
                if st != PushState.READY:
                    self._error(f"push {k!r} into {rid!r} failed: {self.receiver.error(k)}")
                    ok = False
            self.counters.add("loads" if ok else "transfer_failures")
            self._recving.add(rid)
            if not ok:
                self._failed.add(rid)
                src = self._sources.get(key)
                if src is not None:
                    self._cancel(pid, rid, key, src.names)
            for k in keys:
                self.receiver.forget(k)
            del self._expect[pid]

    def build_worker_meta(self) -> HmaPushWorkerMeta | None:
        if not (self._new_regs or self._holding or self._released or self._withdrawn):
            return None
        meta = HmaPushWorkerMeta(registered={pid: [self.rank] for pid in self._new_regs},
                                 holding={rid: [self.rank] for rid in self._holding},
                                 released={rid: [self.rank] for rid in self._released},
                                 withdrawn=self._withdrawn)
        self._new_regs, self._holding, self._released = {}, set(), set()
        self._withdrawn = set()
        return meta

    def holds(self) -> dict[str, set[str]]:
        """D: push id -> prefill agents whose cancel acknowledgement is awaited."""
        return {pid: set(c.waiting) for pid, c in self._cancels.items()}

    def stats(self) -> list[dict]:
        """P: one record per ended push (``forward_end`` / ``last_write_done``: monotonic
        seconds; ``write_after_forward_ms``: last layer WRITE seen done minus the entry of
        ``wait_for_save`` of the prompt's last step, milliseconds; negative when the last
        WRITE completed before the forward pass returned)."""
        return list(self._stats)

    def shutdown(self) -> None:
        if self._hs_thread is not None:
            self._hs_jobs.put(None)
            self._hs_thread.join(timeout=2.0)    # daemon: a handshake in flight is dropped
            self._hs_thread = None
        close_transport(self)
