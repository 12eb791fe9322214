"""What both hmacore connectors share: one instance serves one role (SCHEDULER or WORKER) and
forwards vLLM's calls to its scheduler-side or worker-side object; the scheduler objects that
need per-step tables follow them incrementally from the scheduler output (TableFollower)."""
from __future__ import annotations

from typing import Any

from ...tables import RequestState, TrackerSet
from . import _compat as C
from ._metrics import HmaConnectorStats


def require_single_worker(vllm_config: Any, connector: str, *, allow_tp: bool = False) -> None:
    """Refuse worker layouts a connector does not serve: PP > 1 always, TP > 1 unless
    ``allow_tp`` (one worker per TP rank), with a clear error."""
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    if pp != 1 or (tp != 1 and not allow_tp):
        need = "PP = 1" if allow_tp else "TP = PP = 1"
        raise NotImplementedError(
            f"{connector} worker: tensor_parallel_size={tp}, pipeline_parallel_size={pp}; only "
            f"{need} is supported so far")


def close_transport(worker: Any) -> None:
    """A NIXL worker side's shutdown: close ``worker.server`` (handshake server), then
    ``worker.agent``; each is set to None, so a second call does nothing."""
    if worker.server is not None:
        worker.server.close()
        worker.server = None
    if worker.agent is not None:
        worker.agent.close()
        worker.agent = None


