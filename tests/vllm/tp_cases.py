"""Mixed-TP test engines: configs, per-rank KV caches shaped like vLLM's CPU pages, and the
byte pattern written by P and checked by D. Shared by tp_rank.py (rank processes) and
tp_harness.py (the scheduler process)."""
import dataclasses
import os
from typing import Any, Callable

import torch

import numpy as np

import harness as H
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.v1.kv_cache_interface import (KVCacheConfig, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowMLASpec)

import test_state_tp_vllm as STV   # vLLM's state shapes and its weight-loader oracle

MLA = (MLAAttentionSpec, SlidingWindowMLASpec)

TOTAL_HEADS = 2  # the gemma2_tiny fixture's num_key_value_heads (vLLM shards these)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[int], Any]        # TP size -> the worker's KVCacheConfig (per-rank heads)
    vkw: dict
    prompt_tokens: int
    #: pages as vLLM CPU's "vec" attention kernel writes them (per head K transposed, then V):
    #: a block-size remap moves token rows, so the pattern must sit where the kernel puts it
    vec: bool = False
    #: Mamba cases: (tests/vllm/test_state_tp_vllm.py MODELS key or "short_conv", conv
    #: layout "DS"/"SD"); the rank processes run with VLLM_SSM_CONV_STATE_LAYOUT set to the
    #: layout
    state: tuple[str, str] | None = None

    def kcc(self, tp: int):
        return self.make(tp)

    @property
    def env(self) -> dict[str, str]:
        return {} if self.state is None else {"VLLM_SSM_CONV_STATE_LAYOUT": self.state[1]}


#: the Mamba layers of the state cases (one full-attention layer besides)
STATE_LAYERS = ("model.layers.0.linear_attn", "model.layers.1.linear_attn")


def _oriented(conv: tuple, layout: str) -> tuple:
    """vLLM's per-rank conv state shape in ``layout`` (whatever this process's layout)."""
    conv = tuple(conv)
    return conv if (layout == "DS") == mamba_utils.is_conv_state_dim_first() else conv[::-1]


#: the ShortConv layers of the "short_conv" state case (LFM2's convolution block, vLLM's
#: ``ShortConv``): hidden size and ``conv_L_cache`` (LFM2's 3: two conv state rows)
SHORT_CONV_DIM, SHORT_CONV_L = 32, 3


