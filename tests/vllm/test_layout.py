"""layout_from_kv_cache_config: hand-made and vLLM-derived KVCacheConfigs, differential
against vLLM's own block-size resolution and NIXL scheduler window sizes."""
import math
import types

import pytest

import harness as H
from hmacore import GroupKind, LayoutError, MambaMode
from hmacore.integrations.vllm import _compat as C
from hmacore.integrations.vllm.layout import layout_from_kv_cache_config as to_layout


@pytest.fixture(scope="module")
def vc():
    return H.vllm_config()


def vllm_sizes(kcc, vc):
    return C.resolve_kv_cache_block_sizes(kcc, vc)


def nixl_blocks_per_sw(kcc, vc):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import \
        NixlPullConnectorScheduler
    return NixlPullConnectorScheduler(vc, "engine", kcc).blocks_per_sw


def check_against_vllm(kcc, vc):
    lay = to_layout(kcc, vllm_config=vc)
    sched_bs, hash_bs = vllm_sizes(kcc, vc)
    assert lay.scheduler_block_size == sched_bs
    assert lay.hash_block_size == hash_bs
    wb = lay.window_blocks()
    assert [wb[g] for g in lay.transfer_group_ids] == list(nixl_blocks_per_sw(kcc, vc))
    assert lay.num_blocks == kcc.num_blocks
    for g, grp in enumerate(kcc.kv_cache_groups):
        assert lay.groups[g].layer_names == tuple(grp.layer_names)
        assert lay.groups[g].block_size == grp.kv_cache_spec.block_size
    return lay


def test_gemma_like_hand_made(vc):
    lay = check_against_vllm(H.gemma_like(window=64), vc)
    assert [s.kind for s in lay.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    assert lay.groups[1].sliding_window == 64
    assert lay.window_blocks() == (0, 5)          # cdiv(64, 16) + 1
    assert lay.groups[0].page_bytes == H.attn(16).page_size_bytes
    assert lay.is_hybrid


def test_window_not_multiple_of_block(vc):
    # 100-token window, bs 16: cdiv gives 7 (+1 = 8); floor would give 6 (+1 = 7) = bug
    kcc = H.KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["a"], H.attn(16)), H.group(["b"], H.swa(16, 100))])
    assert check_against_vllm(kcc, vc).window_blocks() == (0, 8)


def test_qwen3_next_like_mamba_align():
    vc = H.vllm_config(block_size=64, mamba_cache_mode="align")
    lay = check_against_vllm(H.qwen3_next_like(bs=64), vc)
    assert lay.groups[1].kind == GroupKind.MAMBA
    assert lay.groups[1].mamba_mode == MambaMode.ALIGN
    lay.check_hash_addressable()
    to_layout(H.qwen3_next_like(), vllm_config=vc, for_store=True)


def test_mamba_not_align_rejected_for_stores_only():
    kcc = H.qwen3_next_like(mode="none")
    lay = to_layout(kcc)  # NIXL moves the state slot; fine
    assert lay.groups[1].mamba_mode == MambaMode.NONE
    with pytest.raises(LayoutError, match=r"group 1: .*'none'.*align"):
        to_layout(kcc, for_store=True)


def test_five_group_dsv4_like(vc):
    kcc = H.dsv4_like()
    lay = check_against_vllm(kcc, vc)
    assert lay.block_sizes == (256, 64, 64, 4, 8)
    assert lay.scheduler_block_size == 256 and lay.hash_block_size == 4
    assert lay.window_blocks() == (0, 3, 5, 3, 17)   # C4 (4, 8) -> 3, C128 (8, 128) -> 17
    assert lay.groups[0].mla and lay.groups[3].mla
    assert [s.kind for s in lay.groups] == [GroupKind.FULL] + [GroupKind.SLIDING_WINDOW] * 4


def test_derived_gemma_by_vllm(vc):
    kcc = H.derived_gemma(vc)
    lay = check_against_vllm(kcc, vc)
    # vLLM puts the sliding-window group first for this model
    kinds = sorted(s.kind.name for s in lay.groups)
    assert kinds == ["FULL", "SLIDING_WINDOW"]
    assert lay.window_blocks()[lay.groups.index(next(s for s in lay.groups if s.sliding_window))] \
        == math.ceil(128 / 16) + 1


def test_derived_hybrid_mamba_by_vllm():
    vc = H.vllm_config(block_size=64, mamba_cache_mode="align")
    kcc = H.derived_hybrid_mamba(vc)
    lay = check_against_vllm(kcc, vc)
    assert sorted(s.kind.name for s in lay.groups) == ["FULL", "MAMBA", "MAMBA", "MAMBA"]


def test_single_group_matches(vc):
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                          kv_cache_groups=[H.group(["a", "b"], H.attn(16))])
    lay = check_against_vllm(kcc, vc)
    assert lay.num_groups == 1 and not lay.is_hybrid


def test_cross_attention_rejected_naming_group():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["a"], H.attn(16)),
        H.group(["x"], CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=16,
                                          dtype=H.DT))])
    with pytest.raises(LayoutError, match=r"group 1: CrossAttentionSpec \(cross-attention\)"):
        to_layout(kcc)


def test_unsupported_spec_class_rejected():
    from vllm.v1.kv_cache_interface import CircularBufferSpec
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["a"], H.attn(16)),
        H.group(["r"], CircularBufferSpec(block_size=16, num_kv_heads=2, head_size=16,
                                          dtype=H.DT))])
    with pytest.raises(LayoutError, match=r"group 1: CircularBufferSpec is not supported"):
        to_layout(kcc)


