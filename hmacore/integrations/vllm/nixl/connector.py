"""``HmaNixlConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1 + SupportsHMA) for P/D
disaggregation over NIXL with hmacore's multi-group bookkeeping.

Load it with ``KVTransferConfig(kv_connector="HmaNixlConnector",
kv_connector_module_path="hmacore.integrations.vllm", kv_role=...)``; HMA stays on.

Scheduler role: :class:`~.scheduler.HmaNixlScheduler` (proven inside vLLM's Scheduler).
Worker role: :class:`~.worker.HmaNixlWorker` (pull over NIXL/UCX; one worker per TP
rank, PP = 1; prefill and decode engines may have different TP sizes: see docs/vllm.md).
Each instance serves one role;
calling the other role's methods raises.

``kv_connector_extra_config.transfer_mode``: ``"pull"`` (default: D READs P's finished blocks)
or ``"push"`` (decode first, layer-wise: :mod:`.push_scheduler` / :mod:`.push_worker`, one
worker per TP rank too, equal or different TP sizes; P WRITEs each layer into D's blocks as
soon as the forward pass computed it). Both engines must use the same mode; a mismatch is
refused at the NIXL handshake.
"""
from __future__ import annotations

from typing import Any

from .. import _compat as C
from .._config import is_loopback
from .._roles import RoleDispatch, require_single_worker
from ._tp import worker_tp
from .metadata import HmaNixlWorkerMeta
from .push_metadata import HmaPushWorkerMeta
from .scheduler import HmaNixlScheduler
from .push_scheduler import HmaPushScheduler, transfer_mode
from .transport_config import transport_name

__all__ = ["HmaNixlConnector"]

_logger = C.get_logger(__name__)


