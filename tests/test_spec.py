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
     "GroupSpec.kind: cross-attention is not supported"),
    (lambda: lay(full(0)), "GroupSpec.block_size must be an int >= 1, got 0"),
    (lambda: lay(full(-16)), "GroupSpec.block_size must be an int >= 1, got -16"),
    (lambda: lay(full(True)), "GroupSpec.block_size must be an int >= 1, got True"),
    (lambda: lay(full(16.0)), "GroupSpec.block_size must be an int >= 1, got 16.0"),
    (lambda: lay(full(), GroupSpec(SW, 16)),
     "GroupSpec.sliding_window must be an int >= 1 \\(tokens\\) for a SLIDING_WINDOW group, got None"),
    (lambda: lay(sw(window=0)), "GroupSpec.sliding_window must be an int >= 1"),
    (lambda: lay(full(sliding_window=128)), "sliding_window is only valid for SLIDING_WINDOW"),
    (lambda: lay(GroupSpec(GroupKind.CHUNKED_LOCAL, 16)), "GroupSpec.chunk_size must be an int >= 1"),
    (lambda: lay(full(chunk_size=64)), "chunk_size is only valid for CHUNKED_LOCAL"),
    (lambda: lay(sw(extra_retained_tokens=-1)), "extra_retained_tokens must be an int >= 0"),
    (lambda: lay(full(extra_retained_tokens=4)),
     "extra_retained_tokens is only valid for SLIDING_WINDOW"),
    (lambda: lay(GroupSpec(GroupKind.MAMBA, 16, num_speculative_blocks=-1)),
     "num_speculative_blocks must be an int >= 0"),
    (lambda: lay(full(num_speculative_blocks=2)), "num_speculative_blocks is only valid for MAMBA"),
    (lambda: lay(full(kernel_block_size=0)), "GroupSpec.kernel_block_size must be an int >= 1"),
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
    with pytest.raises(LayoutError, match="bad.toml': group 0: GroupSpec.block_size must be an int >= 1"):
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


