"""P/D with different block sizes (HMA on) through the pull connector, real NIXL: two engines
in one process, each vLLM's real Scheduler with a SCHEDULER-role HmaNixlConnector and a
WORKER-role one over paged KV memory shaped like vLLM's CPU pages (token-major rows). P's
token rows carry a tag of (layer, token); after D's load every byte of D's memory is checked:
the rows of tokens D needed (per group: window, prefix) hold P's tags, nothing else changed.
P frees on D's notification; neither engine leaks a block."""
import os
import time

import numpy as np
import pytest

import harness as H
import push_harness as PH
from ports import free_port
from test_pd_nixl import drain_p
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hmacore.demo.paged_memory import allocate_paged_kv
from hmacore.integrations.vllm.nixl.connector import HmaNixlConnector
from hmacore.paged import layer_geometry
from hmacore.regrain import token_ranges

pytestmark = pytest.mark.nixl
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class Engine:
    def __init__(self, kcc, remap=None, **vkw):
        # HMACORE_TEST_TRANSPORT=mooncake (tests/mooncake/test_te_connector.py): over TE
        extra = {"side_channel_port": free_port(), "kv_lease_duration": 30, **PH.TRANSPORT}
        if remap is not None:                        # default: on
            extra["block_size_remap"] = remap
        self.vc = H.vllm_config(extra=extra, **vkw)
        self.kcc = kcc
        self.s = H.make_scheduler(self.vc, self.kcc)
        self.w = HmaNixlConnector(self.vc, KVConnectorRole.WORKER, self.kcc)
        self.paged = allocate_paged_kv(self.w.layout, self.kcc.num_blocks)
        self.w.register_kv_caches(self.paged.kv_caches)
        assert type(self.w.worker.agent).__name__ == (     # the configured transport's driver
            "MooncakeTeAgent" if PH.TRANSPORT else "NixlAgent")
        self.d = H.Driver(self.s, worker=self.w)

    def close(self):
        self.w.shutdown()


