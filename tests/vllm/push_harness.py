"""Two push-mode engines in one process (test-only): each a real vLLM Scheduler with a
SCHEDULER-role HmaNixlConnector and a WORKER-role one over paged KV memory (real NIXL, DRAM).

The "forward pass" of a step writes, layer by layer, the byte pattern of the tokens that
become computed in this step into the request's pages (a partly filled block gets only its
computed tokens' bytes; the rest holds junk until a later step), then calls ``save_kv_layer``
the way vLLM's attention layers do; then ``start_load_kv``, ``wait_for_save``,
``get_transfer_results`` as the CPU model runner does after the forward.
"""
from __future__ import annotations

import os
import time

import numpy as np

import harness as H
from ports import free_port
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector
from hmacore.demo.paged_memory import _write_pages, allocate_paged_kv, expected_pages, read_pages
from hmacore.plan import layer_sort_key
from hmacore.tables import pair_block_spans

JUNK = 0xAA
# tests/mooncake/test_te_connector.py runs the push tests again inside a network namespace
# with the Mooncake Transfer Engine as the transport ("transport": "mooncake")
TRANSPORT = {"transport": os.environ["HMACORE_TEST_TRANSPORT"]} \
    if os.environ.get("HMACORE_TEST_TRANSPORT") else {}


