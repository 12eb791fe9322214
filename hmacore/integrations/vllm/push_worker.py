"""Worker side of :class:`HmaNixlConnector` in layer-wise push mode.

Built on :mod:`hmacore.layerwise` (LayerPlan, LayerwisePusher, LayerwiseReceiver) over a
:class:`~hmacore.transport.nixl_desc.DescAgent` whose NIXL agent is named
``<engine_id>@push`` (a peer in pull mode is recognised at handshake and refused with a clear
error). A :class:`HandshakeServer` on ``side_channel_host:port`` answers decode peers.

* D (``start_load_kv``): for each :class:`PushRegistration` handshake with P once per address,
  send P ``b"<push_id>:REG:<json>"`` (D's agent name and positional per-group ids) and expect
  the push (LayerwiseReceiver, deadline ``push_recv_timeout`` s). Every layer's notification
  plus ``done`` -> ``finished_recving``; a failure notification, a count mismatch, the deadline
  or a handshake error -> ``finished_recving`` and ``failed_recving`` (nothing valid).
* P: registrations become worker metadata for P's scheduler. In ``save_kv_layer`` the layer's
  WRITE (its group's blocks of this step's :class:`PushSave`) is posted at once: one
  LayerwisePusher request per (push, step), the prompt's last step under the push id itself
  (its per-layer notifications and ``done`` reach D's receiver), earlier steps under
  ``<push_id>.<step>`` (D ignores those). A step starts only after the previous step's WRITEs
  of the same push completed (bounded), so a partly filled block re-written later is never
  overtaken by its stale copy. When the final step is sent or any step failed, the request
  is reported in ``finished_sending`` (P's scheduler frees it if it holds it).

Units: block ids per group; descriptor ids from LayerPlan; times ``time.monotonic()`` seconds.
Single worker (TP = PP = 1).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import queue
import time
from collections import deque
from typing import Any

from ...errors import HandshakeError, HmacoreError
from ...layerwise import LayerPlan, LayerwisePusher, LayerwiseReceiver, PushState
from ...plan import TransferPlan
from ...transport import configure_ucx_env
from ...transport.handshake import HandshakePayload, HandshakeServer, exchange_handshake
from ._roles import close_transport
from .push_metadata import PUSH_AGENT_SUFFIX, HmaPushConnectorMetadata, HmaPushWorkerMeta, \
    PushSave

logger = logging.getLogger(__name__)

__all__ = ["HmaPushWorker"]

_REG = b"REG:"


class _Inbox:
    """The receiver's transport: notifications the worker routed to it."""

    def __init__(self) -> None:
        self.msgs: list[bytes] = []

    def notifs(self) -> list[bytes]:
        out, self.msgs = self.msgs, []
        return out


@dataclasses.dataclass
class _Push:
    request_id: str
    peer: str
    subs: list[str] = dataclasses.field(default_factory=list)
    steps: int = 0
    final_started: bool = False
    failed: str | None = None
    forward_end: float = 0.0
    last_write_done: float = 0.0
    first_post: float = 0.0


