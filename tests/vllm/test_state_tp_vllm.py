"""hmacore.state_tp against vLLM's own state shapes, weight loaders and conv transfer offsets.

* Loader oracle (independent of hmacore's sharding model): each rank's conv channel order is
  what vLLM's own conv1d weight loaders put on that rank (``mamba_v2_sharded_weight_loader``
  for GDN and Mamba2 with one group, ``MergedColumnParallelLinear`` for Mamba2 with sharded
  groups, ``ColumnParallelLinear`` for Mamba1) applied to a channel-tagged full-width weight,
  its ssm heads what ``sharded_weight_loader(0)`` (A_log / dt_bias) gives; the page is laid
  out from vLLM's per-rank state shapes (DS or SD) with the state tensors back to back. Every
  destination byte after copying with :func:`state_ranges` equals D's own sharding.

* vLLM's ``MambaStateShapeCalculator`` (DS and SD, Mamba1 / Mamba2 with n_groups 1 and 2 /
  GDN, several TP sizes) gives per-rank shapes equal to the StateGeometry built from the
  model's parameters with hmacore's sharding model (sub-projections sharded separately, B/C
  replicated for Mamba2 n_groups == 1).
* For DS and non-replicated sub-projections, the byte ranges vLLM's NIXL connector reads
  (``derive_mamba_conv_split`` + ``MambaConvSplitInfo.remote_conv_offsets``/
  ``local_conv_offsets``, assembled per source rank as its worker does: design note section
  2) equal :func:`hmacore.state_tp.state_ranges` after merging adjacent ranges.
* Mamba2 n_groups == 1 across TP sizes: vLLM's offsets differ from hmacore's (vLLM reads P's C
  as D rank 1's B); the difference is asserted by name, so a vLLM fix shows up here.
"""
import types

import numpy as np
import pytest
import torch

from hmacore.state_tp import GlobalStateGeometry, StateGeometry, source_ranks, state_ranges

from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils as sctu
from vllm.model_executor.layers import linear as vllm_linear
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.model_loader import weight_utils
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as MT
from vllm.v1.kv_cache_interface import MambaSpec

CALC = mamba_utils.MambaStateShapeCalculator
KERNEL = 4  # conv rows R = 3
CONV_DT, SSM_DT = torch.float16, torch.float32


def _layout(monkeypatch, layout):
    """vLLM caches the layout (lru_cache on the env var): patch the predicate instead."""
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: layout == "DS")
    monkeypatch.setattr(sctu, "is_conv_state_dim_first", lambda: layout == "DS")


# (kind, model parameters, TP sizes the model allows)
MODELS = {
    "gdn": (MT.GDN_ATTN, dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8), (1, 2)),
    "gdn-k4": (MT.GDN_ATTN, dict(num_k_heads=4, num_v_heads=8, head_k_dim=4, head_v_dim=2),
               (1, 2, 4)),
    "mamba2-g2": (MT.MAMBA2, dict(intermediate_size=8, n_groups=2, num_heads=4, head_dim=2,
                                  state_size=4), (1, 2)),
    "mamba2-g4": (MT.MAMBA2, dict(intermediate_size=8, n_groups=4, num_heads=4, head_dim=2,
                                  state_size=2), (1, 2, 4)),
    "mamba2-g1": (MT.MAMBA2, dict(intermediate_size=8, n_groups=1, num_heads=4, head_dim=2,
                                  state_size=4), (1, 2, 4)),
    "mamba1": (MT.MAMBA1, dict(intermediate_size=8, state_size=4), (1, 2, 4)),
}


def vllm_spec(model, tp):
    mtype, p, _ = MODELS[model]
    if mtype == MT.GDN_ATTN:
        shapes = CALC.gated_delta_net_state_shape(tp, p["num_k_heads"], p["num_v_heads"],
                                                  p["head_k_dim"], p["head_v_dim"], KERNEL)
    elif mtype == MT.MAMBA2:
        shapes = CALC.mamba2_state_shape(tp, p["intermediate_size"], p["n_groups"],
                                         p["num_heads"], p["head_dim"], p["state_size"], KERNEL)
    else:
        shapes = CALC.mamba1_state_shape(tp, p["intermediate_size"], p["state_size"], KERNEL)
    return MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=(CONV_DT, SSM_DT),
                     mamba_type=mtype)