class HmaNixlConnector(RoleDispatch, C.KVConnectorBase_V1, C.SupportsHMA):
    """P/D pull connector keeping HMA on; see the module docstring for the role status.

    ``kv_connector_extra_config``: ``kv_lease_duration`` (seconds P keeps finished blocks for
    D, default 30), ``side_channel_host`` / ``side_channel_port`` (P's address advertised in
    ``kv_transfer_params``), ``side_channel_listen_host`` (where the handshake servers bind,
    default ``side_channel_host``), ``transfer_mode`` (``"pull"`` / ``"push"``),
    ``nixl_progress_delay_us`` (NIXL progress-thread poll delay, default 1000; 0: NIXL's own
    thread, which spins a core), ``transport`` (``"nixl"``, default, or ``"mooncake"``: the
    Mooncake Transfer Engine; pull and push, any TP pairing NIXL takes), push mode only:
    ``push_register_timeout`` (s, P waits for D's registration, default 30),
    ``push_recv_timeout`` (s, D waits for every layer, default 60),
    ``push_cancel_ack_timeout`` (s, D holds a cancelled push's blocks for P's answer, default
    60).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The scheduler-side object also validates the config and owns the layout.
        self.transfer_mode = transfer_mode(vllm_config)
        self.transport = transport_name(vllm_config, self.transfer_mode)
        push = self.transfer_mode == "push"
        sched = (HmaPushScheduler if push else HmaNixlScheduler)(vllm_config, kv_cache_config)
        self.scheduler: HmaNixlScheduler | None = None
        self.worker = None
        self._layout = sched.layout
        if role == C.KVConnectorRole.SCHEDULER:
            self.scheduler = sched
            _logger.info("HmaNixlConnector (%s, %s) engine %s: %s; side channel %s:%d "
                         "(listening on %s)", self.transfer_mode, sched.kv_role,
                         sched.engine_id, C.layout_summary(sched.layout), sched.host,
                         sched.port, sched.listen_host)
            if sched.is_producer and is_loopback(sched.host):
                _logger.warning(
                    "HmaNixlConnector: this prefill engine advertises the loopback side "
                    "channel %s:%d, so only decode engines on this host can reach it; for "
                    "decode engines on other hosts set kv_connector_extra_config."
                    "side_channel_host to this host's routable address (and "
                    "side_channel_listen_host to 0.0.0.0 to listen on every interface)",
                    sched.host, sched.port)
        else:
            # one worker per TP rank in both modes (PP = 1)
            require_single_worker(vllm_config, type(self).__name__
                                  + (" (transfer_mode='push')" if push else ""), allow_tp=True)
            tp = worker_tp(vllm_config, kv_cache_config, sched.layout)
            if push:
                from .push_worker import HmaPushWorker
                self.worker = HmaPushWorker(sched.layout, int(kv_cache_config.num_blocks),
                                            sched.engine_id, sched.listen_host,
                                            sched.port, recv_timeout=sched.recv_timeout,
                                            cancel_ack_timeout=sched.cancel_ack_timeout,
                                            lease_s=sched.lease_s, tp=tp,
                                            progress_delay_us=sched.progress_delay_us,
                                            posting=sched.posting,
                                            transport=self.transport,
                                            block_size_remap=sched.block_size_remap,
                                            state_bytes=sched.state_bytes)
            else:
                from .worker import HmaNixlWorker  # imports the NIXL driver lazily
                self.worker = HmaNixlWorker(sched.layout, int(kv_cache_config.num_blocks),
                                            sched.engine_id, sched.listen_host,
                                            sched.port, tp=tp,
                                            progress_delay_us=sched.progress_delay_us,
                                            confirm_timeout=sched.lease_s,
                                            posting=sched.posting,
                                            recompute=sched.recompute,
                                            transport=self.transport,
                                            block_size_remap=sched.block_size_remap,
                                            state_bytes=sched.state_bytes)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # D loads the request's own blocks of every transfer group (not hash-addressed).
        return True

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A P/D pull restores every transfer group (not only prefix-cacheable ones)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    # -- scheduler side -------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any):
        """The scheduler side's step metadata, flagged ``report_due`` when a deadline has
        passed (a lease; push: an unclaimed registration): vLLM calls
        ``update_connector_output`` (where they are enforced) only for a non-empty worker
        report, and an idle prefill engine's workers report nothing, so the flag makes them
        report (:meth:`build_connector_worker_meta`) and the deadline is kept."""
        sched = self._sched()
        meta = sched.build_connector_meta(scheduler_output)
        meta.report_due = sched.report_due(meta.scheduler_clock)
        return meta

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def request_finished(self, request: Any, block_ids: list[int]):
        """Single-group path (vLLM calls it only when HMA is off and there is one group)."""
        if self._layout.num_groups != 1:
            raise ValueError(f"request_finished got one block list but the layout has "
                             f"{self._layout.num_groups} groups; use "
                             "request_finished_all_groups")
        return self._sched().request_finished(request, (list(block_ids),))

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        from ....transport.cpus import claim_pinned_cpus
        shared = claim_pinned_cpus()
        if shared:
            _logger.warning(
                "HmaNixlConnector: this worker is pinned to CPUs %s, which another pinned "
                "process on this host already uses (pids %s, e.g. another engine); its "
                "busy-waiting starves this engine's transfer progress (over a network "
                "transport a READ can stall until one engine goes idle). Give each engine its "
                "own cores with VLLM_CPU_OMP_THREADS_BIND (docs/vllm.md, 'Several engines on "
                "one host')", sorted(shared), sorted(set(shared.values())))

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return bool(getattr(self.scheduler, "has_pending_push_work", lambda: False)())

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        bind = getattr(self.scheduler, "bind_block_pool", None)
        if bind is not None:
            bind(gpu_block_pool)

    # -- worker side -----------------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Pull: nothing to save (D reads P's blocks in place). Push: post this layer's WRITE
        for every push request of the step."""
        if self.transfer_mode == "push" and self.has_connector_metadata():
            self._work().save_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        """Push: marks the end of the forward pass (overlap figure); WRITEs keep going."""
        if self.transfer_mode == "push" and self.worker is not None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            self.worker.wait_for_save(meta)

    def stats(self) -> list[dict]:
        """Worker side, push mode: one record per ended push (see HmaPushWorker.stats)."""
        w = self._work()
        return w.stats() if hasattr(w, "stats") else []

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads of single-group models (see HmaNixlWorker._block_report)."""
        w = self.worker
        return w.take_invalid_blocks() if w is not None and hasattr(w, "take_invalid_blocks") \
            else set()

    def build_connector_worker_meta(self):
        """The worker's report; on a ``report_due`` step never None (an empty report is not
        handed to the scheduler side, whose lease expiry would then wait for a busy step)."""
        meta = self._work().build_worker_meta()
        if meta is None and self.has_connector_metadata() \
                and getattr(self._get_connector_metadata(), "report_due", False):
            meta = (HmaPushWorkerMeta if self.transfer_mode == "push" else HmaNixlWorkerMeta)()
        return meta

