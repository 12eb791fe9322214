"""Worker side of :class:`~hmacore.integrations.vllm.nixl_connector.HmaNixlConnector`.

Pull mode over :class:`hmacore.transport.nixl.NixlAgent`:

* ``register_kv_caches``: one :class:`~hmacore.plan.TransferPlan` from the layer tensors (the
  layout comes from the KVCacheConfig), one NIXL agent named after the engine id, and a
  :class:`~hmacore.transport.handshake.HandshakeServer` on ``side_channel_host:port`` (the
  address the scheduler side advertises in ``kv_transfer_params``); every client that
  handshakes is added as a NIXL peer.
* D side, each step (``start_load_kv``): for every ``RecvRequest`` handshake with P once per
  address, pair local and remote ids with :func:`hmacore.windows.trim_remote_to_local` and
  post one READ whose completion notifies P (``b"<P request id>:done"``). An all-empty local
  table (full local hit, abort before scheduling) only notifies. Sync loads are waited for
  before the forward pass. Heartbeats (``b"...:HB"``) go to P for every awaited request.
* P side: requests under lease are reported ``finished_sending`` once D's ``done`` arrives;
  ``HB`` messages become lease renewals (:class:`HmaNixlWorkerMeta`); expired and aborted
  requests are forgotten (their blocks were freed by the scheduler side).
* Failures are per request: a READ that cannot be posted or fails is reported in both
  ``finished_recving`` and ``failed_recving`` (vLLM then applies its load-failure policy).

Units: block ids per group (blocks of that group); times in seconds.
Single worker (TP = PP = 1) only: the rank is not part of the agent name yet.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from ...errors import HandshakeError, HmacoreError, TransferError
from ...plan import TransferPlan
from ...transport import configure_ucx_env
from ...transport.handshake import HandshakeServer, exchange_handshake
from ...transport.nixl import NixlAgent, Transfer
from ...windows import trim_remote_to_local
from .metadata import HmaNixlConnectorMetadata, HmaNixlWorkerMeta, RemotePeer
from .push_metadata import PUSH_AGENT_SUFFIX

logger = logging.getLogger(__name__)

__all__ = ["HmaNixlWorker"]


class HmaNixlWorker:
    """Per-worker NIXL state of one engine. Created by the connector in the WORKER role.

    Args:
        layout: the engine's KVLayout (translated from its KVCacheConfig).
        num_blocks: blocks per layer of the shared pool.
        engine_id: this engine's id (also the NIXL agent name).
        host, port: where the handshake server listens (P side; D uses it only to answer).
        sync_timeout: seconds a sync load may take before it is reported failed.
    """

    def __init__(self, layout, num_blocks: int, engine_id: str, host: str, port: int, *,
                 sync_timeout: float = 30.0) -> None:
        configure_ucx_env()  # before nixl is first imported (NixlAgent imports it lazily)
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.engine_id = engine_id
        self.host, self.port = host, port
        self.sync_timeout = sync_timeout
        self.agent: NixlAgent | None = None
        self.server: HandshakeServer | None = None
        self._peer_by_addr: dict[tuple[str, int], str] = {}
        self._recving: dict[str, tuple[Transfer, str]] = {}   # local rid -> (transfer, P rid)
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._sending: dict[str, float] = {}                  # P rid -> local deadline
        self._renewed: set[str] = set()

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> TransferPlan:
        plan = TransferPlan.from_kv_caches(self.layout, kv_caches, num_blocks=self.num_blocks)
        self.agent = NixlAgent(self.engine_id, plan)
        self.server = HandshakeServer(self.agent.handshake_payload(), host=self.host,
                                      port=self.port, on_peer=self.agent.add_peer)
        return plan

    def _peer(self, remote: RemotePeer) -> str:
        key = (remote.host, int(remote.port))
        name = self._peer_by_addr.get(key)
        if name is None:
            payload = exchange_handshake(remote.host, int(remote.port),
                                         self.agent.handshake_payload())
            if payload.agent_name.endswith(PUSH_AGENT_SUFFIX):
                raise HandshakeError(
                    f"transfer_mode mismatch: peer {payload.agent_name!r} at {remote.host}:"
                    f"{remote.port} runs push mode, this engine kv_connector_extra_config."
                    "transfer_mode='pull' (set the same transfer_mode on both engines)")
            name = self.agent.add_peer(payload)
            self._peer_by_addr[key] = name
        return name

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: HmaNixlConnectorMetadata) -> None:
        if self.agent is None:
            raise RuntimeError("register_kv_caches must run before start_load_kv")
        now = time.perf_counter()
        for rid, deadline in meta.reqs_to_send.items():      # P: (re)new leases
            self._sending[rid] = now + (deadline - meta.scheduler_clock)
        for rid in meta.expired | meta.reqs_not_processed:
            self._sending.pop(rid, None)
        for rid, rr in meta.reqs_to_recv.items():            # D: post reads
            self._start_read(rid, rr)
        for rid, rr in meta.reqs_to_recv.items():
            if not rr.awaiting and rid in self._recving:     # sync load: finish it now
                t, _ = self._recving.pop(rid)
                try:
                    self.agent.wait(t, timeout=self.sync_timeout)
                except TransferError as e:
                    raise RuntimeError(f"sync KV load of {rid!r} failed: {e}") from e
        for engine, remote_rids in meta.heartbeats.items():
            for peer_rid in remote_rids:
                peer = self._peer_name_for(engine)
                if peer is not None:
                    try:
                        self.agent.send_notif(peer, peer_rid, b"HB")
                    except HmacoreError as e:
                        logger.warning("heartbeat for %s not sent: %s", peer_rid, e)

    def _peer_name_for(self, engine: str) -> str | None:
        return engine if engine in self.agent.peers else None

    def _start_read(self, rid: str, rr) -> None:
        remote = rr.remote
        if remote is None:
            return
        try:
            peer = self._peer(remote)
            if not any(len(g) for g in rr.local_block_ids):
                self.agent.send_notif(peer, remote.request_id, b"done")   # nothing to read
                if rr.awaiting:
                    self._done_recving.add(rid)
                return
            local, rem = trim_remote_to_local(rr.local_block_ids, remote.block_ids, self.layout)
            t = self.agent.read(remote.request_id, peer, local, rem, notif=b"done")
            self._recving[rid] = (t, remote.request_id)
        except HmacoreError as e:
            logger.warning("KV load of %s failed to start: %s", rid, e)
            if rr.awaiting:
                self._done_recving.add(rid)
                self._failed_recving.add(rid)
            else:
                raise RuntimeError(f"sync KV load of {rid!r} failed: {e}") from e

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        recving, failed = self._done_recving, self._failed_recving
        self._done_recving, self._failed_recving = set(), set()
        for rid, (t, _) in list(self._recving.items()):
            try:
                state = self.agent.poll(t)
            except TransferError as e:
                logger.warning("KV load of %s failed: %s", rid, e)
                state = "FAILED"
                failed.add(rid)
            if state != "PROC":
                del self._recving[rid]
                recving.add(rid)
        sending = set()
        now = time.perf_counter()
        for rid, deadline in list(self._sending.items()):
            msgs = self.agent.notifications(rid)
            if b"HB" in msgs:
                self._renewed.add(rid)
            if b"done" in msgs:
                sending.add(rid)
                del self._sending[rid]
            elif deadline < now - 1.0:    # the scheduler side frees it; stop watching
                del self._sending[rid]
        return sending, recving, failed

    def build_worker_meta(self) -> HmaNixlWorkerMeta | None:
        if not self._renewed:
            return None
        meta, self._renewed = HmaNixlWorkerMeta(renewed=self._renewed), set()
        return meta

    def shutdown(self) -> None:
        from ._roles import close_transport
        close_transport(self)
