"""Worker side of :class:`~hmacore.integrations.vllm.nixl.connector.HmaNixlConnector`.

Pull mode over :class:`hmacore.transport.nixl.NixlAgent`, one worker per TP rank:

* ``register_kv_caches``: one :class:`~hmacore.plan.TransferPlan` from this rank's layer
  tensors (the layout comes from the KVCacheConfig), one NIXL agent per rank
  (:meth:`~._tp.WorkerTp.agent_name`) and a TP-aware
  :class:`~hmacore.transport.handshake.HandshakeServer` on ``side_channel_host:port + rank``
  (the scheduler side advertises ``port`` and its TP size in ``kv_transfer_params``).
* D side, each step (``start_load_kv``): for every ``RecvRequest`` connect once per remote
  engine (address, TP size): handshake with every rank of P. Other block sizes (any TP
  sizes, ``block_size_remap``): one READ of byte runs per source rank through a
  :class:`hmacore.regrain.RegrainPlan` (:meth:`_connect_regrain`). Same TP size and block sizes:
  this rank reads whole pages from the same rank of P. Other TP size: the pair plans of
  :func:`hmacore.transport.tp_peer.tp_pair_plans` say which P ranks hold this rank's heads
  (MLA: one rank) and which byte ranges of each block; one READ per source rank, ids paired
  with :func:`hmacore.windows.trim_remote_to_local`. Each READ's completion notifies its P
  rank (``b"<P request id>:done@<rank>/<tp>"``); P ranks this rank does not read from get
  the same message at once, so every P rank hears from every D rank. An all-empty local
  table (full local hit, abort before scheduling) only notifies. Sync loads are waited for
  before the forward pass. Heartbeats (``b"...:HB"``) go to every P rank of the engine.
* P side: a request under lease is reported ``finished_sending`` by this rank once every
  rank of the reading D engine said done (vLLM's KVOutputAggregator then waits for every P
  rank); ``HB`` messages become lease renewals (:class:`HmaNixlWorkerMeta`); expired and
  aborted requests are forgotten (their blocks were freed by the scheduler side).
* Leases and in-flight READs: each READ's ``done`` asks for an answer (:data:`ASK`). A P
  rank answers ALIVE while the request's lease holds, LATE once it ended (expiry, abort):
  a freed block is reused only by a forward pass after a ``start_load_kv`` that carried the
  expiry, so ALIVE proves the READ read intact blocks. D takes a load only when every rank
  it read from answered ALIVE; LATE or no answer within the lease duration fails it.
* Failures: a READ that cannot be posted or fails invalidates every block of the load (a
  READ fails as a whole). Once none of the request's READs is in flight: with one KV cache
  group, the ids :func:`hmacore.recovery.plan_vllm_report` picks go to
  ``get_block_ids_with_load_errors`` when vLLM then restarts the request at a point safe for
  its window (the load's first block; ``recompute`` keeps the local prefix, ``fail`` fails
  the request alone); otherwise (several groups: vLLM 0.32 / 0.33 raise on block ids) an
  async load is reported in ``finished_recving`` and ``failed_recving`` and vLLM restarts it
  from 0. See docs/vllm.md, "Partial load failures".

Units: block ids per group (blocks of that group); times in seconds. PP > 1 is refused by
the connector. Mamba groups pair between engines of different TP sizes when both sides
declare the group's state geometry (hmacore.state_tp byte ranges; refused by name otherwise,
with or without a block-size remap).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ....errors import ConfigError, HandshakeError, HmacoreError, TransferError
from ....grain import cdiv
from ....plan import TransferPlan
from ....recovery import UNKNOWN, VllmReport, plan_vllm_report
from ....regrain import RegrainPlan, token_ranges
from ....spec import GroupKind
from ....tp import TpMapping
from ....transport import DEFAULT_PROGRESS_DELAY_US, configure_ucx_env
from ....transport.base import KvTransport, check_transport
from ....transport.handshake import HandshakePayload, HandshakeServer, exchange_handshake
from ....transport.nixl import NixlAgent, Transfer
from ....transport.tp_peer import tp_pair_plans
from ....windows import trim_remote_to_local
from .._metrics import StatsCounter
from ._regrain import payload_pages, regrain_plan, worker_pages
from ._tp import WorkerTp, check_rank_peer
from .metadata import HmaNixlConnectorMetadata, HmaNixlWorkerMeta, RemotePeer
from .push_metadata import PUSH_AGENT_SUFFIX
from .. import _compat as C

logger = C.get_logger(__name__)

__all__ = ["HmaNixlWorker", "done_message", "parse_done"]


#: suffix of the ``done`` a READ carries: the prefill rank answers it ALIVE or LATE
ASK = b"+ask"


def done_message(rank: int, tp_size: int, *, ask: bool = False) -> bytes:
    """What decode rank ``rank`` of a TP-``tp_size`` engine tells each prefill rank
    (``ask``: the one its READ carries, which the prefill rank answers)."""
    return b"done@%d/%d" % (rank, tp_size) + (ASK if ask else b"")


def parse_done(msg: bytes) -> tuple[int, int] | None:
    """``(rank, tp_size)`` of a done message (plain ``b"done"``: rank 0 of 1), else None."""
    if msg.endswith(ASK):
        msg = msg[:-len(ASK)]
    if msg == b"done":
        return 0, 1
    if not msg.startswith(b"done@"):
        return None
    try:
        r, _, n = msg[5:].partition(b"/")
        rank, size = int(r), int(n)
    except ValueError:
        return None
    return (rank, size) if 0 <= rank < size else None


@dataclasses.dataclass
class _Source:
    """A connected remote (P) engine: the ranks this rank reads from, and every rank's peer."""

    readers: tuple[str, ...]
    peers: tuple[str, ...]
    engine_id: str = ""
    regrain: Any = None    # RegrainPlans (one per reader) when block sizes differ from ours


