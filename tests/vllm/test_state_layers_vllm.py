"""hmacore's reading of Mamba state across TP sizes against vLLM's REAL layer classes.

test_state_tp_vllm.py proves hmacore's byte ranges against an oracle that re-creates, per
model type, which weight loader vLLM uses for the conv1d (and, from it, each rank's channel
order). Here that premise is checked on the layers themselves: vLLM's ``MambaMixer2`` (n_groups
1, 2, 4), ``MambaMixer`` (Mamba1), ``QwenGatedDeltaNetAttention`` (Qwen3-Next GDN) and
``KimiGatedDeltaNetAttention`` (Kimi-Linear KDA, which vLLM files as ``GDN_ATTN``) are built at
TP 1, 2 and 4 for every rank (vLLM's TP group replaced by its rank and size: no process group
is needed to build a layer), then

* the layer's own state shapes equal the oracle's (``vllm_spec``);
* a channel-tagged full conv1d weight loaded through the layer's OWN ``weight_loader`` lands
  in the oracle's channel order for that rank (``vllm_channels``), so the oracle the byte
  tests use is what the real classes do;
* ``_compat.mamba_state_geometry`` read from the real layer (the conv1d class decides Mamba2's
  sharded or replicated groups) is the TP-independent geometry of the model (``hm_global``),
  the same at every TP size and rank;
* KDA, read as GDN with as many key heads as value heads, passes the whole byte test of
  test_state_tp_vllm (every destination byte between every pair of TP sizes, DS and SD).
"""
import contextlib
import types
from unittest import mock

import pytest
import torch

import test_state_tp_vllm as T

from vllm.config import VllmConfig, set_current_vllm_config
import vllm.distributed.parallel_state as ps
from vllm.model_executor.layers.mamba import mamba_mixer as mm1, mamba_mixer2 as mm2
from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as kg
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qg
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as MT
from vllm.v1.kv_cache_interface import MambaSpec

from hmacore.integrations.vllm import _compat as HC

# KDA (Kimi-Linear): heads H of dim D for Q, K and V alike; vLLM files it as GDN_ATTN
KDA = (MT.GDN_ATTN, dict(num_k_heads=4, num_v_heads=4, head_k_dim=4, head_v_dim=4), (1, 2, 4))
# the real layers built here, by the oracle's model names
LAYERS = ["gdn", "gdn-k4", "mamba2-g1", "mamba2-g2", "mamba2-g4", "mamba1", "kda"]
_n = [0]


@contextlib.contextmanager
def _tp(tp, rank):
    """vLLM's TP group as a layer's constructor and loaders read it (rank, size)."""
    with mock.patch.object(ps, "_TP", types.SimpleNamespace(rank_in_group=rank,
                                                            world_size=tp)):
        yield


def _build(model, vc):
    """vLLM's own layer class for ``model`` (under the current TP patch)."""
    _n[0] += 1
    mtype, p, _ = T.MODELS[model]
    if model == "kda":
        cfg = types.SimpleNamespace(hidden_size=16, hidden_act="silu", rms_norm_eps=1e-6,
                                    linear_attn_config=dict(head_dim=p["head_v_dim"],
                                                            num_heads=p["num_v_heads"],
                                                            short_conv_kernel_size=T.KERNEL))
        return kg.KimiGatedDeltaNetAttention(cfg, vc, prefix=f"model.layers.{_n[0]}.self_attn")
    if mtype == MT.GDN_ATTN:
        cfg = types.SimpleNamespace(
            hidden_size=16, hidden_act="silu", rms_norm_eps=1e-6,
            linear_num_key_heads=p["num_k_heads"], linear_num_value_heads=p["num_v_heads"],
            linear_key_head_dim=p["head_k_dim"], linear_value_head_dim=p["head_v_dim"],
            linear_conv_kernel_dim=T.KERNEL)
        # the prefill-kernel choice reads a model config this test has no use for
        with mock.patch.object(qg, "_resolve_gdn_prefill_backend",
                               return_value=("triton", "triton")), \
                mock.patch.object(qg, "_log_gdn_backend_decision", lambda *a: None):
            return qg.QwenGatedDeltaNetAttention(cfg, vc,
                                                 prefix=f"model.layers.{_n[0]}.linear_attn")
    if mtype == MT.MAMBA2:
        return mm2.MambaMixer2(hidden_size=16, ssm_state_size=p["state_size"],
                               conv_kernel_size=T.KERNEL,
                               intermediate_size=p["intermediate_size"], use_conv_bias=True,
                               use_bias=False, n_groups=p["n_groups"],
                               num_heads=p["num_heads"], head_dim=p["head_dim"],
                               prefix=f"model.layers.{_n[0]}.mixer")
    return mm1.MambaMixer(hidden_size=16, ssm_state_size=p["state_size"],
                          conv_kernel_size=T.KERNEL, intermediate_size=p["intermediate_size"],
                          time_step_rank=2, use_conv_bias=True, use_bias=False,
                          use_rms_norm=False, prefix=f"model.layers.{_n[0]}.mixer")