def hm_global(model, layout):
    """hmacore's TP-independent geometry from the model parameters (what the integration
    must build): global widths and the groups / heads each sub-projection is sharded by."""
    mtype, p, _ = MODELS[model]
    if mtype == MT.GDN_ATTN:
        kd, vd = p["num_k_heads"] * p["head_k_dim"], p["num_v_heads"] * p["head_v_dim"]
        nk, nv = p["num_k_heads"], p["num_v_heads"]
        return GlobalStateGeometry("GDN_ATTN", layout, KERNEL - 1, 2, (kd, kd, vd), (nk, nk, nv),
                                   nv, p["head_v_dim"] * p["head_k_dim"] * 4)
    if mtype == MT.MAMBA2:
        gn, g = p["n_groups"] * p["state_size"], p["n_groups"]
        return GlobalStateGeometry("MAMBA2", layout, KERNEL - 1, 2,
                                   (p["intermediate_size"], gn, gn), (p["num_heads"], g, g),
                                   p["num_heads"], p["head_dim"] * p["state_size"] * 4)
    i = p["intermediate_size"]
    return GlobalStateGeometry("MAMBA1", layout, KERNEL - 1, 2, (i,), (i,), i,
                               p["state_size"] * 4)


def hm_geometry(model, tp, layout) -> StateGeometry:
    return hm_global(model, layout).at(tp)


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_geometry_matches_vllm_shapes(monkeypatch, model, layout):
    _layout(monkeypatch, layout)
    for tp in MODELS[model][2]:
        spec, geo = vllm_spec(model, tp), hm_geometry(model, tp, layout)
        conv, ssm = spec.shapes
        want_conv = (geo.conv_channels, geo.conv_rows)
        assert tuple(conv) == (want_conv if layout == "DS" else want_conv[::-1]), (model, tp)
        assert ssm[0] == geo.ssm_heads
        assert spec.state_content_size_bytes == geo.content_bytes
        assert torch.Size(conv).numel() * 2 == geo.conv_bytes


def _merge(ranges):
    """Merge adjacent conv ranges; the last range (the ssm heads) stays on its own, as
    state_ranges never merges across the conv/ssm boundary."""
    *conv, ssm = ranges
    return _merge_conv(conv) + [ssm]


def _merge_conv(ranges):
    out = []
    for s, d, n in sorted(ranges, key=lambda t: (t[1], t[0])):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


def vllm_ranges(model, tp_p, tp_d, d, p):
    """(src, dst, bytes) vLLM's connector reads from P rank p into D rank d (DS only)."""
    ip, idd = sctu.derive_mamba_conv_split(vllm_spec(model, tp_p), tp_p), \
        sctu.derive_mamba_conv_split(vllm_spec(model, tp_d), tp_d)
    conv_p, conv_d = ip.ssm_sizes[0], idd.ssm_sizes[0]
    if tp_d >= tp_p:
        k = tp_d // tp_p
        i = d % k
        out = [(ro, lo, n) for (ro, n), (lo, _) in
               zip(idd.remote_conv_offsets(i, k), idd.local_conv_offsets)]
        ssm_d = idd.ssm_sizes[1]
        return out + [(conv_p + i * ssm_d, conv_d, ssm_d)]
    k = tp_p // tp_d
    i = p - d * k
    out = [(ro, lo + i * n, n) for (ro, n), (lo, _) in
           zip(idd.remote_conv_offsets(i, -k), idd.local_conv_offsets)]
    ssm_p = ip.ssm_sizes[1]
    return out + [(conv_p, conv_d + i * ssm_p, ssm_p)]


PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (1, 1)]


@pytest.mark.parametrize("model", ["gdn", "gdn-k4", "mamba2-g2", "mamba2-g4", "mamba1"])
def test_ds_ranges_equal_vllm_connector(monkeypatch, model):
    _layout(monkeypatch, "DS")
    tps = MODELS[model][2]
    checked = 0
    for tp_p, tp_d in PAIRS:
        if tp_p not in tps or tp_d not in tps:
            continue
        src, dst = hm_geometry(model, tp_p, "DS"), hm_geometry(model, tp_d, "DS")
        for d in range(tp_d):
            for p in source_ranks(tp_p, tp_d, d):
                assert state_ranges(src, p, dst, d) == _merge(vllm_ranges(model, tp_p, tp_d,
                                                                          d, p)), (tp_p, tp_d, d, p)
                checked += 1
    assert checked >= 6


