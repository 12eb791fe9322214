"""Paged KV allocation (vLLM-shaped aliasing) and the verifiable byte pattern."""
import numpy as np
import pytest

from hmacore.errors import BlockTableError, LayoutError
from hmacore.paged import layer_geometry
from hmacore.demo.paged_memory import (allocate_paged_kv, expected_bytes, fill_pattern, read_page,
                                       verify_pattern)
from hmacore.presets import get_preset


def test_classic_hma_aliases_layer_slots_across_groups():
    layout = get_preset("gpt-oss")  # 2 groups x 18 layers, equal pages
    paged = allocate_paged_kv(layout, 16, page_bytes=64)
    assert paged.shared and len(paged.storages) == 18
    g0, g1 = layout.groups
    for j in range(18):
        a, b = paged.kv_caches[g0.layer_names[j]], paged.kv_caches[g1.layer_names[j]]
        assert a.shape == (16, 64) and a.dtype == np.uint8
        assert a.ctypes.data == b.ctypes.data == paged.storages[j].ctypes.data
        assert np.shares_memory(a, b)


def test_differing_pages_get_own_storage():
    layout = get_preset("dsv4")
    paged = allocate_paged_kv(layout, 4, page_bytes=(256, 64, 64, 32, 32))
    assert not paged.shared and len(paged.storages) == 60
    arrs = list(paged.kv_caches.values())
    for i in range(len(arrs)):
        for j in range(i + 1, len(arrs)):
            assert not np.shares_memory(arrs[i], arrs[j])


def test_split_kv_and_state_parts_shapes():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 4, page_bytes=544, state_parts=3, kv_split=True)
    att = paged.kv_caches["model.layers.3.attn"]
    assert att.shape == (2, 4, 272)
    state = paged.kv_caches["model.layers.0.attn"]
    assert isinstance(state, tuple) and len(state) == 3
    assert sum(p.shape[1] for p in state) == 544 and all(p.strides[0] == 544 for p in state)
    # packed pages: state sub-pages and the attention page of the same slot alias one storage
    packed = allocate_paged_kv(layout, 4, page_bytes=544, state_parts=3)
    assert packed.shared
    assert np.shares_memory(packed.kv_caches["model.layers.0.attn"][0],
                            packed.kv_caches["model.layers.3.attn"])


def test_pattern_roundtrip_and_single_byte_corruption_detected():
    layout = get_preset("gemma-3")
    paged = allocate_paged_kv(layout, 32, page_bytes=48)
    table = [[1, 2, 3], [0, 4, 5], [6], [], [7, 8], [9], [10, 11]]
    fill_pattern(paged, table)
    assert verify_pattern(paged, table) == []
    name = layout.groups[1].layer_names[3]
    paged.kv_caches[name][5, 17] ^= 1
    assert verify_pattern(paged, table) == [(name, 1, 2)]


def test_pattern_depends_on_layer_and_position():
    layout = get_preset("gpt-oss")
    a = expected_bytes(layout, "model.layers.0.attn", 3, 64)
    assert np.array_equal(a, expected_bytes(layout, "model.layers.0.attn", 3, 64))
    assert not np.array_equal(a, expected_bytes(layout, "model.layers.2.attn", 3, 64))
    assert not np.array_equal(a, expected_bytes(layout, "model.layers.0.attn", 4, 64))
    # misplacement of a block (wrong position) is detected
    paged = allocate_paged_kv(layout, 8, page_bytes=64)
    fill_pattern(paged, [[1, 2], [3]])
    assert verify_pattern(paged, [[2, 1], [3]]) != []
    assert verify_pattern(paged, [[2], [3]], positions=[[1], [0]]) == []


def test_mamba_pattern_by_state_position():
    layout = get_preset("qwen3-next")
    paged = allocate_paged_kv(layout, 8, page_bytes=544)
    fill_pattern(paged, [[1], [2], [3], [4, 5]])
    page = read_page(paged.kv_caches["model.layers.0.attn"], 1)
    assert np.array_equal(page, expected_bytes(layout, "model.layers.0.attn", 0, 544))
    assert verify_pattern(paged, [[1], [2], [3], [4, 5]]) == []


def test_geometry_matches_allocation():
    layout = get_preset("gpt-oss")
    storage, parts, shared = layer_geometry(layout, 8, page_bytes=64)
    assert shared and storage == [512] * 18
    assert parts["model.layers.1.attn"] == [(0, 0, 64, 64)]


@pytest.mark.parametrize("kw, match", [
    ({"num_blocks": 1}, "num_blocks"),
    ({"num_blocks": 4.0}, "num_blocks"),
    ({"page_bytes": 40}, "multiple of 16"),
    ({"page_bytes": 0}, "multiple of 16"),
    ({"page_bytes": (64,)}, "2 groups"),
    ({"page_bytes": (64, 128), "shared": True}, "shared=True"),
    ({"state_parts": 0}, "state_parts"),
])
def test_bad_allocation_args(kw, match):
    args = {"num_blocks": 4, "page_bytes": 64, **kw}
    with pytest.raises(LayoutError, match=match):
        allocate_paged_kv(get_preset("gpt-oss"), args.pop("num_blocks"), **args)


def test_bad_table_and_layer():
    layout = get_preset("gpt-oss")
    paged = allocate_paged_kv(layout, 4, page_bytes=64)
    with pytest.raises(BlockTableError, match="groups"):
        fill_pattern(paged, [[1]])
    with pytest.raises(BlockTableError, match="groups"):
        verify_pattern(paged, [[1], [2], [3]])
    with pytest.raises(LayoutError, match="not in the layout"):
        expected_bytes(layout, "nope", 0, 64)


def test_kv_split_never_aliases_packed_pages():
    layout = get_preset("qwen3-next")  # Mamba state pages are packed per block
    auto = allocate_paged_kv(layout, 4, page_bytes=544, kv_split=True)
    assert not auto.shared
    with pytest.raises(LayoutError, match="kv_split with shared slots"):
        allocate_paged_kv(layout, 4, page_bytes=544, kv_split=True, shared=True)
