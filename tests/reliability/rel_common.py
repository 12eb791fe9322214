"""Shared pieces of the reliability suite: adversarial id strategies, the 'answer or clear
error' harness, and snapshots for all-or-nothing checks."""
from __future__ import annotations

import os

import numpy as np
from hypothesis import settings, strategies as st

from hmacore.errors import HmacoreError

EXAMPLES = int(os.environ.get("HMACORE_REL_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None)

INT32_MAX = 2**31 - 1
EDGE_INTS = [0, 1, -1, -2**31, INT32_MAX, 2**31, 2**32, 2**63 - 1, -2**63, 2**64, 10**30]
JUNK = [True, False, 1.0, 2.5, float("nan"), None, "1", b"1", object(), [1], (2,)]
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
OTHER_DTYPES = [np.float32, np.float64, np.bool_, np.complex64]

CLEAR = (HmacoreError, ValueError, TypeError)


class Unclear(AssertionError):
    """A call failed with something other than a clear hmacore/ValueError/TypeError."""


def call(fn, *args, **kw):
    """(True, result) or (False, exception); an unclear exception fails the test."""
    try:
        return True, fn(*args, **kw)
    except CLEAR as e:
        if not str(e):
            raise Unclear(f"{type(e).__name__} without a message from {fn.__name__}") from e
        return False, e
    except Exception as e:  # noqa: BLE001 - anything else is a bug (IndexError, SystemError...)
        raise Unclear(f"{fn.__name__} raised {type(e).__name__}: {e}") from e


def ids_values(nb: int, adversarial: bool = True):
    """One block id: mostly valid, sometimes edge ints (negative, past int32/int64)."""
    valid = st.integers(0, nb - 1)
    if not adversarial:
        return valid
    bad = st.one_of(st.sampled_from(EDGE_INTS), st.integers(nb, nb + 3))
    return st.integers(0, 29).flatmap(lambda k: bad if k == 0 else valid)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@st.composite
def group_form(draw, nb: int, max_size: int = 12, adversarial: bool = True):
    """(obj, meaning, canonical): obj is one group in some container form; meaning is the
    list of ints it stands for, or None if it is malformed (wrong element type / dtype /
    shape); canonical forms (lists/tuples of ints, 1-D integer arrays) must be accepted
    whenever their ids are valid, the others may be refused with a clear error."""
    vals = draw(st.lists(ids_values(nb, adversarial), max_size=max_size))
    form = draw(st.sampled_from(["list", "list", "tuple", "arr", "arr", "arr", "noncontig", "readonly",
                                 "junk", "float", "twod", "object", "npscalars"]
                                if adversarial else ["list", "arr"]))
    if form in ("list", "tuple"):
        return (list(vals) if form == "list" else tuple(vals)), list(vals), True
    if form == "junk":
        j = draw(st.sampled_from(JUNK))
        pos = draw(st.integers(0, len(vals)))
        obj = list(vals[:pos]) + [j] + list(vals[pos:])
        return obj, None, False
    if form == "npscalars":
        return [np.int64(v) if -2**63 <= v < 2**63 else v for v in vals], list(vals), False
    if form == "object":
        return (np.array(vals, dtype=object) if vals else np.array([], dtype=object)), list(vals), False
    if form in ("float", "twod"):
        a = np.array(vals, dtype=np.float64) if form == "float" else \
            np.zeros((len(vals), 2), dtype=np.int32)
        return a, ([] if form == "float" and not vals else None), False
    dt = draw(st.sampled_from(INT_DTYPES))
    info = np.iinfo(dt)
    vals = [v for v in vals if info.min <= v <= info.max]
    a = np.array(vals, dtype=dt)
    if form == "noncontig":
        b = np.zeros(2 * len(vals), dtype=dt)
        b[::2] = a
        a = b[::2]
    elif form == "readonly":
        a.flags.writeable = False
    return a, [int(v) for v in vals], True


def meaning_ok(meaning, nb) -> bool:
    return meaning is not None and all(_is_int(v) and 0 <= v < nb for v in meaning)


def tracker_snapshot(ts):
    """Everything observable about a TrackerSet (tables, states, watermarks)."""
    return {r: ([x.tolist() for x in ts.block_ids(r)], int(ts.state(r)), ts.scheduled_tokens(r),
                ts.saved_tokens(r), ts.loaded_tokens(r), ts.num_prompt_tokens(r))
            for r in ts}
