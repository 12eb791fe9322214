"""Scheduler side of :class:`HmaNixlConnector` in layer-wise push mode (decode first).

The proxy sends the request to D first (``kv_transfer_params``: ``do_remote_prefill``,
``transfer_mode="push"``, ``push_id``, ``remote_host``/``remote_port`` = P's side channel) and to
P (``do_remote_decode``, ``transfer_mode="push"``, the same ``push_id``, ``max_tokens=1``).

D: :meth:`get_num_new_matched_tokens` answers an async load of the prompt (tokens);
:meth:`update_state_after_alloc` queues a :class:`PushRegistration` (D's positional per-group
table) for D's worker, which sends it to P and waits for P's per-layer WRITEs.

P: a push request whose registration has not reached P's scheduler yet is held
(``get_num_new_matched_tokens`` returns ``None``: ask again next step) for at most
``push_register_timeout`` seconds, then runs without push and every worker is told to abort
it (ranks holding registrations tell those decode ranks it failed; D then recomputes). With
TP > 1 a push counts as registered once every prefill rank reported it
(``HmaPushWorkerMeta.registered``: push id -> the reporting ranks; a rank reports once all
decode ranks it writes to registered; D's table never reaches the scheduler). Once
registered, every step's metadata carries a :class:`PushSave` per scheduled push request:
the tokens that become computed in this step (all tokens up to the step's end in
the first pushed step, so a local prefix hit on P is pushed too) and vLLM's new block ids of
the request, by reference. P's scheduler follows no block table: P's worker follows its own
and pairs it with D's registration (design (b) of issue 15). ``request_finished`` keeps the
blocks (returns True) until the worker reports the push ended (``finished_sending``), or the
lease (``kv_lease_duration`` s) expires. A decode engine of other block sizes gets its
steps planned in token ranges instead of block pairs, by P's worker alone (``PushSave.regrain``,
from D's block sizes, first token and token count in D's registration).

Units: tokens, blocks of each group (positional tables), seconds of ``clock``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ....errors import BlockTableError, ConfigError
from .._config import number
from .. import _compat as C
from .._clip import clip_table
from .scheduler import HmaNixlScheduler
from .push_metadata import (TRANSFER_MODES, HmaPushConnectorMetadata, PushRegistration,
                            PushSave, check_push_id)

logger = C.get_logger(__name__)

__all__ = ["HmaPushScheduler", "transfer_mode"]


def transfer_mode(vllm_config: Any) -> str:
    """``kv_connector_extra_config.transfer_mode``: ``"pull"`` (default) or ``"push"``;
    anything else raises ConfigError naming the field."""
    ktc = vllm_config.kv_transfer_config
    mode = "pull" if ktc is None else ktc.get_from_extra_config("transfer_mode", "pull")
    if mode not in TRANSFER_MODES:
        raise ConfigError(f"kv_connector_extra_config.transfer_mode must be one of "
                          f"{TRANSFER_MODES}, got {mode!r}")
    return mode


class HmaPushScheduler(HmaNixlScheduler):
    """Push-mode bookkeeping of one engine (scheduler process); see the module docstring.

    Extra ``kv_connector_extra_config`` keys: ``push_register_timeout`` (P: seconds a push
    request waits for D's registration, default 30), ``push_recv_timeout`` (D: seconds from
    registration until every layer must have arrived, default 60; read by the worker),
    ``push_cancel_ack_timeout`` (D: seconds the blocks of a cancelled push stay pinned while
    the prefill side has not answered the cancel, default 60; read by the worker).
    Refused (ValueError): ``sync_load`` true. Mamba groups register one state slot (the block
    holding the state after the loaded tokens; P computes the prompt less the backoff token);
    at TP > 1 what a pair of engines cannot move is refused per decode peer by P's worker
    (:meth:`~.push_prefill.PrefillSide._mamba_tp_why`), not here.

    P's scheduler follows no block table: each step's :class:`PushSave` carries the token
    span and vLLM's new ids of each pushing request, and P's worker follows its own sparse
    table and pairs it with D's registration (:class:`~.push_worker.HmaPushWorker`).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(vllm_config, kv_cache_config, clock=clock)
        ktc = vllm_config.kv_transfer_config
        if self.sync_load:
            raise ConfigError("kv_connector_extra_config.sync_load must be false with "
                             "transfer_mode='push' (pushed KV arrives asynchronously)")
        extra = dict(ktc.kv_connector_extra_config or {})
        self.register_timeout = number(extra, "push_register_timeout", 30.0, positive=True)
        self.recv_timeout = number(extra, "push_recv_timeout", 60.0, positive=True)
        self.cancel_ack_timeout = number(extra, "push_cancel_ack_timeout", 60.0, positive=True)
        # D side
        self._regs_pending: dict[str, PushRegistration] = {}
        # request id -> the block ids its registration lets P write (kept until the worker
        # reports the request's load ended: a cancelled push pins them, see _hold)
        self._reg_blocks: dict[str, list[int]] = {}
        self._pins: dict[tuple[str, int], list[Any]] = {}   # (request id, D rank) -> blocks
        self._block_pool: Any = None
        # P side
        self._push_reqs: dict[str, tuple[Any, str]] = {}   # rid -> (Request, push id)
        self._hold_since: dict[str, float] = {}
        # push ids every rank of this engine reported registered. D's table and any block-size
        # remap stay on the workers, which plan the steps: the scheduler needs only the id
        self._registered: set[str] = set()
        self._claimed: set[str] = set()                    # push ids of this engine's requests
        # complete registrations no request claimed yet: push id -> arrival (clock s), in
        # arrival order (the stale sweep stops at the first fresh one)
        self._unclaimed_at: dict[str, float] = {}
        # push id -> (P ranks that reported it, first report): not all ranks yet
        self._reg_partial: dict[str, tuple[set[int], float]] = {}
        self._unpushed: set[str] = set()                   # registration timed out / bad
        self._push_steps: dict[str, int] = {}              # rid -> steps pushed so far
        self._push_ended: set[str] = set()                 # worker reported the push over
        self._aborts: set[str] = set()
        # push ids whose decode side cancelled before P's request came (insertion order,
        # bounded like the workers' record of ended pushes): that request prefills at once
        self._withdrawn: dict[str, None] = {}

    # -- params ---------------------------------------------------------------------------
    def _push_params(self, params: dict, *, decode_side: bool) -> dict | None:
        """Validated push fields of a request's ``kv_transfer_params``; None (with a warning
        naming the field and the rule) when unusable: the request then runs without transfer."""
        try:
            mode = params.get("transfer_mode", "pull")
            if mode != "push":
                raise ValueError(f"kv_transfer_params.transfer_mode is {mode!r} but this engine "
                                 "runs kv_connector_extra_config.transfer_mode='push' (both "
                                 "engines and the proxy must agree)")
            out = {"push_id": check_push_id(params.get("push_id"))}
            if decode_side:
                host, port = params.get("remote_host"), params.get("remote_port")
                if not isinstance(host, str) or not host:
                    raise ValueError(f"kv_transfer_params.remote_host must be P's side-channel "
                                     f"host (non-empty string), got {host!r}")
                if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                    raise ValueError(f"kv_transfer_params.remote_port must be an int in "
                                     f"[1, 65535], got {port!r}")
                out.update(host=host, port=port)
            return out
        except ValueError as e:
            logger.warning("%s; the request runs without KV transfer", e)
            return None

    def _is_push_producer(self, request: Any) -> str | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return None
        rid = request.request_id
        if rid in self._push_reqs:
            return self._push_reqs[rid][1]
        if rid in self._unpushed:        # refused once (bad params, a withdrawn push): final
            return None
        pp = self._push_params(params, decode_side=False)
        if pp is None:
            self._unpushed.add(rid)
            return None
        if pp["push_id"] in self._withdrawn:
            logger.warning("push %s of %s: withdrawn before this request came (the decode "
                           "engine cancelled it, or its registration was refused); "
                           "prefilling without push", pp["push_id"], rid)
            self._unpushed.add(rid)
            return None
        self._push_reqs[rid] = (request, pp["push_id"])
        self._claimed.add(pp["push_id"])
        self._unclaimed_at.pop(pp["push_id"], None)
        return pp["push_id"]

    # -- scheduler hooks ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        """D: ``(prompt tokens beyond num_computed_tokens, True)`` (async load). P: ``(0,
        False)`` once D registered, ``(None, False)`` while waiting for it (bounded)."""
        params = request.kv_transfer_params
        if not params:
            return 0, False
        rid = request.request_id
        if params.get("do_remote_decode"):
            pid = self._is_push_producer(request)
            if pid is None or pid in self._registered or rid in self._unpushed:
                return 0, False
            now = self.clock()
            first = self._hold_since.setdefault(rid, now)
            if now - first < self.register_timeout:
                return None, False
            partial = self._reg_partial.pop(pid, None)
            logger.warning("push %s: no %sregistration from the decode engine within %.1f s; "
                           "prefilling without push", pid,
                           f"complete (prefill ranks {sorted(partial[0])} of TP {self.tp_size} "
                           "reported it) " if partial else "", self.register_timeout)
            # every worker forgets the push: ranks holding registrations tell those D ranks
            # it failed, a registration arriving later is answered the same way at once
            self._aborts.add(pid)
            self._unpushed.add(rid)
            return 0, False
        if not params.get("do_remote_prefill"):
            return 0, False
        if self._push_params(params, decode_side=True) is None:
            return 0, False
        self._local_tokens[rid] = int(num_computed_tokens)
        n = C.prompt_len(request)
        if self.backoff and n > self.backoff:
            n -= self.backoff
        count = n - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """P: track a push request's table (its steps push their new blocks); D: queue the
        registration (first call with params)."""
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            if self._is_push_producer(request) is not None:
                # its steps go to the worker from its first scheduled one (full table)
                self._pushing[request.request_id] = None
            return
        if not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        table, hashed = C.table_and_hashed(blocks)
        pp = self._push_params(params, decode_side=True)
        if pp is not None:
            start = self._local_tokens.pop(rid, 0)
            end = start + max(0, int(num_external_tokens))
            awaiting = num_external_tokens > 0
            ids = self._positions(table, hashed, start, end) if awaiting else \
                [[] for _ in self.layout.groups]
            self._regs_pending[rid] = PushRegistration(
                request_id=rid, push_id=pp["push_id"], host=pp["host"], port=pp["port"],
                block_ids=ids, num_tokens=end, awaiting=awaiting, start_tokens=start)
            if awaiting:
                self._awaiting[rid] = ("", pp["push_id"])
                self._reg_blocks[rid] = [int(b) for g in ids for b in g if b]
        params["do_remote_prefill"] = False
        params["_hma_remote_processed"] = True

    def _positions(self, table, hashed, start: int, end: int) -> list[list[int]]:
        """D's positional table for tokens ``[start, end)``: positions ``< start // bs`` (local
        hit), hashed, null or outside the window clip become 0."""
        sliced = [ids[:-(-end // spec.block_size)] for ids, spec in zip(table, self.layout.groups)]
        clipped = clip_table(sliced, self.layout)
        out = []
        for ids, h, keep, spec in zip(sliced, hashed, clipped, self.layout.groups):
            lo = max(start // spec.block_size, len(ids) - len(keep))
            pos = np.where(h[:len(ids)], 0, ids)     # hashed positions: D's local hit
            pos[:lo] = 0
            out.append(pos.tolist())
        return out

    def build_connector_meta(self, scheduler_output: Any) -> HmaPushConnectorMetadata:
        """This step's metadata: D registrations, P per-request WRITE ranges, expiries."""
        now = self.clock()
        meta = HmaPushConnectorMetadata(scheduler_clock=now)
        meta.push_saves = self._push_plan(scheduler_output)
        meta.push_regs, self._regs_pending = self._regs_pending, {}
        meta.reqs_to_send, self._new_leases = self._new_leases, {}
        meta.expired, self._expired_pending = self._expired_pending, set()
        meta.push_aborts, self._aborts = self._aborts, set()
        return meta

    def _push_plan(self, scheduler_output: Any) -> dict[str, PushSave]:
        """P: one :class:`PushSave` per scheduled push request: the step's token span and
        vLLM's new block ids of the request as vLLM handed them (by reference; the whole
        table when ``full``: its first scheduled step, or resumed after a preemption). P's
        worker follows its own table from them and pairs it with D's registration, which it
        holds (design (b) of issue 15): the work here is finding the pushing requests'
        entries in the scheduler output and their spans, never a table or a block."""
        pushing = self._pushing
        if not pushing:
            return {}
        saves: dict[str, PushSave] = {}
        num_sched = scheduler_output.num_scheduled_tokens
        push_reqs, registered, steps = self._push_reqs, self._registered, self._push_steps
        unpushed, ended = self._unpushed, self._push_ended
        for rid, ids, full in C.scheduled_entries(scheduler_output, list(pushing)):
            entry = push_reqs.get(rid)
            if entry is None or rid in unpushed or rid in ended:
                pushing.pop(rid, None)
                continue
            request, pid = entry
            if pid not in registered:     # (held until registered: not reached in practice)
                self._give_up_push(rid, BlockTableError("scheduled without a registration"))
                continue
            total = request.num_prompt_tokens
            step = steps.get(rid, 0)
            computed = request.num_computed_tokens
            # tokens [start, end): every position up to the step's end in its first pushed
            # step, so a local prefix hit on P is pushed too
            start = 0 if step == 0 else computed
            end = min(computed + num_sched[rid], total)
            final = end >= total
            saves[rid] = PushSave(request_id=rid, push_id=pid, step=step, final=final,
                                  start=start, end=end, new_block_ids=ids, full=full)
            steps[rid] = step + 1
            if final:           # the prompt's last push: nothing more to send for it
                del pushing[rid]
        return saves

    @property
    def _pushing(self) -> dict[str, None]:
        """P: push requests whose steps still go to the worker (from their allocation until
        their final step, a give-up or the end of the request), in arrival order."""
        return self.__dict__.setdefault("_pushing_reqs", {})

    def _unfollow(self, rid: str) -> None:
        self._pushing.pop(rid, None)

    def _give_up_push(self, rid: str, err: Exception) -> None:
        """A push request whose step cannot be paired: it runs on without push (its blocks
        are not held for it), and the workers tell the decode engine the push failed."""
        pid = self._push_reqs[rid][1]
        logger.warning("push %s of %s: %s; prefilling without push (the decode engine is "
                       "told the push failed)", pid, rid, err)
        self._unpushed.add(rid)
        self._aborts.add(pid)
        self._pushing.pop(rid, None)

    def update_connector_output(self, connector_output: Any) -> None:
        """Fold the workers' report: D loads finished/failed; P registrations, pushes ended
        (only requests P holds become ``finished_sending``), lease expiry."""
        wmeta = getattr(connector_output, "kv_connector_worker_meta", None)
        holding = getattr(wmeta, "holding", None)
        released = getattr(wmeta, "released", None)
        if not (connector_output.finished_sending or connector_output.finished_recving
                or connector_output.failed_recving or getattr(wmeta, "registered", None)
                or holding or released or self._leases or self._reg_partial
                or getattr(wmeta, "withdrawn", None)):
            # the common step: nothing reported, no lease to expire
            if self._unclaimed_at:
                self._drop_stale_registrations(self.clock())
            connector_output.finished_sending = None
            return
        # before the loads are folded: vLLM frees a failed request's blocks after this call
        self._hold(holding or {}, released or {})
        for rid in connector_output.finished_recving or ():
            self._reg_blocks.pop(rid, None)
        self._fold_loads(connector_output)
        for pid, by in (getattr(wmeta, "registered", None) or {}).items():
            ranks, first = self._reg_partial.get(pid) or (set(), self.clock())
            ranks.update(int(r) for r in by)
            if ranks >= set(range(self.tp_size)):    # every prefill rank has its consumers
                self._reg_partial.pop(pid, None)
                self._registered.add(pid)
                if pid not in self._claimed:
                    self._unclaimed_at[pid] = self.clock()
            else:
                self._reg_partial[pid] = (ranks, first)
        self._withdraw(getattr(wmeta, "withdrawn", None) or ())
        now = self.clock()
        self._drop_stale_registrations(now)
        sending = set()
        for rid in connector_output.finished_sending or ():
            if self._leases.pop(rid, None) is not None:
                self._new_leases.pop(rid, None)
                sending.add(rid)
            elif rid in self._push_reqs:
                self._push_ended.add(rid)        # ended (failed) before the request finished
        self._expire_leases(now, sending)
        connector_output.finished_sending = sending or None

    def _withdraw(self, pids: Any) -> None:
        """Registrations the decode side cancelled before any WRITE (its deadline passed while
        P's request had not come) or a worker refused (Mamba states of other bytes):
        forgotten, so a request that comes later prefills without push, and one that claimed
        it but has not pushed yet prefills without push at once. One already pushing stays:
        its workers end that push (``finished_sending``, nothing held). Work: one scan of the
        push requests per withdrawn claimed registration (rare)."""
        for pid in pids:
            if pid in self._claimed:
                rid = next((r for r, (_, q) in self._push_reqs.items() if q == pid), None)
                if rid is None or self._push_steps.get(rid, 0) > 0:
                    continue
                self._unpushed.add(rid)
                self._pushing.pop(rid, None)
                logger.warning("push %s of %s: withdrawn before its first step (the decode "
                               "engine cancelled it, or its registration was refused); "
                               "prefilling without push", pid, rid)
            else:
                self._withdrawn[pid] = None
                while len(self._withdrawn) > 4096:
                    del self._withdrawn[next(iter(self._withdrawn))]
            self._registered.discard(pid)
            self._reg_partial.pop(pid, None)
            self._unclaimed_at.pop(pid, None)

    def report_due(self, now: float) -> bool:
        """Also a registration unclaimed past ``kv_lease_duration`` (dropped in
        :meth:`_drop_stale_registrations`, which an idle engine's empty report never
        reaches; see ``HmaNixlConnector.build_connector_meta``)."""
        if super().report_due(now):
            return True
        first = next(iter(self._unclaimed_at.values()), None)    # in registration order
        return (first is not None and now - first > self.lease_s) or any(
            now - t > self.lease_s for _, t in self._reg_partial.values())

    def _drop_stale_registrations(self, now: float) -> None:
        """A registration no request of this engine claimed within ``kv_lease_duration``
        seconds (P's request never came, or was refused) is forgotten. Work per step: the
        stale entries plus one (partial registrations last only until every rank reported)."""
        if self._reg_partial:
            for pid, (_, t) in list(self._reg_partial.items()):
                if pid not in self._claimed and now - t > self.lease_s:
                    del self._reg_partial[pid]
        while self._unclaimed_at:
            pid, t = next(iter(self._unclaimed_at.items()))
            if now - t <= self.lease_s:
                break
            del self._unclaimed_at[pid]
            self._registered.discard(pid)
            self._aborts.add(pid)     # the workers tell the decode engine, which stops waiting
            logger.warning("push %s: registration unclaimed for %.1f s; dropped (the decode "
                           "engine is told the push failed)", pid, self.lease_s)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """P: hold the blocks (True) while a registered push may still be writing from them;
        an abort also tells the worker to stop. D and everything else: False (for a D request
        aborted while its push is awaited vLLM itself keeps the blocks until the worker
        reports it in ``finished_recving``)."""
        rid = request.request_id
        self._unfollow(rid)
        self._local_tokens.pop(rid, None)
        self._awaiting.pop(rid, None)
        # a queued registration stays queued: vLLM keeps an aborted WAITING_FOR_REMOTE_KVS
        # request's blocks until the worker reports it (pushed, failed or past its deadline)
        self.failed_recving.discard(rid)
        self._hold_since.pop(rid, None)
        pushed = self._push_steps.pop(rid, 0) > 0
        entry = self._push_reqs.pop(rid, None)
        unpushed = rid in self._unpushed
        self._unpushed.discard(rid)
        ended = rid in self._push_ended
        self._push_ended.discard(rid)
        if entry is None:
            return False, None
        pid = entry[1]
        registered = pid in self._registered
        self._registered.discard(pid)
        self._claimed.discard(pid)
        self._unclaimed_at.pop(pid, None)
        if self._reg_partial.pop(pid, None) is not None:
            self._aborts.add(pid)        # some ranks hold registrations: they tell D
        if unpushed or not registered or ended:
            return False, None
        has_blocks = any(len(g) for g in block_ids)
        if not C.finished_normally(request):
            self._aborts.add(pid)        # the worker stops and tells D the push failed
            if not pushed or not has_blocks:
                return False, None       # no WRITE was ever posted from these blocks
        if not has_blocks:
            return False, None
        self._leases[rid] = self._new_leases[rid] = self.clock() + self.lease_s
        return True, None

    def bind_block_pool(self, block_pool: Any) -> None:
        """D: vLLM's block pool (``bind_gpu_block_pool``), where cancelled pushes pin blocks."""
        self._block_pool = block_pool

    def _hold(self, holding: dict[str, list[int]], released: dict[str, list[int]]) -> None:
        """D: pin the registered blocks of each push a decode rank cancelled (one reference
        per rank in vLLM's block pool, so freeing the request does not return them to the
        free queue) and unpin them when that rank's hold ended (prefill acknowledged, found
        dead, or ``push_cancel_ack_timeout``). The request itself fails at once."""
        for rid, ranks in holding.items():
            ids = self._reg_blocks.get(rid)
            if not ids:
                continue
            if self._block_pool is None:
                logger.warning("push of %s cancelled but vLLM bound no block pool to the "
                               "connector: its blocks are freed with the request (a late "
                               "WRITE may land in a reused block)", rid)
                continue
            for rank in ranks:
                if (rid, rank) not in self._pins:
                    blocks = [self._block_pool.blocks[b] for b in ids]
                    self._block_pool.touch(blocks)
                    self._pins[(rid, rank)] = blocks
        for rid, ranks in released.items():
            for rank in ranks:
                blocks = self._pins.pop((rid, rank), None)
                if blocks is not None:
                    self._block_pool.free_blocks(blocks)

    def held_blocks(self) -> set[int]:
        """D: ids of the blocks pinned for cancelled pushes."""
        return {b.block_id for blocks in self._pins.values() for b in blocks}

    def has_pending_block_frees(self) -> bool:
        """P: leases held; D: blocks pinned for cancelled pushes (released soon)."""
        return bool(self._pins) or super().has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """D: keep the engine stepping while blocks are pinned, so the release arrives."""
        return bool(self._pins)

    # -- queries ---------------------------------------------------------------------------
    def registered(self) -> set[str]:
        """P: push ids whose registration arrived and whose request has not finished."""
        return set(self._registered)

    def held(self) -> set[str]:
        """P: push requests waiting for D's registration."""
        return set(self._hold_since) - self._unpushed
