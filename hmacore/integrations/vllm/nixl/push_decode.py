"""Decode side (D) of the push worker: the handshake with every rank of a prefill engine
(on a background thread), registrations sent and retried, cancels and the holds they keep,
liveness pings and lost sources. Mixed into :class:`.push_worker.HmaPushWorker`, whose
``__init__`` creates the state these methods use; see that module's docstring for the
protocol."""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

from ....errors import HandshakeError, HmacoreError
from ....plan import TransferPlan
from ....tp import TpMapping
from ....transport.handshake import HandshakePayload, exchange_handshake
from ._regrain import payload_pages, worker_pages
from ._tp import check_rank_peer, mamba_tp_refusal, state_bytes_at
from .push_metadata import PUSH_AGENT_SUFFIX
from .. import _compat as C
from .push_common import _CANCEL, _Cancel, FIRST_CONTACT_TIMEOUT_S, PEER_CHECK_INTERVAL_S, _PING, \
    push_tag, _REG, _regrain_plan_with, _Source

logger = C.get_logger(__name__)


class DecodeSide:
    """D's methods of :class:`~.push_worker.HmaPushWorker` (registrations, handshakes,
    cancels, sources)."""

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
        why = mamba_tp_refusal(self.layout, self.tp, self.tp_size, ptp,
                               tuple(got[0].block_sizes) != tuple(self.layout.block_sizes))
        if why is not None:       # P's ranks refuse this peer alike (PrefillSide._accept_peers)
            raise HandshakeError(f"prefill engine at {host}:{port} (TP {ptp}) refused for "
                                 f"push: {why}")
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
        # another TP size: P's per-rank Mamba state bytes from the state geometry (the
        # handshake required P's equal ours), the plan pairing its byte ranges
        src_state = self.state_bytes if mapping is None else \
            state_bytes_at(self.tp, self.layout, mapping.remote_tp)
        for r in from_ranks:
            p = got[r]
            assert p.tp is not None       # check_compatible: a remap is TP-aware
            player = p.tp.kv_layout()
            pplan = TransferPlan.from_region_table(player, p.regions, mem_type=p.mem_type)
            _regrain_plan_with(player, pplan, payload_pages(p, pplan), self.layout, self.plan,
                               mine, mapping, r, f"prefill rank {r} ({p.agent_name!r})",
                               log=False, state=self.state_bytes, src_state=src_state)

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
