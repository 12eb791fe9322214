"""hmacore.spec: every validation rule of GroupSpec/KVLayout with its message, presets,
window sizes (vllm-hma.md §4.2, §13.2), hash/scheduler block sizes, JSON/TOML loading."""
import json

import pytest
from hypothesis import given, strategies as st

from hmacore.errors import LayoutError
from hmacore.presets import PRESETS, get_preset, preset_names
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode
from tests.oracle_core import ceil_div

FULL = GroupKind.FULL
SW = GroupKind.SLIDING_WINDOW


def full(bs=16, **kw):
    return GroupSpec(FULL, bs, **kw)


def sw(bs=16, window=128, **kw):
    return GroupSpec(SW, bs, sliding_window=window, **kw)


def lay(*groups, **kw):
    return KVLayout(groups=tuple(groups), **kw)


# -- GroupSpec / KVLayout validation (one case per rule) ---------------------------------
BAD_LAYOUTS = [
    (lambda: GroupSpec(99, 16), "kind must be one of"),
    (lambda: GroupSpec(GroupKind.MAMBA, 16, mamba_mode="fast"), "mamba_mode must be one of"),
    (lambda: lay(), "a layout needs at least one group"),
    (lambda: KVLayout(groups=("full",)), "groups\\[0\\] must be a GroupSpec"),
    (lambda: lay(full(layer_names=("a",)), sw(layer_names=("a",))),
     "layer 'a' is in group 0 and group 1"),
    (lambda: lay(full(), num_blocks=1), "num_blocks must be an int in \\[2, 2\\*\\*31-1\\]"),
    (lambda: lay(full(), num_blocks=2**31), "num_blocks must be an int"),
    (lambda: lay(full(), num_blocks=True), "num_blocks must be an int"),
    (lambda: lay(full(), num_blocks=10.0), "num_blocks must be an int"),
    (lambda: lay(full(), context_parallel=0), "context_parallel must be an int >= 1"),
    (lambda: lay(full(), context_parallel=True), "context_parallel must be an int >= 1"),
    (lambda: lay(full(), sw(), context_parallel=2),
     "context parallelism > 1 is only supported with a single KV cache group"),
    (lambda: lay(full(), prefix_match_unit=0), "prefix_match_unit must be a positive int"),
    (lambda: lay(full(16), prefix_match_unit=32),
     "group 0: block_size 16 is not a multiple of prefix_match_unit 32"),
    (lambda: lay(GroupSpec(GroupKind.CROSS_ATTENTION, 16)),
     "group 0: cross-attention is not supported"),
    (lambda: lay(full(0)), "group 0: block_size must be a positive int"),
    (lambda: lay(full(-16)), "block_size must be a positive int"),
    (lambda: lay(full(True)), "block_size must be a positive int"),
    (lambda: lay(full(16.0)), "block_size must be a positive int"),
    (lambda: lay(full(), GroupSpec(SW, 16)), "group 1: sliding_window must be a positive int"),
    (lambda: lay(sw(window=0)), "sliding_window must be a positive int"),
    (lambda: lay(full(sliding_window=128)), "sliding_window is only valid for SLIDING_WINDOW"),
    (lambda: lay(GroupSpec(GroupKind.CHUNKED_LOCAL, 16)), "chunk_size must be a positive int"),
    (lambda: lay(full(chunk_size=64)), "chunk_size is only valid for CHUNKED_LOCAL"),
    (lambda: lay(sw(extra_retained_tokens=-1)), "extra_retained_tokens must be an int >= 0"),
    (lambda: lay(full(extra_retained_tokens=4)),
     "extra_retained_tokens is only valid for SLIDING_WINDOW"),
    (lambda: lay(GroupSpec(GroupKind.MAMBA, 16, num_speculative_blocks=-1)),
     "num_speculative_blocks must be an int >= 0"),
    (lambda: lay(full(num_speculative_blocks=2)), "num_speculative_blocks is only valid for MAMBA"),
    (lambda: lay(full(kernel_block_size=0)), "kernel_block_size must be a positive int"),
    (lambda: lay(full(64, kernel_block_size=48)), "kernel_block_size 48 does not divide block_size 64"),
    (lambda: lay(full(page_bytes=-1)), "page_bytes must be an int >= 0"),
    (lambda: KVLayout.from_dict({}), "needs a 'groups' list"),
    (lambda: KVLayout.from_dict({"groups": "full"}), "'groups' must be a list"),
    (lambda: GroupSpec.from_dict({"kind": "nope", "block_size": 16}), "kind must be one of"),
    (lambda: GroupSpec.from_dict({"kind": "full", "block_size": 16, "colour": 1}),
     "unknown group fields: \\['colour'\\]"),
]


