"""Prefill side (P) of the push worker: decode peers accepted (whole pages, TP head slices or
a block-size remap), D's registrations folded in and reported, each step's tables followed
and paired (:meth:`PrefillSide._plan_step`), the layer WRITEs posted, and a push's end,
failure, abort or cancel. Mixed into :class:`.push_worker.HmaPushWorker`, whose
``__init__`` creates the state these methods use; see that module's docstring for the
protocol."""
from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any

import numpy as np

from ....errors import BlockTableError, HandshakeError, HmacoreError
from ....layerwise import LayerPlan, PushState, runs_by_layer
from ....plan import TransferPlan
from ....regrain import token_ranges
from ....spec import GroupKind
from ....tp import TpMapping, TpPairPlan
from ....transport.handshake import HandshakePayload
from ._regrain import payload_pages, worker_pages
from ._tp import mamba_tp_refusal, state_bytes_at
from .push_metadata import PUSH_AGENT_SUFFIX, PushSave
from .. import _compat as C
from .push_common import _CANCELLED, _positional, _Push, _Reg, _regrain_plan_with

logger = C.get_logger(__name__)


class PrefillSide:
    """P's methods of :class:`~.push_worker.HmaPushWorker` (peers, registrations, step
    planning, WRITEs, ends)."""

    def _check_decode_peer(self, payload: HandshakePayload) -> None:
        """P's handshake server's rule for a decode rank that connects (server thread): a
        Mamba group this rank cannot pair with the peer's TP size
        (:func:`~._tp.mamba_tp_refusal`: no state geometry) refuses it by that rule and its
        reason, before the protocol's own checks (``check_compatible``, whose state check
        only says a geometry is missing). D hears the refusal as its handshake failure and
        never registers; P records it (:meth:`_take_server_refusals`)."""
        d, dtp = (payload.tp.tp_rank, payload.tp.tp_size) if payload.tp is not None else (0, 1)
        remap = tuple(payload.block_sizes) != tuple(self.layout.block_sizes)
        why = mamba_tp_refusal(self.layout, self.tp, self.tp_size, dtp, remap)
        if why is not None:
            raise HandshakeError(f"decode peer {payload.agent_name!r} (rank {d} of TP {dtp}) "
                                 f"refused for push: {why}")
        self._me.check_compatible(payload)

    def _take_server_refusals(self) -> None:
        """Record (``errors``, logged) the handshakes this rank's server refused since the
        last call: a decode peer refused at the handshake never registers, so nothing else
        on P would name it."""
        errors = self.server.errors if self.server is not None else []
        for e in errors[self._server_seen:]:
            self._error(f"handshake refused: {e}")
        self._server_seen = len(errors)

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
            if name in self._dpeers or name in self._refused_peers:
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
                why = mamba_tp_refusal(self.layout, self.tp, self.tp_size, dtp, remap)
                if why is not None:     # known to NIXL (its registrations are answered)
                    self._refused_peers[name] = why
                    self._error(f"decode peer {name!r} (rank {d} of TP {dtp}) refused for "
                                f"push: {why}; its requests prefill without push")
                    continue
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
        the chunks of the heads that rank takes from this one, and the Mamba state byte
        ranges of the state geometry that rank takes from this one, hmacore.state_tp), the
        layer of each region pair, and the peer's registered memory for the runs' bounds (no
        dlist pair)."""
        assert self.tp is not None and payload.tp is not None and self.plan is not None
        dlayout = payload.tp.kv_layout()
        dplan = TransferPlan.from_region_table(dlayout, payload.regions,
                                               mem_type=payload.mem_type)
        plan = _regrain_plan_with(self.layout, self.plan, worker_pages(self.layout, self.plan,
                                                                      self.tp),
                                  dlayout, dplan, payload_pages(payload, dplan),
                                  self._mapping_of(d, dtp, payload.tp.page_layout), self.rank,
                                  f"decode rank {d} of TP {dtp} ({name!r})",
                                  state=self._d_state_bytes(dtp), src_state=self.state_bytes)
        pair_layer = plan.pair_layers(self.layers.layers)
        self.pusher.add_runs_peer(name)
        self.agent.add_runs_peer(name, dplan.registration_ranges())
        self._regrain[name] = (plan, pair_layer)

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
            self._new_regs[pid] = None
            if agent in self._regrain:      # its steps are planned in token ranges
                reg.remap = (int(doc["start"]), int(doc["n"]),
                             [int(b) for b in self._regrain[agent][0].dst_block_sizes])

    def _refuse_peer_reg(self, pid: str, agent: str) -> None:
        """P: a registration from a decode peer refused at acceptance
        (:func:`~._tp.mamba_tp_refusal`): nothing of ``pid`` is ever written; D is told
        (``failed``: its request ends at once, nothing loaded) and the scheduler
        (``withdrawn``: P's request prefills without push)."""
        self._error(f"push registration {pid!r} from {agent!r} refused: "
                    f"{self._refused_peers[agent]}")
        if pid not in self._dead:
            self._refuse_reg(pid)
        try:
            self.agent.send_notif(agent, f"{self._tag(pid)}:failed".encode())
        except Exception:  # noqa: BLE001 - its deadline fails it anyway
            pass

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
        self._withdrawn.add(pid)

    def _d_state_bytes(self, dtp: int) -> Any:
        """P: per group the Mamba state bytes of a rank of a TP-``dtp`` decode engine: ours
        at equal TP sizes; else from our state geometry at ``dtp``
        (:func:`~._tp.state_bytes_at`; the handshake required D's geometry equal ours)."""
        if dtp == self.tp_size:
            return self.state_bytes
        return state_bytes_at(self.tp, self.layout, dtp)

    def _state_mismatch(self, agent: str, theirs: Any) -> str | None:
        """P: why a registration from decode agent ``agent`` (of other block sizes) cannot
        take this engine's Mamba states, or None: each Mamba group's unpadded state bytes
        (``state`` of D's registration, :func:`~._regrain.state_bytes`) must equal what the
        plan bounds D's side with (:meth:`_d_state_bytes`): ours at equal TP sizes, as pull's
        ``remote_state_bytes`` rule; across TP sizes our state geometry's bytes at D's TP
        size (a D whose real state disagrees with the geometry it declared is refused)."""
        if agent not in self._regrain:
            return None
        groups = [g for g, spec in enumerate(self.layout.groups)
                  if spec.kind == GroupKind.MAMBA and spec.transfer]
        if not groups:
            return None
        dtp = self._dpeers[agent][1]
        mine = self._d_state_bytes(dtp) or [None] * self.layout.num_groups
        got = theirs if theirs is not None else [None] * self.layout.num_groups
        bad = [g for g in groups if got[g] != mine[g]]
        if not bad:
            return None
        if dtp == self.tp_size:
            return (f"Mamba groups {bad}: the decode engine's state bytes "
                    f"{[got[g] for g in bad]} differ from this engine's "
                    f"{[mine[g] for g in bad]} (registration field 'state'); a state maps only "
                    "onto a state of equal bytes (same model, same TP size)")
        return (f"Mamba groups {bad}: the decode engine's state bytes {[got[g] for g in bad]} "
                f"(registration field 'state', TP {dtp}) differ from the state geometry's "
                f"{[mine[g] for g in bad]} at TP {dtp}; its state byte ranges would not fit")

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
            if pid in self._new_regs:        # not reported yet: never is
                del self._new_regs[pid]
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