#: seconds a dropped source's agents stay loaded before removal (messages sent to it leave;
#: NIXL's progress thread polls every ``nixl_progress_delay_us``, 1 ms by default)
STALE_PEER_GRACE_S = 2.0

#: P's answers to a reader's ``done`` (see :meth:`HmaNixlWorker._answer_done`)
ALIVE, LATE = b"alive", b"late"

#: queued notifications of requests this rank does not track, beyond which the oldest go at
#: once (before their grace period, ``kv_lease_duration``, ends)
UNCLAIMED_NOTIF_CAP = 4096


class _Tracked:
    """The request ids a worker still tracks (P: leases, ended leases still answered; D:
    loads and their late answers), as a container: asked only about old queues."""

    def __init__(self, worker: HmaNixlWorker) -> None:
        self.worker = worker
        self._loads: set[str] | None = None

    def __contains__(self, rid: object) -> bool:
        w = self.worker
        if rid in w._sending or rid in w._late or rid in w._stale_answers:
            return True
        if self._loads is None:
            self._loads = {load.remote_rid for load in w._recving.values()}
        return rid in self._loads


class _Refused(HandshakeError):
    """Every rank of P answered the handshake but this rank refused to pair with it (block
    sizes, TP rank, transfer mode, ...): ``payloads`` still let it tell P to free."""

    def __init__(self, msg: str, payloads: list[HandshakePayload]) -> None:
        super().__init__(msg)
        self.payloads = tuple(payloads)


@dataclasses.dataclass
class _Load:
    """A D-side load in flight: one READ per source rank, then the sources' answers.

    ``confirm``: the reading peers whose ``alive`` is still awaited (a READ's data is taken
    only once the rank it read from says its lease still held the blocks when the READ's
    ``done`` reached it); ``remote_rid``: P's request id (the answers' key)."""

    transfers: list[Transfer]
    failed: bool = False
    source: tuple[str, int, int] | None = None     # _sources key (dropped if the load fails)
    local_ids: tuple = ()                          # sync loads: blocks to report on failure
    confirm: set[str] = dataclasses.field(default_factory=set)
    remote_rid: str = ""
    confirm_by: float = 0.0                        # time.monotonic() deadline for answers
    late: bool = False                             # a source answered LATE (not a link fault)
    recv: Any = None                               # the RecvRequest (its restart point)
    peers: tuple[str, ...] = ()                    # every rank of P: told "done" if it fails


