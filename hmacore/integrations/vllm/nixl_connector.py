"""``HmaNixlConnector``: a vLLM 0.32 KV connector (KVConnectorBase_V1 + SupportsHMA) for P/D
disaggregation over NIXL with hmacore's multi-group bookkeeping.

Load it with ``KVTransferConfig(kv_connector="HmaNixlConnector",
kv_connector_module_path="hmacore.integrations.vllm", kv_role=...)``; HMA stays on.

Scheduler role: complete (:class:`~.nixl_scheduler.HmaNixlScheduler`).
Worker role: NOT IMPLEMENTED YET - constructing the connector with
``KVConnectorRole.WORKER`` raises ``NotImplementedError`` (a silent no-op worker would let D
decode from blocks that were never read). It is the next step, built on ``hmacore.plan`` and
``hmacore.transport.nixl`` (branch ``plan``).
"""
from __future__ import annotations

from typing import Any

from . import _compat as C
from .metadata import HmaNixlConnectorMetadata
from .nixl_scheduler import HmaNixlScheduler

__all__ = ["HmaNixlConnector"]

_WORKER_TODO = ("HmaNixlConnector worker side is not implemented yet (needs hmacore.plan / "
                "hmacore.transport.nixl); only the scheduler role can be constructed")


class HmaNixlConnector(C.KVConnectorBase_V1, C.SupportsHMA):
    """P/D pull connector keeping HMA on; see the module docstring for the role status.

    ``kv_connector_extra_config``: ``kv_lease_duration`` (seconds P keeps finished blocks for
    D, default 30), ``side_channel_host`` / ``side_channel_port`` (P's address advertised in
    ``kv_transfer_params``).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if role != C.KVConnectorRole.SCHEDULER:
            raise NotImplementedError(_WORKER_TODO)
        self.scheduler = HmaNixlScheduler(vllm_config, kv_cache_config)

    @property
    def layout(self):
        """The hmacore KVLayout this connector works with."""
        return self.scheduler.layout

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        # D loads the request's own blocks of every transfer group (not hash-addressed).
        return True

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A P/D pull restores every transfer group (not only prefix-cacheable ones)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    # -- scheduler side -------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HmaNixlConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        """One id list per KV cache group; see HmaNixlScheduler.request_finished."""
        return self.scheduler.request_finished(request, block_ids)

    def request_finished(self, request: Any, block_ids: list[int]):
        """Single-group path (vLLM calls it only when HMA is off and there is one group)."""
        if self.scheduler.layout.num_groups != 1:
            raise ValueError(f"request_finished got one block list but the layout has "
                             f"{self.scheduler.layout.num_groups} groups; use "
                             "request_finished_all_groups")
        return self.scheduler.request_finished(request, (list(block_ids),))

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    # -- worker side (not implemented: the WORKER role cannot be constructed) -----------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_WORKER_TODO)

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError(_WORKER_TODO)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_WORKER_TODO)

    def wait_for_save(self) -> None:
        raise NotImplementedError(_WORKER_TODO)