# -- GroupSpec validates itself (no layout needed), naming the argument and the rule --------
MAMBA = GroupKind.MAMBA
CL = GroupKind.CHUNKED_LOCAL
BAD_SPECS = [
    (dict(kind=FULL, block_size=-5), "GroupSpec.block_size must be an int >= 1, got -5"),
    (dict(kind=FULL, block_size=0), "GroupSpec.block_size must be an int >= 1, got 0"),
    (dict(kind=FULL, block_size=16.0), "GroupSpec.block_size must be an int >= 1, got 16.0"),
    (dict(kind=FULL, block_size=False), "GroupSpec.block_size must be an int >= 1, got False"),
    (dict(kind=FULL, block_size="16"), "GroupSpec.block_size must be an int >= 1, got '16'"),
    (dict(kind=True, block_size=16), "GroupSpec.kind must be one of FULL, SLIDING_WINDOW"),
    (dict(kind=1.0, block_size=16), "GroupSpec.kind must be one of"),
    (dict(kind="full", block_size=16), "GroupSpec.kind must be one of"),
    (dict(kind=4, block_size=16), "cross-attention is not supported"),
    (dict(kind=FULL, block_size=16, layer_names="abc"),
     "GroupSpec.layer_names must be a sequence of layer-name strings, got str 'abc' "
     "\\(one layer: layer_names=\\('abc',\\)\\)"),
    (dict(kind=FULL, block_size=16, layer_names=b"ab"), "GroupSpec.layer_names must be a sequence"),
    (dict(kind=FULL, block_size=16, layer_names={"a", "b"}), "GroupSpec.layer_names must be a sequence"),
    (dict(kind=FULL, block_size=16, layer_names=5), "GroupSpec.layer_names must be a sequence"),
    (dict(kind=FULL, block_size=16, layer_names=("a", 3)),
     "GroupSpec.layer_names\\[1\\] must be a non-empty str, got 3"),
    (dict(kind=FULL, block_size=16, layer_names=("a", "")), "layer_names\\[1\\] must be a non-empty str"),
    (dict(kind=FULL, block_size=16, layer_names=("a", "b", "a")),
     "GroupSpec.layer_names lists layer 'a' twice"),
    (dict(kind=SW, block_size=16), "GroupSpec.sliding_window must be an int >= 1 .* got None"),
    (dict(kind=SW, block_size=16, sliding_window=128.0), "sliding_window must be an int >= 1"),
    (dict(kind=SW, block_size=16, sliding_window=True), "sliding_window must be an int >= 1"),
    (dict(kind=FULL, block_size=16, sliding_window=128),
     "GroupSpec.sliding_window is only valid for SLIDING_WINDOW groups, got 128 for a FULL group"),
    (dict(kind=CL, block_size=16), "GroupSpec.chunk_size must be an int >= 1 .* got None"),
    (dict(kind=CL, block_size=16, chunk_size=-64), "GroupSpec.chunk_size must be an int >= 1"),
    (dict(kind=SW, block_size=16, sliding_window=64, chunk_size=64),
     "GroupSpec.chunk_size is only valid for CHUNKED_LOCAL groups"),
    (dict(kind=SW, block_size=16, sliding_window=64, extra_retained_tokens=-1),
     "GroupSpec.extra_retained_tokens must be an int >= 0, got -1"),
    (dict(kind=SW, block_size=16, sliding_window=64, extra_retained_tokens=2.5),
     "GroupSpec.extra_retained_tokens must be an int >= 0, got 2.5"),
    (dict(kind=FULL, block_size=16, extra_retained_tokens=4),
     "GroupSpec.extra_retained_tokens is only valid for SLIDING_WINDOW groups"),
    (dict(kind=FULL, block_size=16, eagle="no"),
     "GroupSpec.eagle must be a bool \\(True or False\\), got 'no'"),
    (dict(kind=FULL, block_size=16, eagle="false"), "GroupSpec.eagle must be a bool"),
    (dict(kind=FULL, block_size=16, eagle=1), "GroupSpec.eagle must be a bool"),
    (dict(kind=FULL, block_size=16, mla="yes"), "GroupSpec.mla must be a bool"),
    (dict(kind=FULL, block_size=16, transfer=0), "GroupSpec.transfer must be a bool"),
    (dict(kind=MAMBA, block_size=16, mla=True), "GroupSpec.mla is only valid for attention groups"),
    (dict(kind=MAMBA, block_size=16, mamba_mode="fast"),
     "GroupSpec.mamba_mode must be one of none/all/align"),
    (dict(kind=FULL, block_size=16, mamba_mode="all"),
     "GroupSpec.mamba_mode is only valid for MAMBA groups .* got 'all' for a FULL group"),
    (dict(kind=MAMBA, block_size=16, num_speculative_blocks=1.0),
     "GroupSpec.num_speculative_blocks must be an int >= 0"),
    (dict(kind=FULL, block_size=16, num_speculative_blocks=2),
     "GroupSpec.num_speculative_blocks is only valid for MAMBA groups"),
    (dict(kind=FULL, block_size=64, kernel_block_size=16.0),
     "GroupSpec.kernel_block_size must be an int >= 1, got 16.0"),
    (dict(kind=FULL, block_size=64, kernel_block_size=48),
     "GroupSpec.kernel_block_size 48 does not divide block_size 64"),
    (dict(kind=FULL, block_size=16, page_bytes=-1), "GroupSpec.page_bytes must be an int >= 0, got -1"),
    (dict(kind=FULL, block_size=16, page_bytes=1024.0), "GroupSpec.page_bytes must be an int >= 0"),
    (dict(kind=FULL, block_size=16, name=7), "GroupSpec.name must be a str, got 7"),
    # head shape: None (unknown) or in range; shapes on attention groups only
    (dict(kind=FULL, block_size=16, num_kv_heads=0),
     "GroupSpec.num_kv_heads must be None \\(unknown\\) or an int >= 1, got 0"),
    (dict(kind=FULL, block_size=16, num_kv_heads=8.0), "GroupSpec.num_kv_heads must be None"),
    (dict(kind=FULL, block_size=16, num_kv_heads=True), "num_kv_heads must be None .* got True"),
    (dict(kind=FULL, block_size=16, num_kv_heads="8"), "num_kv_heads must be None .* got '8'"),
    (dict(kind=FULL, block_size=16, head_size=-128),
     "GroupSpec.head_size must be None \\(unknown\\) or an int >= 1, got -128"),
    (dict(kind=FULL, block_size=16, head_size=128, head_size_v=-1),
     "GroupSpec.head_size_v must be None \\(unknown\\) or an int >= 0, got -1"),
    (dict(kind=FULL, block_size=16, head_size_v=128),
     "GroupSpec.head_size_v needs head_size .* got head_size_v=128 and head_size=None"),
    (dict(kind=MAMBA, block_size=16, num_kv_heads=4),
     "GroupSpec.num_kv_heads is only valid for attention groups .* got 4 for a MAMBA group"),
    (dict(kind=MAMBA, block_size=16, head_size=64), "GroupSpec.head_size is only valid for attention"),
    (dict(kind=FULL, block_size=16, dtype=""),
     "GroupSpec.dtype must be None \\(unknown\\) or a non-empty str, got ''"),
    (dict(kind=FULL, block_size=16, dtype="torch."), "GroupSpec.dtype must be None .* got 'torch.'"),
    (dict(kind=FULL, block_size=16, dtype=2), "GroupSpec.dtype must be None .* got 2"),
    (dict(kind=FULL, block_size=16, attn_type="  "),
     "GroupSpec.attn_type must be None \\(unknown\\) or a non-empty str, got '  '"),
    (dict(kind=FULL, block_size=16, attn_type=b"full"), "GroupSpec.attn_type must be None"),
]