def test_multi_group_with_context_parallel_rejected():
    stub = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=2,
                                              prefill_context_parallel_size=1),
        cache_config=types.SimpleNamespace(prefix_match_unit=None))
    with pytest.raises(LayoutError, match=r"2 groups with decode_context_parallel_size=2.*single"):
        to_layout(H.gemma_like(), vllm_config=stub)
    single = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                             kv_cache_groups=[H.group(["a"], H.attn(16))])
    lay = to_layout(single, vllm_config=stub)
    assert lay.context_parallel == 2 and lay.block_sizes == (32,)   # DCP-sharded attention


def test_uniform_type_specs_unwrapped_and_checked():
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    ok = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": H.attn(16),
                                                                "b": H.attn(16, heads=4)})
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                          kv_cache_groups=[H.group(["a", "b"], ok), H.group(["c"], H.swa(16, 64))])
    lay = to_layout(kcc)
    assert lay.groups[0].kind == GroupKind.FULL and lay.groups[0].page_bytes == 0  # mixed pages
    g = lay.groups[0]       # layers disagree on KV heads: the head shape is unknown, not one's
    assert (g.num_kv_heads, g.head_size, g.head_size_v, g.dtype, g.attn_type) == \
        (None, None, None, "float16", "FullAttentionSpec")
    bad = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": H.swa(16, 64),
                                                                 "b": H.swa(16, 128)})
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                          kv_cache_groups=[H.group(["x"], H.attn(16)), H.group(["a", "b"], bad)])
    with pytest.raises(LayoutError, match=r"group 1: UniformTypeKVCacheSpecs mixes layers.*'b'"):
        to_layout(kcc)


def test_head_fields_come_from_the_specs(vc):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    import torch
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["f"], H.attn(16, heads=8, head=128)), H.group(["s"], H.swa(16, 64)),
        H.group(["l"], mla), H.group(["m"], H.mamba(16, 4096))])
    f, s, m_la, mb = to_layout(kcc, vllm_config=vc).groups
    assert (f.num_kv_heads, f.head_size, f.head_size_v, f.dtype, f.attn_type) == \
        (8, 128, 128, "float16", "FullAttentionSpec")
    assert (s.num_kv_heads, s.head_size, s.attn_type) == (2, 16, "SlidingWindowSpec")
    assert (m_la.mla, m_la.head_size, m_la.head_size_v, m_la.dtype) == (True, 576, 0, "bfloat16")
    assert (mb.num_kv_heads, mb.dtype, mb.attn_type) == (None, "float16,float16",
                                                         "MambaSpec:MAMBA2")


def test_store_layouts_merge_exactly_what_vllm_merges():
    """Twins vLLM looks up apart must be apart in hmacore too: head shapes at equal page
    bytes are told apart; specs differing only where GroupSpec has no field are refused for
    stores (their hits could differ), and accepted elsewhere."""
    from hmacore.hits import HitFinder
    twins = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["f"], H.attn(16)), H.group(["a"], H.swa(16, 64, heads=2, head=16)),
        H.group(["b"], H.swa(16, 64, heads=4, head=8)), H.group(["c"], H.swa(16, 64))])
    lay = to_layout(twins, for_store=True)
    assert len({g.page_bytes for g in lay.groups}) == 1
    assert sorted(sg.group_ids for sg in HitFinder(lay).spec_groups) == [(0,), (1, 3), (2,)]
    import dataclasses
    other = dataclasses.replace(H.swa(16, 64), max_tp_shards=1)   # a field GroupSpec lacks
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[], kv_cache_groups=[
        H.group(["f"], H.attn(16)), H.group(["a"], H.swa(16, 64)), H.group(["b"], other)])
    with pytest.raises(LayoutError, match=r"groups 1 and 2: vLLM's hit rule looks them up apart "
                                          r"\(their SlidingWindowSpecs differ in fields "
                                          r"max_tp_shards\)"):
        to_layout(kcc, for_store=True)
    assert to_layout(kcc).num_groups == 3              # NIXL moves blocks, it has no hit rule
    not_moved = H.KVCacheGroupSpec(["b"], other, enable_kv_transfer=False)
    kcc.kv_cache_groups[2] = not_moved                 # not looked up: nothing to merge
    assert to_layout(kcc, for_store=True).transfer_group_ids == (0, 1)


def test_host_resident_group_rejected():
    g = H.KVCacheGroupSpec(["h"], H.attn(16), host_resident=True)
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                          kv_cache_groups=[H.group(["a"], H.attn(16)), g])
    with pytest.raises(LayoutError, match=r"group 1: host-resident"):
        to_layout(kcc)


def test_non_transfer_group_kept_but_not_transferred(vc):
    g = H.KVCacheGroupSpec(["s"], H.swa(16, 64), enable_kv_transfer=False)
    kcc = H.KVCacheConfig(num_blocks=50, kv_cache_tensors=[],
                          kv_cache_groups=[H.group(["a"], H.attn(16)), g])
    lay = check_against_vllm(kcc, vc)
    assert lay.transfer_group_ids == (0,)


def test_package_import_does_not_import_vllm():
    import subprocess
    import sys
    code = ("import sys, hmacore, hmacore.integrations.vllm as v; "
            "assert 'vllm' not in sys.modules, 'vllm imported eagerly'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
