"""hmacore.grain: token <-> block unit conversions, incl. the DSv4 divide-or-multiply rule
(vLLM PR 42437) and coarse_block_count with a missing group (its review bug)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from hmacore.grain import blocks_covering, cdiv, coarse_block_count, complete_blocks, grain_slice

DSV4_BS = [256, 64, 64, 4, 8]


@pytest.mark.parametrize("a,b,want", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2),
                                      (2048, 16, 128), (4096, 32, 128), (4097, 32, 129)])
def test_cdiv(a, b, want):
    assert cdiv(a, b) == want


@pytest.mark.parametrize("tokens,bs,cover,complete", [(0, 16, 0, 0), (15, 16, 1, 0),
                                                      (16, 16, 1, 1), (33, 16, 3, 2),
                                                      (4096, 256, 16, 16), (4095, 256, 16, 15)])
def test_covering_vs_complete(tokens, bs, cover, complete):
    assert blocks_covering(tokens, bs) == cover
    assert complete_blocks(tokens, bs) == complete
    assert blocks_covering(np.int64(tokens), np.int32(bs)) == cover


@pytest.mark.parametrize("fn", [blocks_covering, complete_blocks])
@pytest.mark.parametrize("tokens,bs,exc,msg", [
    (-1, 16, ValueError, "tokens must be >= 0"), (16, 0, ValueError, "block_size must be > 0"),
    (16, -4, ValueError, "block_size must be >= 0"), (1.5, 16, TypeError, "tokens must be an int"),
    (True, 16, TypeError, "tokens must be an int"), (16, "16", TypeError, "block_size must be an int")])
def test_covering_rejects(fn, tokens, bs, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(tokens, bs)


def test_dsv4_divide_or_multiply_4096_tokens():
    # Grain = hash block 4 tokens; a 4096-token prompt is 1024 grain units. The naive
    # multiplier grain // bs is 0 for bs > 4 and empties four of the five slices.
    got = [grain_slice(0, 1024, 4, bs)[1] - grain_slice(0, 1024, 4, bs)[0] for bs in DSV4_BS]
    assert got == [16, 64, 64, 1024, 512]


@pytest.mark.parametrize("start,end,grain,bs,want", [
    (64, 128, 4, 256, (1, 2)),      # divide: 64 grain units = 1 block of 256
    (64, 128, 4, 64, (4, 8)),
    (64, 128, 4, 4, (64, 128)),     # equal sizes: identity in both branches
    (64, 128, 4, 8, (32, 64)),
    (1, 3, 256, 16, (16, 48)),      # multiply: legacy grain 256, group bs 16
    (2, 5, 256, 256, (2, 5)),
    (0, 0, 4, 256, (0, 0)),
])
def test_grain_slice_cases(start, end, grain, bs, want):
    assert grain_slice(start, end, grain, bs) == want


@pytest.mark.parametrize("args,msg", [
    ((0, 4, 4, 6), "block_size \\(6\\) must be a multiple of grain \\(4\\)"),
    ((0, 4, 256, 48), "grain \\(256\\) must be a multiple of block_size \\(48\\)"),
    ((5, 4, 4, 4), "end \\(4\\) must be >= start \\(5\\)"),
    ((-1, 4, 4, 4), "start must be >= 0"),
    ((0, 4, 0, 4), "grain must be > 0"),
    ((0, 4, 4, 0), "block_size must be > 0"),
])
def test_grain_slice_rejects(args, msg):
    with pytest.raises(ValueError, match=msg):
        grain_slice(*args)


@given(st.integers(0, 4096), st.integers(0, 4096), st.sampled_from([1, 2, 4, 8, 16, 64, 256]),
       st.sampled_from([1, 2, 4, 8, 16, 64, 256]))
def test_grain_slice_matches_token_math(a, b, grain, bs):
    start, end = min(a, b), max(a, b)
    s, e = grain_slice(start, end, grain, bs)
    # In tokens: [start*grain, end*grain) -> complete blocks of bs that the range starts/ends in.
    assert s == start * grain // bs
    assert e == end * grain // bs
    if bs <= grain:
        assert s * bs == start * grain and e * bs == end * grain


def test_coarse_block_count_dsv4():
    assert coarse_block_count([16, 64, 64, 1024, 512], DSV4_BS, 4) == 1024
    assert coarse_block_count([16, 64, 64, 1024, 511], DSV4_BS, 4) == 1022
    assert coarse_block_count({0: 16, 1: 64, 2: 64, 3: 1024, 4: 512}, DSV4_BS, 4) == 1024


def test_coarse_block_count_missing_group_is_zero():
    # PR 42437 review: skipping absent groups over-counts; an absent group has 0 blocks.
    assert coarse_block_count({0: 16, 1: 64, 3: 1024, 4: 512}, DSV4_BS, 4) == 0
    assert coarse_block_count({}, DSV4_BS, 4) == 0
    assert coarse_block_count([], [], 4) == 0


def test_coarse_block_count_rejects():
    with pytest.raises(ValueError, match="lengths has 2 groups, block_sizes has 3"):
        coarse_block_count([1, 2], [16, 16, 16], 16)
    with pytest.raises(ValueError, match="lengths\\[1\\] must be >= 0"):
        coarse_block_count([1, -2], [16, 16], 16)
    with pytest.raises(ValueError, match="block_sizes\\[0\\] must be > 0"):
        coarse_block_count([1], [0], 16)
    with pytest.raises(ValueError, match="grain must be > 0"):
        coarse_block_count([1], [16], 0)


@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([4, 8, 64, 256])), min_size=1,
                max_size=5), st.sampled_from([4, 8, 64, 256]))
def test_coarse_block_count_is_min_over_groups(groups, grain):
    lengths = [n for n, _ in groups]
    sizes = [bs for _, bs in groups]
    want = min(n * bs // grain for n, bs in groups)
    assert coarse_block_count(lengths, sizes, grain) == want
    # Every group covers at least that many grain units of tokens.
    assert all(n * bs >= want * grain for n, bs in groups)


# -- the library's error classes (still the builtins), floats and bools refused ------------
from hmacore.errors import ArgumentTypeError, ArgumentValueError, HmacoreError  # noqa: E402


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: cdiv(1.5, 16), ArgumentTypeError, "a must be an int, got float 1.5"),
    (lambda: cdiv(16, 4.0), ArgumentTypeError, "b must be an int, got float 4.0"),
    (lambda: cdiv(True, 16), ArgumentTypeError, "a must be an int, got bool"),
    (lambda: cdiv(16, np.float64(4)), ArgumentTypeError, "b must be an int"),
    (lambda: cdiv(16, 0), ArgumentValueError, "b must be > 0, got 0"),
    (lambda: cdiv(-1, 16), ArgumentValueError, "a must be >= 0, got -1"),
    (lambda: blocks_covering(16, 2.5), ArgumentTypeError, "block_size must be an int"),
    (lambda: complete_blocks(-1, 16), ArgumentValueError, "tokens must be >= 0"),
    (lambda: grain_slice(0, 4.0, 4, 4), ArgumentTypeError, "end must be an int"),
    (lambda: grain_slice(0, 4, 4, 6), ArgumentValueError, "must be a multiple of grain"),
    (lambda: grain_slice(5, 4, 4, 4), ArgumentValueError, "end \\(4\\) must be >= start"),
    (lambda: coarse_block_count([1.0], [16], 16), ArgumentTypeError, "lengths\\[0\\] must be an int"),
    (lambda: coarse_block_count([1], [16.0], 16), ArgumentTypeError, "block_sizes\\[0\\] must be an int"),
    (lambda: coarse_block_count([1], [16], 16.0), ArgumentTypeError, "grain must be an int"),
    (lambda: coarse_block_count([1, 2], [16], 16), ArgumentValueError, "lengths has 2 groups"),
    (lambda: coarse_block_count({0: 1, 5: 2}, [16, 16], 16), ArgumentValueError,
     "lengths has group 5, block_sizes has 2 groups"),
    (lambda: coarse_block_count(3, [16], 16), ArgumentTypeError, "lengths must be a sequence"),
    (lambda: coarse_block_count([1], 16, 16), ArgumentTypeError, "block_sizes must be a sequence"),
])
def test_grain_errors_are_library_errors_naming_the_argument(call, exc, msg):
    with pytest.raises(exc, match=msg) as info:
        call()
    assert isinstance(info.value, HmacoreError)
    assert isinstance(info.value, TypeError if exc is ArgumentTypeError else ValueError)


def test_cdiv_takes_numpy_integers_and_arrays_of_sizes():
    assert cdiv(np.int64(17), np.int32(16)) == 2 and type(cdiv(np.int64(17), 16)) is int
    assert coarse_block_count(np.array([16, 64]), np.array([256, 64]), 4) == 1024
