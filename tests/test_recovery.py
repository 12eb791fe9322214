"""hmacore.recovery against the plain-Python oracle (tests/oracle_recovery.py): hand cases per
group kind and Hypothesis properties over random layouts, tables and failures."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import ArgumentTypeError, ArgumentValueError
from hmacore.recovery import UNKNOWN, plan_vllm_report, safe_restart_point, vllm_landing
from hmacore.spec import GroupKind, GroupSpec, KVLayout

from oracle_recovery import point_is_safe, safe_point, vllm_truncation


def full(bs, n=0):
    return GroupSpec(GroupKind.FULL, bs, (f"f{n}",))


def swa(bs, w, n=0):
    return GroupSpec(GroupKind.SLIDING_WINDOW, bs, (f"s{n}",), sliding_window=w)


def chunked(bs, c, n=0):
    return GroupSpec(GroupKind.CHUNKED_LOCAL, bs, (f"c{n}",), chunk_size=c)


def mamba(bs, n=0):
    return GroupSpec(GroupKind.MAMBA, bs, (f"m{n}",))


def lay(*groups):
    return KVLayout(groups=tuple(groups))


# --- hand cases: gemma-like (full 16 + sliding 16/window 32), 8 local + 8 loaded blocks -----
GEMMA = lay(full(16), swa(16, 32, 1))
FULL_T = [UNKNOWN] * 2 + list(range(100, 108))     # 10 blocks, 2 local hits
SWA_T = [0, UNKNOWN] + list(range(200, 208))        # window before 32 kept locally


def test_nothing_failed_keeps_everything():
    assert safe_restart_point(GEMMA, [FULL_T, SWA_T], [], start=32, end=160) == 160


def test_last_full_block_only():
    # block 9 of the full group covers [144, 160): restart at 144 (both groups intact there)
    assert safe_restart_point(GEMMA, [FULL_T, SWA_T], [(0, 9)], start=32, end=160) == 144


def test_one_sliding_block_inside_the_window():
    # sliding block 8 covers [128, 144): every point above 128 caches it -> 128
    assert safe_restart_point(GEMMA, [FULL_T, SWA_T], [(1, 8)], start=32, end=160) == 128


def test_sliding_block_with_nulls_before_window():
    swa_clipped = [0] * 7 + [207, 208, 209]      # only the last 3 blocks loaded
    full_t = [UNKNOWN] * 2 + list(range(100, 108))
    # block 7 failed: nothing above 112 is safe; 112 needs blocks 5, 6 (null) -> start
    assert safe_restart_point(GEMMA, [full_t, swa_clipped], [(1, 7)], start=32, end=160) == 32
    # block 9 failed: 144 needs blocks 7, 8 -> loaded, intact
    assert safe_restart_point(GEMMA, [full_t, swa_clipped], [(1, 9)], start=32, end=160) == 144


def test_window_reach_is_window_minus_one_tokens():
    # window 18, bs 16: the token at 64 reads [47, 64) -> blocks 2 and 3 (not block 3 alone)
    layout = lay(swa(16, 18))
    table = [0, 0, 0, 13, 14, 15]
    assert safe_restart_point(layout, [table], [(0, 4)], start=0, end=96) == 0
    table = [0, 0, 12, 13, 14, 15]
    assert safe_restart_point(layout, [table], [(0, 4)], start=0, end=96) == 64


def test_mamba_state_only():
    layout = lay(full(64), mamba(64, 1))
    full_t = [UNKNOWN] + [10, 11, 12]
    mamba_t = [0, 0, 0, 20]                       # state slot at the end of the load (256)
    # the state failed: no other state was loaded -> start (64, the local state)
    assert safe_restart_point(layout, [full_t, [0, 0, 0, 20]], [(1, 3)], start=64, end=256) == 64
    # a full block failed at 128: the state at 128 was never loaded -> start
    assert safe_restart_point(layout, [full_t, mamba_t], [(0, 2)], start=64, end=256) == 64


def test_chunked_local():
    layout = lay(full(16), chunked(16, 64, 1))
    t = [UNKNOWN] + list(range(1, 8))
    # chunk block 6 (tokens 96..112) failed: 96 needs [64, 96) = blocks 4, 5 -> intact
    assert safe_restart_point(layout, [t, list(t)], [(1, 6)], start=16, end=128) == 96


def test_vllm_report_single_group_lands_on_safe_point():
    layout = lay(full(16))
    table = [UNKNOWN, UNKNOWN] + list(range(100, 106))
    rep = plan_vllm_report(layout, [table], [(0, 5), (0, 7)], start=32, end=128)
    assert rep.safe_tokens == 80 and rep.lands_at == 80 and not rep.per_request
    assert rep.block_ids == {103, 105}
    assert vllm_landing(16, table, rep.block_ids, 128) == 80
    assert rep.tokens_lost == 48


def test_vllm_report_single_sliding_group_null_at_start_is_per_request():
    layout = lay(swa(16, 32))
    table = [0] * 5 + [105, 106, 107]          # long load, window-clipped: nulls at 2..4
    rep = plan_vllm_report(layout, [table], [(0, 5)], start=32, end=128)
    # safe point 32 (the local hit), but block 2 is null: vLLM cannot be told by block ids
    assert rep.safe_tokens == 32 and rep.per_request and not rep.block_ids


def test_vllm_report_multi_group_is_per_request():
    rep = plan_vllm_report(GEMMA, [FULL_T, SWA_T], [(0, 9)], start=32, end=160)
    assert rep.per_request and rep.safe_tokens == 144 and not rep.block_ids


@pytest.mark.parametrize("kw,exc,text", [
    (dict(start=5, end=4), ArgumentValueError, "start must be <= end"),
    (dict(start=-1, end=4), ArgumentValueError, "start must be >= 0"),
    (dict(start=0, end=1.5), ArgumentTypeError, "end must be an int"),
])
def test_bad_bounds(kw, exc, text):
    with pytest.raises(exc, match=text):
        safe_restart_point(GEMMA, [FULL_T, SWA_T], [(0, 9)], **kw)


def test_bad_failed_and_tables():
    with pytest.raises(ArgumentValueError, match="one block-id list per group"):
        safe_restart_point(GEMMA, [FULL_T], [], start=0, end=16)
    with pytest.raises(ArgumentValueError, match="failed group must be < 2"):
        safe_restart_point(GEMMA, [FULL_T, SWA_T], [(2, 0)], start=0, end=16)
    with pytest.raises(ArgumentValueError, match="past its table"):
        safe_restart_point(GEMMA, [FULL_T, SWA_T], [(0, 10)], start=0, end=16)
    with pytest.raises(ArgumentValueError, match=r"tables\[1\]\[0\] must be >= -1"):
        safe_restart_point(GEMMA, [FULL_T, [-2]], [], start=0, end=16)
    with pytest.raises(ArgumentValueError, match="pairs"):
        safe_restart_point(GEMMA, [FULL_T, SWA_T], [0], start=0, end=16)


# --- properties --------------------------------------------------------------------------
@st.composite
def cases(draw):
    unit = draw(st.sampled_from([4, 8, 16]))
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "chunk", "mamba"]), min_size=1,
                          max_size=3))
    groups = []
    for n, k in enumerate(kinds):
        bs = unit * draw(st.sampled_from([1, 2, 4]))
        if k == "full":
            groups.append(full(bs, n))
        elif k == "swa":
            groups.append(swa(bs, draw(st.integers(1, 5 * bs) | st.builds(
                lambda k, d: max(1, k * bs + d), st.integers(1, 4), st.integers(-2, 2))), n))
        elif k == "chunk":
            groups.append(chunked(bs, bs * draw(st.integers(1, 4)), n))
        else:
            groups.append(mamba(bs, n))
    layout = lay(*groups)
    grain = layout.scheduler_block_size
    start = grain * draw(st.integers(0, 3))
    end = start + draw(st.integers(0, 6 * grain))
    next_id = [1]
    tables, loaded = [], []
    for g, spec in enumerate(groups):
        bs = spec.block_size
        n = -(-end // bs)
        table = []
        for i in range(n):
            if i * bs < start and (i + 1) * bs <= start:
                # a local hit: present where the hit at `start` needs it, else maybe null
                need = i in range(*_needed(spec, start))
                table.append(UNKNOWN if need or draw(st.booleans()) else 0)
            elif draw(st.integers(0, 3)) == 0 and spec.kind != GroupKind.FULL:
                table.append(0)                   # clipped / skipped by the engine
            else:
                table.append(next_id[0])
                next_id[0] += 1
                loaded.append((g, i))
        tables.append(table)
    failed = draw(st.lists(st.sampled_from(loaded), unique=True, max_size=3)) if loaded else []
    return layout, tables, failed, start, end


def _needed(spec, p):
    from hmacore.recovery import needed_blocks
    r = needed_blocks(spec, p)
    return r.start, r.stop


@settings(max_examples=400, deadline=None)
@given(cases())
def test_safe_point_matches_oracle(case):
    layout, tables, failed, start, end = case
    got = safe_restart_point(layout, tables, failed, start=start, end=end)
    assert got == safe_point(layout, tables, failed, start, end)
    assert start <= got <= end
    if failed and got != start:
        assert point_is_safe(layout, tables, set(failed), got)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_vllm_report_lands_where_it_says_and_is_safe(case):
    layout, tables, failed, start, end = case
    rep = plan_vllm_report(layout, tables, failed, start=start, end=end)
    if not failed:
        assert rep.block_ids == frozenset() and rep.lands_at == end and not rep.per_request
        return
    if layout.num_groups > 1 or rep.per_request:
        assert rep.per_request and not rep.block_ids
        return
    bs, table = layout.groups[0].block_size, tables[0]
    assert vllm_truncation(bs, table, rep.block_ids, end) == rep.lands_at
    assert rep.lands_at <= rep.safe_tokens
    assert rep.lands_at == start or point_is_safe(layout, tables, set(failed), rep.lands_at)
    assert all(b > 0 for b in rep.block_ids)            # never the null block or a local hit
    assert {table[i] for g, i in failed if table[i] > 0 and i * bs >= rep.lands_at} \
        <= rep.block_ids
    # landing exactly on the safe point whenever its block is one the load wrote
    i = rep.safe_tokens // bs
    if rep.safe_tokens % bs == 0 and rep.safe_tokens < end and table[i] > 0:
        assert rep.lands_at == rep.safe_tokens
