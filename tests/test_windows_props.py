"""Hypothesis differential tests: hmacore.windows vs the plain-Python oracle over random
layouts (always including DSv4's five groups 256/64/64/4/8) and random tables."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hmacore.errors import BlockTableError
from hmacore.presets import get_preset
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.windows import (clip_to_window, expand_layout_to_kernel, expand_to_kernel,
                             map_block_size, trim_remote_to_local)
from tests import oracle_core as oracle

NB = 5000
BLOCK_SIZES = [1, 4, 8, 16, 32, 64, 256, 544]


@st.composite
def group_specs(draw):
    kind = draw(st.sampled_from([GroupKind.FULL, GroupKind.SLIDING_WINDOW,
                                 GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA]))
    bs = draw(st.sampled_from(BLOCK_SIZES))
    kw = {}
    if kind == GroupKind.SLIDING_WINDOW:
        kw["sliding_window"] = draw(st.integers(1, 4096))
        kw["extra_retained_tokens"] = draw(st.sampled_from([0, 0, 1, 16, 100]))
    elif kind == GroupKind.CHUNKED_LOCAL:
        kw["chunk_size"] = draw(st.sampled_from([64, 8192]))
    elif kind == GroupKind.MAMBA:
        kw["num_speculative_blocks"] = draw(st.integers(0, 3))
    if kind != GroupKind.MAMBA:
        divisors = [d for d in (1, 2, 4, 8, 16, 32) if bs % d == 0]
        kw["kernel_block_size"] = draw(st.one_of(st.none(), st.sampled_from(divisors)))
    return GroupSpec(kind, bs, **kw)


layouts = st.one_of(
    st.just(get_preset("deepseek-v4", num_blocks=NB)),
    st.just(get_preset("qwen3-next-80b", num_blocks=NB)),
    st.lists(group_specs(), min_size=1, max_size=6).map(
        lambda gs: KVLayout(groups=tuple(gs), num_blocks=NB)),
)


def ids(max_size=40, lead_nulls=True):
    core = st.lists(st.integers(1, NB - 1), max_size=max_size)
    if not lead_nulls:
        return core
    return st.tuples(st.integers(0, 8), core).map(lambda t: [0] * t[0] + t[1])


def tables(layout, max_size=40, lead_nulls=True):
    return st.tuples(*[ids(max_size, lead_nulls) for _ in layout.groups]).map(list)


def lists(t):
    return [x.tolist() for x in t]


@given(st.data(), layouts, st.booleans(), st.booleans())
def test_clip_matches_oracle(data, layout, exact, clip_state):
    t = data.draw(tables(layout))
    groups = oracle.layout_to_dicts(layout)
    got = clip_to_window(tuple(t), layout, exact=exact, clip_state=clip_state)
    assert all(x.dtype == np.int32 for x in got)
    assert lists(got) == oracle.clip(t, groups, exact, clip_state)
    for g, (spec, x, orig) in enumerate(zip(layout.groups, got, t)):
        if spec.kind == GroupKind.MAMBA and clip_state:
            assert len(x) == min(1, len(orig))  # one running-state slot
            continue
        assert x.tolist() == orig[len(orig) - len(x):]        # otherwise always a suffix
        if spec.kind == GroupKind.SLIDING_WINDOW:
            assert len(x) == min(len(orig), spec.window_blocks(exact))


@given(st.data(), layouts)
def test_trim_matches_oracle(data, layout):
    G = layout.num_groups
    local = data.draw(tables(layout, 12, lead_nulls=False))
    remote = data.draw(tables(layout, 16))
    ratios = data.draw(st.one_of(st.none(), st.tuples(*[st.integers(1, 3)] * G)))
    rratios = data.draw(st.one_of(st.none(), st.tuples(*[st.integers(1, 3)] * G)))
    groups = oracle.layout_to_dicts(layout)
    try:
        want = oracle.trim(local, remote, groups, ratios and list(ratios), rratios and list(rratios))
    except oracle.OracleError:
        with pytest.raises(BlockTableError):
            trim_remote_to_local(tuple(local), tuple(remote), layout, local_kernel_ratios=ratios,
                                 remote_kernel_ratios=rratios)
        return
    l, r = trim_remote_to_local(tuple(local), tuple(remote), layout, local_kernel_ratios=ratios,
                                remote_kernel_ratios=rratios)
    assert [lists(l), lists(r)] == [want[0], want[1]]
    assert all(len(a) == len(b) for a, b in zip(l, r))


@given(st.data(), layouts)
def test_trim_end_aligns_when_remote_is_longer(data, layout):
    """Constructive case: remote = nulls + a prefix + the local-length suffix; D's blocks pair
    with exactly that suffix, and an empty local group pulls nothing."""
    local, remote, want_r = [], [], []
    for spec in layout.groups:
        n = data.draw(st.integers(0, 6))
        if spec.kind == GroupKind.MAMBA:
            n = min(n, 1)
            local.append(list(range(1, n + 1)))
            remote.append(list(range(100, 100 + n)))
            want_r.append(remote[-1])
            continue
        pre = data.draw(st.integers(0, 5))
        nulls = data.draw(st.integers(0, 3))
        tail = list(range(200, 200 + n))
        local.append(list(range(1, n + 1)))
        remote.append([0] * nulls + list(range(300, 300 + pre)) + tail)
        want_r.append(tail)
    l, r = trim_remote_to_local(tuple(local), tuple(remote), layout)
    assert lists(l) == local and lists(r) == want_r


@given(st.data(), st.integers(1, 8), st.integers(1, 300))
def test_expand_matches_oracle(data, G, extra_stride):
    t = [data.draw(ids(20, lead_nulls=False)) for _ in range(G)]
    ratios = [data.draw(st.sampled_from([1, 2, 4, 16, 34])) for _ in range(G)]
    strides = [r + data.draw(st.integers(0, extra_stride)) for r in ratios]
    got = expand_to_kernel(tuple(t), tuple(ratios), strides=tuple(strides))
    assert lists(got) == [oracle.expand(x, r, s) for x, r, s in zip(t, ratios, strides)]


@given(st.data(), layouts)
def test_expand_layout_matches_oracle(data, layout):
    t = data.draw(tables(layout, 20))
    groups = oracle.layout_to_dicts(layout)
    got = expand_layout_to_kernel(tuple(t), layout)
    assert lists(got) == [oracle.expand(x, g["kr"]) for x, g in zip(t, groups)]


@given(st.data(), layouts, st.sampled_from([1, 2, 4, 8]))
def test_map_block_size_matches_oracle(data, layout, ratio):
    t = data.draw(tables(layout, 20, lead_nulls=False))
    lengths = [data.draw(st.integers(0, 100)) for _ in layout.groups]
    groups = oracle.layout_to_dicts(layout)
    got = map_block_size(tuple(t), ratio, lengths, layout)
    want = oracle.map_block_size(t, ratio, lengths, groups)
    assert (got == () and want == []) or lists(got) == want


@given(st.integers(1, 2**31 - 1), st.sampled_from([1, 2, 3, 34, 261]))
def test_expand_overflow_boundary(b, ratio):
    fits = b * ratio + ratio - 1 <= 2**31 - 1
    if fits:
        assert expand_to_kernel([[b]], ratio)[0].tolist() == [b * ratio + k for k in range(ratio)]
    else:
        with pytest.raises(BlockTableError, match="overflows int32"):
            expand_to_kernel([[b]], ratio)


BAD_VALUES = [-1, NB, 2**31, 2**40, 1.5, True, None, "7"]


@given(st.data(), layouts, st.booleans(), st.sampled_from(["list", "tuple", "int32", "int64"]))
def test_clip_any_form_validates_exactly_the_kept_ids(data, layout, exact, form):
    """Fast (C) and general paths agree: the kept ids are validated, the dropped are not."""
    t = data.draw(tables(layout, 20))
    groups = oracle.layout_to_dicts(layout)
    bad_at = None
    if data.draw(st.booleans()) and any(t):
        g = data.draw(st.sampled_from([g for g in range(len(t)) if t[g]]))
        i = data.draw(st.integers(0, len(t[g]) - 1))
        val = data.draw(st.sampled_from(BAD_VALUES if form in ("list", "tuple") else [-1, NB]))
        t[g] = t[g][:i] + [val] + t[g][i + 1:]
        bad_at = (g, i)
    conv = {"list": list, "tuple": tuple, "int32": lambda x: np.array(x, dtype=np.int32),
            "int64": lambda x: np.array(x, dtype=np.int64)}[form]
    positions = oracle.clip([list(range(len(x))) for x in t], groups, exact)
    kept_bad = bad_at is not None and bad_at[1] in positions[bad_at[0]]
    if kept_bad:
        with pytest.raises(BlockTableError, match=f"group {bad_at[0]}, index {bad_at[1]}"):
            clip_to_window(tuple(conv(x) for x in t), layout, exact=exact)
    else:
        got = clip_to_window(tuple(conv(x) for x in t), layout, exact=exact)
        assert lists(got) == [[x[i] for i in p] for x, p in zip(t, positions)]


@given(st.data(), layouts, st.sampled_from(["list", "tuple", "int32", "int64"]))
def test_trim_any_form_matches_oracle(data, layout, form):
    """Fast (C) and general paths agree with the oracle, errors included."""
    conv = {"list": list, "tuple": tuple, "int32": lambda x: np.array(x, dtype=np.int32),
            "int64": lambda x: np.array(x, dtype=np.int64)}[form]
    local = data.draw(tables(layout, 8, lead_nulls=False))
    remote = data.draw(tables(layout, 12))
    if data.draw(st.booleans()) and any(remote):
        g = data.draw(st.sampled_from([g for g in range(len(remote)) if remote[g]]))
        i = data.draw(st.integers(0, len(remote[g]) - 1))
        remote[g][i] = data.draw(st.sampled_from([-1, 0, 2**31] if form != "int32" else [-1, 0]))
    groups = oracle.layout_to_dicts(layout)
    args = (tuple(conv(x) for x in local), tuple(conv(x) for x in remote), layout)
    try:
        want = oracle.trim(local, remote, groups)
        bad = any(v < 0 or v >= 2**31 for x in want[1] for v in x)
    except oracle.OracleError:
        want, bad = None, True
    if bad:
        with pytest.raises(BlockTableError):
            trim_remote_to_local(*args)
    else:
        l, r = trim_remote_to_local(*args)
        assert [lists(l), lists(r)] == [want[0], want[1]]