@pytest.mark.parametrize("make,msg", BAD_LAYOUTS, ids=[m for _, m in BAD_LAYOUTS])
def test_layout_rule(make, msg):
    with pytest.raises(LayoutError, match=msg):
        make()


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_non_align_mamba_not_hash_addressable():
    layout = lay(GroupSpec(GroupKind.MAMBA, 16, mamba_mode=MambaMode.ALL), full())
    with pytest.raises(LayoutError, match="group 0: Mamba cache mode 'all' is not hash-addressable"):
        layout.check_hash_addressable()
    assert not layout.groups[0].prefix_cacheable
    lay(GroupSpec(GroupKind.MAMBA, 16), full()).check_hash_addressable()  # align: fine
    lay(GroupSpec(GroupKind.MAMBA, 16, mamba_mode="none", transfer=False)).check_hash_addressable()


# -- window sizes (golden, §13.2) -------------------------------------------------------
@pytest.mark.parametrize("bs,window,want", [(16, 2048, 129), (16, 128, 9), (32, 4096, 129),
                                           (4, 8, 3), (8, 128, 17), (64, 128, 3)])
def test_window_blocks_golden(bs, window, want):
    assert sw(bs, window).window_blocks() == want
    assert window // bs + 1 <= want  # floor would drop the boundary block when it divides


def test_window_blocks_floor_bug_case():
    assert sw(32, 4096).window_blocks() == 129 and 4096 // 32 == 128


@pytest.mark.parametrize("bs,window,extra,want", [
    (16, 128, 0, 9),     # cdiv(127, 16) + 1
    (16, 129, 0, 9),     # cdiv(128, 16) + 1, while the NIXL bound is 10
    (16, 128, 16, 10),   # MTP re-prefill tail: cdiv(143, 16) + 1
    (4, 8, 0, 3), (8, 128, 0, 17), (1, 1, 0, 1),
])
def test_window_blocks_exact(bs, window, extra, want):
    spec = sw(bs, window, extra_retained_tokens=extra)
    assert spec.window_blocks(exact=True) == want
    if extra == 0:
        assert spec.window_blocks(exact=True) <= spec.window_blocks()


def test_window_blocks_zero_for_other_kinds():
    assert full().window_blocks() == 0
    assert GroupSpec(GroupKind.MAMBA, 16).window_blocks(exact=True) == 0
    assert GroupSpec(GroupKind.CHUNKED_LOCAL, 16, chunk_size=64).window_blocks() == 0
    assert full().hit_run_blocks() == 0
    assert sw(4, 8).hit_run_blocks() == 2  # vLLM docstring: bs 4, sw 8 -> need 2


@given(st.integers(1, 512), st.integers(1, 1 << 17), st.integers(0, 64))
def test_window_blocks_formula(bs, window, extra):
    spec = sw(bs, window, extra_retained_tokens=extra)
    g = {"kind": "sw", "bs": bs, "sw": window, "extra": extra}
    from tests.oracle_core import window_blocks
    assert spec.window_blocks() == window_blocks(g)
    n = spec.window_blocks(exact=True)
    assert n == window_blocks(g, exact=True)
    # Enough blocks to hold the window tail of any length (sw-1+extra tokens + the current
    # token at an arbitrary offset): n*bs >= retained + bs, and one block fewer is not.
    retained = window - 1 + extra
    assert (n - 1) * bs >= retained and (n - 2) * bs < retained
    assert spec.hit_run_blocks() == ceil_div(window - 1, bs)


# -- derived sizes ----------------------------------------------------------------------
def test_hash_and_scheduler_block_sizes_dsv4():
    d = get_preset("deepseek-v4")
    assert d.block_sizes == (256, 64, 64, 4, 8)
    assert d.hash_block_size == 4 and d.scheduler_block_size == 256
    assert d.window_blocks() == (0, 3, 3, 3, 17)