def _loaded_channels(model, layer):
    """Global conv channels the layer's own conv1d weight loader puts on its rank, in order:
    a full weight whose channel c holds c, loaded as vLLM loads a checkpoint (KDA: three
    checkpoint tensors q, k, v with shard ids 0, 1, 2)."""
    w = layer.conv1d.weight
    w.data.fill_(-1)
    tail = tuple(w.shape[1:])
    if model == "kda":
        p = T.MODELS[model][1]
        width = p["num_v_heads"] * p["head_v_dim"]
        for sid in range(3):
            full = (sid * width + torch.arange(width, dtype=w.dtype)).view(
                width, *[1] * len(tail)).expand(width, *tail).contiguous()
            w.weight_loader(w, full, sid)
    else:
        mtype, p, _ = T.MODELS[model]
        if mtype == MT.GDN_ATTN:
            n = 2 * p["num_k_heads"] * p["head_k_dim"] + p["num_v_heads"] * p["head_v_dim"]
        elif mtype == MT.MAMBA2:
            n = p["intermediate_size"] + 2 * p["n_groups"] * p["state_size"]
        else:
            n = p["intermediate_size"]
        full = torch.arange(n, dtype=w.dtype).view(n, *[1] * len(tail)).expand(
            n, *tail).contiguous()
        w.weight_loader(w, full)
    out = w.data.reshape(w.shape[0], -1)[:, 0].to(torch.int64).tolist()
    assert min(out) >= 0, (model, "every local channel loaded")
    return out


@pytest.fixture
def models(monkeypatch):
    monkeypatch.setitem(T.MODELS, "kda", KDA)


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize("model", LAYERS)
def test_real_layers_match_the_oracle_and_the_geometry(monkeypatch, models, model, layout):
    T._layout(monkeypatch, layout)
    mtype, _, tps = T.MODELS[model]
    want = T.hm_global(model, layout)
    vc = VllmConfig()
    seen = 0
    with set_current_vllm_config(vc):
        for tp in tps:
            for rank in range(tp):
                with _tp(tp, rank):
                    layer = _build(model, vc)
                    assert layer.mamba_type == mtype, model
                    # where the worker finds it (integrations/vllm/nixl/_tp.py): by layer name
                    assert vc.compilation_config.static_forward_context[layer.prefix] is layer
                    shapes = tuple(tuple(s) for s in layer.get_state_shape())
                    assert shapes == tuple(tuple(s) for s in T.vllm_spec(model, tp).shapes), \
                        (model, tp, shapes)
                    chans = _loaded_channels(model, layer)
                    assert chans == T.vllm_channels(model, tp, rank)[0], (model, tp, rank)
                    spec = MambaSpec(block_size=16, shapes=shapes,
                                     dtypes=(T.CONV_DT, T.SSM_DT), mamba_type=mtype)
                    geo, why = HC.mamba_state_geometry(spec, tp, layer)
                    assert why == "" and geo == want, (model, tp, rank, why, geo)
                    seen += 1
    assert seen == sum(tps)


def test_mamba2_conv1d_class_is_the_rule_compat_reads(models):
    """The premise of _compat's Mamba2 decision on the real class: at TP > 1 with B/C of one
    group per rank, vLLM builds a MergedColumnParallelLinear conv1d exactly when the groups
    are sharded (n_groups == tp), and another class when they are replicated (n_groups 1)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        for model, tp, merged in [("mamba2-g1", 2, False), ("mamba2-g1", 4, False),
                                  ("mamba2-g2", 2, True), ("mamba2-g4", 4, True)]:
            with _tp(tp, 0):
                layer = _build(model, vc)
            assert isinstance(layer.conv1d, MergedColumnParallelLinear) == merged, (model, tp)


@pytest.mark.parametrize("layout", ["DS", "SD"])
def test_kda_every_byte_across_tp_sizes(monkeypatch, models, layout):
    """KDA read as GDN: every destination byte between TP sizes 1, 2 and 4 (the whole-state
    byte test of test_state_tp_vllm, on KDA's parameters; its channel oracle is checked on
    the real KDA layer above)."""
    T.test_ranges_reproduce_vllm_sharding_of_a_full_state(monkeypatch, "kda", layout)