class HmaNixlWorker:
    """Per-rank NIXL state of one engine. Created by the connector in the WORKER role.

    Args:
        layout: the engine's KVLayout (translated from its KVCacheConfig).
        num_blocks: blocks per layer of the shared pool.
        engine_id: this engine's id (the NIXL agent name at TP = 1).
        host, port: where the handshake server of rank 0 listens (rank r: ``port + r``).
        tp: this worker's TP description (None: a TP = 1 worker speaking the same-TP
            handshake, which pairs only with such workers).
        sync_timeout: seconds a sync load may take before it is reported failed.
        progress_delay_us: the NIXL agent's progress-thread poll delay (microseconds).
        posting: how a READ's descriptors reach NIXL (:mod:`hmacore.transport.nixl_post`);
            over Mooncake TE ``"blocks"`` posts per block, the others the runs.
        confirm_timeout: seconds a finished READ waits for its source's ``alive`` before the
            load is reported failed (the lease duration: past it the lease is gone anyway).
        transport: ``"nixl"`` or ``"mooncake"`` (:mod:`hmacore.transport.base`).
    """

    def __init__(self, layout, num_blocks: int, engine_id: str, host: str, port: int, *,
                 tp: WorkerTp | None = None, sync_timeout: float = 30.0,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
                 confirm_timeout: float = 30.0, posting: str = "auto",
                 recompute: bool = False,
                 transport: str = "nixl",
                 block_size_remap: bool = True,
                 state_bytes: Any = None) -> None:
        self.transport = check_transport(transport)
        configure_ucx_env()  # before nixl is first imported (NixlAgent imports it lazily)
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.engine_id = engine_id
        self.tp = tp
        self.rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.name = tp.agent_name(engine_id) if tp is not None else engine_id
        self.host, self.port = host, (tp.port(port) if tp is not None else port)
        self.sync_timeout = sync_timeout
        self.progress_delay_us = progress_delay_us
        self.confirm_timeout = float(confirm_timeout)
        self.posting = posting
        self.recompute = recompute      # kv_load_failure_policy == "recompute"
        self.block_size_remap = block_size_remap   # other block sizes: hmacore.regrain
        # per group the unpadded Mamba state bytes (None: not Mamba); a remap moves those
        # bytes of each state page (P's are checked equal by D's scheduler, per request)
        self.state_bytes = None if state_bytes is None else list(state_bytes)
        self.agent: KvTransport | None = None
        self.server: HandshakeServer | None = None
        self._done_msg = done_message(self.rank, self.tp_size)
        self._read_done_msg = done_message(self.rank, self.tp_size, ask=True)
        self._sources: dict[tuple[str, int, int], _Source] = {}
        self._engine_peers: dict[str, tuple[str, ...]] = {}   # remote engine -> its ranks
        self._recving: dict[str, _Load] = {}                  # local rid -> READs in flight
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._sending: dict[str, float] = {}                  # P rid -> local deadline
        self._done_from: dict[str, tuple[int, set[int]]] = {}  # P rid -> (D tp, D ranks done)
        self._renewed: set[str] = set()
        self._late: dict[str, float] = {}      # P rid whose lease ended -> forget at (monotonic)
        self._stale_answers: dict[str, float] = {}   # D: answers no load waits for -> until
        self._invalid_blocks: set[int] = set()   # failed loads of single-group models
        self.recoveries: dict[str, VllmReport] = {}   # rid -> last block-level report
        self._stale_peers: dict[str, float] = {}  # agents of dropped sources -> removable at
        self.counters = StatsCounter()           # vLLM's stats / /metrics (_metrics.py)
        # a queued notification no tracked request claims is dropped after this (s): a
        # request's first message reaches this rank within a step of its tracking starting
        self.unclaimed_grace_s = self.confirm_timeout

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> TransferPlan:
        plan = TransferPlan.from_kv_caches(self.layout, kv_caches, num_blocks=self.num_blocks)
        tp = self.tp.handshake_args() if self.tp is not None else None
        if self.transport == "mooncake":
            if self.host in ("0.0.0.0", "::", ""):
                raise ConfigError("transport 'mooncake' advertises the address its engine "
                                  "listens on: set side_channel_listen_host to a routable "
                                  f"address, not {self.host!r}")
            from ....transport.mooncake_te import MooncakeTeAgent
            self.agent = MooncakeTeAgent(self.name, plan, hostname=self.host, tp=tp,
                                         posting=self.posting)
        else:
            self.agent = NixlAgent(self.name, plan, tp=tp,
                                   progress_delay_us=self.progress_delay_us,
                                   posting=self.posting)
        # a reader only needs to notify us: its pages may be shaped for another TP size
        self.server = HandshakeServer(self.agent.handshake_payload(), host=self.host,
                                      port=self.port, on_peer=self.agent.add_notify_peer)
        return plan

    @staticmethod
    def _key(remote: RemotePeer) -> tuple[str, int, int]:
        return (remote.host, int(remote.port), int(remote.tp_size or 1))

    def _source(self, remote: RemotePeer) -> _Source:
        """The connected engine at the params' address. Keyed by address and checked by
        engine id: another engine id at a known address (a restarted prefill engine) is
        handshaken afresh and the stale agent dropped."""
        key = self._key(remote)
        src = self._sources.get(key)
        if src is not None and src.engine_id != remote.engine_id:
            logger.info("engine %s at %s:%d replaces %s; handshaking afresh",
                        remote.engine_id, key[0], key[1], src.engine_id)
            self._drop_source(key)
            src = None
        if src is None:
            src = self._connect(*key)
            src.engine_id = remote.engine_id
            self._sources[key] = src
            self._engine_peers[remote.engine_id] = src.peers
        return src

    def _drop_source(self, key: tuple[str, int, int]) -> None:
        """Forget a remote engine: the next load from that address handshakes again. Called
        when it was replaced or a transfer with it failed. Its agents are removed once no
        READ in flight uses them (:meth:`_reap_stale_peers`): releasing a peer's descriptor
        list under a posted READ is not safe; and not before :data:`STALE_PEER_GRACE_S`, so
        that messages already handed to NIXL for it (a failed load's ``done``) leave first:
        removing the agent tears its endpoint down, and queued messages with it (seen: two
        engines, P kept 2 of 4 leases to their end)."""
        src = self._sources.pop(key, None)
        if src is None:
            return
        if self._engine_peers.get(src.engine_id) == src.peers:
            del self._engine_peers[src.engine_id]
        at = time.monotonic() + STALE_PEER_GRACE_S
        for peer in src.peers:
            self._stale_peers.setdefault(peer, at)

    def _reap_stale_peers(self) -> None:
        live = {p for src in self._sources.values() for p in src.peers}
        busy = {t.peer for load in self._recving.values() for t in load.transfers}
        now = time.monotonic()
        for peer, at in list(self._stale_peers.items()):
            if peer in busy or now < at:
                continue
            del self._stale_peers[peer]
            if peer in live:                 # re-handshaken under the same agent name
                continue
            try:
                self.agent.remove_peer(peer)
            except Exception as e:  # noqa: BLE001 - best effort: the agent may be gone
                logger.warning("dropping peer %s: %s", peer, e)

    def _connect(self, host: str, port: int, remote_tp: int) -> _Source:
        """Handshake with every rank of a remote engine (rank r at ``port + r``); add the
        ranks this rank reads from as transfer peers, the others as notify-only peers.
        :class:`_Refused` when every rank answered and this rank still refuses the pairing."""
        if remote_tp != self.tp_size:
            self._check_state_geometry(f"engine at {host}:{port}", remote_tp)
        me = self.agent.handshake_payload()
        got = [exchange_handshake(host, port + r, me) for r in range(remote_tp)]
        try:
            return self._pair(host, port, me, got)
        except HmacoreError as e:
            raise _Refused(str(e), got) from e

    def _check_state_geometry(self, where: str, remote_tp: int) -> None:
        """Between different TP sizes every Mamba group needs this rank's state geometry
        (hmacore.state_tp; the handshake then requires the peer's and refuses a mismatch by
        field): HandshakeError naming the group and why it has none otherwise."""
        for g, s in enumerate(self.layout.groups):
            if s.kind != GroupKind.MAMBA or not s.transfer:
                continue
            if self.tp is None:
                why = "this worker has no TP description"
            elif self.tp.shardings[g].state is None:
                why = (self.tp.state_why[g] if self.tp.state_why else "") or \
                    "its state type is not modelled across TP sizes"
            else:
                continue
            raise HandshakeError(
                f"group {g} is Mamba state without a state geometry ({why}); its pages pair "
                f"only between equal TP sizes (this rank: TP {self.tp_size}, {where}: TP "
                f"{remote_tp})")

    def _pair(self, host: str, port: int, me: HandshakePayload,
              got: list[HandshakePayload]) -> _Source:
        """:meth:`_connect` once every rank of P answered (``got``, in rank order)."""
        remote_tp = len(got)
        regrain = False
        for r, p in enumerate(got):
            if p.agent_name.endswith(PUSH_AGENT_SUFFIX):
                raise HandshakeError(
                    f"transfer_mode mismatch: peer {p.agent_name!r} at {host}:{port + r} runs "
                    "push mode, this engine kv_connector_extra_config.transfer_mode='pull' (set "
                    "the same transfer_mode on both engines)")
            sizes = self.layout.block_sizes
            if tuple(p.block_sizes) != tuple(sizes) and p.tp is not None \
                    and self.block_size_remap:
                sizes, regrain = tuple(p.block_sizes), True   # a block-size remap (below)
            check_rank_peer(p, r, remote_tp, f"{host}:{port + r}", sizes,
                            f"kv_transfer_params said TP {remote_tp}, so port {port + r} "
                            f"must be rank {r}")
        if regrain:
            return self._connect_regrain(got)
        if remote_tp == self.tp_size:
            readers = {self.rank: self.agent.add_peer(got[self.rank])}
        else:
            _, pairs, _ = tp_pair_plans(me, self.agent.plan, got)
            readers = {r: self.agent.add_peer(got[r], pair=pair) for r, pair in pairs.items()}
        peers = tuple(readers[r] if r in readers else self.agent.add_notify_peer(got[r])
                      for r in range(remote_tp))
        return _Source(tuple(readers[r] for r in sorted(readers)), peers)

    def _connect_regrain(self, got: list[HandshakePayload]) -> _Source:
        """Other block sizes: this rank reads through one :class:`hmacore.regrain.RegrainPlan`
        per source rank (byte runs in each side's block grain). Same TP size: its own rank of
        P, every chunk; other TP size: the ranks :class:`hmacore.tp.TpMapping` names, each
        plan pairing only the chunks of the heads read from that rank (MLA: one rank) and
        the Mamba state byte ranges read from it (state geometry required)."""
        assert self.tp is not None and self.agent is not None
        if not hasattr(self.agent, "add_regrain_peer"):
            raise HandshakeError(f"block sizes {list(got[0].block_sizes)} differ from this "
                                 f"engine's {list(self.layout.block_sizes)}: a block-size remap "
                                 f"needs transport 'nixl' (this engine runs {self.transport!r}); "
                                 "use equal --block-size on both engines")
        remote_tp = len(got)
        # other TP size: Mamba groups need a state geometry on both sides (_connect checked
        # ours, check_compatible the peer's and that they agree); their state ranges
        # (hmacore.state_tp) pair per source rank inside the RegrainPlan
        if remote_tp == self.tp_size:
            sources: dict[int, Any] = {self.rank: None}
        else:
            mapping = TpMapping(self.layout, self.tp.shardings, local_tp=self.tp_size,
                                local_rank=self.rank, remote_tp=remote_tp,
                                page_layout=self.tp.page_layout)
            sources = {r: (mapping, r) for r in mapping.remote_ranks}
        lpages = worker_pages(self.layout, self.agent.plan, self.tp)
        readers: dict[int, str] = {}
        plans: dict[int, RegrainPlan] = {}
        for r, tp in sources.items():
            p = got[r]
            name, rplan = self.agent.add_regrain_peer(p)
            readers[r] = name
            assert p.tp is not None
            # P's per-rank state bytes are ours at equal TP (D's scheduler checked them);
            # at another TP size its state ranges come from the state geometry
            plans[r] = regrain_plan(p.tp.kv_layout(), self.layout, rplan, self.agent.plan,
                                    payload_pages(p, rplan), lpages, tp=tp,
                                    state=self.state_bytes,
                                    src_state=self.state_bytes if tp is None else None)
        peers = tuple(readers[r] if r in readers else self.agent.add_notify_peer(got[r])
                      for r in range(remote_tp))
        return _Source(tuple(readers[r] for r in sorted(readers)), peers,
                       regrain=tuple(plans[r] for r in sorted(readers)))

    def _read_regrain(self, rr, src: _Source, posted: list[Transfer]) -> None:
        """One READ of byte runs per source rank (appended to ``posted`` as posted): tokens
        ``[load_start, load_start + external)`` of every attention group (clipped per group by
        :func:`token_ranges`), Mamba state slots paired from the front: P's clipped list is
        its running-state slot (the state after ``remote_num_tokens``, at P's position
        ``cdiv(n, P's bs) - 1``), D's the slot for the state after the tokens it loads (at
        ``cdiv(end, D's bs) - 1``); D's scheduler made ``end`` equal P's ``n``."""
        remote = rr.remote
        if rr.num_external_tokens <= 0 or len(rr.local_first) != len(rr.local_block_ids) \
                or remote.block_first is None:
            # the token range and table starts come from the scheduler side; without them
            # the runs would silently move nothing (or the wrong rows)
            raise HandshakeError(f"load of {rr.request_id}: a block-size remap needs the "
                                 "token range and both tables' starts (num_external_tokens, "
                                 "local_first, remote_block_first); this metadata lacks them")
        end = int(rr.load_start) + int(rr.num_external_tokens)
        lo, hi = token_ranges(self.layout, end, int(rr.load_start))
        local = [list(g) for g in rr.local_block_ids]
        rem = [list(g) for g in remote.block_ids]
        for g, spec in enumerate(self.layout.groups):
            if spec.kind == GroupKind.MAMBA:
                n = min(len(local[g]), len(rem[g]))
                local[g], rem[g] = local[g][:n], rem[g][:n]
        for peer, plan in zip(src.readers, src.regrain):     # one READ per source rank
            runs = plan.runs(rem, local, lo, hi,
                             src_first=remote.block_first or [0] * len(rem),
                             dst_first=list(rr.local_first) or [0] * len(local))
            t = self.agent.read_runs(remote.request_id, peer, runs.as_runs("dst"),
                                     notif=self._read_done_msg)
            t.local_block_ids = tuple(np.asarray(g, dtype=np.int32) for g in local)
            posted.append(t)      # as it goes: a later rank's failure leaves it in flight

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: HmaNixlConnectorMetadata) -> None:
        if self.agent is None:
            raise RuntimeError("register_kv_caches must run before start_load_kv")
        now = time.perf_counter()
        for rid, deadline in meta.reqs_to_send.items():      # P: (re)new leases
            self._sending[rid] = now + (deadline - meta.scheduler_clock)
        for rid in meta.expired | meta.reqs_not_processed:
            self._lease_ended(rid)
        for rid, rr in meta.reqs_to_recv.items():            # D: post reads
            self._start_read(rid, rr)
        for rid, rr in meta.reqs_to_recv.items():
            if not rr.awaiting and rid in self._recving:     # sync load: finish it now
                self._finish_sync(rid, self._recving.pop(rid))
        for engine, remote_rids in meta.heartbeats.items():
            for peer_rid in remote_rids:
                for peer in self._engine_peers.get(engine, ()):
                    try:
                        self.agent.send_notif(peer, peer_rid, b"HB")
                    except HmacoreError as e:
                        logger.warning("heartbeat for %s not sent: %s", peer_rid, e)

    def _finish_sync(self, rid: str, load: _Load) -> None:
        err = None
        for t in load.transfers:        # every READ leaves flight before anything is reported
            try:
                self.agent.wait(t, timeout=self.sync_timeout)
            except TransferError as e:
                err = err or e
        if err is None and not load.failed:
            err = self._await_answers(load)
        if err is not None or load.failed:
            if not load.late and not self._in_flight(load):
                self._abandon(load)          # P's lease still holds: let it free them now
            self._sync_failed(rid, load.recv, err or "a READ failed", load.source)

    def _in_flight(self, load: _Load) -> bool:
        """True while one of the load's READs may still be reading P's blocks."""
        for t in load.transfers:
            try:
                if self.agent.poll(t) == "PROC":
                    return True
            except TransferError:
                pass             # failed: out of flight
        return False

    def _await_answers(self, load: _Load) -> str | None:
        """A sync load's READs are done: wait (at most ``sync_timeout`` s) for the sources'
        answers. Returns why the load failed, or None."""
        deadline = time.monotonic() + self.sync_timeout
        while load.confirm and not load.failed:
            try:
                self.agent.fetch_notifs()
            except TransferError as e:
                return f"answers not read: {e}"
            self._fold_answers(load)
            if load.confirm and not load.failed:
                if time.monotonic() >= deadline:
                    self.counters.add("read_confirm_timeouts")
                    return f"no answer from {sorted(load.confirm)} within {self.sync_timeout} s"
                time.sleep(0.001)
        return "the prefill engine's lease had ended" if load.failed else None

    def _block_report(self, rid: str, rr) -> VllmReport | None:
        """vLLM's restart for a failed load of a one-group model, every block the load fills
        counted failed; None when vLLM cannot be told by block ids (several groups, no
        window-safe landing block, unknown start)."""
        if rr is None or self.layout.num_groups != 1 or rr.start_tokens is None:
            return None
        bs = self.layout.groups[0].block_size
        start, fills = int(rr.start_tokens), [int(b) for b in rr.local_block_ids[0]]
        end = start + int(rr.num_external_tokens)
        n = cdiv(end, bs)
        first, local = n - len(fills), start // bs
        if not fills or first < local:
            return None
        table = [UNKNOWN] * local + [0] * (first - local) + fills
        try:
            rep = plan_vllm_report(self.layout, [table], [(0, i) for i in range(first, n)],
                                   start=start, end=end)
        except HmacoreError as e:     # a hook must not raise: fall back to per request
            logger.warning("no block-level report for %s: %s", rid, e)
            return None
        self.recoveries[rid] = rep
        if len(self.recoveries) > 1024:
            del self.recoveries[next(iter(self.recoveries))]
        return None if rep.per_request else rep

    def _sync_failed(self, rid: str, rr, err, source) -> None:
        """A sync load that failed. vLLM has no per-request path for a sync load (it ignores
        failed_recving of a running request): one group, its blocks go to vLLM as invalid
        (the request restarts at the safe point, or fails alone under ``fail``); several
        groups, or no window-safe landing under ``recompute``, the step must fail (why the
        scheduler warns about sync_load with HMA)."""
        if source is not None:
            self._drop_source(source)
        rep = self._block_report(rid, rr)
        if rep is not None:
            logger.warning("sync KV load of %s failed (%s); vLLM restarts it at token %d",
                           rid, err, rep.lands_at)
            self._invalid_blocks |= rep.block_ids
            return
        if self.layout.num_groups == 1 and not self.recompute and rr is not None \
                and len(rr.local_block_ids[0]):
            # fail policy: any block of the load fails the request alone
            logger.warning("sync KV load of %s failed (%s); its blocks are reported invalid",
                           rid, err)
            self._invalid_blocks.update(int(b) for b in rr.local_block_ids[0])
            return
        raise RuntimeError(f"sync KV load of {rid!r} failed: {err} (vLLM 0.32 cannot restart "
                           "this sync load at a point safe for every group; use async loads)")

    def _async_failed(self, rid: str, rr) -> bool:
        """An async load that failed: block ids when vLLM then keeps the local prefix (a
        restart at 0 frees the request's blocks: failed_recving says the same). True: report
        it in failed_recving."""
        rep = self._block_report(rid, rr)
        if rep is not None and rep.lands_at > 0:
            logger.warning("KV load of %s failed; vLLM restarts it at token %d", rid,
                           rep.lands_at)
            self._invalid_blocks |= rep.block_ids
            return False
        return True

    def take_invalid_blocks(self) -> set[int]:
        """Blocks of failed sync loads since the last call (single-group models)."""
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def _start_read(self, rid: str, rr) -> None:
        """Post this load's READs. Never raises for an async load: any failure (handshake,
        NIXL error, a bug) ends it in failed_recving; a sync load's failure goes to
        :meth:`_sync_failed`."""
        remote = rr.remote
        if remote is None:
            return
        if remote.known_only:     # refused params: no handshake on their word
            peers = self._engine_peers.get(remote.engine_id)
            if peers:
                self._tell_done(remote.request_id, peers)
            else:
                logger.info("request %s: prefill engine %s is not connected; its lease frees "
                            "the blocks", remote.request_id, remote.engine_id)
            return
        posted: list[Transfer] = []
        key = self._key(remote)
        nothing = not any(len(g) for g in rr.local_block_ids)
        src: _Source | None = None
        try:
            src = self._source(remote)
            if nothing:
                for peer in src.peers:                       # nothing to read
                    self.agent.send_notif(peer, remote.request_id, self._done_msg)
                if rr.awaiting:
                    self._done_recving.add(rid)
                return
            if src.regrain is not None:
                self._read_regrain(rr, src, posted)
                local = posted[-1].local_block_ids
            else:
                local, rem = trim_remote_to_local(rr.local_block_ids, remote.block_ids,
                                                  self.layout)
                for peer in src.readers:
                    posted.append(self.agent.read(remote.request_id, peer, local, rem,
                                                  notif=self._read_done_msg))
            for peer in src.peers:
                if peer not in src.readers:
                    self.agent.send_notif(peer, remote.request_id, self._done_msg)
            self._recving[rid] = _Load(posted, source=key, local_ids=tuple(local), recv=rr,
                                       confirm=set(src.readers),
                                       remote_rid=remote.request_id, peers=src.peers)
            c = self.counters
            for t in posted:
                c.add("transfers")
                c.add("transfer_bytes", t.bytes)
                c.add("transfer_descriptors", t.descriptors)
                c.add("transfer_block_descriptors", t.block_descriptors)
                c.add_groups("blocks_moved", [len(ids) for ids in t.local_block_ids])
        except Exception as e:  # noqa: BLE001 - a hook must not raise: report the failure
            if isinstance(e, HmacoreError):
                logger.warning("KV load of %s failed to start: %s", rid, e)
            else:
                logger.exception("KV load of %s failed to start", rid)
            self._drop_source(key)          # the next load handshakes again
            if not nothing:
                self.counters.add("transfer_failures")
            whole = retried = False
            if not posted and not nothing and rr.awaiting:
                whole = self._async_failed(rid, rr)
                retried = whole and rr.retry     # the retry reads P's blocks: keep them
            if not posted and not retried:   # no READ in flight: P may free its blocks now
                peers = src.peers if src is not None else self._refused_peers(e)
                if peers:
                    self._tell_done(remote.request_id, peers)
                    if not nothing:
                        self.counters.add("loads_abandoned")
            if nothing:
                if rr.awaiting:
                    self._done_recving.add(rid)
            elif posted:       # READs already in flight write into our blocks: let them end
                self._recving[rid] = _Load(posted, failed=True, local_ids=tuple(
                    rr.local_block_ids), recv=rr, peers=src.peers if src is not None else ())
                if not rr.awaiting:
                    self._finish_sync(rid, self._recving.pop(rid))
            elif rr.awaiting:
                self._done_recving.add(rid)
                if whole:
                    self._failed_recving.add(rid)
            else:
                self._sync_failed(rid, rr, e, None)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` of this rank since the
        last call."""
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        now = time.monotonic()
        answering = False
        for rid, load in list(self._recving.items()):
            busy = False
            for t in load.transfers:
                try:
                    busy |= self.agent.poll(t) == "PROC"
                except TransferError as e:
                    if not load.failed:
                        logger.warning("KV load of %s failed: %s", rid, e)
                    load.failed = True
            if busy:
                continue
            if load.confirm and not load.failed:
                load.confirm_by = load.confirm_by or now + self.confirm_timeout
                answering = True            # folded below, from this step's notifications
                continue
            self._end_load(rid, load, recving, failed)
        if self._sending or self._late or answering or self._stale_answers:
            try:
                self.agent.fetch_notifs()     # once per step, not once per request
            except TransferError as e:        # leases still end by expiry
                logger.warning("notifications not read this step: %s", e)
            else:
                self._drop_unclaimed(now)
        if answering:
            self._take_answers(now, recving, failed)
        sending = set()
        wall = time.perf_counter()
        for rid, deadline in list(self._sending.items()):
            if self._heard_from_all(rid):
                sending.add(rid)
                del self._sending[rid]
            elif deadline < wall - 1.0:   # the scheduler side frees it; stop watching
                self._lease_ended(rid)
        if self._late or self._stale_answers:
            self._answer_late(now)
        if self._stale_peers:
            self._reap_stale_peers()
        return sending, recving, failed

    def _drop_unclaimed(self, now: float) -> None:
        """Drop queued notifications no tracked request will claim (late messages: a
        ``done`` after the lease ended and its LATE window closed, an answer after the load
        gave up), once older than ``unclaimed_grace_s`` or past :data:`UNCLAIMED_NOTIF_CAP`
        queues. A request this rank tracks keeps its queue whatever its age."""
        n = self.agent.drop_unclaimed_notifs(now - self.unclaimed_grace_s, _Tracked(self),
                                             UNCLAIMED_NOTIF_CAP)
        if n:
            self.counters.add("late_messages_dropped", n)
            logger.info("dropped %d notification(s) no tracked request claimed", n)

    def _end_load(self, rid: str, load: _Load, recving: set[str], failed: set[str]) -> None:
        del self._recving[rid]
        recving.add(rid)
        if load.failed:
            self.counters.add("transfer_failures")
            per_request = self._async_failed(rid, load.recv)
            if per_request:
                failed.add(rid)
            # a per-request failure the scheduler retries reads P's blocks again: keep them
            if not load.late and not (per_request and getattr(load.recv, "retry", False)):
                self._abandon(load)
            if load.confirm_by and load.remote_rid:
                # answers may still come (a late or slow source): drop them when they do
                self._stale_answers[load.remote_rid] = time.monotonic() + self.confirm_timeout
            if load.source is not None and not load.late:
                self._drop_source(load.source)   # reconnect on the next load
            return
        self.counters.add("loads")
        done_at = time.monotonic()      # Transfer.posted_at's clock
        for t in load.transfers:
            if t.posted_at:
                self.counters.add("transfer_seconds", done_at - t.posted_at)

    def _abandon(self, load: _Load) -> None:
        """D: a failed load, none of its READs in flight any more: tell every rank of P
        ``done`` so it frees its blocks now rather than at its lease's end (a failed READ
        carries no ``done``; vLLM recomputes, nobody reads them again). Best effort: a lost
        message leaves the lease to free them."""
        remote = getattr(load.recv, "remote", None)
        if not load.peers or remote is None:
            return
        self._tell_done(remote.request_id, load.peers)
        self.counters.add("loads_abandoned")

    def _tell_done(self, remote_rid: str, peers) -> None:
        """Tell every rank of P this rank is done with ``remote_rid`` (best effort: a lost
        message leaves P's lease to free the blocks)."""
        for peer in peers:
            try:
                self.agent.send_notif(peer, remote_rid, self._done_msg)
            except HmacoreError as e:
                logger.warning("done for %s to %s not sent: %s", remote_rid, peer, e)

    def _refused_peers(self, err: BaseException) -> tuple[str, ...]:
        """P's ranks as notify-only peers when the handshake was refused after every rank of
        P answered (:class:`_Refused`); () otherwise (P unreachable: nothing can be sent).
        They are dropped like a stale source's agents, once the ``done`` has left."""
        payloads = err.payloads if isinstance(err, _Refused) else ()
        if not payloads or any(p.agent_name.endswith(PUSH_AGENT_SUFFIX) for p in payloads):
            return ()       # a push-mode engine holds no pull lease for this request
        names = []
        at = time.monotonic() + STALE_PEER_GRACE_S
        try:
            for p in payloads:
                name = p.agent_name
                if name not in self.agent.peers:
                    name = self.agent.add_notify_peer(p)
                self._stale_peers.setdefault(name, at)
                names.append(name)
        except HmacoreError as e:
            logger.warning("refused prefill engine cannot be told to free: %s", e)
            return ()
        return tuple(names)

    def _take_answers(self, now: float, recving: set[str], failed: set[str]) -> None:
        """D: end the loads whose READs are done once every source answered (any LATE, or
        no answer by ``confirm_timeout``: failed, vLLM's load-failure policy applies)."""
        for rid, load in list(self._recving.items()):
            if not load.confirm_by or load.failed:
                continue
            self._fold_answers(load)
            if load.confirm and not load.failed:
                if now < load.confirm_by:
                    continue
                logger.warning("KV load of %s: no answer from %s within %.1f s; reported "
                               "failed", rid, sorted(load.confirm), self.confirm_timeout)
                self.counters.add("read_confirm_timeouts")
                load.failed = True
            self._end_load(rid, load, recving, failed)

    def _fold_answers(self, load: _Load) -> None:
        """Fold the sources' answers to this load's ``done`` (see :meth:`_answer_done`)."""
        for sender, body in self.agent.notifications_from(load.remote_rid, fetch=False):
            if sender not in load.confirm:
                continue
            if body == ALIVE:
                load.confirm.discard(sender)
            elif body == LATE:
                logger.warning("KV load from %s: the prefill engine's lease on request %s had "
                               "ended when the READ finished (its blocks may have been reused); "
                               "the load is reported failed", sender, load.remote_rid)
                self.counters.add("late_reads")
                load.failed = load.late = True
                load.confirm.clear()
            else:
                logger.warning("unknown answer %r from %s for %s ignored", body, sender,
                               load.remote_rid)

    def _lease_ended(self, rid: str) -> None:
        """P: ``rid``'s blocks are (or may be) freed: a ``done`` that still comes for it is
        answered LATE, for as long as a reader may wait for the answer."""
        self._sending.pop(rid, None)
        self._done_from.pop(rid, None)
        self._late[rid] = time.monotonic() + 2 * self.confirm_timeout

    def _answer_late(self, now: float) -> None:
        for rid, forget_at in list(self._late.items()):
            for sender, m in self.agent.notifications_from(rid, fetch=False):
                if m.endswith(ASK):
                    self._answer(sender, rid, LATE)
            if now > forget_at:
                del self._late[rid]
        for rid, forget_at in list(self._stale_answers.items()):
            self.agent.notifications(rid, fetch=False)
            if now > forget_at:
                del self._stale_answers[rid]

    def _answer(self, sender: str, rid: str, answer: bytes) -> None:
        try:
            self.agent.send_notif(sender, rid, answer)
        except HmacoreError as e:     # the reader is gone or unknown: it fails its load itself
            logger.warning("answer %r for %s to %s not sent: %s", answer, rid, sender, e)

    def _heard_from_all(self, rid: str) -> bool:
        """P: fold this request's new notifications in; True once every D rank said done.
        A READ's ``done`` is answered ALIVE at once: the lease still holds the blocks here,
        and no forward pass can have written into them (a freed block is reused only after
        a step whose metadata carried its expiry, and that step's ``start_load_kv`` ran
        :meth:`_lease_ended` first), so the READ that finished before it read them intact."""
        for sender, m in self.agent.notifications_from(rid, fetch=False):
            if m == b"HB":
                self._renewed.add(rid)
                continue
            who = parse_done(m)
            if who is None:
                logger.warning("unknown notification %r for %s ignored", m, rid)
                continue
            if m.endswith(ASK):
                self._answer(sender, rid, ALIVE)
            rank, size = who
            tp, ranks = self._done_from.setdefault(rid, (size, set()))
            if size != tp:
                logger.warning("request %s: done from a TP-%d rank after TP-%d ones; ignored",
                               rid, size, tp)
                continue
            ranks.add(rank)
        tp_ranks = self._done_from.get(rid)
        if tp_ranks is None or len(tp_ranks[1]) < tp_ranks[0]:
            return False
        del self._done_from[rid]
        return True

    def build_worker_meta(self) -> HmaNixlWorkerMeta | None:
        if not self._renewed:
            return None
        meta, self._renewed = HmaNixlWorkerMeta(renewed=self._renewed), set()
        return meta

    def shutdown(self) -> None:
        from .._roles import close_transport
        close_transport(self)