def test_mamba2_one_group_differs_from_vllm(monkeypatch):
    """P tp 1 -> D tp 2, D rank 1. P page: x [0,48) B [48,72) C [72,96) ssm [96,224).
    hmacore reads B whole at 48; vLLM's formula reads B at 72 (P's C) and C at 120 (P's ssm)."""
    _layout(monkeypatch, "DS")
    raw = vllm_ranges("mamba2-g1", 1, 2, 1, 0)
    assert raw[1] == (72, 24, 24) and raw[2] == (120, 48, 24)
    ours = state_ranges(hm_geometry("mamba2-g1", 1, "DS"), 0, hm_geometry("mamba2-g1", 2, "DS"), 1)
    assert ours == [(24, 0, 72), (160, 72, 64)]   # x half 2, then B and C whole: 24..96
    assert ours != _merge(raw)


# ----------------------------------------------------------------- vLLM weight-loader oracle

def _fake_layer(cls, tp, rank, output_sizes=None):
    """The attributes vLLM's (Merged)ColumnParallelLinear.weight_loader reads, without a
    distributed group (the loader is vLLM's own function, called unbound)."""
    fake = types.SimpleNamespace(tp_size=tp, tp_rank=rank, output_sizes=output_sizes)
    fake.validate_shard_id = lambda sid: cls.validate_shard_id(fake, sid)
    fake.weight_loader = lambda prm, w, *sid: cls.weight_loader(fake, prm, w, *sid)
    return fake


def _loaded(loader, n_local, n_global):
    """Global indices a loader places on one rank: load arange(n_global) into n_local slots."""
    param = torch.nn.Parameter(torch.full((n_local,), -1, dtype=torch.float64),
                               requires_grad=False)
    param.output_dim = 0
    loader(param, torch.arange(n_global, dtype=torch.float64))
    out = param.data.to(torch.int64).tolist()
    assert min(out) >= 0, "every slot filled"
    return out


def vllm_channels(model, tp, rank):
    """The global conv channels (in page order) and ssm heads rank ``rank`` holds at ``tp``,
    per vLLM's own weight loaders."""
    mtype, p, _ = MODELS[model]
    conv_local = vllm_spec(model, tp).shapes[0]
    n_local = conv_local[0] if mamba_utils.is_conv_state_dim_first() else conv_local[1]
    if mtype == MT.GDN_ATTN:
        kd, vd = p["num_k_heads"] * p["head_k_dim"], p["num_v_heads"] * p["head_v_dim"]
        loader = mamba_v2_sharded_weight_loader([(kd, 0, False), (kd, 0, False), (vd, 0, False)],
                                                tp, rank)
        n_glob, heads = 2 * kd + vd, p["num_v_heads"]
    elif mtype == MT.MAMBA2:
        i, g, n = p["intermediate_size"], p["n_groups"], p["state_size"]
        n_glob, heads = i + 2 * g * n, p["num_heads"]
        if g % tp == 0:          # mamba_mixer2: MergedColumnParallelLinear([I, GN, GN])
            fake = _fake_layer(vllm_linear.MergedColumnParallelLinear, tp, rank, [i, g * n, g * n])
            loader = fake.weight_loader
        else:                    # n_groups == 1: groups extended to tp, group 0 duplicated
            ext = g + mamba_utils.MambaStateShapeCalculator.extra_groups_for_head_shards(g, tp)
            gs = (ext * n, (ext - g) * n, g == 1)
            loader = mamba_v2_sharded_weight_loader([(i, 0, False), gs, gs], tp, rank)
    else:                        # MambaMixer: conv1d is a ColumnParallelLinear
        n_glob = heads = p["intermediate_size"]
        loader = _fake_layer(vllm_linear.ColumnParallelLinear, tp, rank).weight_loader
    chans = _loaded(loader, n_local, n_glob)
    head_loader = weight_utils.sharded_weight_loader(0)   # A_log / dt_bias / A
    orig = weight_utils.get_tensor_model_parallel_rank
    weight_utils.get_tensor_model_parallel_rank = lambda: rank
    try:
        hs = _loaded(head_loader, vllm_spec(model, tp).shapes[1][0], heads)
    finally:
        weight_utils.get_tensor_model_parallel_rank = orig
    return chans, hs