@pytest.mark.parametrize("kw,msg", BAD_SPECS, ids=[m[:60] for _, m in BAD_SPECS])
def test_group_spec_validates_itself(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        GroupSpec(**kw)


def test_group_spec_normalises_but_never_truncates():
    g = GroupSpec(SW, 16, ["a", "b"], sliding_window=64, mamba_mode="align")
    assert g.layer_names == ("a", "b") and g.mamba_mode is MambaMode.ALIGN
    assert GroupSpec(1, 16, sliding_window=64).kind is SW           # the int value is a kind
    assert GroupSpec(FULL, 16, (f"l{i}" for i in range(3))).layer_names == ("l0", "l1", "l2")
    assert GroupSpec(MAMBA, 64, kernel_block_size=16, num_speculative_blocks=2).kernel_ratio == 1
    import dataclasses as dc
    with pytest.raises(LayoutError, match="block_size must be an int >= 1"):
        dc.replace(g, block_size=-1)                                   # replace validates too


def test_head_fields_follow_vllm_defaults():
    g = full(16, num_kv_heads=8, head_size=128, dtype="torch.bfloat16", attn_type="FullAttentionSpec")
    # vLLM's AttentionSpec sets head_size_v = head_size; MLA stores no separate V
    assert (g.head_size_v, g.dtype) == (128, "bfloat16")
    assert g == full(16, num_kv_heads=8, head_size=128, head_size_v=128, dtype="bfloat16",
                     attn_type="FullAttentionSpec")
    assert full(16, mla=True, head_size=576).head_size_v == 0
    assert full(16, head_size=192, head_size_v=128).head_size_v == 128
    m = GroupSpec(MAMBA, 64, dtype="float16,float32", attn_type="MambaSpec:GDN_ATTN")
    assert m.num_kv_heads is m.head_size is m.head_size_v is None
    unknown = full(16)
    assert (unknown.num_kv_heads, unknown.head_size, unknown.head_size_v, unknown.dtype,
            unknown.attn_type) == (None,) * 5


def test_head_fields_in_documents_pickles_reprs_and_fingerprints():
    import pickle
    import hmacore
    g = sw(16, 64, layer_names=("a",), num_kv_heads=8, head_size=128, dtype="bfloat16",
           attn_type="SlidingWindowSpec", page_bytes=65536)
    layout = lay(full(16, layer_names=("f",)), g)
    assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert eval(repr(g), vars(hmacore)) == g and "num_kv_heads=8" in repr(g)
    doc = {"groups": [{"kind": "sliding_window", "block_size": 16, "sliding_window": 64,
                       "num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}]}
    assert KVLayout.from_dict(doc).groups[0].head_size_v == 128
    with pytest.raises(LayoutError, match="group 0: GroupSpec.num_kv_heads must be None"):
        KVLayout.from_dict({"groups": [{"kind": "full", "block_size": 16, "num_kv_heads": 0}]})
    with pytest.raises(LayoutError, match="'num_kv_head' \\(did you mean 'num_kv_heads'\\?\\)"):
        KVLayout.from_dict({"groups": [{"kind": "full", "block_size": 16, "num_kv_head": 8}]})
    # unknown head fields leave the fingerprint as it was; known ones enter it, and the
    # pairing fingerprint ignores the per-rank KV heads (they scale with TP, as page bytes)
    import hashlib
    from hmacore.spec import HEAD_FIELDS
    base = lay(full(16, layer_names=("f",)), sw(16, 64, layer_names=("a",)))
    before = {"groups": [{k: v for k, v in s.to_dict().items() if k not in HEAD_FIELDS}
                         for s in base.groups], "cp": 1, "pmu": None}      # the old document
    assert base.fingerprint() == \
        hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:32]
    import dataclasses as dc
    heads = dc.replace(base, groups=(base.groups[0], dc.replace(base.groups[1], num_kv_heads=8)))
    tp2 = dc.replace(base, groups=(base.groups[0], dc.replace(base.groups[1], num_kv_heads=4)))
    assert heads.fingerprint() != base.fingerprint() != tp2.fingerprint()
    assert heads.pairing_fingerprint() == tp2.pairing_fingerprint() == base.pairing_fingerprint()
    dtyped = dc.replace(base, groups=(base.groups[0], dc.replace(base.groups[1], dtype="fp8")))
    assert dtyped.pairing_fingerprint() != base.pairing_fingerprint()


def test_toml_layout_with_head_fields(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[[groups]]\nkind = "full"\nblock_size = 16\nnum_layers = 1\n'
                 'num_kv_heads = 8\nhead_size = 128\ndtype = "bfloat16"\n'
                 'attn_type = "FullAttentionSpec"\n'
                 '[[groups]]\nkind = "sliding_window"\nblock_size = 16\nsliding_window = 64\n'
                 'num_layers = 1\n')
    a, b = KVLayout.from_file(p).groups
    assert (a.num_kv_heads, a.head_size, a.head_size_v, a.dtype, a.attn_type) == \
        (8, 128, 128, "bfloat16", "FullAttentionSpec")
    assert b.num_kv_heads is None and b.dtype is None      # optional: absent = unknown
    p.write_text('[[groups]]\nkind = "mamba"\nblock_size = 16\nhead_size = 64\n')
    with pytest.raises(LayoutError, match="m.toml': group 0: GroupSpec.head_size is only valid "
                                          "for attention groups"):
        KVLayout.from_file(p)


def test_layout_revalidates_groups_it_did_not_see_built():
    import pickle
    g = full(16)
    object.__setattr__(g, "block_size", -3)                            # bypasses __init__
    with pytest.raises(LayoutError, match="group 1: GroupSpec.block_size must be an int >= 1"):
        lay(full(), g)
    good = pickle.loads(pickle.dumps(get_preset("qwen3-next")))
    assert good == get_preset("qwen3-next")
    with pytest.raises(LayoutError, match="groups must be a sequence of GroupSpec, got one GroupSpec"):
        KVLayout(groups=full())
    with pytest.raises(LayoutError, match="groups must be a sequence of GroupSpec, got int"):
        KVLayout(groups=3)


# -- documents: unknown keys with "did you mean", missing keys named ------------------------
BAD_DOCS = [
    ({"groups": [{"kind": "full", "block_size": 16}], "num_block": 100},
     "unknown layout keys: \\['num_block' \\(did you mean 'num_blocks'\\?\\)\\]; allowed: "),
    ({"groups": [{"kind": "full", "block_size": 16}], "contex_parallel": 2},
     "did you mean 'context_parallel'"),
    ({"groups": [{"kind": "full", "blok_size": 16}]},
     "group 0: unknown group fields: \\['blok_size' \\(did you mean 'block_size'\\?\\)\\]"),
    ({"groups": [{"kind": "full", "block_size": 16}, {"kind": "sliding_window", "block_size": 16,
                                                       "slidingwindow": 128}]},
     "group 1: unknown group fields: \\['slidingwindow' \\(did you mean 'sliding_window'\\?\\)\\]"),
    ({"groups": [{"kind": "full"}]}, "group 0: group is missing required key 'block_size'"),
    ({"groups": [{"block_size": 16}]}, "group 0: group is missing required key 'kind'"),
    ({"groups": [{"kind": "ful", "block_size": 16}]},
     "GroupSpec.kind must be one of full, sliding_window, chunked_local, mamba, got 'ful' "
     "\\(did you mean 'full'\\?\\)"),
    ({"groups": [{"kind": "full", "block_size": 16, "num_layers": 2.9}]},
     "group 0: num_layers must be an int >= 1, got 2.9"),
    ({"groups": [{"kind": "full", "block_size": 16, "num_layers": True}]}, "num_layers must be an int"),
    ({"groups": [{"kind": "full", "block_size": 16, "num_layers": 0}]}, "num_layers must be an int >= 1"),
    ({"groups": [{"kind": "full", "block_size": 16, "num_layers": 3, "layer_names": ["a"]}]},
     "num_layers is 3 but layer_names lists 1 layers"),
    ({"groups": [{"kind": "full", "block_size": 16, "layer_names": "attn"}]},
     "group 0: GroupSpec.layer_names must be a sequence of layer-name strings, got str 'attn'"),
    ({"groups": [{"kind": "full", "block_size": 16, "eagle": "false"}]},
     "group 0: GroupSpec.eagle must be a bool \\(True or False\\), got 'false'"),
    ({"groups": [{"kind": "full", "block_size": 16, "transfer": "true"}]},
     "GroupSpec.transfer must be a bool"),
    ({"groups": ["full"]}, "group 0: a group must be a table/object of GroupSpec fields, got str"),
    ({"groups": []}, "a layout needs at least one group"),
    ([{"kind": "full"}], "a layout document must be a table/object with a 'groups' list, got list"),
]


@pytest.mark.parametrize("doc,msg", BAD_DOCS, ids=[m[:50] for _, m in BAD_DOCS])
def test_layout_documents_are_checked(doc, msg):
    with pytest.raises(LayoutError, match=msg):
        KVLayout.from_dict(doc)


def test_missing_keys_are_key_errors_too():
    from hmacore.errors import LayoutKeyError
    for doc in ({}, {"groups": [{"kind": "full"}]}):
        with pytest.raises(LayoutKeyError) as info:
            KVLayout.from_dict(doc)
        assert isinstance(info.value, KeyError) and "missing" in str(info.value)
        assert not str(info.value).startswith('"')    # plain message, not KeyError's repr


def test_every_field_roundtrips_through_a_document():
    for name in preset_names():
        layout = get_preset(name)
        assert KVLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    g = GroupSpec(MAMBA, 64, ("s.0",), mamba_mode="all", num_speculative_blocks=2,
                  kernel_block_size=16, eagle=True, transfer=False, page_bytes=4096, name="s")
    assert GroupSpec.from_dict(g.to_dict()) == g
    assert set(g.to_dict()) | {"num_layers"} == set(GroupSpec.DOCUMENT_KEYS)


BAD_FILES = [
    ("l.toml", '[[groups]]\nkind = "full"\nblock_size = \n', "TOML syntax error: .*line 3"),
    ("l.toml", 'num_blocks = 10\nnum_blocks = 11\n[[groups]]\nkind = "full"\nblock_size = 16\n',
     "TOML syntax error"),
    ("l.json", '{"groups": [{"kind": "full", "block_size": 16,}]}', "JSON syntax error: .*line 1"),
    ("l.json", '{"groups": [{"kind": "full", "block_size": 16, "block_size": 32}]}',
     "JSON object repeats key 'block_size'"),
    ("l.json", b'\xff\xfe\x00garbage', "not UTF-8 text"),
    ("l.yaml", 'groups:\n  - kind: full\n',
     "JSON syntax error: .* \\(files not named \\*.toml are read as JSON\\)"),
    ("l.toml", 'num_block = 10\n[[groups]]\nkind = "full"\nblock_size = 16\n',
     "l.toml': unknown layout keys: \\['num_block' \\(did you mean 'num_blocks'\\?\\)\\]"),
    ("l.toml", '[[groups]]\nkind = "full"\n', "l.toml': group 0: group is missing required key 'block_size'"),
    ("l.toml", '[[groups]]\nkind = "full"\nblock_size = 16\nmla = "false"\n',
     "GroupSpec.mla must be a bool \\(True or False\\), got 'false'"),
]


@pytest.mark.parametrize("fname,text,msg", BAD_FILES, ids=[m[:40] for _, _, m in BAD_FILES])
def test_layout_files_report_the_file_and_the_rule(tmp_path, fname, text, msg):
    p = tmp_path / fname
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(LayoutError, match=msg) as info:
        KVLayout.from_file(p)                            # a Path works as well as a str
    assert str(info.value).startswith(f"layout file {str(p)!r}: ")


def test_unreadable_layout_file_is_a_config_file_error(tmp_path):
    from hmacore.errors import ConfigError, ConfigFileError
    with pytest.raises(ConfigFileError, match="layout file '.*missing.toml': cannot read it "
                                              "\\(No such file or directory\\)") as info:
        KVLayout.from_file(tmp_path / "missing.toml")
    assert isinstance(info.value, OSError) and isinstance(info.value, ConfigError)
    with pytest.raises(ConfigFileError, match="cannot read it"):
        KVLayout.from_file(tmp_path)                     # a directory
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        KVLayout.from_file(3)


def test_preset_errors_suggest_a_name():
    with pytest.raises(LayoutError, match="got 'gpt-oss-12b' \\(did you mean 'gpt-oss-120b'\\?\\)"):
        get_preset("gpt-oss-12b")
    with pytest.raises(LayoutError, match="preset must be a str, got int"):
        get_preset(3)


# -- readable reprs ------------------------------------------------------------------------
def test_reprs_are_readable_and_evaluable():
    import hmacore
    assert repr(full(16)) == "GroupSpec(kind=GroupKind.FULL, block_size=16)"
    assert repr(sw(64, 128, name="swa")) == \
        "GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=64, sliding_window=128, name='swa')"
    assert repr(lay(full(16), num_blocks=10)) == \
        "KVLayout(groups=(GroupSpec(kind=GroupKind.FULL, block_size=16),), num_blocks=10)"
    ns = vars(hmacore)
    for name in preset_names():
        layout = get_preset(name)
        assert eval(repr(layout), ns) == layout
        assert "<" not in repr(layout)                  # no <GroupKind.FULL: 0> noise
    g = GroupSpec(MAMBA, 64, mamba_mode="none", num_speculative_blocks=1)
    assert eval(repr(g), ns) == g and "MambaMode.NONE" in repr(g)