def short_conv_spec(tp: int, layout: str, bs: int, page: int) -> MambaSpec:
    """The MambaSpec vLLM's ``ShortConv`` layer builds (``get_kv_cache_spec``) at ``tp``:
    one conv state ``MambaStateShapeCalculator.short_conv_state_shape`` (in ``layout``) in
    the dtype ``MambaStateDtypeCalculator.short_conv_state_dtype`` gives
    for the test model, mamba_type SHORT_CONV. hmacore has no state geometry for it
    (``_compat.mamba_state_geometry``: "state sharding not modelled"); the rank processes
    build the real layers and check their spec equals this one (tp_rank.short_conv_layers)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    (conv,) = mamba_utils.MambaStateShapeCalculator.short_conv_state_shape(
        tp, SHORT_CONV_DIM, SHORT_CONV_L)
    dtypes = MambaStateDtypeCalculator.short_conv_state_dtype(H.model_config().dtype, "auto")
    return MambaSpec(block_size=bs, shapes=(_oriented(conv, layout),), dtypes=dtypes,
                     mamba_type=MambaAttentionBackendEnum.SHORT_CONV, page_size_padded=page,
                     mamba_cache_mode="align")


def state_hybrid(model: str, layout: str, tp: int, bs: int = 64,
                 num_blocks: int = 64, head: int = 16) -> KVCacheConfig:
    """Full attention (``TOTAL_HEADS`` KV heads over ``tp``, head size ``head``) + two
    Mamba-type layers whose per-rank state shapes, dtypes and type are vLLM's
    (``MambaStateShapeCalculator`` for the test_state_tp_vllm model ``model`` at ``tp``;
    "short_conv": :func:`short_conv_spec`), padded to the attention page (align)."""
    fa = H.attn(bs, heads=max(1, TOTAL_HEADS // tp), head=head)
    if model == "short_conv":
        ms = short_conv_spec(tp, layout, bs, fa.page_size_bytes)
    else:
        v = STV.vllm_spec(model, tp)
        ms = MambaSpec(block_size=bs,
                       shapes=(_oriented(v.shapes[0], layout), tuple(v.shapes[1])),
                       dtypes=v.dtypes, mamba_type=v.mamba_type,
                       page_size_padded=fa.page_size_bytes, mamba_cache_mode="align")
    assert ms.state_content_size_bytes <= fa.page_size_bytes
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["model.layers.3.attn"], fa), H.group(list(STATE_LAYERS), ms)])


def _state_case(model: str, layout: str) -> Case:
    name = f"{model}-{layout.lower()}"
    return Case(name, lambda tp: state_hybrid(model, layout, tp),
                dict(block_size=64, mamba_cache_mode="align"), 150, state=(model, layout))


def _state_remap_case(model: str, layout: str, bs: int) -> Case:
    """A state case at ``bs``-token blocks with head size 64 (>= 32-token blocks: vLLM CPU's
    "vec" kernel, the one a block-size remap models): peers of other block sizes."""
    name = f"{model}-{layout.lower()}-b{bs}"
    return Case(name, lambda tp: state_hybrid(model, layout, tp, bs=bs, num_blocks=48, head=64),
                dict(block_size=bs, mamba_cache_mode="align"), 150, vec=True,
                state=(model, layout))


#: Mamba state across TP sizes AND block sizes (issue 20 (b)): each state case at 32- and
#: 64-token blocks (test_pd_nixl_tp.py::test_mamba_state_remap_across_tp_pull_every_byte)
STATE_REMAP_CASES = {c.name: c for c in (_state_remap_case(m, lay, bs)
                                         for m in ("gdn", "mamba2-g2", "mamba2-g1", "mamba1")
                                         for lay in ("DS", "SD") for bs in (32, 64))}

#: Mamba state across TP sizes (issue 20): GDN (qwen3-next-like), Mamba2 with 2 groups
#: (B/C sharded) and with 1 (B/C replicated on every rank), Mamba1, each in both conv layouts
STATE_CASES = {c.name: c for c in (_state_case(m, lay)
                                   for m in ("gdn", "mamba2-g2", "mamba2-g1", "mamba1")
                                   for lay in ("DS", "SD"))}


#: Mamba state hmacore has no state geometry for (issue 20's "no geometry" paths): vLLM's
#: ShortConv (LFM2), a Mamba type vLLM really has; whole pages at equal TP, refused by name
#: across TP sizes (tests/vllm/test_nogeom_tp.py)
NOGEOM_CASES = {c.name: c for c in (_state_case("short_conv", "SD"),)}


CASES = {
    "gemma": Case("gemma", lambda tp: H.gemma_like(num_blocks=64,
                                                   heads=max(1, TOTAL_HEADS // tp)), {}, 150),
    # P's budget of 64 tokens per step: a 150-token prompt is prefilled (and pushed) in 3 steps
    "gemma-chunk": Case("gemma-chunk", lambda tp: H.gemma_like(num_blocks=64,
                                                               heads=max(1, TOTAL_HEADS // tp)),
                        dict(max_num_batched_tokens=64), 150),
    # block-size remap with other TP sizes (test_pd_nixl_tp.py): head size 64 and >= 32-token
    # blocks, which vLLM CPU serves with its "vec" kernel (the one a remap models, CPU_VEC)
    "gemma-vec32": Case("gemma-vec32", lambda tp: H.gemma_like(
        num_blocks=48, bs=32, heads=max(1, TOTAL_HEADS // tp), head=64), dict(block_size=32),
        150, vec=True),
    "gemma-vec64": Case("gemma-vec64", lambda tp: H.gemma_like(
        num_blocks=24, bs=64, heads=max(1, TOTAL_HEADS // tp), head=64), dict(block_size=64),
        150, vec=True),
    "dsv4": Case("dsv4", lambda tp: H.dsv4_like(num_blocks=600),
                 dict(max_num_batched_tokens=1024), 600),
    # DeepSeek-V4-like at half the block sizes: a block-size remap peer of "dsv4" (push)
    "dsv4-half": Case("dsv4-half", lambda tp: H.dsv4_like(num_blocks=1000,
                                                          sizes=(128, 32, 32, 2, 4)),
                      dict(max_num_batched_tokens=1024), 600),
    **STATE_CASES,
    **STATE_REMAP_CASES,
    **NOGEOM_CASES,
}


def engine_config(case: Case, *, tp: int, port: int, engine_id: str, extra: dict | None = None):
    """``extra``: more kv_connector_extra_config keys (e.g. ``transfer_mode``).
    ``HMACORE_TEST_TRANSPORT`` (tests/mooncake/test_te_connector.py): the transport."""
    transport = os.environ.get("HMACORE_TEST_TRANSPORT")
    return H.vllm_config(extra={"side_channel_port": port, "kv_lease_duration": 30,
                                **({"transport": transport} if transport else {}),
                                **(extra or {})}, tp=tp,
                         engine_id=engine_id, kv_cache_layout="LBHNC", **case.vkw)


def _specs(kcc):
    for grp in kcc.kv_cache_groups:
        for name in grp.layer_names:
            yield grp.kv_cache_spec, name


def allocate(case: Case, kcc, tp: int) -> dict[str, torch.Tensor]:
    """Zeroed per-layer caches of this rank, blocks on dim 0 (Mamba: the raw padded page,
    as vLLM's state views are cut from it)."""
    out = {}
    for spec, name in _specs(kcc):
        nb, bs = kcc.num_blocks, spec.block_size
        if isinstance(spec, MambaSpec):
            out[name] = torch.zeros(nb, spec.page_size_bytes, dtype=torch.uint8)
        elif isinstance(spec, MLA):
            out[name] = torch.zeros(nb, bs, spec.head_size, dtype=spec.dtype)
        else:
            out[name] = torch.zeros(nb, spec.num_kv_heads, bs, 2 * spec.head_size, dtype=spec.dtype)
        assert out[name][0].numel() * out[name].element_size() == spec.page_size_bytes
    return out


#: the byte P writes into its state pages' padding: a decode rank of another TP size reads
#: only state ranges, so its padding stays 0; at equal TP whole pages are copied
STATE_PAD = 0xEE


def state_page(case: Case, layer: int, position: int, spec, tp: int, rank: int,
               pad: int = 0) -> torch.Tensor:
    """The bytes of a state page (table position ``position`` of ``layer``) on rank ``rank``
    at ``tp``, from vLLM's sharding of the full-width state (test_state_tp_vllm's oracle: the
    global conv channels and ssm heads vLLM's own weight loaders put on that rank; nothing
    from hmacore.state_tp): conv state in vLLM's per-rank shape and layout (int16 tags, the
    fp16 size) holding ``(c*R + r + 53*layer + 31*position) % 32000 + 1`` for global channel
    ``c``, row ``r``; then the ssm state (int32 tags, the fp32 size) holding
    ``1e6*(1+layer) + 1e4*position + h*E + e`` for global head ``h``, element ``e``; then
    ``pad`` bytes up to the page."""
    model, layout = case.state
    assert STV.mamba_utils.is_conv_state_dim_first() == (layout == "DS"), \
        "the process's conv layout is not the case's"
    if model == "short_conv":
        return _short_conv_page(layer, position, spec, tp, rank, pad)
    chans, heads = STV.vllm_channels(model, tp, rank)
    R = STV.KERNEL - 1
    conv = np.array([[(c * R + r + 53 * layer + 31 * position) % 32000 + 1 for r in range(R)]
                     for c in chans], np.int16)                       # (C, R)
    if layout == "SD":
        conv = conv.T.copy()
    assert conv.shape == tuple(spec.shapes[0]), (conv.shape, spec.shapes)
    e = int(np.prod(spec.shapes[1][1:]))
    ssm = np.array([[1_000_000 * (1 + layer) + 10_000 * position + h * e + x for x in range(e)]
                    for h in heads], np.int32)
    body = np.concatenate([conv.reshape(-1).view(np.uint8), ssm.reshape(-1).view(np.uint8)])
    assert body.size == spec.state_content_size_bytes
    page = np.full(spec.page_size_bytes, pad, np.uint8)
    page[:body.size] = body
    return torch.from_numpy(page)


def _short_conv_page(layer: int, position: int, spec, tp: int, rank: int,
                     pad: int) -> torch.Tensor:
    """:func:`state_page` of a ShortConv state (one conv state, no ssm state): global channel
    ``c`` (rank ``rank`` holds ColumnParallelLinear's contiguous slice of the
    ``SHORT_CONV_DIM`` channels), row ``r`` hold ``(c*R + r + 53*layer + 31*position) % 32000
    + 1`` as integer tags of the state dtype's size, in vLLM's per-rank shape and layout."""
    n = SHORT_CONV_DIM // tp
    R = SHORT_CONV_L - 1
    size = torch.empty((), dtype=spec.dtypes[0]).element_size()
    conv = np.array([[(c * R + r + 53 * layer + 31 * position) % 32000 + 1 for r in range(R)]
                     for c in range(rank * n, rank * n + n)], np.dtype(f"<i{size}"))
    if not mamba_utils.is_conv_state_dim_first():
        conv = conv.T.copy()
    assert conv.shape == tuple(spec.shapes[0]), (conv.shape, spec.shapes)
    body = conv.reshape(-1).view(np.uint8)
    assert body.size == spec.state_content_size_bytes
    page = np.full(spec.page_size_bytes, pad, np.uint8)
    page[:body.size] = body
    return torch.from_numpy(page)


def _heads(spec, tp: int, rank: int) -> list[int] | None:
    """Global KV heads this rank holds (vLLM's rule), None for MLA (one latent)."""
    if isinstance(spec, MLA):
        return None
    if tp <= TOTAL_HEADS:
        n = TOTAL_HEADS // tp
        return list(range(rank * n, rank * n + n))
    return [rank * TOTAL_HEADS // tp]


def block_pattern(layer: int, position: int, spec, heads) -> torch.Tensor:
    """The bytes of table position ``position`` of ``layer``: token t of the block, global
    head h and element e hold ``(7 layer + 3 token + 11 h + e) % 251 + 1`` (exact in fp16)."""
    bs = spec.block_size
    tok = torch.arange(position * bs, position * bs + bs).view(-1, 1)
    if heads is None:
        e = torch.arange(spec.head_size).view(1, -1)
        v = (7 * layer + 3 * tok + e) % 251 + 1
    else:
        e = torch.arange(2 * spec.head_size).view(1, 1, -1)
        h = torch.tensor(heads).view(-1, 1, 1)
        v = (7 * layer + 3 * tok.view(1, -1, 1) + 11 * h + e) % 251 + 1
    return v.to(spec.dtype)


def _vec(v: torch.Tensor, spec) -> torch.Tensor:
    """A ``[heads, tokens, 2*head_size]`` block as vLLM CPU's vec kernel stores it: per head
    K transposed (``[head_size, tokens]``) then V (``[tokens, head_size]``), same shape."""
    hs = spec.head_size
    k = v[:, :, :hs].transpose(1, 2).reshape(v.shape[0], -1)
    return torch.cat([k, v[:, :, hs:].reshape(v.shape[0], -1)], dim=1).view(v.shape)


def _page(case: Case, layer: int, position: int, spec, heads, lo: int = 0,
          hi: int | None = None) -> torch.Tensor:
    """The bytes of a block at table position ``position``: the pattern of its tokens in
    ``[lo, hi)`` (all by default), zeros elsewhere; in the vec kernel's order for vec cases."""
    v = block_pattern(layer, position, spec, heads)
    if lo or hi is not None:
        tok = torch.arange(position * spec.block_size, (position + 1) * spec.block_size)
        out = (tok < lo) | (tok >= (hi if hi is not None else tok[-1] + 1))
        if heads is None:
            v[out] = 0
        else:
            v[:, out] = 0
    return _vec(v, spec) if case.vec and heads is not None else v


def _layers(kcc) -> dict[str, int]:
    return {n: i for i, n in enumerate(sorted(n for _, n in _specs(kcc)))}


def fill(case: Case, kcc, caches, table, tp: int, rank: int, layers=None) -> None:
    """P: write every block of ``table`` (per group, position order; 0 = null) with the
    pattern of its positions and this rank's heads (only ``layers`` if given)."""
    idx = _layers(kcc)
    for g, grp in enumerate(kcc.kv_cache_groups):
        spec = grp.kv_cache_spec
        for j, b in enumerate(table[g]):
            if b:
                for name in grp.layer_names:
                    if layers is not None and name not in layers:
                        continue
                    if isinstance(spec, MambaSpec):
                        caches[name][b] = state_page(case, idx[name], j, spec, tp, rank,
                                                     STATE_PAD)
                        continue
                    caches[name][b] = _page(case, idx[name], j, spec, _heads(spec, tp, rank))


def check(case: Case, kcc, caches, table, loaded, tp: int, rank: int,
          state_pad: int = 0) -> dict:
    """D: every block in ``loaded[g]`` equals the pattern of its position in ``table[g]`` for
    this rank's heads (state pages: with ``state_pad`` bytes of padding); every other block
    of every layer is still zero."""
    idx = _layers(kcc)
    bad = checked = stray = 0
    touched: set[int] = set()
    for g, grp in enumerate(kcc.kv_cache_groups):
        spec = grp.kv_cache_spec
        want = set(loaded[g])
        touched |= want
        for j, b in enumerate(table[g]):
            if b in want:
                for name in grp.layer_names:
                    got = caches[name][b]
                    if isinstance(spec, MambaSpec):   # content and (zero) padding, every byte
                        want_b = state_page(case, idx[name], j, spec, tp, rank, state_pad)
                    else:
                        want_b = block_pattern(idx[name], j, spec, _heads(spec, tp, rank))
                    bad += int((got != want_b).sum())
                    checked += got.numel() * got.element_size()
    others = torch.tensor(sorted(set(range(kcc.num_blocks)) - touched), dtype=torch.long)
    for name, t in caches.items():
        stray += int((t[others] != 0).sum())
    return {"bad": bad, "checked": checked, "stray": stray}


def check_tokens(case: Case, kcc, caches, table, lo, hi, tp: int, rank: int,
                 state: tuple[int, int] | None = None) -> dict:
    """D after a block-size remap: per group g, every block of ``table[g]`` holds the pattern
    of its tokens in ``[lo[g], hi[g])`` for this rank's heads and zeros elsewhere; every block
    outside the table is zero (every byte of every layer compared). Mamba groups (``state``
    = (D's slot position, P's state position)): the slot holds P's state as vLLM shards it
    for this rank (:func:`state_page` at P's position, padding 0), every other state block
    of the table zero."""
    idx = _layers(kcc)
    bad = checked = stray = states = 0
    touched: set[int] = set()
    for g, grp in enumerate(kcc.kv_cache_groups):
        spec = grp.kv_cache_spec
        for j, b in enumerate(table[g]):
            if not b:
                continue
            touched.add(b)
            for name in grp.layer_names:
                got = caches[name][b]
                if isinstance(spec, MambaSpec):
                    assert state is not None, "a Mamba group needs state=(D slot, P position)"
                    want = state_page(case, idx[name], state[1], spec, tp, rank) \
                        if j == state[0] else torch.zeros_like(got)
                    bad += int((got != want).sum())
                    states += int(spec.state_content_size_bytes) if j == state[0] else 0
                    continue
                want = _page(case, idx[name], j, spec, _heads(spec, tp, rank), lo[g], hi[g])
                bad += int((got != want).sum())
                checked += int((want != 0).sum())
    others = torch.tensor(sorted(set(range(kcc.num_blocks)) - touched), dtype=torch.long)
    for name, t in caches.items():
        stray += int((t[others] != 0).sum())
    return {"bad": bad, "checked": checked, "stray": stray, "states": states}


#: the Mamba state cases `make test` runs end to end (one engine pool each: GDN in DS, and
#: Mamba2 with one group, B/C replicated on every rank, in SD); the others are marked slow
#: and run in `make test-mamba-tp` (figures in docs/hetero-tp.md)
CI_STATE_CASES = ("gdn-ds", "mamba2-g1-sd")


def state_params(cases, *axes, ci=CI_STATE_CASES):
    """pytest params over ``cases`` x every combination of ``axes`` (lists of tuples or
    values), the cases outside ``ci`` marked slow."""
    import itertools

    import pytest
    out = []
    for c in cases:
        for combo in itertools.product(*axes):
            flat = [x for a in combo for x in (a if isinstance(a, tuple) else (a,))]
            marks = () if c in ci else (pytest.mark.slow,)
            out.append(pytest.param(c, *flat, marks=marks))
    return out
