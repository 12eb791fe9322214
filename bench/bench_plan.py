"""Descriptor-id flattening per request: hmacore (Cython) next to the plain-Python oracle, a
vectorized NumPy reference (the vLLM-style ``off[:, None] + ids[None, :]``, on int32 arrays)
and vLLM 0.32's own ``_compute_desc_ids``; hmacore and vLLM start from the per-group
``list[int]`` tables a worker receives in the connector metadata; results checked equal first.
Groups ``desc_ids-<preset>-<tokens>`` put the three side by side."""
import numpy as np
import pytest

from hmacore.plan import TransferPlan
from hmacore.presets import get_preset, preset_names

from oracle_plan import oracle_desc_ids

TOKENS = [4096, 32768, 131072]


def request_table(plan, tokens, seed=0):
    """Disjoint random block ids per group, as many as the (window-clipped) request moves."""
    rng = np.random.default_rng(seed)
    counts = plan.request_blocks(tokens)
    pool = rng.permutation(np.arange(1, plan.regions[0].logical_blocks, dtype=np.int32))
    out, k = [], 0
    for n in counts:
        out.append(np.sort(pool[k:k + n]))
        k += n
    return out


def numpy_reference(plan, table):
    """The same ids with NumPy broadcasting per (group, region) run."""
    off = np.concatenate([[0], np.cumsum([r.num_descs for r in plan.regions])[:-1]])
    gstate = [s.kind.name == "MAMBA" for s in plan.layout.groups]

    def runs_for(g, r):
        reg = plan.regions[r]
        ids = table[g].astype(np.int64)
        if not reg.state and reg.ratio > 1:
            ids = (ids[:, None] * reg.ratio + np.arange(reg.ratio)).ravel()
        return off[r] + ids

    def serves(r, g):
        reg = plan.regions[r]
        return reg.state == gstate[g] and reg.group in (-1, g)

    parts = []
    if plan.group_major:
        for g in range(len(table)):
            if table[g].size:
                parts += [runs_for(g, r) for r in range(len(plan.regions)) if serves(r, g)]
    else:
        for r in range(len(plan.regions)):
            parts += [runs_for(g, r) for g in range(len(table)) if table[g].size and serves(r, g)]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


@pytest.fixture(scope="module", params=preset_names())
def preset_plan(request):
    return request.param, TransferPlan.from_layout(get_preset(request.param, num_blocks=65536))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("impl", ["hmacore", "numpy", "oracle"])
def test_desc_ids(benchmark, preset_plan, tokens, impl):
    preset, plan = preset_plan
    table = request_table(plan, tokens)
    want = plan.desc_ids(table)
    benchmark.group = f"desc_ids-{preset}-{tokens}"
    benchmark.extra_info["descriptors"] = int(want.size)
    if impl == "hmacore":
        # from what the worker really has: the metadata's per-group lists of Python ints
        lists = tuple(t.tolist() for t in table)
        out = np.empty(want.size, np.int64)
        got = benchmark(plan.desc_ids, lists, out=out)
    elif impl == "numpy":
        got = benchmark(numpy_reference, plan, table)
    else:
        lists = [t.tolist() for t in table]
        regions = [(r.logical_blocks, r.ratio, r.group, r.state) for r in plan.regions]
        gstate = [s.kind.name == "MAMBA" for s in plan.layout.groups]
        got = benchmark(oracle_desc_ids, regions, gstate, lists, group_major=plan.group_major)
    assert np.array_equal(np.asarray(got, dtype=np.int64), want)


# vLLM 0.32.0's own NixlBaseConnectorWorker._compute_desc_ids on the same regions. Its SSM path
# needs the worker's conv-state decomposition, so the Mamba preset (qwen3-next) is left out.
VLLM_PRESETS = [p for p in preset_names() if p != "qwen3-next-80b"]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("preset", VLLM_PRESETS)
def test_desc_ids_vllm(benchmark, preset, tokens):
    from types import SimpleNamespace

    from hmacore.integrations.vllm import _compat  # noqa: F401  (pins the vLLM version)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker)
    plan = TransferPlan.from_layout(get_preset(preset, num_blocks=65536))
    assert not any(r.state or r.ratio != 1 for r in plan.regions)
    table = request_table(plan, tokens)
    want = plan.desc_ids(table)
    lists = tuple(t.tolist() for t in table)          # vLLM's BlockIds arrive as lists
    groups = [r.group for r in plan.regions]
    worker = SimpleNamespace(_has_mamba=False, _conv_decomp=None, _transfer_layer_group_ids=[],
                             num_regions=len(plan.regions), block_len_per_layer=groups,
                             region_group_ids=groups, _uses_region_group_mapping=plan.group_major)
    benchmark.group = f"desc_ids-{preset}-{tokens}"
    benchmark.extra_info["impl"] = "vllm"
    got = benchmark(NixlBaseConnectorWorker._compute_desc_ids, worker, lists, 65536, None, 1,
                    [r.logical_blocks for r in plan.regions], groups, plan.group_major)
    assert np.array_equal(np.asarray(got, dtype=np.int64), want)