def tag(g, j, t, n):
    x = (np.arange(n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    x ^= np.full(1, (g << 48) | (j << 40) | t, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
    return (x >> np.uint64(40)).astype(np.uint8)


def rows(layout, g, page):
    """Token rows of a block: (bs, bytes per token) -- every page here is token-major
    (LBNHC: [tokens, heads*2*head_size]; MLA: [tokens, latent])."""
    bs = layout.groups[g].block_size
    return bs, page // bs


def hashed(kcc):
    """A KV cache config whose hash block size the engine resolved to its block size (what a
    real engine's layout takes as its prefix-match unit)."""
    kcc.hash_block_size = kcc.kv_cache_groups[0].kv_cache_spec.block_size
    return kcc


CASES = {
    "gemma_p16_d32": (dict(block_size=16), lambda: H.gemma_like(num_blocks=64, bs=16),
                      dict(block_size=32), lambda: H.gemma_like(num_blocks=64, bs=32), 150),
    "gemma_p32_d8": (dict(block_size=32), lambda: H.gemma_like(num_blocks=64, bs=32),
                     dict(block_size=8), lambda: H.gemma_like(num_blocks=160, bs=8), 150),
    # D's blocks (and so its hash unit) larger than P's: P's layout takes P's unit
    "gemma_p64_d128": (dict(block_size=64), lambda: H.gemma_like(num_blocks=32, bs=64),
                       dict(block_size=128), lambda: hashed(H.gemma_like(num_blocks=32, bs=128)),
                       150),
    "dsv4_p1x_d2x": (dict(max_num_batched_tokens=1024), lambda: H.dsv4_like(num_blocks=600),
                     dict(max_num_batched_tokens=1024),
                     lambda: H.dsv4_like(num_blocks=400, sizes=(512, 128, 128, 8, 16)), 600),
    "dsv4_p1x_dhalf": (dict(max_num_batched_tokens=1024), lambda: H.dsv4_like(num_blocks=600),
                       dict(max_num_batched_tokens=1024),
                       lambda: H.dsv4_like(num_blocks=1000, sizes=(128, 32, 32, 2, 4)), 600),
}


def qwen3_next_none(num_blocks: int, bs: int):
    """qwen3_next_like in Mamba "none" mode as vLLM sets it up: the Mamba block size is
    max_model_len (MambaModelConfig.verify_and_update_config), equal on both engines, its
    page padded to this engine's attention page (which follows --block-size)."""
    kcc = H.qwen3_next_like(num_blocks=num_blocks, bs=bs, mode="none")
    grp = kcc.kv_cache_groups[1]
    grp.kv_cache_spec = H.mamba(H.MAX_LEN, kcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
                                "none")
    return kcc


#: P/D with Mamba state groups of other block sizes: (P kwargs, P config, D kwargs, D config,
#: prompt length); align mode: the Mamba block size is --block-size on each engine
MAMBA_CASES = {
    "qwen3next_align_p32_d64": (dict(block_size=32, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=32),
                                dict(block_size=64, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=64), 200),
    "qwen3next_align_p64_d32": (dict(block_size=64, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=64),
                                dict(block_size=32, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=32), 200),
    # a prompt ending inside a block of both engines
    "qwen3next_align_p32_d64_150": (dict(block_size=32, mamba_cache_mode="align"),
                                    lambda: H.qwen3_next_like(num_blocks=64, bs=32),
                                    dict(block_size=64, mamba_cache_mode="align"),
                                    lambda: H.qwen3_next_like(num_blocks=64, bs=64), 150),
    "qwen3next_none_p32_d64": (dict(block_size=32, mamba_cache_mode="none", prefix_caching=False),
                               lambda: qwen3_next_none(64, 32),
                               dict(block_size=64, mamba_cache_mode="none", prefix_caching=False),
                               lambda: qwen3_next_none(64, 64), 200),
}
CASES.update(MAMBA_CASES)


def _state_page(paged, lay, num_blocks, name, b):
    """The bytes of block ``b``'s state page of Mamba layer ``name`` (padding included): the
    page's parts sit back to back from its start (hmacore.paged.layer_geometry)."""
    _, geo, _ = layer_geometry(lay, num_blocks, page_bytes=paged.page_bytes)
    s, off, stride, _ = geo[name][0]
    return paged.storages[s][off + b * stride: off + (b + 1) * stride]


def _expect_states(want, P, D, p_table, d_table, s_tokens, end) -> int:
    """Write, into ``want`` (D's storages), P's state after ``s_tokens`` tokens (P's block at
    its table position cdiv(s, P's bs) - 1, vLLM's align/none rule) over D's slot for the
    state after ``end`` tokens (position cdiv(end, D's bs) - 1): the unpadded state bytes
    only (MambaSpec.state_content_size_bytes); the rest of D's page keeps its bytes."""
    assert end == s_tokens, f"D's load ends at {end}, P's state is after {s_tokens} tokens"
    moved = 0
    lay = D.w.layout
    _, geo, _ = layer_geometry(lay, D.kcc.num_blocks, page_bytes=D.paged.page_bytes)
    for g, spec in enumerate(lay.groups):
        if spec.kind.name != "MAMBA":
            continue
        n = D.kcc.kv_cache_groups[g].kv_cache_spec.state_content_size_bytes
        pbs, dbs = P.w.layout.groups[g].block_size, spec.block_size
        pb = p_table[g][-(-s_tokens // pbs) - 1]
        db = d_table[g][-(-end // dbs) - 1]
        assert pb and db, (g, p_table[g], d_table[g])
        assert P.paged.page_bytes[g] != D.paged.page_bytes[g] and n < min(
            P.paged.page_bytes[g], D.paged.page_bytes[g])      # padded differently
        for name in spec.layer_names:
            src = _state_page(P.paged, P.w.layout, P.kcc.num_blocks, name, pb)
            s, off, stride, _ = geo[name][0]
            a = off + db * stride
            want[s][a:a + n] = src[:n]
            moved += n
    return moved


def _expect_tokens(want, lay, page_bytes, geo, table, lo, hi) -> int:
    """Write P's tags for tokens [lo[g], hi[g]) into ``want`` (D's storages) at D's blocks
    ``table``; the bytes written."""
    moved = 0
    for g, spec in enumerate(lay.groups):
        if spec.kind.name == "MAMBA":
            continue                       # states: _expect_states
        bs, row = rows(lay, g, page_bytes[g])
        for j, name in enumerate(spec.layer_names):
            (s, off, stride, _), = geo[name]
            for t in range(lo[g], hi[g]):
                b = table[g][t // bs]
                assert b, f"group {g}: D has no block for token {t}"
                a = off + b * stride + (t % bs) * row
                want[s][a:a + row] = tag(g, j, t, row)
                moved += row
    return moved


def _assert_storages(case, storages, want, moved) -> None:
    for k, (a, w) in enumerate(zip(storages, want)):
        bad = np.flatnonzero(a != w)
        assert bad.size == 0, f"{case}: storage {k}: {bad.size} bytes differ"
    assert moved > 0


@pytest.mark.parametrize("case", list(CASES))
def test_pd_pull_other_block_sizes_every_byte(case):
    pkw, pk, dkw, dk, n = CASES[case]
    P, D = Engine(pk(), **pkw), Engine(dk(), **dkw)
    try:
        prompt = [1 + i % 900 for i in range(n)]
        p_req = H.make_request("req", prompt, H.C.resolve_kv_cache_block_sizes(
            P.kcc, P.vc)[1], params={"do_remote_decode": True}, max_tokens=1)
        P.s.add_request(p_req)
        while "req" not in P.d.finished_params():
            P.d.step()
        params = P.d.finished_params()["req"]
        assert params["remote_block_sizes"] != list(D.w.layout.block_sizes)
        # the "model" wrote the prompt's KV: every token row of every block P holds
        p_table = P.s.kv_cache_manager.get_block_ids("req")
        for g, spec in enumerate(P.w.layout.groups):
            bs, row = rows(P.w.layout, g, P.paged.page_bytes[g])
            for j, name in enumerate(spec.layer_names):
                if spec.kind.name == "MAMBA":     # every state page P holds: its own bytes
                    for i, b in enumerate(p_table[g]):
                        if b:
                            page = _state_page(P.paged, P.w.layout, P.kcc.num_blocks, name, b)
                            page[:] = tag(g, j, i, page.shape[0])
                    continue
                arr = P.paged.kv_caches[name].reshape(P.kcc.num_blocks, bs, row)
                for i, b in enumerate(p_table[g]):
                    if b:
                        for r in range(bs):
                            arr[b, r] = tag(g, j, i * bs + r, row)
        rng = np.random.default_rng(3)
        for s in D.paged.storages:
            s[...] = rng.integers(0, 256, s.shape, dtype=np.uint8)
        before = [s.copy() for s in D.paged.storages]

        hbs = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        d_req = H.make_request("d-req", prompt, hbs, params=params, max_tokens=3)
        D.s.add_request(d_req)
        D.d.step()                                       # READ posted
        rr = D.d.metas[-1].reqs_to_recv["d-req"]
        assert rr.awaiting and rr.remote.block_sizes == params["remote_block_sizes"]
        deadline = time.monotonic() + 30
        while d_req.status == H.RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert time.monotonic() < deadline, "READ did not complete"
            D.d.step()
            P.d.step()          # P answers the READ's done: D takes the data only then
        # expected: D's memory as before, plus P's tags on the rows of the tokens D needed
        lay = D.w.layout
        _, geo, _ = layer_geometry(lay, D.kcc.num_blocks, page_bytes=D.paged.page_bytes)
        want = [b.copy() for b in before]
        d_table = D.s.kv_cache_manager.get_block_ids("d-req")
        end = rr.load_start + rr.num_external_tokens
        lo, hi = token_ranges(lay, end, rr.load_start)
        moved = _expect_tokens(want, lay, D.paged.page_bytes, geo, d_table, lo, hi)
        if case in MAMBA_CASES:
            moved += _expect_states(want, P, D, p_table, d_table, params["remote_num_tokens"],
                                    end)
        _assert_storages(case, D.paged.storages, want, moved)
        if case in MAMBA_CASES:
            # D computes the prompt's suffix after the load: the backoff token(s) P left
            so = D.d.step()
            assert end == n - D.s.connector.scheduler.backoff
            assert so.num_scheduled_tokens.get("d-req") == n - end, so.num_scheduled_tokens
        D.d.run()
        H.assert_no_leak(D.s)
        drain_p(P)
    finally:
        P.close()
        D.close()


def test_remap_off_refuses_other_block_sizes(caplog):
    """The off switch on D (kv_connector_extra_config.block_size_remap=false): P's blocks of
    another size are refused with the reason logged, D computes the prompt itself."""
    P = Engine(H.gemma_like(num_blocks=64, bs=16), block_size=16)
    D = Engine(H.gemma_like(num_blocks=64, bs=32), remap=False, block_size=32)
    try:
        prompt = [1 + i % 900 for i in range(100)]
        P.s.add_request(H.make_request("req", prompt, H.C.resolve_kv_cache_block_sizes(
            P.kcc, P.vc)[1], params={"do_remote_decode": True}, max_tokens=1))
        while "req" not in P.d.finished_params():
            P.d.step()
        params = P.d.finished_params()["req"]
        d_req = H.make_request("d-req", prompt, H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1],
                               params=params, max_tokens=2)
        D.s.add_request(d_req)
        D.d.step()
        rr = D.d.metas[-1].reqs_to_recv["d-req"]    # nothing read; P is told "done" only
        assert rr.remote.known_only and not any(rr.local_block_ids)   # if D holds its agent
        assert "P's block sizes [16, 16] differ from ours [32, 32] and kv_connector_extra_" \
               "config.block_size_remap is false" in caplog.text
        D.d.run()
        H.assert_no_leak(D.s)
    finally:
        P.close()
        D.close()


class PushEngine(PH.Engine):
    """A push-mode engine (tests/vllm/push_harness.py) whose "forward pass" writes, per layer,
    the tag of (group, layer, token) into the token row of every token that becomes computed
    this step (rows: the spec's page bytes / block size, equal at any block size)."""

    def __init__(self, make_kcc, **vkw):
        super().__init__(make_kcc, page_bytes=None, **vkw)
        self.remap_saves = 0

    def _forward(self, so) -> None:
        for layer in self.layers:
            g = self.layout.layer_to_group[layer]
            spec = self.layout.groups[g]
            bs, row = rows(self.layout, g, self.paged.page_bytes[g])
            j = spec.layer_names.index(layer)
            if spec.kind.name == "MAMBA":
                self._forward_state(so, g, j, layer)
                self.w.save_kv_layer(layer, None, None)
                continue
            arr = self.paged.kv_caches[layer].reshape(self.kcc.num_blocks, bs, row)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.s.requests[rid]
                end = min(req.num_computed_tokens, req.num_prompt_tokens)
                table = self.s.kv_cache_manager.get_block_ids(rid)[g]
                for t in range(max(0, end - n), end):
                    if t // bs < len(table) and table[t // bs]:
                        arr[table[t // bs], t % bs] = tag(g, j, t, row)
            self.w.save_kv_layer(layer, None, None)

    def _forward_state(self, so, g, j, layer) -> None:
        """A Mamba layer: the state after this step's last computed prompt token ``end`` goes
        to the block at position cdiv(end, bs) - 1 (vLLM align mode; "none" mode: the block
        size is max_model_len, position 0, overwritten each step), its whole page (padding
        included) the tag of (group, layer, end): a state of another step differs."""
        bs = self.layout.groups[g].block_size
        for rid, n in so.num_scheduled_tokens.items():
            req = self.s.requests[rid]
            end = min(req.num_computed_tokens, req.num_prompt_tokens)
            if end <= max(0, req.num_computed_tokens - n):
                continue                       # nothing of the prompt computed this step
            table = self.s.kv_cache_manager.get_block_ids(rid)[g]
            b = table[-(-end // bs) - 1]
            assert b, (rid, g, end, table)
            page = _state_page(self.paged, self.layout, self.kcc.num_blocks, layer, b)
            page[:] = tag(g, j, end, page.shape[0])

    def _check_push_saves(self, so) -> None:
        # remap steps carry token ranges and each side's blocks (checked by D's bytes)
        saves = self.planned[-1]          # P's worker planned them (design (b))
        self.remap_saves += sum(s.regrain is not None for s in saves.values())


PUSH_CASES = {   # name: (P kwargs, P config, D kwargs, D config, prompt, P's budget per step)
    "gemma_p16_d32_chunk40": (dict(block_size=16), lambda: H.gemma_like(num_blocks=64, bs=16),
                              dict(block_size=32), lambda: H.gemma_like(num_blocks=64, bs=32),
                              [150], 40),
    "gemma_p32_d8": (dict(block_size=32), lambda: H.gemma_like(num_blocks=64, bs=32),
                     dict(block_size=8), lambda: H.gemma_like(num_blocks=160, bs=8), [150], 256),
    "dsv4_p1x_dhalf_chunk200": (dict(), lambda: H.dsv4_like(num_blocks=600), dict(),
                                lambda: H.dsv4_like(num_blocks=1000, sizes=(128, 32, 32, 2, 4)),
                                [600], 200),
    # the two-engine test's batch: four prompts sharing P's 64-token steps
    "gemma_p64_d32_batch": (dict(block_size=64), lambda: H.gemma_like(num_blocks=64, bs=64),
                            dict(block_size=32), lambda: H.gemma_like(num_blocks=128, bs=32),
                            [10, 100, 150, 37], 64),
}
#: Mamba state groups of other block sizes (TP 1): the state after P's prompt (less the
#: backoff) lands in D's slot for the state after its registered tokens
PUSH_MAMBA_CASES = {
    # align mode, one budget: vLLM still cuts the prompt at its last block boundary (2 steps)
    "qwen3next_align_p32_d64": (dict(block_size=32, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=32),
                                dict(block_size=64, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=64), [200], 256),
    "qwen3next_align_p64_d32": (dict(block_size=64, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=64),
                                dict(block_size=32, mamba_cache_mode="align"),
                                lambda: H.qwen3_next_like(num_blocks=64, bs=32), [200], 256),
    # P's state point (129 - 1 backoff = 128) on a block boundary of both engines, and a
    # prompt ending inside a block of both (149) in one batch
    "qwen3next_align_p32_d64_ends": (dict(block_size=32, mamba_cache_mode="align"),
                                     lambda: H.qwen3_next_like(num_blocks=64, bs=32),
                                     dict(block_size=64, mamba_cache_mode="align"),
                                     lambda: H.qwen3_next_like(num_blocks=64, bs=64),
                                     [129, 150], 512),
    # chunked prefill: P's states of earlier steps sit at other positions, not D's to take
    "qwen3next_align_p64_d32_chunk64": (dict(block_size=64, mamba_cache_mode="align"),
                                        lambda: H.qwen3_next_like(num_blocks=64, bs=64),
                                        dict(block_size=32, mamba_cache_mode="align"),
                                        lambda: H.qwen3_next_like(num_blocks=64, bs=32),
                                        [200], 64),
    # "none" mode: one state block (position 0) rewritten every step; only the last is D's
    "qwen3next_none_p32_d64_chunk64": (dict(block_size=32, mamba_cache_mode="none",
                                            prefix_caching=False),
                                       lambda: qwen3_next_none(64, 32),
                                       dict(block_size=64, mamba_cache_mode="none",
                                            prefix_caching=False),
                                       lambda: qwen3_next_none(64, 64), [200], 64),
}
PUSH_CASES.update(PUSH_MAMBA_CASES)


def _expect_pushed_states(want, P, D, reg, s_tokens) -> int:
    """Write into ``want`` (D's storages) the state P's forward pass left after its
    ``s_tokens`` prompt tokens (PushEngine._forward_state's tag of (group, layer, s)) over
    D's registered slot for the state after ``reg.num_tokens`` tokens (position
    cdiv(n, D's bs) - 1): its unpadded state bytes only; D's padding keeps its bytes."""
    assert reg.num_tokens == s_tokens, (reg.num_tokens, s_tokens)
    moved = 0
    lay = D.layout
    _, geo, _ = layer_geometry(lay, D.kcc.num_blocks, page_bytes=D.paged.page_bytes)
    for g, spec in enumerate(lay.groups):
        if spec.kind.name != "MAMBA":
            continue
        n = D.kcc.kv_cache_groups[g].kv_cache_spec.state_content_size_bytes
        assert P.paged.page_bytes[g] != D.paged.page_bytes[g] and n < min(
            P.paged.page_bytes[g], D.paged.page_bytes[g])      # padded differently
        slot = -(-reg.num_tokens // spec.block_size) - 1
        assert [p for p, b in enumerate(reg.block_ids[g]) if b] == [slot]
        db = reg.block_ids[g][slot]
        for j, name in enumerate(spec.layer_names):
            s, off, stride, _ = geo[name][0]
            a = off + db * stride
            want[s][a:a + n] = tag(g, j, s_tokens, n)
            moved += n
    return moved


@pytest.mark.parametrize("case", list(PUSH_CASES))
def test_pd_push_other_block_sizes_every_byte(case):
    """Push mode (decode first) into a decode engine of other block sizes: P's worker WRITEs
    every layer of every step as byte runs of the tokens D needs (chunked prefill: several
    steps, several requests per step). Every byte of D's memory is checked: per group the
    token rows of the tokens D needs hold P's tags, every other byte still holds D's junk."""
    pkw, pk, dkw, dk, lengths, budget = PUSH_CASES[case]
    P = PushEngine(pk, max_num_batched_tokens=budget, **pkw)
    D = PushEngine(dk, max_num_batched_tokens=max(budget, 1024 if "dsv4" in case else 256),
                   **dkw)
    # D's own forward pass stays off: with Mamba groups D computes the backoff token itself
    # once its push is in, which may come a step before another request's push ends
    D.forward = False
    try:
        assert P.layout.block_sizes != D.layout.block_sizes
        before = [s.copy() for s in D.paged.storages]
        dh = H.C.resolve_kv_cache_block_sizes(D.kcc, D.vc)[1]
        ph = H.C.resolve_kv_cache_block_sizes(P.kcc, P.vc)[1]
        reqs = []
        for k, n in enumerate(lengths):
            prompt = [1 + (i * 7 + 31 * k) % 900 for i in range(n)]
            d_params, p_params = PH.push_params(f"push-remap-{k}", P.port)
            reqs.append((H.make_request(f"d-{k}", prompt, dh, params=d_params, max_tokens=3),
                         H.make_request(f"p-{k}", prompt, ph, params=p_params, max_tokens=1)))
        for d_req, _ in reqs:
            D.s.add_request(d_req)
        D.step()
        for _, p_req in reqs:
            P.s.add_request(p_req)
        PH.step_until(lambda: not D.conn.awaiting(), [P, D], what="the pushes complete")
        assert not D.conn.failed_recving
        for k in range(len(lengths)):
            steps = [m[f"p-{k}"] for m in P.planned if f"p-{k}" in m]
            assert steps and all(s.regrain is not None for s in steps) and steps[-1].final
        assert P.remap_saves > (len(lengths) if budget < sum(lengths) else 0)
        lay = D.layout
        _, geo, _ = layer_geometry(lay, D.kcc.num_blocks, page_bytes=D.paged.page_bytes)
        want = [b.copy() for b in before]
        moved = 0
        for k in range(len(lengths)):
            reg = PH.registration(D, f"d-{k}")
            lo, hi = token_ranges(lay, reg.num_tokens, reg.start_tokens)
            moved += _expect_tokens(want, lay, D.paged.page_bytes, geo, reg.block_ids, lo, hi)
            if case in PUSH_MAMBA_CASES:
                moved += _expect_pushed_states(want, P, D, reg, lengths[k] - P.conn.backoff)
        _assert_storages(case, D.paged.storages, want, moved)
        PH.step_until(lambda: not D.s.requests, [D], what="D finishes")
        H.assert_no_leak(D.s)
        PH.step_until(lambda: not P.s.requests, [P], what="P frees its blocks")
        H.assert_no_leak(P.s)
        assert P.conn.leases() == {} and P.conn.registered() == set()
    finally:
        P.close()
        D.close()


def _qwen3_next_other_state(num_blocks: int, bs: int):
    """qwen3_next_like whose Mamba layer holds a larger state (another model): state bytes
    differ from qwen3_next_like's, the page still padded to the attention page."""
    from vllm.v1.kv_cache_interface import MambaSpec
    kcc = H.qwen3_next_like(num_blocks=num_blocks, bs=bs)
    page = kcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    kcc.kv_cache_groups[1].kv_cache_spec = MambaSpec(
        block_size=bs, shapes=((4, 8), (32,)), dtypes=(H.DT, H.DT), page_size_padded=page,
        mamba_cache_mode="align")
    return kcc


@pytest.mark.parametrize("p_first", [True, False], ids=["p-request-first", "refusal-first"])
def test_push_remap_refuses_mamba_states_of_other_bytes(p_first):
    """Push into a decode engine of other block sizes whose Mamba state has other bytes: P's
    worker refuses D's registration naming the rule (before any WRITE), D's request fails
    (failed_recving, nothing of P's in D's memory), P prefills without push at once: the
    refusal withdraws the push from P's scheduler, whether P's request came before it
    (``p-request-first``: the request was waiting for the registration) or comes after it
    (``refusal-first``: forced, P's request is added only once P's worker has refused).
    P's registration timeout (600 s) is far past step_until's bound, so waiting it out fails
    the test. (It used to be 1 s: a registration reaching a loaded P later than that found
    the push already given up and was answered ``failed`` without the state check.)"""
    P = PushEngine(lambda: H.qwen3_next_like(num_blocks=64, bs=32), max_num_batched_tokens=256,
                   block_size=32, mamba_cache_mode="align",
                   extra={"push_register_timeout": 600.0})
    D = PushEngine(lambda: _qwen3_next_other_state(64, 64), max_num_batched_tokens=256,
                   block_size=64, mamba_cache_mode="align")
    rule = ("Mamba groups [1]: the decode engine's state bytes [128] differ from this "
            "engine's [96] (registration field 'state')")
    try:
        assert P.w.worker.state_bytes != D.w.worker.state_bytes
        before = [s.copy() for s in D.paged.storages]
        prompt = [1 + i % 900 for i in range(150)]
        d_params, p_params = PH.push_params("states", P.port)

        def add_p():
            P.s.add_request(H.make_request("p", prompt, H.C.resolve_kv_cache_block_sizes(
                P.kcc, P.vc)[1], params=p_params, max_tokens=1))
        if p_first:
            add_p()
        D.s.add_request(H.make_request("d", prompt, H.C.resolve_kv_cache_block_sizes(
            D.kcc, D.vc)[1], params=d_params, max_tokens=2))
        PH.step_until(lambda: "d" in D.conn.failed_recving, [P, D], what="D's request fails")
        errs = " ".join(P.w.worker.errors)
        assert rule in errs, errs
        if not p_first:
            assert not P.s.requests
            add_p()
        for a, b in zip(D.paged.storages, before):
            assert np.array_equal(a, b)
        PH.step_until(lambda: not P.s.requests, [P], what="P runs without push")
        assert all(not m.push_saves for m in P.metas if m)
        H.assert_no_leak(P.s)
    finally:
        P.close()
        D.close()


def test_push_remap_state_points_must_agree():
    """P's worker pairs a Mamba state only between equal points: P's state after its prompt
    (``end``) must be the state D registered its slot for (``n``); else BlockTableError
    naming both (the push fails, never a wrong state). Equal points pair P's block at
    cdiv(end, P's bs) - 1 with D's at cdiv(n, D's bs) - 1; a null slot on D moves nothing."""
    from hmacore.errors import BlockTableError
    from hmacore.integrations.vllm.nixl.push_worker import HmaPushWorker
    w = object.__new__(HmaPushWorker)
    w._block_sizes = (32, 32)
    mine = np.arange(1, 9, dtype=np.int32)            # P's blocks 1..8 at positions 0..7
    theirs = np.array([0, 0, 70, 0], dtype=np.int32)  # D's slot at position 2 (bs 64)
    with pytest.raises(BlockTableError, match=r"group 1 \(Mamba\): this engine's state is "
                       r"after its 150 prompt tokens, the decode engine registered its state "
                       r"slot for 149 tokens"):
        w._state_pair(1, mine, theirs, 150, 149, 64)
    p, d = w._state_pair(1, mine, theirs, 149, 149, 64)
    assert (p.tolist(), d.tolist()) == ([5], [70])    # cdiv(149, 32) - 1 = 4; cdiv(149, 64) - 1
    p, d = w._state_pair(1, mine, np.zeros(4, np.int32), 149, 149, 64)
    assert p.size == d.size == 0
    with pytest.raises(BlockTableError, match="holds no state block at position 4"):
        w._state_pair(1, np.zeros(8, np.int32), theirs, 149, 149, 64)
