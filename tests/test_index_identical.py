"""tables.index_identical (a request id found in vLLM's per-step id list by pointer, without
reading the other ids) against a plain-Python oracle; bad input raises naming the argument."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.tables import index_identical


def oracle(seq, item):
    return next((i for i, x in enumerate(seq) if x is item), -1)


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.text(min_size=0, max_size=6), max_size=30), pick=st.integers(-1, 40),
       as_tuple=st.booleans())
def test_matches_identity_oracle(names, pick, as_tuple):
    # distinct objects with possibly equal values: only identity counts
    objs = [("r-" + n + "!")[:-1] for n in names]
    item = objs[pick] if 0 <= pick < len(objs) else "r-absent"
    seq = tuple(objs) if as_tuple else objs
    assert index_identical(seq, item) == oracle(seq, item)


def test_equal_but_distinct_is_not_found():
    a = "".join(["req-", "7"])
    b = "".join(["req", "-7"])
    assert a == b and a is not b
    assert index_identical([b], a) == -1
    assert [b].index(a) == 0          # the caller's fallback finds it by value
    assert index_identical([b, a], a) == 1


@pytest.mark.parametrize("bad", [{"x"}, "abc", None, iter(["x"])])
def test_refuses_non_sequences(bad):
    with pytest.raises(TypeError, match="seq must be a list or tuple"):
        index_identical(bad, "x")