class HmaPushWorker:
    """Per-worker push state of one engine. Created by the connector in the WORKER role.

    Args:
        layout, num_blocks, engine_id, host, port: as :class:`HmaNixlWorker`.
        recv_timeout: D, seconds from registration until the push must be complete.
        lease_s: P, seconds a push may take at most (the scheduler's lease).
        gate_timeout: P, seconds a step waits for the previous step's WRITEs of a push.
    """

    def __init__(self, layout, num_blocks: int, engine_id: str, host: str, port: int, *,
                 recv_timeout: float = 60.0, lease_s: float = 30.0,
                 gate_timeout: float = 5.0, tp: Any = None) -> None:
        configure_ucx_env()
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.name = f"{engine_id}{PUSH_AGENT_SUFFIX}"
        self.tp = tp   # WorkerTp (TP = 1): the TP-aware handshake pull workers speak
        self.host, self.port = host, port
        self.recv_timeout, self.lease_s, self.gate_timeout = recv_timeout, lease_s, gate_timeout
        self.agent = None
        self.server: HandshakeServer | None = None
        self.plan: TransferPlan | None = None
        self.layers: LayerPlan | None = None
        self.pusher: LayerwisePusher | None = None
        self.receiver: LayerwiseReceiver | None = None
        self._inbox = _Inbox()
        self._new_peers: queue.Queue = queue.Queue()
        self._peer_by_addr: dict[tuple[str, int], str] = {}
        self.errors: list[str] = []           # handshake / registration problems (bounded)
        # D side
        self._expect: dict[str, str] = {}     # push id -> local request id
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        # P side
        self._regs: dict[str, str] = {}       # push id -> D agent name
        self._new_regs: dict[str, list[list[int]]] = {}
        self._pending_regs: list[tuple[float, str, dict]] = []
        self._pushes: dict[str, _Push] = {}
        self._dead: deque[str] = deque(maxlen=4096)
        self._sending: set[str] = set()
        self._step_meta: Any = None
        self._step_saves: list[tuple[str, str]] = []   # (push id, pusher request id)
        self._stats: deque[dict] = deque(maxlen=1024)
        self._need_fwd_end: dict[str, dict] = {}   # ended in this step's forward pass

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> TransferPlan:
        from ...transport.nixl_desc import DescAgent
        plan = TransferPlan.from_kv_caches(self.layout, kv_caches, num_blocks=self.num_blocks)
        self.plan = plan
        self.layers = LayerPlan(plan)
        self.agent = DescAgent(self.name, plan.registration_ranges(), mem_type=plan.mem_type)
        self.pusher = LayerwisePusher(self.agent, self.layers)
        self.receiver = LayerwiseReceiver(self._inbox, len(self.layers.layers))
        self.server = HandshakeServer(self._payload(), host=self.host, port=self.port,
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

    def _accept_peers(self) -> None:
        """P: decode peers that handshook (queued by the server thread) become NIXL peers."""
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
            if name in self.pusher.remote:
                continue
            try:
                self.agent.add_remote(payload.agent_metadata)
                dplan = payload.remote_plan(self.layout)
                self.agent.prep_pair(name, name, self.plan.descriptors(), dplan.descriptors())
                self.pusher.add_peer(name, LayerPlan(dplan))
            except Exception as e:  # noqa: BLE001 - hmacore and NIXL errors: refuse this peer
                self._error(f"decode peer {name!r} not usable for push: {e}")

    def _peer(self, host: str, port: int) -> str:
        """D: handshake with P once per address; HandshakeError on a mode mismatch."""
        key = (host, int(port))
        name = self._peer_by_addr.get(key)
        if name is None:
            payload = exchange_handshake(host, int(port), self._payload())
            if not payload.agent_name.endswith(PUSH_AGENT_SUFFIX):
                raise HandshakeError(
                    f"transfer_mode mismatch: peer {payload.agent_name!r} at {host}:{port} runs "
                    "pull mode, this engine kv_connector_extra_config.transfer_mode='push' "
                    "(set the same transfer_mode on both engines)")
            name = self.agent.add_remote(payload.agent_metadata)
            self._peer_by_addr[key] = name
        return name

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, meta: HmaPushConnectorMetadata) -> None:
        """D: send registrations and expect pushes. P: aborts, expiries, step preparation."""
        if self.agent is None:
            raise RuntimeError("register_kv_caches must run before start_load_kv")
        for reg in getattr(meta, "push_regs", {}).values():
            self._register(reg)
        for pid in getattr(meta, "push_aborts", ()):
            self._abort(pid, "the prefill request was aborted")
        for rid in meta.expired | meta.reqs_not_processed:
            for pid, p in list(self._pushes.items()):
                if p.request_id == rid:
                    self._abort(pid, "the prefill lease expired")
                    self._pushes.pop(pid, None)
                    self._regs.pop(pid, None)
                    self._dead.append(pid)

    def _register(self, reg) -> None:
        try:
            if ":" in reg.push_id or reg.push_id in self._expect:
                raise HmacoreError(f"push_id {reg.push_id!r} is malformed or already expected")
            peer = self._peer(reg.host, reg.port)
            body = json.dumps({"agent": self.name, "ids": reg.block_ids}).encode()
            if reg.awaiting:
                self.receiver.expect(reg.push_id, reg.block_ids, timeout_s=self.recv_timeout)
                self._expect[reg.push_id] = reg.request_id
            self.agent.send_notif(peer, reg.push_id.encode() + b":" + _REG + body)
        except Exception as e:  # noqa: BLE001 - hmacore and NIXL errors fail this request only
            self._error(f"push registration of {reg.request_id!r} with {reg.host}:{reg.port} "
                        f"failed: {e}")
            if reg.push_id in self._expect:
                self.receiver.forget(reg.push_id)
                self._expect.pop(reg.push_id, None)
            if reg.awaiting:
                self._recving.add(reg.request_id)
                self._failed.add(reg.request_id)

    def _route_notifs(self) -> None:
        for m in self.agent.notifs():
            pid, _, body = m.partition(b":")
            if body.startswith(_REG):
                try:
                    doc = json.loads(body[len(_REG):])
                    ids = doc["ids"]
                    if not isinstance(doc["agent"], str) or len(ids) != self.layout.num_groups:
                        raise ValueError(f"needs 'agent' and {self.layout.num_groups} id lists")
                    ids = [[int(x) for x in g] for g in ids]
                except (ValueError, KeyError, TypeError) as e:
                    self._error(f"malformed push registration for {pid!r}: {e}")
                    continue
                self._pending_regs.append((time.monotonic(), pid.decode(errors="replace"),
                                           {"agent": doc["agent"], "ids": ids}))
            else:
                self._inbox.msgs.append(m)
        if self._pending_regs:
            self._accept_peers()
            keep = []
            for t, pid, doc in self._pending_regs:
                if doc["agent"] in self.pusher.remote:
                    self._regs[pid] = doc["agent"]
                    while len(self._regs) > 4096:        # unclaimed registrations: bounded
                        self._regs.pop(next(iter(self._regs)))
                    self._new_regs[pid] = doc["ids"]
                elif time.monotonic() - t < self.gate_timeout:
                    keep.append((t, pid, doc))       # its handshake is still being accepted
                else:
                    self._error(f"push registration {pid!r} names unknown peer {doc['agent']!r}")
            self._pending_regs = keep

    # -- P: layer-wise writes ---------------------------------------------------------------
    def _prepare_step(self, meta: Any) -> None:
        """Once per step (first save_kv_layer, else start_load_kv): start this step's pushes."""
        if meta is self._step_meta:
            return
        self._step_meta, self._step_saves = meta, []
        saves = getattr(meta, "push_saves", None) or {}
        if not saves:
            return
        self._accept_peers()
        for save in saves.values():
            sub = self._start_sub(save)
            if sub is not None:
                self._step_saves.append((save.push_id, sub))

    def _start_sub(self, save: PushSave) -> str | None:
        pid = save.push_id
        if pid in self._dead:
            return None
        peer = self._regs.get(pid)
        p = self._pushes.get(pid)
        if p is None:
            if peer is None:
                self._error(f"push {pid!r}: no registration on this worker; not pushed")
                return None
            p = self._pushes[pid] = _Push(save.request_id, peer)
        if p.failed is not None or p.final_started:
            return None
        deadline = time.monotonic() + self.gate_timeout
        while any(self.pusher.state(s) == PushState.PUSHING for s in p.subs):
            self._progress()
            if time.monotonic() >= deadline:
                self._fail_push(pid, p, f"step {save.step - 1} WRITEs not done within "
                                        f"{self.gate_timeout} s")
                return None
            time.sleep(0.0002)
        sub = pid if save.final else f"{pid}.{save.step}"
        try:
            self.pusher.start(sub, p.peer, save.local_block_ids, save.remote_block_ids,
                              lease_s=self.lease_s)
        except HmacoreError as e:
            self._fail_push(pid, p, f"step {save.step} could not start: {e}")
            return None
        p.subs.append(sub)
        p.steps += 1
        p.final_started = save.final
        if not p.first_post:
            p.first_post = time.monotonic()
        return sub

    def save_layer(self, layer_name: str, meta: Any) -> None:
        """The forward pass computed ``layer_name``: post its WRITE for every push request of
        this step (layers the plan does not know are ignored)."""
        if self.pusher is None or meta is None:
            return
        self._prepare_step(meta)
        if not self._step_saves or layer_name not in self.layers.meta:
            return
        for pid, sub in self._step_saves:
            p = self._pushes.get(pid)
            if p is None or p.failed is not None:
                continue
            try:
                self.pusher.save_layer(sub, layer_name)
            except HmacoreError as e:
                self._fail_push(pid, p, f"layer {layer_name!r}: {e}")
        self._progress()

    def wait_for_save(self, meta: Any) -> None:
        """Forward pass over: record its end for final steps (overlap figure); poll WRITEs."""
        now = time.monotonic()
        if meta is not None and meta is self._step_meta:
            for pid, sub in self._step_saves:
                p = self._pushes.get(pid)
                if p is not None and sub == pid:
                    p.forward_end = now
                elif sub == pid and pid in self._need_fwd_end:   # done before the pass ended
                    rec = self._need_fwd_end[pid]
                    rec["forward_end"] = now
                    if rec["last_write_done"]:
                        rec["write_after_forward_ms"] = (rec["last_write_done"] - now) * 1e3
        self._need_fwd_end.clear()
        self._progress()

    def _progress(self) -> None:
        self.pusher.progress()
        for pid, p in list(self._pushes.items()):
            for sub in list(p.subs):
                try:
                    st = self.pusher.state(sub)
                except HmacoreError:
                    p.subs.remove(sub)
                    continue
                if st == PushState.SENT:
                    p.last_write_done = max(p.last_write_done, self.pusher.last_write_done(sub))
                    self.pusher.finish(sub)
                    p.subs.remove(sub)
                elif st == PushState.FAILED:
                    err = self.pusher.error(sub)
                    self.pusher.finish(sub)
                    p.subs.remove(sub)
                    self._fail_push(pid, p, err or "WRITE failed")
            if p.failed is not None or (p.final_started and not p.subs):
                self._end(pid, p)

    def _fail_push(self, pid: str, p: _Push, why: str) -> None:
        if p.failed is None:
            p.failed = why
            logger.warning("push %s of %s failed: %s", pid, p.request_id, why)
            try:
                self.agent.send_notif(p.peer, f"{pid}:failed".encode())
            except Exception:  # noqa: BLE001 - the peer may be gone; its deadline fails it
                pass

    def _abort(self, pid: str, why: str) -> None:
        p = self._pushes.get(pid)
        if p is None:                  # nothing posted yet: only tell D
            peer = self._regs.pop(pid, None)
            self._dead.append(pid)
            if peer is not None:
                try:
                    self.agent.send_notif(peer, f"{pid}:failed".encode())
                except Exception:  # noqa: BLE001 - D's deadline fails it anyway
                    pass
            return
        self._fail_push(pid, p, why)
        for sub in p.subs:
            try:
                self.pusher.finish(sub)
            except HmacoreError:
                pass
        p.subs.clear()

    def _end(self, pid: str, p: _Push) -> None:
        if p.subs:                              # a failure: stop the other steps' WRITEs
            for sub in p.subs:
                self.pusher.finish(sub)
            p.subs.clear()
        self._pushes.pop(pid, None)
        self._regs.pop(pid, None)
        self._dead.append(pid)
        self._sending.add(p.request_id)
        gap = (p.last_write_done - p.forward_end) * 1e3 if p.forward_end and \
            p.last_write_done else None
        rec = {"push_id": pid, "request_id": p.request_id, "steps": p.steps,
               "ok": p.failed is None, "error": p.failed, "forward_end": p.forward_end,
               "last_write_done": p.last_write_done, "write_after_forward_ms": gap}
        self._stats.append(rec)
        if not p.forward_end:
            self._need_fwd_end[pid] = rec

    # -- results ----------------------------------------------------------------------------
    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        if self.agent is None:
            return set(), set(), set()
        self._accept_peers()
        self._route_notifs()
        self._progress()
        self.receiver.poll()
        recving, failed = self._recving, self._failed
        self._recving, self._failed = set(), set()
        for pid, rid in list(self._expect.items()):
            st = self.receiver.state(pid)
            if st == PushState.WAITING:
                continue
            if st != PushState.READY:
                self._error(f"push {pid!r} into {rid!r} failed: {self.receiver.error(pid)}")
                failed.add(rid)
            recving.add(rid)
            self.receiver.forget(pid)
            del self._expect[pid]
        sending, self._sending = self._sending, set()
        return sending, recving, failed

    def build_worker_meta(self) -> HmaPushWorkerMeta | None:
        if not self._new_regs:
            return None
        meta, self._new_regs = HmaPushWorkerMeta(registered=self._new_regs), {}
        return meta

    def stats(self) -> list[dict]:
        """P: one record per ended push (``forward_end`` / ``last_write_done``: monotonic
        seconds; ``write_after_forward_ms``: last layer WRITE seen done minus the entry of
        ``wait_for_save`` of the prompt's last step, milliseconds; negative when the last
        WRITE completed before the forward pass returned)."""
        return list(self._stats)

    def shutdown(self) -> None:
        close_transport(self)