class Engine:
    def __init__(self, make_kcc, extra=None, mode="push", port=None, page_bytes=64, **vkw):
        self.port = free_port() if port is None else port   # a restart reuses its port
        self.vc = H.vllm_config(extra={"side_channel_port": self.port, "kv_lease_duration": 30,
                                       "transfer_mode": mode, **TRANSPORT, **(extra or {})},
                             **vkw)
        self.kcc = make_kcc()
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.w = HmaNixlConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.layout = self.w.layout
        # page_bytes None: the specs' own page sizes (rows of equal bytes at any block size)
        self.paged = allocate_paged_kv(self.layout, self.kcc.num_blocks, page_bytes=page_bytes)
        for arr in self.paged.kv_caches.values():
            for part in (arr if isinstance(arr, (tuple, list)) else [arr]):
                part[...] = JUNK
        self.w.register_kv_caches(self.paged.kv_caches)
        if mode == "push":   # the driver the connector built is the configured one
            assert type(self.w.worker.agent).__name__ == (
                "TeDescAgent" if TRANSPORT else "DescAgent")
        self.layers = sorted(self.layout.layer_to_group, key=layer_sort_key)
        self.metas: list = []
        self.planned: list = []     # per step: P's worker's planned saves (request id -> save)
        self.outputs: list = []
        self.forward = True
        self.mirror_checks = 0
        self.save_checks = 0
        self.reg_ids: dict = {}     # push id -> D's registered table, as P's worker got it

    @property
    def conn(self):
        return self.s.connector.scheduler

    def _forward(self, so) -> None:
        for layer in self.layers:
            g = self.layout.layer_to_group[layer]
            bs, nbytes = self.layout.groups[g].block_size, self.paged.page_bytes[g]
            for rid, n in so.num_scheduled_tokens.items():
                req = self.s.requests[rid]
                end = min(req.num_computed_tokens, req.num_prompt_tokens)
                # (a request resumed after preemption recomputes from 0, outputs included)
                start = min(max(req.num_computed_tokens - n, 0), end)
                if start >= end:
                    continue
                table = self.s.kv_cache_manager.get_block_ids(rid)[g]
                for p in range(start // bs, H.cdiv(end, bs)):
                    if p >= len(table) or table[p] == 0:
                        continue
                    want = expected_pages(self.layout, layer, [p], nbytes)[0]
                    tok = p * bs + np.arange(nbytes) * bs // nbytes
                    page = read_pages(self.paged.kv_caches[layer], [table[p]])[0]
                    page[tok < end] = want[tok < end]
                    _write_pages(self.paged.kv_caches[layer], [table[p]], page[None])
            self.w.save_kv_layer(layer, None, None)

    def _see_regs(self) -> None:
        """D's registrations P's worker holds (a push's ids never change; a cancel may drop
        one from the worker in the step whose saves are checked)."""
        for pid, reg in getattr(self.w.worker, "_regs", {}).items():
            self.reg_ids[pid] = reg.ids

    def step(self):
        self._see_regs()
        so = self.s.schedule()
        self.metas.append(so.kv_connector_metadata)
        self.w.bind_connector_metadata(so.kv_connector_metadata)
        if so.total_num_scheduled_tokens and self.forward:
            self._forward(so)
        self.w.start_load_kv(None)
        self._see_regs()
        worker = self.w.worker
        if hasattr(worker, "planned"):
            # P's worker planned the step (its first save_kv_layer / start_load_kv): its own
            # tables of the push requests against vLLM's, and its WRITE pairs
            self.planned.append(dict(worker.planned)
                                if so.kv_connector_metadata is worker._step_meta else {})
            trk, mgr = worker.tables, self.s.kv_cache_manager
            for rid in so.num_scheduled_tokens:
                if rid in trk:
                    assert_push_mirror(self.conn, worker, rid, trk.block_ids(rid),
                                       mgr.get_block_ids(rid), self.kcc, (rid, len(self.metas)))
                    self.mirror_checks += 1
            self._check_push_saves(so)
        self.w.wait_for_save()
        r = self.w.get_transfer_results(so.finished_req_ids)
        wmeta = self.w.build_connector_worker_meta()
        self.w.clear_connector_metadata()
        out = self.s.update_from_output(so, H.runner_output(
            so, self.s, finished_sending=r.finished_sending, finished_recving=r.finished_recving,
            failed_recving=r.failed_recving, worker_meta=wmeta))
        self.outputs.append(out)
        return so

    def _check_push_saves(self, so) -> None:
        """Every PushSave the scheduler sent this step carries the step's token span, and
        P's worker planned each (pairs built in one C call for all push requests from its
        own tables) to the per-request pairing of vLLM's own table with D's registration
        over the step's tokens (pair_block_spans): the same WRITE pairs, group by group."""
        sent = getattr(so.kv_connector_metadata, "push_saves", None) or {}
        saves = self.planned[-1]
        assert set(saves) <= set(sent), (set(saves), set(sent))
        mgr = self.s.kv_cache_manager
        for rid, save in saves.items():
            req = self.s.requests[rid]
            n = so.num_scheduled_tokens[rid]
            computed = req.num_computed_tokens - n       # schedule() advanced it already
            start = 0 if save.step == 0 else computed
            end = min(computed + n, req.num_prompt_tokens)
            assert (sent[rid].start, sent[rid].end) == (save.start, save.end) == (start, end)
            table = [np.asarray(g, np.int32) for g in mgr.get_block_ids(rid)]
            want = pair_block_spans(table, self.reg_ids[save.push_id],
                                    [g.block_size for g in self.layout.groups], start, end)
            for g in range(self.layout.num_groups):
                assert save.local_block_ids[g].dtype == save.remote_block_ids[g].dtype == np.int32
                assert save.local_block_ids[g].tolist() == want[0][g].tolist(), (rid, g, save.step)
                assert save.remote_block_ids[g].tolist() == want[1][g].tolist(), (rid, g, save.step)
            self.save_checks += 1

    def close(self):
        self.w.shutdown()


def assert_push_mirror(conn, worker, rid, tracked, table, kcc, where) -> None:
    """P's followed table of a push request against vLLM's own: equal at every position
    D's registration holds a block (every position ever paired); elsewhere vLLM's id or 0
    (sparse appends: step_pairs does not read those ids). Without a registration (not
    pushing) the plain mirror rule. D's registration is the one P's worker holds (the
    scheduler keeps only the push id)."""
    entry = conn._push_reqs.get(rid)
    got = None if entry is None or entry[1] not in conn._registered else \
        worker._regs.get(entry[1])
    # a push into other block sizes reads every id (D's positions are in D's grain)
    if got is None or rid in conn._unpushed or got.remap is not None:
        H.assert_mirror(tracked, table, kcc, where)
        return
    reg = got.ids
    assert len(tracked) == len(table) == len(reg), where
    for g, (mine, vllm_ids, d_ids, grp) in enumerate(zip(tracked, table, reg,
                                                         kcc.kv_cache_groups)):
        mine, vllm_ids = [int(x) for x in mine], [int(x) for x in vllm_ids]
        assert len(mine) == len(vllm_ids), (where, g, len(mine), len(vllm_ids))
        nulls_in_place = isinstance(grp.kv_cache_spec, (SlidingWindowSpec, MambaSpec))
        for p, (a, b) in enumerate(zip(mine, vllm_ids)):
            if a == b or (b == 0 and nulls_in_place):   # equal, or stale where vLLM nulled
                continue
            assert a == 0 and not (p < len(d_ids) and d_ids[p]), (where, g, p, a, b)


def push_params(push_id: str, p_port: int | None = None) -> tuple[dict, dict]:
    """(D's params, P's params) a decode-first proxy sends."""
    d = {"do_remote_prefill": True, "transfer_mode": "push", "push_id": push_id,
         "remote_host": "127.0.0.1", "remote_port": p_port}
    p = {"do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}
    return d, p


def step_until(cond, engines, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        for e in engines:
            e.step()


def registration(D, rid):
    for m in D.metas:
        if m is not None and rid in getattr(m, "push_regs", {}):
            return m.push_regs[rid]
    raise AssertionError(f"no registration of {rid} in D's metadata")


def bad_pages(E, table, num_tokens: int) -> list[tuple[str, int, int]]:
    """``(layer, group, position)`` of every page of a positional table (0 = skipped) whose
    bytes of tokens ``< num_tokens`` differ from the pattern (bytes of later tokens are not
    computed by anyone and are not compared)."""
    bad = []
    for g, ids in enumerate(table):
        spec = E.layout.groups[g]
        bs, nbytes = spec.block_size, E.paged.page_bytes[g]
        for p, b in enumerate(ids):
            if not b:
                continue
            tok = p * bs + np.arange(nbytes) * bs // nbytes
            for layer in spec.layer_names:
                got = read_pages(E.paged.kv_caches[layer], [b])[0]
                want = expected_pages(E.layout, layer, [p], nbytes)[0]
                if not (got[tok < num_tokens] == want[tok < num_tokens]).all():
                    bad.append((layer, g, p))
    return bad