def vllm_page(model, tp, rank, layout, pad):
    """Rank ``rank``'s page at ``tp``: tagged conv state (int16 = conv dtype size) in vLLM's
    per-rank shape (DS (C, R) / SD (R, C)), then the tagged ssm state (int32 = fp32 size),
    then ``pad`` bytes of 0xEE. Tag of conv (global channel c, row r) = c*R + r + 1; of ssm
    (global head h, element e) = 1_000_000 + h*E + e."""
    spec = vllm_spec(model, tp)
    chans, heads = vllm_channels(model, tp, rank)
    R = KERNEL - 1
    conv = np.array([[c * R + r + 1 for r in range(R)] for c in chans], np.int16)  # (C, R)
    if layout == "SD":
        conv = conv.T.copy()
    assert conv.shape == tuple(spec.shapes[0]), (model, tp, layout)
    e = int(np.prod(spec.shapes[1][1:]))
    ssm = np.array([[1_000_000 + h * e + x for x in range(e)] for h in heads], np.int32)
    out = np.concatenate([conv.reshape(-1).view(np.uint8), ssm.reshape(-1).view(np.uint8),
                          np.full(pad, 0xEE, np.uint8)])
    assert out.size - pad == spec.state_content_size_bytes
    return out


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_ranges_reproduce_vllm_sharding_of_a_full_state(monkeypatch, model, layout):
    """Every byte of D's page after the copy equals D's own (vLLM loader) sharding of the
    full-width state; P's pages are P's own sharding. Padding is never written."""
    _layout(monkeypatch, layout)
    tps = MODELS[model][2]
    checked = 0
    for tp_p, tp_d in PAIRS:
        if tp_p not in tps or tp_d not in tps:
            continue
        src, dst = hm_geometry(model, tp_p, layout), hm_geometry(model, tp_d, layout)
        pages = [vllm_page(model, tp_p, p, layout, 5) for p in range(tp_p)]
        for d in range(tp_d):
            want = vllm_page(model, tp_d, d, layout, 7)
            got = np.full(want.size, 0xEE, np.uint8)
            got[:dst.content_bytes] = 0
            for p in range(tp_p):
                for s, o, n in state_ranges(src, p, dst, d):
                    got[o:o + n] = pages[p][s:s + n]
            assert np.array_equal(got, want), (model, layout, tp_p, tp_d, d)
            checked += 1
    assert checked >= 4


# ------------------------------------------------------ the integration's reading (_compat)

def _layer(merged: bool):
    """A stand-in MambaMixer2 whose conv1d is of vLLM's class for its branch (sharded groups:
    MergedColumnParallelLinear; n_groups == 1: ColumnParallelLinear), built without __init__."""
    cls = vllm_linear.MergedColumnParallelLinear if merged else vllm_linear.ColumnParallelLinear
    return types.SimpleNamespace(conv1d=cls.__new__(cls))


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_compat_reading_equals_the_model_geometry(monkeypatch, model, layout):
    from hmacore.integrations.vllm import _compat as HC
    _layout(monkeypatch, layout)
    mtype, p, tps = MODELS[model]
    for tp in tps:
        merged = not (mtype == MT.MAMBA2 and p["n_groups"] % tp)
        geo, why = HC.mamba_state_geometry(vllm_spec(model, tp), tp, _layer(merged))
        assert why == "" and geo == hm_global(model, layout), (model, tp)


def test_compat_refuses_what_it_cannot_read(monkeypatch):
    from hmacore.integrations.vllm import _compat as HC
    _layout(monkeypatch, "DS")
    spec = vllm_spec("mamba2-g1", 2)
    geo, why = HC.mamba_state_geometry(spec, 2, None)
    assert geo is None and "n_groups undecidable" in why
    ring = MambaSpec(block_size=16, shapes=tuple(spec.shapes) + ((4,),),
                     dtypes=(CONV_DT, SSM_DT, SSM_DT), mamba_type=MT.MAMBA2)
    assert "ring tensors" in HC.mamba_state_geometry(ring, 2, _layer(False))[1]
    rep = MambaSpec(block_size=16, shapes=spec.shapes, dtypes=spec.dtypes, mamba_type=MT.MAMBA2,
                    tp_replicated=True)
    assert "tp_replicated" in HC.mamba_state_geometry(rep, 2, None)[1]
    other = next((m for m in MT if m.name not in ("MAMBA1", "MAMBA2", "GDN_ATTN")), None)
    if other is not None:
        o = MambaSpec(block_size=16, shapes=spec.shapes, dtypes=spec.dtypes, mamba_type=other)
        assert f"mamba_type {other.name}: state sharding not modelled" in \
            HC.mamba_state_geometry(o, 2, None)[1]
