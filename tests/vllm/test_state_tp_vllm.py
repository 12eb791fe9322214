"""hmacore.state_tp against vLLM's own state shapes and conv transfer offsets.

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
import pytest
import torch

from hmacore.state_tp import StateGeometry, source_ranks, state_ranges

from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils as sctu
from vllm.model_executor.layers.mamba import mamba_utils
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
    "mamba2-g2": (MT.MAMBA2, dict(intermediate_size=8, n_groups=2, num_heads=4, head_dim=2,
                                  state_size=4), (1, 2)),
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


def hm_geometry(model, tp, layout):
    """hmacore's geometry from the model parameters (what Part 2's _compat reading must give)."""
    mtype, p, _ = MODELS[model]
    if mtype == MT.GDN_ATTN:
        kd, vd = p["num_k_heads"] * p["head_k_dim"], p["num_v_heads"] * p["head_v_dim"]
        return StateGeometry("GDN_ATTN", tp, layout, KERNEL - 1, 2, (kd // tp, kd // tp, vd // tp),
                             (False,) * 3, p["num_v_heads"] // tp,
                             p["head_v_dim"] * p["head_k_dim"] * 4)
    if mtype == MT.MAMBA2:
        gn, rep = p["n_groups"] * p["state_size"], p["n_groups"] == 1
        bc = gn if rep else gn // tp
        return StateGeometry("MAMBA2", tp, layout, KERNEL - 1, 2,
                             (p["intermediate_size"] // tp, bc, bc), (False, rep, rep),
                             p["num_heads"] // tp, p["head_dim"] * p["state_size"] * 4)
    return StateGeometry("MAMBA1", tp, layout, KERNEL - 1, 2, (p["intermediate_size"] // tp,),
                         (False,), p["intermediate_size"] // tp, p["state_size"] * 4)


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


@pytest.mark.parametrize("model", ["gdn", "mamba2-g2", "mamba1"])
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