def test_hash_block_size_rules():
    assert lay(full(64), sw(256)).hash_block_size == 64
    assert lay(full(64), sw(256), prefix_match_unit=32).hash_block_size == 32
    # Only prefix-cacheable groups count; none -> scheduler block size.
    assert lay(full(64), GroupSpec(GroupKind.MAMBA, 96, mamba_mode="all")).hash_block_size == 64
    only_state = lay(GroupSpec(GroupKind.MAMBA, 96, mamba_mode="none"))
    assert only_state.hash_block_size == only_state.scheduler_block_size == 96
    assert lay(full(16), sw(48)).scheduler_block_size == 48


def test_kernel_ratio_and_kinds():
    q = get_preset("qwen3-next-80b")
    assert [g.kernel_ratio for g in q.groups] == [1, 1, 1, 34]
    assert [g.is_attention for g in q.groups] == [False, False, False, True]
    assert full(64, kernel_block_size=16).kernel_ratio == 4
    assert GroupSpec(GroupKind.MAMBA, 64, kernel_block_size=16).kernel_ratio == 1


def test_group_id_views():
    layout = lay(full(16, layer_names=("l0",)), sw(16, layer_names=("l1", "l2")),
                 GroupSpec(GroupKind.MAMBA, 16, mamba_mode="all", transfer=False))
    assert layout.layer_to_group == {"l0": 0, "l1": 1, "l2": 1}
    assert layout.transfer_group_ids == (0, 1)
    assert layout.prefix_cacheable_group_ids == (0, 1)
    assert layout.is_hybrid and not get_preset("llama").is_hybrid
    assert layout.num_groups == 3
    assert layout.with_num_blocks(100).num_blocks == 100


def test_fingerprint():
    a = get_preset("gpt-oss-120b")
    assert a.fingerprint() == get_preset("gpt-oss-120b", num_blocks=7).fingerprint()
    swapped = KVLayout(groups=(a.groups[1], a.groups[0]))
    assert swapped.fingerprint() != a.fingerprint()
    assert len(a.fingerprint()) == 32


# -- documents ------------------------------------------------------------------------
def test_from_dict_roundtrip_and_num_layers():
    d = get_preset("deepseek-v4").to_dict()
    assert KVLayout.from_dict(json.loads(json.dumps(d))) == get_preset("deepseek-v4")
    g = GroupSpec.from_dict({"kind": "sliding_window", "block_size": 16, "sliding_window": 64,
                             "num_layers": 2, "name": "swa"})
    assert g.kind == SW and g.layer_names == ("swa.0", "swa.1")


def test_from_file_json_and_toml(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps({"num_blocks": 1000, "groups": [
        {"kind": "full", "block_size": 16, "num_layers": 2},
        {"kind": "SLIDING_WINDOW", "block_size": 16, "sliding_window": 128, "num_layers": 2}]}))
    j = KVLayout.from_file(str(p))
    assert j.num_blocks == 1000 and j.window_blocks() == (0, 9)
    t = tmp_path / "l.toml"
    t.write_text('num_blocks = 1000\n[[groups]]\nkind = "full"\nblock_size = 16\nnum_layers = 2\n'
                 '[[groups]]\nkind = "sliding_window"\nblock_size = 16\nsliding_window = 128\n'
                 'num_layers = 2\n')
    assert KVLayout.from_file(str(t)) == j
    bad = tmp_path / "bad.toml"
    bad.write_text('[[groups]]\nkind = "full"\nblock_size = 0\n')
    with pytest.raises(LayoutError, match="block_size must be a positive int"):
        KVLayout.from_file(str(bad))


# -- presets ---------------------------------------------------------------------------
def test_presets_build_and_sizes():
    assert preset_names() == list(PRESETS)
    want = {"gpt-oss-120b": ((9, 0), 2), "gemma-3-27b": ((0,) + (65,) * 6, 7),
            "qwen3-next-80b": ((0, 0, 0, 0), 4), "deepseek-v4": ((0, 3, 3, 3, 17), 5),
            "llama-3-70b": ((0,), 1)}
    for name, (windows, groups) in want.items():
        layout = get_preset(name)
        assert layout.num_groups == groups
        assert layout.window_blocks() == windows
        layers = [n for g in layout.groups for n in g.layer_names]
        assert len(layers) == len(set(layers))


def test_preset_aliases_and_errors():
    assert get_preset("dsv4") == get_preset("deepseek-v4")
    assert get_preset("gpt-oss", num_blocks=123).num_blocks == 123
    with pytest.raises(LayoutError, match="preset must be one of"):
        get_preset("gpt-5")
