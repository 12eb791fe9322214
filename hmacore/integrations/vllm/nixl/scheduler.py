"""Scheduler side of :class:`~hmacore.integrations.vllm.nixl.connector.HmaNixlConnector`.

P/D disaggregation by pull: the prefill node (P) finishes a request, keeps its blocks under a
lease and returns ``kv_transfer_params`` naming them per KV cache group; the decode node (D)
allocates blocks, its worker READs P's blocks, and reports ``finished_recving``.

Units: block tables are per group, in blocks of that group (vLLM group order, null block 0);
token counts are tokens; times are seconds of ``clock`` (``time.perf_counter`` by default).

Contracts kept (vllm-hma.md §1.6, §4.2, §4.7, §4.8):
* ``get_num_new_matched_tokens`` returns the same answer however often it is called (its
  only effect is a per-request hint, the local-hit length, overwritten on every call) and
  returns ``(0, False)``, never ``(0, True)``; P side always 0.
* ``update_state_after_alloc`` receives the request's FULL per-group table, may come twice
  (async loads) and decides on ``num_external_tokens`` (0 = nothing to load); only the first
  call with remote params schedules a load (or, with 0 external tokens, a notify-only entry).
* ``request_finished_all_groups`` is called exactly once per request; P delays the free only
  for a normal finish with blocks, under a lease of ``kv_lease_duration`` seconds, renewed by
  D heartbeats (worker metadata) and expired here: an expired lease is reported to vLLM as
  ``finished_sending`` so the blocks are freed.
* Failures: per request (``failed_recving``), or block ids for one-group models (see
  HmaNixlWorker); vLLM's recompute/fail policy then applies.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ....errors import BlockTableError, ConfigError
from ....regrain import block_size_ratio
from ....spec import GroupKind
from ....tables import as_block_table, count_hashed, fill_blocks, \
    from_wire
from ....transport import DEFAULT_PROGRESS_DELAY_US
from ....transport.nixl_post import POSTINGS
from .. import _compat as C
from .._clip import clip_table
from .._config import NIXL_KEYS, check_keys, flag, number, side_channel, text
from .._metrics import StatsCounter
from ..layout import layout_from_kv_cache_config
from ._regrain import state_bytes
from .metadata import HmaNixlConnectorMetadata, RecvRequest, RemotePeer

logger = C.get_logger(__name__)

__all__ = ["HmaNixlScheduler"]

#: what a block-size remap needs of P's Mamba state (docs/vllm.md, "Mamba state across
#: block sizes"): D reads P's state after exactly the tokens it loads
MAMBA_REMAP_RULE = (
    "a Mamba block holds one state (the state after the tokens up to its position), not token "
    "rows: a remap reads P's state after exactly the tokens D loads, and P keeps one state, "
    "after the remote_num_tokens it computed")

_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class HmaNixlScheduler:
    """Per-request P/D bookkeeping for one engine (scheduler process).

    Args:
        vllm_config: the engine's ``VllmConfig`` (``kv_transfer_config`` must be set).
            ``kv_connector_extra_config`` keys read: ``kv_lease_duration`` (s, default 30),
            ``side_channel_host`` (the address peers are told, default ``"127.0.0.1"``),
            ``side_channel_listen_host`` (where the handshake servers bind, default the
            advertised host; ``0.0.0.0``: every interface), ``side_channel_port`` (default
            5600 + data-parallel index), ``sync_load`` (bool, default False: D loads
            asynchronously, the request waits in WAITING_FOR_REMOTE_KVS; True: the worker
            must finish the read in ``start_load_kv`` before the forward pass),
            ``nixl_progress_delay_us`` (the workers' NIXL progress-thread poll delay, default
            1000; 0 restores NIXL's own thread, which spins a core), ``nixl_posting`` (how
            a transfer's descriptors reach NIXL: ``auto`` (default), ``dynamic``,
            ``prepped`` or ``blocks``; :mod:`hmacore.transport.nixl_post`),
            ``load_retries`` (default 1: loads of a request that failed as a whole, under
            ``kv_load_failure_policy: recompute``, that D starts again from P's blocks before
            it computes the prompt itself; 0: recompute at once).
        kv_cache_config: the scheduler's ``KVCacheConfig``.
        clock: monotonic seconds; injectable for lease tests.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ConfigError("HmaNixlConnector needs vllm_config.kv_transfer_config")
        extra = check_keys(ktc.kv_connector_extra_config, NIXL_KEYS, "HmaNixlConnector")
        # the worker picks its block-level failure report by it (see HmaNixlWorker)
        self.recompute = getattr(ktc, "kv_load_failure_policy", "fail") == "recompute"
        self.layout = layout_from_kv_cache_config(kv_cache_config, vllm_config=vllm_config)
        self.kv_cache_config = kv_cache_config
        self.clock = clock
        self.engine_id = str(ktc.engine_id)
        self.kv_role = str(ktc.kv_role)
        self.is_producer, self.is_consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        self.lease_s = number(extra, "kv_lease_duration", 30.0, positive=True)
        self.heartbeat_s = self.lease_s / 6
        pc = vllm_config.parallel_config
        self.host, self.listen_host = side_channel(extra)
        self.port = number(extra, "side_channel_port",
                           5600 + int(getattr(pc, "data_parallel_index", 0) or 0),
                           integer=True, minimum=1)
        if self.port > 65535:
            raise ConfigError(f"kv_connector_extra_config.side_channel_port must be a TCP port "
                              f"in [1, 65535], got {self.port}")
        self.tp_size = int(pc.tensor_parallel_size)
        self.sync_load = flag(extra, "sync_load", False)
        # A load that fails as a whole (several groups: vLLM 0.32 restarts the request from 0,
        # freeing every block) is started again from P's blocks, which P still holds under its
        # lease: every group is loaded again, none recomputed. Only under recompute (fail ends
        # the request) and only async loads (a sync load's failure is reported by block ids).
        self.load_retries = number(extra, "load_retries", 1, integer=True, minimum=0)
        self._tries: dict[str, int] = {}         # req -> loads retried so far
        self._retry_params: dict[str, dict] = {}  # req -> its params, while a retry is open
        # pair with a prefill engine of other block sizes (hmacore.regrain, docs/vllm.md);
        # false: refused as before the remap existed
        self.block_size_remap = flag(extra, "block_size_remap", True)
        if self.sync_load and self.layout.num_groups > 1:
            logger.warning(
                "sync_load with %d KV cache groups: vLLM 0.32 has no per-request failure path "
                "for synchronous loads of multi-group models (it refuses invalid_block_ids), so "
                "a failed sync load stops the engine; async loads (the default) report "
                "failures per request", self.layout.num_groups)
        # the workers' NIXL progress-thread poll delay (see hmacore.transport.new_nixl_agent;
        # 0: NIXL's own thread, which spins a core)
        self.progress_delay_us = number(extra, "nixl_progress_delay_us",
                                        DEFAULT_PROGRESS_DELAY_US, integer=True, minimum=0)
        posting = text(extra, "nixl_posting", "auto")
        if posting not in POSTINGS:
            raise ConfigError(f"kv_connector_extra_config.nixl_posting must be one of "
                              f"{list(POSTINGS)}, got {posting!r}")
        self.posting = posting
        has_mamba = any(s.kind == GroupKind.MAMBA for s in self.layout.groups)
        # per group the unpadded bytes of one layer's Mamba state (None: not Mamba): P sends
        # them (remote_state_bytes), D's remap requires P's equal to its own at equal TP sizes
        self.state_bytes = state_bytes(kv_cache_config, self.layout)
        self._remap_mamba = [g for g, s in enumerate(self.layout.groups)
                             if s.kind == GroupKind.MAMBA and s.transfer]
        # Tokens D recomputes itself (Mamba needs h(N-1) to derive h(N)); P stops short.
        self.backoff = max(1 if has_mamba else 0, C.prefill_lookahead_tokens(vllm_config) - 1)
        # Pull mode follows no request per step: D reads its table at allocation, P gets its
        # table from request_finished (push mode's follower is in push_scheduler.py).
        # D side
        self._recv_pending: dict[str, RecvRequest] = {}
        self._awaiting: dict[str, tuple[str, str]] = {}   # req -> (P engine, P request id)
        self._local_tokens: dict[str, int] = {}           # req -> local hit (tokens)
        self._last_heartbeat = float("-inf")
        self.failed_recving: set[str] = set()  # loads reported failed, until the request ends
        # P side
        self._leases: dict[str, float] = {}
        self._new_leases: dict[str, float] = {}
        self._expired_pending: set[str] = set()
        self._not_processed: set[str] = set()
        self.counters = StatsCounter()     # vLLM's stats / /metrics (_metrics.py)

    # -- binding --------------------------------------------------------------------------
    # -- helpers ---------------------------------------------------------------------------
    def _remote(self, params: dict, release: bool = False) -> RemotePeer | None:
        """Parse and validate P's params; None (with a warning) if unusable. With
        ``release``, params whose endpoint and layout are sound but whose block lists are
        refused give P's endpoint alone (no block ids): a notify-only entry then tells P to
        free those blocks at once instead of at its lease end; params refused for P's layout
        or endpoint give a ``known_only`` entry (sent only to an engine already connected)."""
        if params.get("transfer_mode", "pull") != "pull":
            logger.warning("kv_transfer_params.transfer_mode is %r but this engine runs "
                           "kv_connector_extra_config.transfer_mode='pull'; no remote load",
                           params.get("transfer_mode"))
            return None
        if not all(params.get(k) is not None for k in _REMOTE_KEYS):
            logger.warning("kv_transfer_params lack %s; no remote load", _REMOTE_KEYS)
            return None
        fp = params.get("hma_layout_fingerprint")
        try:
            p_layout = self._remote_layout(params.get("remote_block_sizes"))
        except (ConfigError, TypeError, ValueError) as e:
            logger.warning("kv_transfer_params.remote_block_sizes rejected (%s); no remote "
                           "load", e)
            return self._known_only(params, release)
        if p_layout is not self.layout and not self.block_size_remap:
            logger.warning("P's block sizes %s differ from ours %s and kv_connector_extra_"
                           "config.block_size_remap is false (remove it to remap); no remote "
                           "load", params.get("remote_block_sizes"),
                           list(self.layout.block_sizes))
            return self._known_only(params, release)
        if p_layout is not self.layout:    # a block-size remap: P says what it agrees on
            fp = params.get("hma_regrain_fingerprint")
            if fp is None:
                logger.warning("P's block sizes %s differ from ours %s and its params carry no "
                               "hma_regrain_fingerprint; no remote load",
                               params.get("remote_block_sizes"), list(self.layout.block_sizes))
                return self._known_only(params, release)
            if fp != self.layout.regrain_fingerprint():
                logger.warning("P's KV layout differs from ours beyond block sizes (regrain "
                               "fingerprint %s vs %s); no remote load", fp,
                               self.layout.regrain_fingerprint())
                return self._known_only(params, release)
            why = self._state_mismatch(params.get("remote_state_bytes"), params.get("tp_size"))
            if why:
                logger.warning("P's block sizes %s differ from ours %s and %s; no remote load",
                               params.get("remote_block_sizes"),
                               list(self.layout.block_sizes), why)
                return self._known_only(params, release)
        elif fp is not None and fp != self.layout.pairing_fingerprint():
            logger.warning("P's KV layout fingerprint %s differs from ours %s (groups, block "
                           "sizes or windows disagree); no remote load", fp,
                           self.layout.pairing_fingerprint())
            return self._known_only(params, release)
        try:
            table = from_wire(params.get("remote_block_ids") or [], self.layout.num_groups)
            self._check_remote(table, params, p_layout)
            first = params.get("remote_block_first")
            if first is not None and (not isinstance(first, list) or len(first) != len(table)
                                      or any(isinstance(f, bool) or not isinstance(f, int)
                                             or f < 0 for f in first)):
                raise ValueError(f"remote_block_first must be one int >= 0 per group, got "
                                 f"{first!r}")
            return RemotePeer(engine_id=str(params["remote_engine_id"]),
                              request_id=str(params["remote_request_id"]),
                              host=str(params["remote_host"]), port=int(params["remote_port"]),
                              block_ids=[[int(x) for x in g] for g in table],
                              num_tokens=int(params.get("remote_num_tokens") or 0),
                              expiry_time=params.get("remote_blocks_expiry_time"),
                              tp_size=int(params.get("tp_size") or 1),
                              block_sizes=None if p_layout is self.layout
                              else list(p_layout.block_sizes),
                              block_first=None if first is None else [int(f) for f in first])
        except (BlockTableError, TypeError, ValueError) as e:
            peer = self._endpoint(params, p_layout) if release and not self._lease_over(
                params) else None
            logger.warning("kv_transfer_params rejected (%s); no remote load%s", e,
                           "; telling P to free its blocks" if peer is not None else "")
            return peer if peer is not None else self._known_only(params, release)

    def _state_mismatch(self, theirs: Any, tp: Any = None) -> str:
        """Why P's Mamba states cannot map onto ours in a remap ('' when they can): P's
        ``remote_state_bytes`` must name, for every moved Mamba group, a state of our bytes
        (pages may be padded differently; the states must be equal). Another TP size (P's
        ``tp_size``): per-rank states differ by construction; the worker's handshake requires
        and compares both sides' state geometry (hmacore.state_tp byte ranges, refused by
        name without one or on a DS/SD mix), so only the params' shape is checked here."""
        if not self._remap_mamba:
            return ""
        if not isinstance(theirs, list) or len(theirs) != self.layout.num_groups:
            return (f"its params carry no remote_state_bytes (one per group; got {theirs!r}): "
                    f"the Mamba states of groups {self._remap_mamba} cannot be checked")
        if (tp or 1) != self.tp_size:
            return ""
        for g in self._remap_mamba:
            if theirs[g] != self.state_bytes[g]:
                return (f"group {g} (Mamba): P's state is {theirs[g]!r} B per layer, ours "
                        f"{self.state_bytes[g]} B (remote_state_bytes); a state maps only onto "
                        "a state of equal bytes (same model, same TP size)")
        return ""

    def _known_only(self, params: dict, release: bool) -> RemotePeer | None:
        """With ``release``, params refused for P's layout or endpoint: a notify-only entry
        the worker sends only through an agent of P's engine id it already holds (these
        params are not trusted for a handshake); None if their lease already ended."""
        if not release or self._lease_over(params):
            return None
        return RemotePeer(engine_id=str(params["remote_engine_id"]),
                          request_id=str(params["remote_request_id"]),
                          host=str(params["remote_host"]), port=0, block_ids=self._empty(),
                          known_only=True)

    @staticmethod
    def _lease_over(params: dict) -> bool:
        """P's lease on these blocks has ended by P's wall clock: P freed them already."""
        expiry = params.get("remote_blocks_expiry_time")
        return (isinstance(expiry, (int, float)) and not isinstance(expiry, bool)
                and time.time() > expiry)

    def _endpoint(self, params: dict, p_layout: Any) -> RemotePeer | None:
        """P's endpoint with no block ids (a notify-only entry), None if the endpoint itself
        does not parse."""
        port, tp = params.get("remote_port"), params.get("tp_size") or 1
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (port, tp)) \
                or not 0 < port < 65536 or tp < 1:
            return None
        return RemotePeer(engine_id=str(params["remote_engine_id"]),
                          request_id=str(params["remote_request_id"]),
                          host=str(params["remote_host"]), port=port, block_ids=self._empty(),
                          tp_size=tp, block_sizes=None if p_layout is self.layout
                          else list(p_layout.block_sizes))

    def _remote_layout(self, sizes: Any):
        """P's layout: ours, or ours with P's block size per group when ``remote_block_sizes``
        differs (a block-size remap, hmacore.regrain; attention sizes must be integer
        multiples of ours; a Mamba group may hold its states at other positions, as vLLM's
        align mode sets its block size to ``--block-size``: the remap maps state to state,
        see :meth:`get_num_new_matched_tokens`). ValueError naming the rule."""
        if sizes is None or list(sizes) == list(self.layout.block_sizes):
            return self.layout
        if not isinstance(sizes, list) or len(sizes) != self.layout.num_groups or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"remote_block_sizes must be one int >= 1 per group, got {sizes!r}")
        groups = []
        for g, (spec, bs) in enumerate(zip(self.layout.groups, sizes)):
            if bs == spec.block_size:
                groups.append(spec)
                continue
            if spec.kind == GroupKind.MAMBA:
                # a state page, padded to P's attention page (which scales with its block size)
                groups.append(dataclasses.replace(
                    spec, block_size=bs, page_bytes=spec.page_bytes * bs // spec.block_size))
                continue
            block_size_ratio(bs, spec.block_size)
            kbs = spec.kernel_block_size
            groups.append(dataclasses.replace(
                spec, block_size=bs, page_bytes=spec.page_bytes * bs // spec.block_size,
                kernel_block_size=None if kbs is None or bs % kbs else kbs))
        # P's hash unit follows P's block sizes (ours may be larger than P's blocks: D 128 / P 64)
        return dataclasses.replace(self.layout, groups=tuple(groups), prefix_match_unit=None)

    def _check_remote(self, table, params: dict, p_layout: Any = None) -> None:
        """What D can check of P's params against its own layout (ValueError naming the
        rule): the lease has not expired (P's wall clock; P frees the blocks then), and with
        ``remote_num_tokens`` n, each group's id count fits n tokens (at most
        cdiv(n, bs) + 1 + speculative slots; a full-attention group exactly covers n, with no
        null block). A forged list that passes reads other in-range blocks of P's pool: the
        params come from the operator's proxy and are trusted that far (docs/vllm.md)."""
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None:
            if isinstance(expiry, bool) or not isinstance(expiry, (int, float)):
                raise ValueError(f"remote_blocks_expiry_time must be a number (P's wall clock, "
                                 f"s), got {expiry!r}")
            if time.time() > expiry:
                raise ValueError(f"P's lease on these blocks expired {time.time() - expiry:.1f} "
                                 "s ago (P has freed them)")
        n = params.get("remote_num_tokens")
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"remote_num_tokens must be an int >= 0, got {n!r}")
        for g, (ids, spec) in enumerate(zip(table, (p_layout or self.layout).groups)):
            need = -(-n // spec.block_size)
            most = need + 1 + (spec.num_speculative_blocks or 0)
            if len(ids) > most:
                raise ValueError(f"group {g}: {len(ids)} block ids for {n} tokens of "
                                 f"{spec.block_size}-token blocks (at most {most})")
            if spec.kind == GroupKind.FULL and spec.transfer and n:
                if len(ids) < need:
                    raise ValueError(f"group {g} (full attention): {len(ids)} block ids cannot "
                                     f"hold {n} tokens of {spec.block_size}-token blocks "
                                     f"(needs {need})")
                if not ids[:need].all():
                    raise ValueError(f"group {g} (full attention): null block id among the "
                                     f"first {need}")

    def _load_window(self, table, hashed, start: int, end: int):
        """Restrict fill candidates to the positions holding tokens ``[start, end)``.

        Attention group g: positions ``[start // bs, cdiv(end, bs))`` (earlier positions are
        the local prefix hit, later ones hold tokens computed this step). Mamba groups keep
        their whole table (the state slot is picked by the clip). For async loads this equals
        vLLM's "unhashed, non-null" set; for sync loads vLLM has already hashed the loaded
        blocks, so the hash flags alone would select nothing.
        """
        out_t, out_h = [], []
        for ids, h, spec in zip(table, hashed, self.layout.groups):
            if spec.kind == GroupKind.MAMBA:
                out_t.append(ids)
                out_h.append(h)
                continue
            first, stop = start // spec.block_size, -(-end // spec.block_size)
            ids = ids[:stop]
            h = h[:stop].copy()
            h[:first] = True
            h[first:] = False
            out_t.append(ids)
            out_h.append(h)
        return tuple(out_t), tuple(out_h)

    def _empty(self) -> list[list[int]]:
        return [[] for _ in range(self.layout.num_groups)]

    # -- scheduler hooks ----------------------------------------------------------------------
    def _enforce_role(self, request: Any, params: dict) -> None:
        """A request asking this engine for a role its ``kv_role`` does not have (a decode
        request on a ``kv_producer``, a prefill-for-decode request on a ``kv_consumer``) runs
        as a plain request, with a warning: a mis-routed request must not hold blocks under a
        lease nobody reads, nor wait for a load nobody serves."""
        for param, allowed, role in (("do_remote_prefill", self.is_consumer, "kv_consumer"),
                                    ("do_remote_decode", self.is_producer, "kv_producer")):
            if params.get(param) and not allowed:
                params[param] = False
                logger.warning("request %s asks for %s but this engine's kv_role is %s (not "
                               "%s or kv_both); it runs without KV transfer",
                               request.request_id, param, self.kv_role, role)

    def on_new_request(self, request: Any) -> None:
        """Enforce this engine's kv_role; P side: drop the trailing ``backoff`` prompt tokens
        D will recompute (once)."""
        params = request.kv_transfer_params
        if params:
            self._enforce_role(request, params)
        if params and params.get("do_remote_decode") and self.backoff \
                and not params.get("_hma_p_truncated"):
            if C.truncate_prompt(request, self.backoff):
                params["_hma_p_truncated"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """D side: prompt tokens (less ``backoff``) beyond ``num_computed_tokens`` to pull,
        asynchronously unless ``sync_load``; ``(0, False)`` otherwise (P side, no params,
        nothing left, bad params).
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = self._remote(params)
        if remote is None:
            return 0, False
        # Where the load starts (tokens); update_state_after_alloc needs it for sync loads,
        # whose loaded blocks vLLM already hashed at allocation. Overwritten on every call.
        self._local_tokens[request.request_id] = int(num_computed_tokens)
        n = C.prompt_len(request)
        if self.backoff and n > self.backoff:
            n -= self.backoff
        if self.sync_load:
            # A sync load is computed-on-arrival: leave >= 1 prompt token for the forward pass
            # (async loads get this from vLLM's finished_recving path instead).
            n = min(n, C.prompt_len(request) - 1)
        if remote.block_sizes is not None and self._remap_mamba:
            n = self._state_point(request, remote, n)
        count = n - num_computed_tokens
        return (count, not self.sync_load) if count > 0 else (0, False)

    def _state_point(self, request: Any, remote: RemotePeer, n: int) -> int:
        """A remap with Mamba groups: where D's load may end. P keeps one state, after the
        ``remote_num_tokens`` s it computed (its running-state slot, at P's table position
        ``cdiv(s, P's bs) - 1``); D's slot for the state after its load's end e sits at
        ``cdiv(e, D's bs) - 1``. So the load ends at s: at n = s as planned (P computed the
        prompt less the same backoff), fewer external tokens when s < n (D computes the rest
        itself), none when s > n or unknown (no P state where D needs one; logged)."""
        s = remote.num_tokens
        if s <= 0 or s > n:
            logger.warning("request %s: P keeps its Mamba state after %s tokens and D's load "
                           "would end at %d; %s, so none is at D's point; no remote load",
                           request.request_id, s or "an unknown number of", n,
                           MAMBA_REMAP_RULE)
            return 0
        return s

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Schedule the D-side load on the first call with params (P: nothing to do; its
        table comes with request_finished)."""
        params = request.kv_transfer_params
        if not params or params.get("do_remote_decode") or not params.get("do_remote_prefill"):
            return  # P, a plain request, a second call of an async load or a handled D request
        rid = request.request_id
        table, hashed = C.table_and_hashed(blocks)
        remote = self._remote(params, release=True)
        if remote is not None:
            computed = count_hashed(table, hashed)
            start = self._local_tokens.pop(rid, None)
            if num_external_tokens > 0:
                if start is not None:
                    table, hashed = self._load_window(table, hashed, start,
                                                      start + int(num_external_tokens))
                local = clip_table(fill_blocks(table, hashed), self.layout)
                # each list is a suffix of its (load-windowed) table: where it starts
                first = tuple(len(t) - len(x) for t, x in zip(table, local))
                if not self.sync_load:  # a sync load completes inside the step
                    self._awaiting[rid] = (remote.engine_id, remote.request_id)
                    if self.recompute and self._tries.get(rid, 0) < self.load_retries:
                        self._retry_params[rid] = params
            else:  # full local prefix hit: nothing to read, only let P free its blocks
                local = self._empty()
                first = ()
            self._recv_pending[rid] = RecvRequest(
                request_id=rid, local_block_ids=local,
                local_num_computed_blocks=computed, remote=remote,
                awaiting=num_external_tokens > 0 and not self.sync_load,
                num_external_tokens=int(num_external_tokens),
                start_tokens=None if start is None else int(start),
                load_start=int(start or 0), local_first=first,
                retry=rid in self._retry_params)
        params["do_remote_prefill"] = False
        params["_hma_remote_processed"] = True

    def build_connector_meta(self, scheduler_output: Any) -> HmaNixlConnectorMetadata:
        """This step's metadata; resets the per-step state."""
        now = self.clock()
        meta = HmaNixlConnectorMetadata(scheduler_clock=now)
        meta.reqs_to_recv, self._recv_pending = self._recv_pending, {}
        meta.reqs_to_send, self._new_leases = self._new_leases, {}
        meta.expired, self._expired_pending = self._expired_pending, set()
        meta.reqs_not_processed, self._not_processed = self._not_processed, set()
        if self._awaiting and now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            for engine, remote_rid in self._awaiting.values():
                meta.heartbeats.setdefault(engine, []).append(remote_rid)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Fold the workers' report: finished/failed loads, lease renewals, finished sends;
        expire leases (expired requests are added to ``finished_sending`` so vLLM frees
        their blocks; a later worker report for them is dropped)."""
        self._fold_loads(connector_output)
        now = self.clock()
        wmeta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid in getattr(wmeta, "renewed", None) or ():
            if self._leases.pop(rid, None) is not None:    # re-inserted: see _expire_leases
                self._leases[rid] = self._new_leases[rid] = now + self.lease_s
        sending = set()
        for rid in connector_output.finished_sending or ():
            if self._leases.pop(rid, None) is not None:
                sending.add(rid)
                self._new_leases.pop(rid, None)
            else:
                logger.warning("finished_sending for %s, which holds no lease; ignored", rid)
        self._expire_leases(now, sending)
        connector_output.finished_sending = sending or None

    def _fold_loads(self, connector_output: Any) -> None:
        """D side of a worker report: loads finished or failed (both end the wait)."""
        for rid in connector_output.finished_recving or ():
            self._awaiting.pop(rid, None)
        for rid in connector_output.failed_recving or ():
            self._awaiting.pop(rid, None)
            self.failed_recving.add(rid)
            params = self._retry_params.pop(rid, None)
            if params is not None:
                # vLLM (recompute) restarts the request from 0 and asks us again: load it again
                # (the worker did not tell P to free; P's lease still holds its blocks)
                self._tries[rid] = self._tries.get(rid, 0) + 1
                params["do_remote_prefill"] = True
                params.pop("_hma_remote_processed", None)
                self.counters.add("load_retries")
                logger.warning("KV load of %s failed as a whole; loading it again from the "
                               "prefill engine (retry %d of %d)", rid, self._tries[rid],
                               self.load_retries)
        for rid in connector_output.finished_recving or ():
            self._retry_params.pop(rid, None)     # done (a failed one was handled above)

    def report_due(self, now: float) -> bool:
        """True when :meth:`update_connector_output` has a deadline to enforce by ``now``:
        P side, the earliest lease ended (``_leases`` is in deadline order, see
        :meth:`_expire_leases`)."""
        leases = self._leases
        return bool(leases) and next(iter(leases.values())) <= now

    def _expire_leases(self, now: float, sending: set[str]) -> None:
        """P side: every lease whose deadline (clock seconds) is ``<= now`` ends; its request
        joins ``sending`` (vLLM then frees the blocks) and a later worker report is dropped.

        Every lease is (re)inserted with deadline ``clock() + lease_s`` (a renewal deletes it
        first), so with a monotonic clock ``_leases`` is in deadline order: the walk stops at
        the first lease still running (work per step: the expired leases plus one)."""
        leases = self._leases
        while leases:
            rid, deadline = next(iter(leases.items()))
            if deadline > now:
                break
            del leases[rid]
            self._new_leases.pop(rid, None)
            self._expired_pending.add(rid)
            sending.add(rid)
            self.counters.add("lease_expiries")
            logger.warning("lease of %s expired after %.1f s; freeing its blocks", rid,
                           self.lease_s)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Called exactly once, before the blocks are freed, with one id list per group.

        P side (``do_remote_decode``), normal finish with blocks: keep them under a lease and
        return ``kv_transfer_params`` whose ``remote_block_ids`` is one list per group,
        clipped to the window / state slot. Abort: forget (``reqs_not_processed``). D side
        aborted before scheduling: queue a notify-only entry so P frees its blocks.
        """
        params = request.kv_transfer_params
        rid = request.request_id
        self._local_tokens.pop(rid, None)
        self.failed_recving.discard(rid)
        self._tries.pop(rid, None)
        self._retry_params.pop(rid, None)
        if not params:
            return False, None
        self._awaiting.pop(rid, None)
        if params.get("do_remote_prefill"):
            remote = self._remote(params, release=True)
            params["do_remote_prefill"] = False
            if remote is not None:
                self._recv_pending[rid] = RecvRequest(
                    request_id=rid, local_block_ids=self._empty(),
                    local_num_computed_blocks=(0,) * self.layout.num_groups, remote=remote,
                    awaiting=False)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not C.finished_normally(request):
            self._not_processed.add(rid)
            return False, None
        table = as_block_table(block_ids, self.layout.num_groups, name="block_ids")
        delay = any(len(g) for g in table)
        expiry = None
        if delay:
            self._leases[rid] = self._new_leases[rid] = self.clock() + self.lease_s
            expiry = time.time() + self.lease_s     # for D: wall clock, comparable there
        clipped = clip_table(table, self.layout) if delay else self._empty()
        if delay:    # what window / state clipping spares the decode side from reading
            self.counters.add_groups("blocks_clipped", [
                len(t) - len(c) if s.transfer else 0
                for t, c, s in zip(table, clipped, self.layout.groups)])
        return delay, dict(
            do_remote_prefill=True, do_remote_decode=False,
            remote_block_ids=clipped,
            remote_engine_id=self.engine_id, remote_request_id=rid,
            remote_host=self.host, remote_port=self.port, tp_size=self.tp_size,
            remote_num_tokens=int(request.num_computed_tokens),
            remote_block_sizes=list(self.layout.block_sizes),
            remote_block_first=[len(t) - len(c) for t, c in zip(table, clipped)],
            remote_state_bytes=list(self.state_bytes),
            remote_blocks_expiry_time=expiry,
            hma_layout_fingerprint=self.layout.pairing_fingerprint(),
            hma_regrain_fingerprint=self.layout.regrain_fingerprint())

    # -- queries ---------------------------------------------------------------------------
    def has_pending_block_frees(self) -> bool:
        """True while some P-side request holds blocks under a lease."""
        return bool(self._leases)

    def leases(self) -> dict[str, float]:
        """Request id -> lease deadline (seconds of ``clock``); a copy."""
        return dict(self._leases)

    def awaiting(self) -> set[str]:
        """D-side requests whose load is in flight."""
        return set(self._awaiting)
