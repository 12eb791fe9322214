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
* P: a rank reports a push id (worker metadata, ``registered_by`` = this rank) once every
  *consumer* decode rank (:func:`hmacore.tp.consumer_ranks`; equal TP: the same rank)
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

import dataclasses
import json
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ....errors import BlockTableError, ConfigError, HandshakeError, HmacoreError, LayoutError
from .._metrics import StatsCounter
from ....layerwise import LayerPlan, LayerwisePusher, LayerwiseReceiver, PushState, \
    runs_by_layer
from ....plan import TransferPlan
from ....regrain import RegrainPlan, token_ranges
from ....spec import GroupKind
from ....tables import TrackerSet, from_wire
from ....tp import TpMapping, TpPairPlan, consumer_ranks
from ....transport import DEFAULT_PROGRESS_DELAY_US, configure_ucx_env
from ....transport.base import check_transport, make_desc_transport
from ....transport.handshake import HandshakePayload, HandshakeServer, exchange_handshake
from .._roles import close_transport
from ._regrain import check_push_mamba, payload_pages, regrain_plan, worker_pages
from ._tp import check_rank_peer
from .push_metadata import PUSH_AGENT_SUFFIX, HmaPushConnectorMetadata, HmaPushWorkerMeta, \
    PushSave
from .. import _compat as C

logger = C.get_logger(__name__)

#: D's first handshake with a prefill engine: P's side adds D's agent to NIXL while D waits,
#: which on a loaded host can take several seconds the first time (5 s timed out in CI)
FIRST_CONTACT_TIMEOUT_S = 30.0
#: D pings each prefill engine it awaits a push from this often (seconds): NIXL reports a dead
#: peer's agent at the next send, so a push from a killed prefill fails within about this
#: interval instead of at push_recv_timeout
PEER_CHECK_INTERVAL_S = 0.5

__all__ = ["HmaPushWorker"]

_REG = b"REG:"
_PING = b":PING"         # D -> P liveness probe (no push id); P drops it
_CANCEL = b"CANCEL:"     # D -> P "<push_id>:CANCEL:<D agent>": D gave up on that push
_CANCELLED = b"CANCELLED:"   # P -> D "<push_id>:CANCELLED:<P agent>": no WRITE of it in flight


def _regrain_plan_with(src_layout: Any, src_plan: Any, src_pages: Any, dst_layout: Any,
                       dst_plan: Any, dst_pages: Any, mapping: Any, src_rank: int, who: str,
                       log: bool = True, state: Any = None) -> Any:
    """The RegrainPlan P rank ``src_rank`` -> one D rank (``mapping``: that D rank's
    TpMapping at other TP sizes, else None). ``state``: per group this worker's Mamba state
    bytes (:func:`~._regrain.state_bytes`), taken for both sides (P checks D's registration
    carries equal ones before any WRITE: :meth:`HmaPushWorker._state_mismatch`). What a
    remap cannot plan (chunks whose bytes per token differ, e.g. NHD pages head-sliced by TP;
    unmodelled CPU kernels; Mamba groups without state bytes) is a HandshakeError naming
    ``who``."""
    tp = None if mapping is None else (mapping, src_rank)
    try:
        if log:
            return regrain_plan(src_layout, dst_layout, src_plan, dst_plan, src_pages,
                                dst_pages, tp=tp, state=state)
        if state is None:
            check_push_mamba(src_layout, dst_layout)
        return RegrainPlan(src_layout, dst_layout, src_plan, dst_plan, src_pages, dst_pages,
                           tp=tp, src_state_bytes=state, dst_state_bytes=state)
    except LayoutError as e:
        raise HandshakeError(f"block-size remap with {who}: {e}") from e


def _positional(ids: Any, num_groups: int) -> tuple[np.ndarray, ...]:
    """D's registered positional table (null block 0 allowed: positions P must not write)
    as int32 arrays, converted once per push; BlockTableError naming the rule otherwise."""
    if len(ids) != num_groups:
        raise BlockTableError(f"the registration has {len(ids)} groups, the layout {num_groups}")
    try:
        return tuple(np.array(g, dtype=np.int32) for g in from_wire(ids, num_groups))
    except (TypeError, ValueError, OverflowError) as e:
        raise BlockTableError(f"registration rejected: {e}") from e


class _Inbox:
    """The receiver's transport: notifications the worker routed to it."""

    def __init__(self) -> None:
        self.msgs: list[bytes] = []

    def notifs(self) -> list[bytes]:
        out, self.msgs = self.msgs, []
        return out


def push_tag(push_id: str, rank: int, tp_size: int) -> str:
    """The prefix of the notifications prefill rank ``rank`` of a TP-``tp_size`` engine sends
    for ``push_id``: the push id itself at TP = 1, ``<push_id>@<rank>`` else (a decode rank
    fed by several prefill ranks tells their layers apart)."""
    return push_id if tp_size == 1 else f"{push_id}@{rank}"


@dataclasses.dataclass
class _Source:
    """D: a prefill engine (one handshake per rank): its TP size, every rank's agent name,
    and the ranks that WRITE into this rank."""

    tp: int
    names: tuple[str, ...]
    from_ranks: tuple[int, ...]
    checked: float = 0.0           # last liveness ping (time.monotonic())


@dataclasses.dataclass
class _Reg:
    """P: one push id's registrations on this rank: D's TP size and table (identical on
    every D rank), ``agents`` D rank -> agent name, ``reported`` to the scheduler."""

    dtp: int
    ids: list[list[int]]
    agents: dict[int, str] = dataclasses.field(default_factory=dict)
    reported: bool = False
    #: a decode engine of other block sizes: (D's first token, D's token count, D's sizes)
    remap: tuple[int, int, list[int]] | None = None
    table: tuple[np.ndarray, ...] | None = None    # ``ids`` as int32 arrays (first step)


@dataclasses.dataclass
class _Push:
    request_id: str
    peers: dict[int, str]          # consumer D rank -> agent name
    subs: list[str] = dataclasses.field(default_factory=list)   # pusher request ids
    steps: int = 0
    final_started: bool = False
    failed: str | None = None
    forward_end: float = 0.0
    last_write_done: float = 0.0
    first_post: float = 0.0
    cancelled_by: set[str] = dataclasses.field(default_factory=set)  # D agents to acknowledge
    abandoned: bool = False        # a step's WRITEs were released in flight (P's lease ended)


