"""Test-only connectors for the real two-engine runs: hmacore's connectors plus injected faults,
so the negative controls prove the equality tests can fail.

Faults (set in the engine process by the runner's ``fault`` command → :func:`set_fault`):
* ``{"drop_group": g}``: the decode side does not load group g (its blocks keep stale bytes).
  In push mode (``transfer_mode="push"``) set it on the prefill engine: P does not WRITE
  group g into D's blocks (every layer's notification still goes out, so D completes).
* ``{"push_layers": n}`` (push mode, on the prefill engine): the prompt's last step WRITEs
  only its first ``n`` layers (earlier steps push whole), then the push stalls, never
  finishing nor failing: a prefill engine killed after that dies mid-push.
* ``{"fail_read": True}`` (pull, decode engine): every READ the decode engine polls or waits
  for reports a transfer error (the READ itself is real: a peer lost mid-transfer).
* ``{"corrupt_group": g}``: after a load completes, one loaded block of group g (the last one of
  the request's table) is overwritten with noise in every layer of the group.
* ``{"drop_last_key_group": g}`` (``FaultyStoreConnector``): the store key of the last block
  of group g in a request's first load is removed between the scheduler's lookup and the
  worker's load (an eviction in between): that load fails, the fresh lookup sees the rest.
  (``FaultyStoreConnector`` supports ``corrupt_group`` and ``drop_last_key_group``.)
* ``None``: no fault.
"""
from __future__ import annotations

import dataclasses

import torch

from hmacore.integrations.vllm import HmaNixlConnector, HmaStoreConnector

FAULT: dict | None = None


def set_fault(spec: dict | None) -> None:
    global FAULT
    FAULT = dict(spec) if spec else None


def _corrupt(caches: dict, layers_of: list[list[str]], ids: list[list[int]] | None) -> None:
    """Overwrite the last loaded block of the faulted group with noise, in each of its layers."""
    if not FAULT or "corrupt_group" not in FAULT or not ids:
        return
    g = int(FAULT["corrupt_group"])
    if not ids[g]:
        return
    gen = torch.Generator().manual_seed(1)
    for name in layers_of[g]:
        page = caches[name][ids[g][-1]]
        page.copy_(torch.randn(page.shape, generator=gen, dtype=torch.float32).to(page.dtype))


def _drop_last_key(w, ld, g: int) -> None:
    """Remove the store key of the last block of group g the load ``ld`` reads."""
    import numpy as np

    from hmacore.integrations.vllm.store.worker import _hashes
    bs, h = w.finder.block_sizes[g], w.finder.hash_block_size
    last = ld.hit_tokens // bs - 1
    if last < 0:
        return
    rows = np.array([(last + 1) * (bs // h) - 1], dtype=np.int64)
    keys = w.keys.keys(g, w.finder.key_digests(_hashes(ld.hashes, ld.digest_size), g, rows))
    w.store.batch_remove(keys)


def _layers_of(kv_cache_config) -> list[list[str]]:
    return [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]


def _fail_reads(agent) -> None:
    """Under ``fail_read`` every poll / wait of a transfer raises TransferError."""
    from hmacore.errors import TransferError
    poll, wait = agent.poll, agent.wait

    def failing(inner):
        def call(transfer, *args, **kwargs):
            if FAULT and FAULT.get("fail_read"):
                raise TransferError("injected (fail_read): remote peer lost mid-transfer")
            return inner(transfer, *args, **kwargs)
        return call

    agent.poll, agent.wait = failing(poll), failing(wait)


class FaultyStoreConnector(HmaStoreConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        w = self.worker
        if w is None:
            return
        layers_of, caches = _layers_of(kv_cache_config), {}
        register, start_load = w.register_kv_caches, w.start_load_kv
        dropped: set[str] = set()

        def _register(kv_caches):
            caches.update(kv_caches)
            return register(kv_caches)

        def _start_load(meta):
            if FAULT and "drop_last_key_group" in FAULT:
                for rid, ld in meta.loads.items():
                    if rid not in dropped:
                        dropped.add(rid)
                        _drop_last_key(w, ld, int(FAULT["drop_last_key_group"]))
            start_load(meta)
            for rid in meta.loads:
                _corrupt(caches, layers_of, w.loaded_blocks.get(rid))

        w.register_kv_caches, w.start_load_kv = _register, _start_load


class FaultyNixlConnector(HmaNixlConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.worker is not None:
            self._wrap_worker(self.worker, kv_cache_config)

    @staticmethod
    def _wrap_worker(w, kv_cache_config) -> None:
        if hasattr(w, "_start_sub"):             # push mode: faults act on P's WRITEs
            FaultyNixlConnector._wrap_push_worker(w)
            return
        layers_of, caches = _layers_of(kv_cache_config), {}
        loaded: dict[str, list[list[int]]] = {}
        register, start_read, start_load, results = (w.register_kv_caches, w._start_read,
                                                     w.start_load_kv, w.get_transfer_results)

        def corrupt(rid: str) -> None:
            _corrupt(caches, layers_of, loaded.pop(rid, None))

        def _register(kv_caches):
            caches.update(kv_caches)
            out = register(kv_caches)
            _fail_reads(w.agent)
            return out

        def _start_read(rid, rr):
            if FAULT and "drop_group" in FAULT:
                local = [list(g) for g in rr.local_block_ids]
                local[int(FAULT["drop_group"])] = []
                rr = dataclasses.replace(rr, local_block_ids=local)
            loaded[rid] = [list(g) for g in rr.local_block_ids]
            return start_read(rid, rr)

        def _start_load(meta):
            start_load(meta)
            for rid, rr in meta.reqs_to_recv.items():
                if not rr.awaiting:          # sync load: complete now
                    corrupt(rid)

        def _results():
            sending, recving, failed = results()
            for rid in recving - failed:
                corrupt(rid)
            return sending, recving, failed

        w.register_kv_caches, w._start_read = _register, _start_read
        w.start_load_kv, w.get_transfer_results = _start_load, _results

    @staticmethod
    def _wrap_push_worker(w) -> None:
        start_sub = w._start_sub

        def _start_sub(save):
            if FAULT and "drop_group" in FAULT:
                g = int(FAULT["drop_group"])
                local, remote = list(save.local_block_ids), list(save.remote_block_ids)
                local[g], remote[g] = [], []
                rg = save.regrain
                if rg is not None:         # a block-size remap step: no tokens of group g
                    rg = tuple([0 if k == g else x for k, x in enumerate(v)] for v in rg)
                save = dataclasses.replace(save, local_block_ids=local, remote_block_ids=remote,
                                           regrain=rg)
            return start_sub(save)

        w._start_sub = _start_sub
        register = w.register_kv_caches

        def _register(kv_caches):
            plan = register(kv_caches)
            save_layer = w.pusher.save_layer

            def _save_layer(sub, layer):
                final = "." not in sub.partition(">")[0]     # final steps: "<tag>><rank>"
                if FAULT and "push_layers" in FAULT and final \
                        and w.layers.layers.index(layer) >= int(FAULT["push_layers"]):
                    return
                return save_layer(sub, layer)

            w.pusher.save_layer = _save_layer
            return plan

        w.register_kv_caches = _register