class RoleDispatch:
    """Mixin for a ``KVConnectorBase_V1`` subclass with ``self.scheduler`` / ``self.worker``
    (exactly one of them set) and ``self._layout``. Calling the other role's method raises."""

    scheduler: Any
    worker: Any

    def _sched(self):
        if self.scheduler is None:
            raise RuntimeError(f"scheduler-side method called on a WORKER-role {type(self).__name__}")
        return self.scheduler

    def _work(self):
        if self.worker is None:
            raise RuntimeError(f"worker-side method called on a SCHEDULER-role {type(self).__name__}")
        return self.worker

    @property
    def layout(self):
        """The hmacore KVLayout this connector works with."""
        return self._layout

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any):
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        """One id list per KV cache group (tuple length = number of groups)."""
        return self._sched().request_finished(request, block_ids)

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Layer name -> tensor (blocks on dim 0); the groups alias one storage."""
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's loads; sync loads complete here, before the forward pass."""
        self._work().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer: whole requests move between steps."""
        return

    def get_transfer_results(self, finished_req_ids: set[str]):
        sending, recving, failed = self._work().get_transfer_results()
        return C.KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                            failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # -- statistics (vLLM's stats pipeline and /metrics; see _metrics.py) -----------------------
    def get_kv_connector_stats(self):
        """What this role counted since vLLM last asked (None if nothing). Called every
        step: a stats object is built only when something was counted."""
        side = self.worker if self.worker is not None else self.scheduler
        counter = getattr(side, "counters", None)
        data = counter.take() if counter is not None else None
        return HmaConnectorStats(data=data) if data else None

    # -- sleep mode (vLLM 0.33: checked when enable_sleep_mode is set) ---------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: vLLM refuses ``enable_sleep_mode`` with an hmacore connector at config time.

        Sleep frees and later remaps the KV cache tensors; hmacore's NIXL agent, the
        embedded store's and Mooncake's registrations and the P/D handshake (which publishes
        the registered regions) would point at the old memory. Re-registering and
        republishing (``unregister_kv_caches`` / ``restore_kv_caches``) is not implemented,
        so the connectors say so up front instead of transferring from stale addresses."""
        return False

    def unregister_kv_caches(self) -> None:
        """Never reached (``supports_sleep_mode`` is False); refuses loudly if it is."""
        raise NotImplementedError(f"{type(self).__name__} does not support sleep mode")

    def restore_kv_caches(self) -> None:
        """Never reached (``supports_sleep_mode`` is False); refuses loudly if it is."""
        raise NotImplementedError(f"{type(self).__name__} does not support sleep mode")

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return HmaConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from ._metrics import HmaPromMetrics
        return HmaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class TableFollower:
    """Mixin for a scheduler-side object with ``self.trackers`` (TrackerSet): follows the
    per-group tables of the requests it tracks from what vLLM hands it, incrementally.

    Per step the work is O(new blocks) of the tracked scheduled requests: a new or resumed
    request brings its full table once (vLLM built that list anyway), a running one appends
    ``new_block_ids``. vLLM's table is never re-read. The mirror differs from vLLM's own
    table only where vLLM nulled a block in place (sliding-window blocks that left the window,
    superseded Mamba states): those positions lie before the tokens any later step computes,
    so every position a connector reads for the current step (its new blocks) equals vLLM's.
    ``tests/vllm/test_follow_mirror.py`` checks exactly this in vLLM's real Scheduler.
    (A push producer's mirror is sparser still: see ``HmaPushScheduler``.)
    A request is followed from the moment the connector tracks it (``_track_full``) until it
    stops tracking it (``trackers.finish``); untracked requests cost one dict lookup.
    """

    trackers: TrackerSet
    #: a request followed from the scheduler output starts with an empty table and its first
    #: full table goes through the step's one append call (push: ``TrackerSet.step_pairs``,
    #: which reads only the ids the consumer can receive) instead of ``TrackerSet.add``
    first_table_as_appends = False
    # requests whose full table update_state_after_alloc gave in this scheduling pass: the
    # same pass's scheduler output repeats that table (vLLM builds both from one allocation),
    # so _follow_step skips re-reading it
    _fresh: set[str]

    def _track_full(self, rid: str, table: Any, num_prompt_tokens: int, *,
                    at_alloc: bool = False) -> None:
        """A full per-group table: new request, resumed request (replace) or a repeat (suffix).
        ``at_alloc``: given by ``update_state_after_alloc`` (see ``_fresh``)."""
        if at_alloc:
            fresh = self.__dict__.setdefault("_fresh", set())
            fresh.add(rid)
        if rid not in self.trackers:
            self.trackers.add(rid, table, num_prompt_tokens=num_prompt_tokens)
        elif self.trackers.state(rid) == RequestState.PREEMPTED:
            self.trackers.replace(rid, table)
        else:
            self.trackers.update_after_alloc(rid, table)

    def _follow_from_output(self, rid: str, num_prompt_tokens: int) -> None:
        """Start following ``rid`` from the full table the scheduler output of its first
        scheduled step carries (vLLM's lists, converted in one C pass), instead of reading
        ``KVCacheBlocks`` at allocation: for a request scheduled in the step it is allocated
        in (a prefill-side request)."""
        self.__dict__.setdefault("_pending", {})[rid] = int(num_prompt_tokens)

    def _unfollow(self, rid: str) -> None:
        """Stop following ``rid`` (finished, or pending and never scheduled)."""
        pending = self.__dict__.get("_pending")
        if pending:
            pending.pop(rid, None)
        if rid in self.trackers:
            self.trackers.finish(rid)

    def _follow_step(self, scheduler_output: Any):
        """Apply one step's preemptions and allocations to the tracked requests; yield the
        tracked scheduled ids (untracked ones are skipped with one membership test)."""
        trackers = self.trackers
        scheduled, new_ids = self._follow_entries(scheduler_output)
        rids = [rid for rid, ids in zip(scheduled, new_ids) if ids is not None]
        if rids:
            trackers.apply_step_lists(rids, [ids for ids in new_ids if ids is not None])
        for rid in scheduled:
            if trackers.state(rid) != RequestState.RUNNING:
                trackers.set_state(rid, RequestState.RUNNING)
            yield rid

    def _follow_entries(self, scheduler_output: Any) -> tuple[list[str], list[Any]]:
        """The first part of a step's follow: pending requests added from their full table
        (or, ``first_table_as_appends``, with an empty one, the full table then being their
        entry of the returned ids), preemptions applied, new and resumed requests' full
        tables merged. Returns the tracked scheduled ids and, aligned with them, the ids
        each still has to append (vLLM's ``new_block_ids`` entry; None when there is
        nothing to append): the caller appends them in one C call (:meth:`TrackerSet.apply_step_lists` or
        :meth:`TrackerSet.step_pairs`) and marks every scheduled request RUNNING."""
        trackers = self.trackers
        fresh = self.__dict__.pop("_fresh", None) or ()
        pending: dict[str, int] = self.__dict__.get("_pending") or {}
        first: dict[str, Any] = {}
        if pending:
            for rid, ids, full in C.scheduled_entries(scheduler_output, list(pending)):
                if full:
                    prompt = pending.pop(rid)
                    if self.first_table_as_appends:
                        trackers.add(rid, [[] for _ in range(trackers.num_groups)],
                                     num_prompt_tokens=prompt)
                        first[rid] = ids
                    else:
                        trackers.add(rid, ids, num_prompt_tokens=prompt)
                        fresh = {*fresh, rid}
                    self._on_followed(rid, prompt)
        if not len(trackers):
            return [], []
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if rid in trackers:
                trackers.preempt(rid)
        # running requests' appended ids go in one C call; new and resumed ones bring tables.
        # Few tracked requests among many scheduled (push: P's requests still pushing): look
        # those up; else one pass over the scheduled ones with a membership test each.
        if 4 * len(trackers) < len(scheduler_output.num_scheduled_tokens):
            entries = C.scheduled_entries(scheduler_output, list(trackers))
        else:
            entries = (e for e in C.iter_scheduled(scheduler_output) if e[0] in trackers)
        scheduled: list[str] = []
        new_ids: list[Any] = []
        for rid, ids, full in entries:
            scheduled.append(rid)
            if full:
                if rid in first:
                    new_ids.append(ids)
                    continue
                if rid not in fresh:
                    self._track_full(rid, ids, trackers.num_prompt_tokens(rid))
                new_ids.append(None)
            else:
                new_ids.append(ids)
        return scheduled, new_ids

    def _on_followed(self, rid: str, num_prompt_tokens: int) -> None:
        """Hook: ``rid`` is followed from its first full table (``_follow_from_output``)."""