@dataclasses.dataclass
class _Cancel:
    """D: a push D gave up on while some prefill rank may still WRITE into its blocks; the
    blocks stay held (scheduler pin) until every rank in ``waiting`` acknowledged, the source
    is lost, or ``deadline`` (``time.monotonic()``) passes."""

    request_id: str
    key: tuple[str, int]
    waiting: set[str]
    deadline: float


class HmaPushWorker:
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
        # D agent of other block sizes -> (RegrainPlan P -> D, layer index of each region pair)
        self._regrain: dict[str, tuple[Any, Any]] = {}
        self._new_regrain: dict[str, tuple[int, int, list[int]]] = {}
        self._consumers_of: dict[int, tuple[int, ...]] = {}   # D TP size -> consumer ranks
        self._regs: dict[str, _Reg] = {}
        self._new_regs: dict[str, list[list[int]]] = {}
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
                                      on_peer=self._new_peers.put)
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

    def _accept_peers(self) -> None:
        """P: decode ranks that handshook (queued by the server thread) become NIXL peers; the
        ranks that read from this rank get a dlist pair (equal TP: whole pages; else this
        rank's head slices / replicated pages of :class:`~hmacore.tp.TpPairPlan`, seen from
        the decode rank, used in the WRITE direction)."""
        while True:
            try:
                payload = self._new_peers.get_nowait()
            except queue.Empty:
                return
            name = payload.agent_name
            if not name.endswith(PUSH_AGENT_SUFFIX):
                self._error(f"transfer_mode mismatch: peer {name!r} handshook in pull mode but "
                            f"this engine runs kv_connector_extra_config.transfer_mode='push'")
                continue
            if name in self._dpeers:
                continue
            try:
                d, dtp = (payload.tp.tp_rank, payload.tp.tp_size) if payload.tp is not None \
                    else (0, 1)
                remap = tuple(payload.block_sizes) != tuple(self.layout.block_sizes)
                if dtp != 1 or self.tp_size != 1 or remap:
                    self._me.check_compatible(payload)   # TP-aware: one block-size ratio
                    if remap:
                        self._check_remap(payload.block_sizes)
                self.agent.add_remote(payload.agent_metadata)
                if d in self._consumers(dtp):
                    if remap:
                        self._add_regrain_peer(name, payload, d, dtp)
                    elif dtp == self.tp_size:
                        dplan = payload.remote_plan(self.layout)
                        self.agent.prep_pair(name, name, self.plan.descriptors(),
                                             dplan.descriptors())
                        self.pusher.add_peer(name, LayerPlan(dplan))
                    else:
                        dplan = payload.remote_plan(self.layout)
                        mapping = TpMapping(self.layout, self.tp.shardings, local_tp=dtp,
                                            local_rank=d, remote_tp=self.tp_size,
                                            page_layout=payload.tp.page_layout)
                        pair = TpPairPlan(mapping, self.rank, dplan, self.plan)
                        # seen from D: local = D's pages, remote = ours; we WRITE
                        self.agent.prep_pair(name, name, pair.remote.descriptors(),
                                             pair.local.descriptors())
                        self.pusher.add_peer(name, LayerPlan(pair.local), LayerPlan(pair.remote))
                self._dpeers[name] = (d, dtp)
            except Exception as e:  # noqa: BLE001 - hmacore and NIXL errors: refuse this peer
                self._error(f"decode peer {name!r} not usable for push: {e}")

    def _check_remap(self, sizes: Any) -> None:
        """Both sides: a peer of other block sizes pairs only through a block-size remap
        (HandshakeError naming the key and the rule). Any pair of TP sizes: what a remap
        cannot plan is refused when its plan is built (:func:`_regrain_plan_with`)."""
        mine = list(self.layout.block_sizes)
        if not self.block_size_remap:
            raise HandshakeError(f"block sizes {list(sizes)} differ from this engine's {mine} "
                                 "and kv_connector_extra_config.block_size_remap is false "
                                 "(remove it to remap)")
        if self.tp is None:
            raise HandshakeError("a block-size remap needs the TP-aware handshake; this "
                                 "worker has no TP description")

    def _add_regrain_peer(self, name: str, payload: HandshakePayload, d: int, dtp: int) -> None:
        """P: decode rank ``d`` (of a TP-``dtp`` engine) of other block sizes is written by
        byte runs: one RegrainPlan (P -> D) from both sides' page models (other TP sizes: only
        the chunks of the heads that rank takes from this one), the layer of each region
        pair, and the peer's registered memory for the runs' bounds (no dlist pair)."""
        assert self.tp is not None and payload.tp is not None and self.plan is not None
        dlayout = payload.tp.kv_layout()
        dplan = TransferPlan.from_region_table(dlayout, payload.regions,
                                               mem_type=payload.mem_type)
        plan = _regrain_plan_with(self.layout, self.plan, worker_pages(self.layout, self.plan,
                                                                      self.tp),
                                  dlayout, dplan, payload_pages(payload, dplan),
                                  self._mapping_of(d, dtp, payload.tp.page_layout), self.rank,
                                  f"decode rank {d} of TP {dtp} ({name!r})",
                                  state=self.state_bytes)
        pair_layer = plan.pair_layers(self.layers.layers)
        self.pusher.add_runs_peer(name)
        self.agent.add_runs_peer(name, dplan.registration_ranges())
        self._regrain[name] = (plan, pair_layer)

    def _handshake(self, host: str, port: int) -> tuple[int, list[HandshakePayload],
                                                         tuple[int, ...]]:
        """D, on the handshake thread (no NIXL call): handshake with every rank of the prefill
        engine at ``host:port`` (rank r at ``port + r``; rank 0 tells the TP size); its TP
        size, every rank's payload and the ranks that WRITE into this rank. HandshakeError on
        a refused / timed-out connection, a mode mismatch, a rank at the wrong port, other
        block sizes or an incompatible layout."""
        got: list[HandshakePayload] = []
        ptp = 1
        r = 0
        while r < ptp:
            payload = exchange_handshake(host, int(port) + r, self._me,
                                         timeout=FIRST_CONTACT_TIMEOUT_S)
            pname = payload.agent_name
            if not pname.endswith(PUSH_AGENT_SUFFIX):
                raise HandshakeError(
                    f"transfer_mode mismatch: peer {pname!r} at {host}:{int(port) + r} runs "
                    "pull mode, this engine kv_connector_extra_config.transfer_mode='push' "
                    "(set the same transfer_mode on both engines)")
            if r == 0:
                ptp = payload.tp.tp_size if payload.tp is not None else 1
            sizes = self.layout.block_sizes
            remap = tuple(payload.block_sizes) != tuple(sizes)
            if ptp != 1 or self.tp_size != 1 or remap:
                self._me.check_compatible(payload)   # TP-aware: one block-size ratio
            if remap:
                self._check_remap(payload.block_sizes)
                sizes = payload.block_sizes       # P writes through a block-size remap
            check_rank_peer(payload, r, ptp, f"{host}:{int(port) + r}", sizes,
                            f"expected rank {r} of TP {ptp} (rank r of a prefill engine "
                            "listens on port + r)")
            got.append(payload)
            r += 1
        if ptp == self.tp_size:
            from_ranks: tuple[int, ...] = (self.rank,)
            mapping = None
        elif self.tp is None:
            raise HandshakeError(f"prefill engine at {host}:{port} has TP {ptp}; this "
                                 "worker has no TP description")
        else:
            mapping = TpMapping(self.layout, self.tp.shardings, local_tp=self.tp_size,
                                local_rank=self.rank, remote_tp=ptp,
                                page_layout=self.tp.page_layout)
            from_ranks = tuple(mapping.remote_ranks)
        if tuple(got[0].block_sizes) != tuple(self.layout.block_sizes):
            self._check_regrain_sources(got, from_ranks, mapping)
        return ptp, got, from_ranks

    def _check_regrain_sources(self, got: list[HandshakePayload], from_ranks: tuple[int, ...],
                               mapping: Any) -> None:
        """D, on the handshake thread: P will WRITE through a block-size remap. Build the plan
        each source rank builds for this rank: a pair that cannot be planned fails this
        engine's requests now, with the reason (P refuses the same peer), not at
        push_recv_timeout."""
        assert self.tp is not None and self.plan is not None
        mine = worker_pages(self.layout, self.plan, self.tp)
        for r in from_ranks:
            p = got[r]
            assert p.tp is not None       # check_compatible: a remap is TP-aware
            player = p.tp.kv_layout()
            pplan = TransferPlan.from_region_table(player, p.regions, mem_type=p.mem_type)
            _regrain_plan_with(player, pplan, payload_pages(p, pplan), self.layout, self.plan,
                               mine, mapping, r, f"prefill rank {r} ({p.agent_name!r})",
                               log=False, state=self.state_bytes)

    def _handshake_loop(self) -> None:
        """The handshake thread: one prefill address at a time, results to ``_hs_done``. It
        keeps the engine loop free while a handshake waits (an unreachable host takes up to
        FIRST_CONTACT_TIMEOUT_S)."""
        while True:
            key = self._hs_jobs.get()
            if key is None:
                return
            try:
                self._hs_done.put((key, self._handshake(*key), None))
            except Exception as e:  # noqa: BLE001 - every failure fails the parked requests
                err = str(e) if isinstance(e, HandshakeError) else f"{type(e).__name__}: {e}"
                self._hs_done.put((key, None, err))

    def _connect(self, key: tuple[str, int], reg: Any) -> None:
        """Park ``reg`` until the handshake with ``key`` ends (one handshake per address)."""
        parked = self._connecting.get(key)
        if parked is not None:
            parked.append(reg)
            return
        self._connecting[key] = [reg]
        if self._hs_thread is None:
            self._hs_thread = threading.Thread(target=self._handshake_loop, daemon=True,
                                               name=f"hmacore-push-handshake-{self.rank}")
            self._hs_thread.start()
        self._hs_jobs.put(key)

    def _poll_connects(self) -> None:
        """D: adopt finished handshakes (NIXL add_remote here, on the engine thread) and send
        the registrations parked on them; a failed handshake fails them."""
        while True:
            try:
                key, result, err = self._hs_done.get_nowait()
            except queue.Empty:
                return
            regs = self._connecting.pop(key, [])
            if err is None:
                try:
                    ptp, got, from_ranks = result
                    live = {n for s in self._sources.values() for n in s.names}
                    names = []
                    for p in got:
                        if p.agent_name in live:
                            names.append(p.agent_name)
                            continue
                        if p.agent_name not in self._dpeers:
                            # a prefill engine restarted under the same engine id: its old
                            # agent (if still loaded) makes way for the new metadata (an
                            # engine that is also our push peer keeps its dlist pairs)
                            self.agent.remove_remote(p.agent_name)
                        names.append(self.agent.add_remote(p.agent_metadata))
                    self._sources[key] = _Source(ptp, tuple(names), from_ranks)
                    for pid, c in list(self._cancels.items()):
                        if c.key == key and not c.waiting & set(names):
                            # another engine answers at that address: the one we cancelled
                            # with is gone (a new engine id means a new NIXL agent). A safety
                            # net: a restart is normally found first by the failed send to the
                            # old agent, whose _lose_source ends every hold at this address
                            # (tests/vllm/test_push_cancel_kill.py)
                            self._end_hold(pid, "source lost (a new engine at its address)")
                except Exception as e:  # noqa: BLE001 - NIXL refused the peer
                    err = f"{type(e).__name__}: {e}"
            for reg in regs:
                if err is not None:
                    self._fail_reg(reg, err)
                else:
                    self._send_reg(reg, key, retry=False)

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: HmaPushConnectorMetadata) -> None:
        """D: send registrations and expect pushes. P: aborts, expiries, then the step's
        plan (:meth:`_prepare_step`; else the first ``save_kv_layer`` makes it). Never raises
        once registered: a failure ends the request it concerns."""
        if self.agent is None:
            raise RuntimeError("register_kv_caches must run before start_load_kv")
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

    def _register(self, reg: Any) -> None:
        """D: register ``reg``'s blocks with every rank of P (handshaking first if P's address
        is new, or its agent was lost); expect one push per source rank (``push_tag`` of that
        rank). Every failure ends the request in failed_recving."""
        try:
            if ":" in reg.push_id or reg.push_id in self._expect:
                raise HmacoreError(f"push_id {reg.push_id!r} is malformed or already expected")
            key = (reg.host, int(reg.port))
        except Exception as e:  # noqa: BLE001
            self._fail_reg(reg, str(e))
            return
        if key in self._sources:
            self._send_reg(reg, key, retry=True)
        else:
            self._connect(key, reg)

    def _send_reg(self, reg: Any, key: tuple[str, int], *, retry: bool) -> None:
        """Send one registration over the connected source ``key``. If no rank took it (a NIXL
        error: the agent is gone, e.g. a prefill engine restarted on the same address), the
        source is dropped and, with ``retry``, handshaken afresh once."""
        src = self._sources[key]
        keys: tuple[str, ...] = ()
        try:
            msg = reg.push_id.encode() + b":" + _REG + json.dumps(
                {"agent": self.name, "ids": reg.block_ids, "rank": self.rank,
                 "tp": self.tp_size, "start": int(getattr(reg, "start_tokens", 0)),
                 "n": int(reg.num_tokens), "state": self.state_bytes}).encode()
            if reg.awaiting:
                keys = tuple(push_tag(reg.push_id, p, src.tp) for p in src.from_ranks)
                for k in keys:
                    self.receiver.expect(k, reg.block_ids, timeout_s=self.recv_timeout)
        except Exception as e:  # noqa: BLE001 - this request's own data: fail it only
            for k in keys:
                self.receiver.forget(k)
            self._fail_reg(reg, f"{type(e).__name__}: {e}")
            return
        if keys:
            self._expect[reg.push_id] = (reg.request_id, keys, key)
        sent = 0
        try:
            for name in src.names:
                self.agent.send_notif(name, msg)
                sent += 1
            return
        except Exception as e:  # noqa: BLE001 - NIXL: that prefill agent is unreachable
            err = f"{type(e).__name__}: {e}"
        if sent:
            # some prefill ranks have it and may WRITE: tell them to stop; losing the source
            # fails this push and every other one awaited from it (one agent of it is gone)
            self._cancel(reg.push_id, reg.request_id, key, src.names[:sent])
            self._lose_source(key, f"registration of {reg.request_id!r} not sent: {err}")
            return
        for k in keys:
            self.receiver.forget(k)
        self._expect.pop(reg.push_id, None)
        if retry:
            self._lose_source(key, err)
            self._connect(key, reg)
        else:
            self._fail_reg(reg, f"registration with {key[0]}:{key[1]} not sent: {err}")

    def _fail_reg(self, reg: Any, why: str) -> None:
        self._error(f"push registration of {reg.request_id!r} with {reg.host}:{reg.port} "
                    f"failed: {why}")
        if reg.awaiting:
            self.counters.add("transfer_failures")
            self._recving.add(reg.request_id)
            self._failed.add(reg.request_id)

    def _cancel(self, pid: str, rid: str, key: tuple[str, int], names: Any) -> None:
        """D gave up on push ``pid`` of request ``rid`` (deadline, failure): P ranks ``names``
        stop pushing it. The request's registered blocks stay held (the scheduler pins them
        on the ``holding`` report) until every rank answered ``CANCELLED`` (sent once none of
        its WRITEs into them is in flight), the source is lost, or ``cancel_ack_timeout``."""
        c = self._cancels.get(pid)
        if c is None:
            c = self._cancels[pid] = _Cancel(rid, key, set(),
                                             time.monotonic() + self.cancel_ack_timeout)
            self._holding.add(rid)
        msg = pid.encode() + b":" + _CANCEL + self.name.encode()
        for name in names:
            c.waiting.add(name)
            try:
                self.agent.send_notif(name, msg)
            except Exception as e:  # noqa: BLE001 - that rank may be gone: pings tell
                logger.warning("push %s: cancel to %s not sent: %s", pid, name, e)

    def _on_cancelled(self, pid: str, agent: str) -> None:
        """D: prefill rank ``agent`` has no WRITE of push ``pid`` in flight any more."""
        c = self._cancels.get(pid)
        if c is None:
            return
        c.waiting.discard(agent)
        if not c.waiting:
            self._end_hold(pid, "acknowledged")

    def _end_hold(self, pid: str, how: str) -> None:
        """D: the blocks of cancelled push ``pid`` may be reused: ``how`` is "acknowledged"
        (every prefill rank answered), "source lost" or "deadline"."""
        c = self._cancels.pop(pid)
        if c.request_id in self._holding:      # not reported yet: never pinned
            self._holding.discard(c.request_id)
        else:
            self._released.add(c.request_id)
        if how == "acknowledged":
            self.counters.add("push_cancels_acknowledged")
            return
        self.counters.add("push_cancels_unacknowledged")
        logger.warning("push %s of %s: blocks released without the prefill engine's cancel "
                       "acknowledgement (%s; still waiting for %s)", pid, c.request_id, how,
                       sorted(c.waiting))

    def _check_cancels(self) -> None:
        """D: holds whose ``cancel_ack_timeout`` passed end unacknowledged."""
        now = time.monotonic()
        for pid, c in list(self._cancels.items()):
            if now >= c.deadline:
                self._end_hold(pid, f"no answer within {self.cancel_ack_timeout} s")

    def _lose_source(self, key: tuple[str, int], why: str) -> None:
        """D: the prefill engine at ``key`` is gone (NIXL reports its agent disconnected, or a
        registration could not reach it): every push awaited from it fails now instead of at
        its deadline, and the next registration for that address handshakes afresh (a
        restarted engine, new engine id or not, gets its new agent)."""
        src = self._sources.pop(key, None)
        for pid, c in list(self._cancels.items()):    # its WRITEs died with its agent
            if c.key == key:
                self._end_hold(pid, "source lost")
        if src is not None:
            live = {n for s in self._sources.values() for n in s.names}
            for name in src.names:
                if name not in live and name not in self._dpeers:
                    try:
                        self.agent.remove_remote(name)
                    except Exception as e:  # noqa: BLE001 - best effort
                        logger.warning("dropping prefill agent %s: %s", name, e)
        failed = []
        for pid, (rid, keys, k) in list(self._expect.items()):
            if k != key:
                continue
            for kk in keys:
                self.receiver.forget(kk)
            del self._expect[pid]
            self._recving.add(rid)
            self._failed.add(rid)
            self.counters.add("transfer_failures")
            failed.append(rid)
        logger.warning("prefill engine at %s:%d unreachable (%s); %d awaited push(es) failed "
                       "now, the next registration handshakes afresh", key[0], key[1], why,
                       len(failed))

    def _notif_failures(self) -> None:
        """D: a prefill agent a notification failed to reach (Mooncake TE sends them on a
        thread of its own and reports the failure here, the next step) is lost as a failed
        ping is (NIXL raises at the send instead)."""
        for name, err in self.agent.notif_failures():
            for key, src in list(self._sources.items()):
                if name in src.names:
                    self._lose_source(key, f"notification to {name} failed: {err}")

    def _check_sources(self) -> None:
        """D: every PEER_CHECK_INTERVAL_S, ping each prefill engine a push is awaited from
        (one NIXL notification per rank, which P ignores). NIXL reports a dead peer's agent
        at the next send (``NIXL_ERR_REMOTE_DISCONNECT``): its pushes fail within about
        that interval instead of at ``push_recv_timeout``."""
        now = time.monotonic()
        keys = {k for _, _, k in self._expect.values()} | {c.key for c in self._cancels.values()}
        for key in keys:
            src = self._sources.get(key)
            if src is None or now - src.checked < PEER_CHECK_INTERVAL_S:
                continue
            src.checked = now
            for name in src.names:
                try:
                    self.agent.send_notif(name, _PING)
                except Exception as e:  # noqa: BLE001 - NIXL's disconnect error, mostly
                    self._lose_source(key, f"NIXL: {type(e).__name__}: {e}")
                    break

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
                elif time.monotonic() - t < self.gate_timeout:
                    keep.append((t, pid, doc))       # its handshake is still being accepted
                else:
                    self._error(f"push registration {pid!r} names unknown peer {doc['agent']!r}")
            self._pending_regs = keep

    def _add_reg(self, pid: str, doc: dict) -> None:
        """P: fold one D rank's registration in; report the push to the scheduler once every
        D rank that reads from this rank registered (a rank nobody reads from: at once)."""
        agent = doc["agent"]
        d, dtp = self._dpeers[agent]
        if (doc["rank"], doc["tp"]) != (d, dtp):
            self._error(f"push registration {pid!r} from {agent!r} claims rank {doc['rank']} of "
                        f"TP {doc['tp']}, but its handshake said rank {d} of TP {dtp}; refused")
            return
        if pid in self._dead:       # already ended or aborted here: D must not wait for it
            try:
                self.agent.send_notif(agent, f"{self._tag(pid)}:failed".encode())
            except Exception:  # noqa: BLE001 - its deadline fails it anyway
                pass
            return
        why = self._state_mismatch(agent, doc.get("state"))
        if why is not None:        # a wrong state must never land: D's request fails now
            self._error(f"push registration {pid!r} from {agent!r} refused: {why}")
            self._refuse_reg(pid)
            try:
                self.agent.send_notif(agent, f"{self._tag(pid)}:failed".encode())
            except Exception:  # noqa: BLE001 - its deadline fails it anyway
                pass
            return
        reg = self._regs.get(pid)
        if reg is None:
            reg = self._regs[pid] = _Reg(dtp, doc["ids"])
            while len(self._regs) > 4096:        # unclaimed registrations: bounded
                old = next((k for k in self._regs if k not in self._pushes), None)
                if old is None:
                    break
                del self._regs[old]
        elif reg.dtp != dtp or reg.ids != doc["ids"]:
            self._error(f"push registration {pid!r} from {agent!r} (rank {d} of TP {dtp}) "
                        f"disagrees with earlier ones (TP {reg.dtp}, or other block ids); "
                        "refused")
            return
        if reg.agents.get(d, agent) != agent:
            self._error(f"push registration {pid!r}: rank {d} registered as {reg.agents[d]!r} "
                        f"and {agent!r}; the second refused")
            return
        reg.agents[d] = agent
        try:
            need = self._consumers(dtp)
        except HmacoreError as e:
            self._error(f"push registration {pid!r}: {e}")
            return
        if not reg.reported and set(need) <= set(reg.agents):
            reg.reported = True
            self._new_regs[pid] = reg.ids
            if agent in self._regrain:      # its steps are planned in token ranges
                reg.remap = (int(doc["start"]), int(doc["n"]),
                             [int(b) for b in self._regrain[agent][0].dst_block_sizes])
                self._new_regrain[pid] = reg.remap

    def _refuse_reg(self, pid: str) -> None:
        """P: push ``pid`` will never be written (its registration was refused): later
        registrations of it are answered ``failed``, and the scheduler is told (``withdrawn``)
        so P's request prefills without push at once, not after ``push_register_timeout``,
        whether it came before the refusal or comes after it."""
        if pid in self._pushes:        # another rank's registration started it: end it
            self._abort(pid, "a registration of it was refused")
            return
        self._dead.append(pid)
        self._regs.pop(pid, None)
        self._new_regs.pop(pid, None)
        self._new_regrain.pop(pid, None)
        self._withdrawn.add(pid)

    def _state_mismatch(self, agent: str, theirs: Any) -> str | None:
        """P: why a registration from decode agent ``agent`` (of other block sizes) cannot
        take this engine's Mamba states, or None: each Mamba group's unpadded state bytes
        (``state`` of D's registration, :func:`~._regrain.state_bytes`) must equal ours,
        as pull's ``remote_state_bytes`` rule (the plan copies ours on both sides)."""
        if agent not in self._regrain:
            return None
        groups = [g for g, spec in enumerate(self.layout.groups)
                  if spec.kind == GroupKind.MAMBA and spec.transfer]
        if not groups:
            return None
        mine = self.state_bytes or [None] * self.layout.num_groups
        got = theirs if theirs is not None else [None] * self.layout.num_groups
        bad = [g for g in groups if got[g] != mine[g]]
        if not bad:
            return None
        return (f"Mamba groups {bad}: the decode engine's state bytes "
                f"{[got[g] for g in bad]} differ from this engine's {[mine[g] for g in bad]} "
                "(registration field 'state'); a state maps only onto a state of equal bytes "
                "(same model, same TP size)")

    # -- P: layer-wise writes ---------------------------------------------------------------
    def _prepare_step(self, meta: Any) -> None:
        """Once per step (first save_kv_layer, else start_load_kv): start this step's pushes."""
        if meta is self._step_meta:
            return
        self._step_meta, self._step_saves, self.planned = meta, [], {}
        saves = getattr(meta, "push_saves", None) or {}
        if not saves:
            return
        self._accept_peers()
        planned = self._guard("planning the push step", self._plan_step, list(saves.values()))
        if planned is None:           # raised (a bug): every push of the step fails
            planned = []
            for save in saves.values():
                self._refuse(save, "its step could not be planned")
        self.planned = {save.request_id: save for save in planned}
        for save in planned:
            subs = self._guard(f"start of push {save.push_id!r}", self._start_sub, save)
            if subs:
                self._step_saves.append((save.push_id, subs, save.final))
            elif subs is None and save.push_id in self._pushes:   # raised: end it failed
                self._fail_push(save.push_id, self._pushes[save.push_id],
                                "its step could not start")

    def _plan_step(self, saves: list[PushSave]) -> list[PushSave]:
        """P: follow this step's pushing requests' tables (vLLM's new ids from the metadata,
        appended sparse, or a full table that replaces) and pair the step's tokens with D's
        registration, every request in one C call (:meth:`TrackerSet.step_pairs`); a remap
        push's table is followed dense and its step planned in token ranges. Returns the
        saves with their WRITE pairs (or ``regrain`` plans) filled in. A request whose table
        or pairs are refused has its push failed (D is told; nothing raises into vLLM)."""
        tables, G = self.tables, len(self._block_sizes)
        out: list[PushSave] = []
        rids: list[str] = []
        new_ids: list[Any] = []
        theirs: list[Any] = []
        spans: list[tuple[int, int] | None] = []
        batch: list[tuple[PushSave, _Reg]] = []
        for save in saves:
            pid, rid = save.push_id, save.request_id
            reg = self._regs.get(pid)
            if pid in self._dead or reg is None or not reg.reported:
                self._unfollow(pid)
                out.append(save)           # _start_sub answers (dead, or no registration)
                continue
            try:
                if not self._consumers(reg.dtp):   # this rank WRITEs to no decode rank:
                    self._unfollow(pid)            # nothing to follow or pair
                    out.append(save)
                    continue
                if reg.table is None:
                    reg.table = _positional(reg.ids, len(self._block_sizes))
                if save.full or self._followed.get(pid) != rid:
                    if not save.full:
                        raise BlockTableError(f"step {save.step} brings new block ids but this "
                                              "worker holds no table of the request (its first "
                                              "step was not seen)")
                    self._unfollow(pid)    # a resumed request: its full table replaces
                    tables.add(rid, [[] for _ in range(G)])
                    self._followed[pid] = rid
            except HmacoreError as e:
                self._refuse(save, str(e))
                continue
            rids.append(rid)
            new_ids.append(save.new_block_ids)
            remap = reg.remap is not None
            theirs.append(None if remap else reg.table)
            spans.append(None if remap else (save.start, save.end))
            batch.append((save, reg))
        if not batch:
            return out
        try:
            local, rem, offsets = tables.step_pairs(rids, new_ids, theirs, spans,
                                                    self._block_sizes)
            cuts = offsets.tolist()
            pairs = []
            for r in range(len(batch)):
                c = cuts[r * G:(r + 1) * G + 1]
                pairs.append(([local[a:b] for a, b in zip(c, c[1:])],
                              [rem[a:b] for a, b in zip(c, c[1:])]))
        except HmacoreError as e:      # nothing applied: each request alone
            logger.debug("batched push plan refused (%s); planning request by request", e)
            pairs = []
            for r in range(len(batch)):
                try:
                    one = tables.step_pairs([rids[r]], [new_ids[r]], [theirs[r]], [spans[r]],
                                            self._block_sizes)
                except HmacoreError as err:
                    pairs.append(err)
                    continue
                c = one[2].tolist()
                pairs.append(([one[0][a:b] for a, b in zip(c, c[1:])],
                              [one[1][a:b] for a, b in zip(c, c[1:])]))
        for (save, reg), pair in zip(batch, pairs):
            if isinstance(pair, HmacoreError):
                self._refuse(save, str(pair))
                continue
            try:
                if reg.remap is not None:
                    save = self._regrain_save(save, reg)
                else:       # a copy: the metadata (shared by in-process ranks) stays as sent
                    save = dataclasses.replace(save, new_block_ids=None,
                                               local_block_ids=pair[0], remote_block_ids=pair[1])
            except HmacoreError as e:
                self._refuse(save, str(e))
                continue
            if save.final:             # the prompt's last push: nothing more to follow
                self._unfollow(save.push_id)
            out.append(save)
        return out

    def _regrain_save(self, save: PushSave, reg: _Reg) -> PushSave:
        """A push into a decode engine of other block sizes: per group the step's tokens D
        needs (:func:`hmacore.regrain.token_ranges` from D's first token and token count,
        intersected with the step's ``[start, end)``) and each side's blocks holding them.
        Mamba groups (:meth:`_state_pair`): the prompt's last step only, P's state block at
        its state point to D's state slot. :meth:`_layer_runs` turns them into byte runs
        (RegrainPlan). Raises BlockTableError when it cannot be planned."""
        d_start, n, d_sizes = reg.remap            # type: ignore[misc]
        start, end = save.start, save.end
        if save.final and end < n:
            raise BlockTableError(f"the decode engine expects {n} tokens, this prompt has {end}")
        mine, theirs = self.tables.block_ids(save.request_id, copy=False), reg.table
        lo, hi = token_ranges(self.layout, n, d_start)
        src, dst, los, his, sf, df = [], [], [], [], [], []
        empty = np.empty(0, dtype=np.int32)
        for g, spec in enumerate(self.layout.groups):
            a, b = max(lo[g], start), min(hi[g], end)
            if spec.kind == GroupKind.MAMBA:
                pair, a, b = (empty, empty), 0, 0
                if spec.transfer and save.final:
                    pair = self._state_pair(g, mine[g], theirs[g], end, n, d_sizes[g])
            elif a >= b or not spec.transfer:
                pair, a, b = (empty, empty), 0, 0
            else:
                ends = []
                for side, table, bs in (("P", mine[g], spec.block_size),
                                        ("D", theirs[g], d_sizes[g])):
                    ids = np.asarray(table[a // bs:(b - 1) // bs + 1], dtype=np.int32)
                    if ids.shape[0] != (b - 1) // bs - a // bs + 1 or not ids.all():
                        raise BlockTableError(
                            f"group {g}: tokens [{a}, {b}) need {side}'s blocks {a // bs}.."
                            f"{(b - 1) // bs}; its table holds {len(table)} positions, null "
                            "among them or too few")
                    ends.append(ids)
                pair = (ends[0], ends[1])
            src.append(pair[0])
            dst.append(pair[1])
            los.append(a)
            his.append(b)
            sf.append(a // spec.block_size)
            df.append(a // d_sizes[g])
        return dataclasses.replace(save, new_block_ids=None, local_block_ids=src,
                                   remote_block_ids=dst, regrain=(los, his, sf, df))

    def _state_pair(self, g: int, mine: Any, theirs: Any, end: int, n: int,
                    d_bs: int) -> tuple[np.ndarray, np.ndarray]:
        """Mamba group ``g`` of a remap push, in the step that ends P's prompt: P's state
        after its ``end`` prompt tokens sits at table position ``cdiv(end, P's bs) - 1`` (vLLM
        align mode: the Mamba block size is --block-size; "none" mode: max_model_len, position
        0), written by this step's forward pass; D's slot for the state after its ``n``
        tokens at ``cdiv(n, D's bs) - 1``. Earlier steps' states are not what D needs, so
        only this step moves one. The points must agree (``end == n``: both engines drop the
        same backoff from the same prompt); else BlockTableError naming both (a wrong state
        is never written). A null slot on D (a local hit of D's): nothing to move."""
        if end != n:
            raise BlockTableError(
                f"group {g} (Mamba): this engine's state is after its {end} prompt tokens, the "
                f"decode engine registered its state slot for {n} tokens; a push remap moves a "
                "Mamba state only between equal points (same prompt, same backoff on both "
                "engines)")
        p_pos, d_pos = -(-end // self._block_sizes[g]) - 1, -(-n // d_bs) - 1
        p = int(mine[p_pos]) if 0 <= p_pos < len(mine) else 0
        d = int(theirs[d_pos]) if 0 <= d_pos < len(theirs) else 0
        empty = np.empty(0, dtype=np.int32)
        if not d:
            return empty, empty
        if not p:
            raise BlockTableError(f"group {g} (Mamba): this engine's table holds no state block "
                                  f"at position {p_pos} (the state after {end} tokens)")
        return np.array([p], dtype=np.int32), np.array([d], dtype=np.int32)

    def _unfollow(self, pid: str) -> None:
        """Drop this worker's table of push ``pid``'s request (final step, end, abort)."""
        rid = self._followed.pop(pid, None)
        if rid is not None and rid in self.tables:
            self.tables.finish(rid)

    def _refuse(self, save: PushSave, why: str) -> None:
        """P: a step that cannot be planned (the table or its pairs refused): the push fails
        here (D is told; the request is reported in ``finished_sending`` once nothing of it
        is in flight, so P's scheduler holds no block for it) and is followed no more."""
        pid = save.push_id
        self._unfollow(pid)
        p = self._pushes.get(pid)
        if p is None:
            reg = self._regs.get(pid)
            peers: dict[int, str] = {}
            if reg is not None:
                try:
                    peers = {d: reg.agents[d] for d in self._consumers(reg.dtp)
                             if d in reg.agents}
                except HmacoreError:
                    peers = dict(reg.agents)
            p = self._pushes[pid] = _Push(save.request_id, peers)
        self._fail_push(pid, p, f"step {save.step} cannot be planned: {why}")

    def _start_sub(self, save: PushSave) -> list[str]:
        """Start one step of a push: one pusher request per consumer D rank (ids
        ``<sub>><rank>``), all under the notification tag ``sub`` (the prompt's last step:
        :func:`push_tag`, earlier steps ``<tag>.<step>``, which D ignores)."""
        pid = save.push_id
        if pid in self._dead:          # aborted or cancelled before it started: nothing held
            if pid not in self._pushes:
                self._sending.add(save.request_id)
            return []
        p = self._pushes.get(pid)
        if p is None:
            reg = self._regs.get(pid)
            if reg is None or not reg.reported:
                self._error(f"push {pid!r}: no complete registration on this worker (rank "
                            f"{self.rank}); not pushed")
                return []
            need = self._consumers(reg.dtp)
            p = self._pushes[pid] = _Push(save.request_id, {d: reg.agents[d] for d in need})
        if p.failed is not None or p.final_started:
            return []
        if not p.peers:                # no decode rank reads from this rank: nothing to WRITE
            p.steps += 1
            p.final_started = save.final   # _progress ends it (reports finished_sending once)
            return []
        deadline = time.monotonic() + self.gate_timeout
        while any(self.pusher.state(s) == PushState.PUSHING for s in p.subs):
            self._progress()
            if time.monotonic() >= deadline:
                self._fail_push(pid, p, f"step {save.step - 1} WRITEs not done within "
                                        f"{self.gate_timeout} s")
                return []
            time.sleep(0.0002)
        tag = self._tag(pid)
        sub = tag if save.final else f"{tag}.{save.step}"
        started = []
        for d, agent in p.peers.items():
            key = f"{sub}>{d}"
            try:
                if (agent in self._regrain) != (save.regrain is not None):
                    raise HandshakeError(f"decode rank {d}: its block sizes and this step's "
                                         "plan disagree (remap vs equal block sizes)")
                if save.regrain is not None:
                    self.pusher.start_runs(key, agent, self._layer_runs(agent, save),
                                           lease_s=self.lease_s, tag=sub)
                else:
                    self.pusher.start(key, agent, save.local_block_ids,
                                      save.remote_block_ids, lease_s=self.lease_s, tag=sub)
            except HmacoreError as e:
                p.subs.extend(started)
                self._fail_push(pid, p, f"step {save.step} could not start for decode rank "
                                        f"{d}: {e}")
                return []
            started.append(key)
        p.subs.extend(started)
        p.steps += 1
        p.final_started = save.final
        if not p.first_post:
            p.first_post = time.monotonic()
        return started

    def _layer_runs(self, agent: str, save: PushSave) -> dict[str, Any]:
        """A remap step's byte runs into decode rank ``agent``, per layer (one Cython pass for
        the step, then split by the layer each region pair moves)."""
        plan, pair_layer = self._regrain[agent]
        lo, hi, sf, df = save.regrain     # type: ignore[misc]
        runs = plan.runs(save.local_block_ids, save.remote_block_ids, lo, hi, src_first=sf,
                         dst_first=df)
        return runs_by_layer(runs.src, runs.dst, pair_layer, runs.pairs, self.layers.layers)

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

    def _progress(self) -> None:
        self.pusher.progress()
        for pid, p in list(self._pushes.items()):
            for sub in list(p.subs):
                try:
                    st = self.pusher.state(sub)
                except HmacoreError:         # released by its lease end, maybe in flight
                    p.subs.remove(sub)
                    p.abandoned = True
                    continue
                if st == PushState.SENT:
                    p.last_write_done = max(p.last_write_done, self.pusher.last_write_done(sub))
                    self.pusher.finish(sub)
                    p.subs.remove(sub)
                elif st == PushState.FAILED:
                    if p.failed is None:
                        self._fail_push(pid, p, self.pusher.error(sub) or "WRITE failed")
                    if not self.pusher.in_flight(sub):
                        self.pusher.finish(sub)
                        p.subs.remove(sub)
            if p.failed is not None:
                # post nothing more; a sub ends once none of its WRITEs is in flight
                for sub in list(p.subs):
                    try:
                        self.pusher.stop(sub)
                        if not self.pusher.in_flight(sub):
                            self.pusher.finish(sub)
                            p.subs.remove(sub)
                    except HmacoreError:
                        p.subs.remove(sub)
                        p.abandoned = True
            if not p.subs and (p.failed is not None or p.final_started):
                self._end(pid, p)

    def _tell_failed(self, pid: str, agents) -> None:
        msg = f"{self._tag(pid)}:failed".encode()
        for agent in agents:
            try:
                self.agent.send_notif(agent, msg)
            except Exception:  # noqa: BLE001 - the peer may be gone; its deadline fails it
                pass

    def _fail_push(self, pid: str, p: _Push, why: str) -> None:
        if p.failed is None:
            p.failed = why
            self.counters.add("transfer_failures")
            logger.warning("push %s of %s failed on rank %d: %s", pid, p.request_id, self.rank,
                           why)
            self._tell_failed(pid, p.peers.values())

    def _abort(self, pid: str, why: str) -> None:
        self._unfollow(pid)
        p = self._pushes.get(pid)
        if p is None:                  # nothing posted yet: only tell D
            reg = self._regs.pop(pid, None)
            self._dead.append(pid)
            if self._new_regs.pop(pid, None) is not None:    # not reported yet: never is
                self._new_regrain.pop(pid, None)
            elif reg is not None and reg.reported:
                self._withdrawn.add(pid)     # reported: the scheduler must forget it
            if reg is not None:
                self._tell_failed(pid, reg.agents.values())
            return
        self._fail_push(pid, p, why)
        self._progress()      # ends the push now if none of its WRITEs is in flight

    def _on_cancel(self, pid: str, agent: str) -> None:
        """P: decode agent ``agent`` gave up on push ``pid``: post nothing more for it and
        acknowledge (``CANCELLED``) once none of its WRITEs is in flight (at once when none
        is: not started, or ended; :meth:`_end` acknowledges the others)."""
        p = self._pushes.get(pid)
        if p is not None:
            p.cancelled_by.add(agent)
        self._abort(pid, "the decode side gave up on it")
        if p is None:
            self._acknowledge(pid, (agent,))

    def _acknowledge(self, pid: str, agents: Any) -> None:
        msg = pid.encode() + b":" + _CANCELLED + self.name.encode()
        for agent in agents:
            try:
                self.agent.send_notif(agent, msg)
                self.counters.add("push_cancels_answered")
            except Exception as e:  # noqa: BLE001 - that decode rank may be gone
                logger.warning("push %s: cancel acknowledgement to %s not sent: %s", pid,
                               agent, e)

    def _end(self, pid: str, p: _Push) -> None:
        """Called once none of the push's WRITEs is in flight (``p.subs`` empty)."""
        self._pushes.pop(pid, None)
        if p.cancelled_by:
            if p.abandoned:     # a WRITE was dropped in flight: let D's ack deadline decide
                logger.warning("push %s: cancel not acknowledged (a WRITE was released in "
                               "flight when the lease ended)", pid)
            else:
                self._acknowledge(pid, sorted(p.cancelled_by))
        self._regs.pop(pid, None)
        self._unfollow(pid)
        self._dead.append(pid)
        self._sending.add(p.request_id)
        gap = (p.last_write_done - p.forward_end) * 1e3 if p.forward_end and \
            p.last_write_done else None
        rec = {"push_id": pid, "request_id": p.request_id, "steps": p.steps,
               "ok": p.failed is None, "error": p.failed, "forward_end": p.forward_end,
               "last_write_done": p.last_write_done, "write_after_forward_ms": gap,
               "rank": self.rank, "consumers": sorted(p.peers)}
        self._stats.append(rec)
        if not p.forward_end:
            self._need_fwd_end[pid] = rec

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
        meta = HmaPushWorkerMeta(registered=self._new_regs,
                                 registered_by={pid: [self.rank] for pid in self._new_regs},
                                 holding={rid: [self.rank] for rid in self._holding},
                                 released={rid: [self.rank] for rid in self._released},
                                 regrain=self._new_regrain, withdrawn=self._withdrawn)
        self._new_regs, self._holding, self._released = {}, set(), set()
        self._new_regrain, self._withdrawn = {}, set()
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
