"""Shared pieces of the Atheris harnesses (fuzz/fuzz_*.py).

* :func:`call` is the contract: a call returns, or raises an ``HmacoreError`` subclass with a
  message. Anything else (a bare ValueError/TypeError/IndexError/OverflowError, SystemError,
  RuntimeError...) raises :class:`ContractViolation`, which Atheris reports as a crash and
  saves the input. Segfaults and ASan/UBSan reports abort the process on their own.
* :class:`Draw` turns libFuzzer's bytes into structured values through
  ``atheris.FuzzedDataProvider``: valid-ish values most of the time, hostile ones (edge ints,
  bools, floats, NumPy scalars and int subclasses, wrong dtypes, byte-swapped, read-only and
  non-contiguous arrays, lists that shrink while they are converted) the rest.
* :func:`group` builds one group of block ids in some container form and says what it means
  (the ids, or None when an element or the dtype/shape is not an integer id), so harnesses
  can compare against the plain-Python oracles in tests/oracle_*.py.

Harnesses import this module AFTER ``atheris.instrument_imports()`` has imported hmacore, so
hmacore's Python code is instrumented (its coverage guides the fuzzer).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from hmacore.errors import HmacoreError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))   # the oracles: tests/oracle_*.py

INT32_MAX = 2**31 - 1
TOKEN_MAX = 2**63 - 1
EDGE_INTS = (0, 1, -1, 2, -2**31, INT32_MAX, 2**31, 2**32, 2**63 - 1, -2**63, 2**63, 2**64, 10**30)
JUNK = (True, False, np.True_, 1.0, 2.5, float("nan"), float("inf"), None, "1", b"1", [1], (2,),
        np.float64(3.0), 1 + 0j, object())
INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


class ContractViolation(AssertionError):
    """An entry point broke the contract (wrong answer, or an error that is not a clear
    HmacoreError)."""


def call(fn, *args, **kw):
    """``(True, result)`` or ``(False, HmacoreError)``; anything else is a violation."""
    try:
        return True, fn(*args, **kw)
    except HmacoreError as e:
        if not str(e):
            raise ContractViolation(f"{type(e).__name__} without a message from "
                                    f"{_name(fn)}") from e
        return False, e
    except Exception as e:  # noqa: BLE001 - the contract allows HmacoreError only
        raise ContractViolation(f"{_name(fn)} raised {type(e).__name__}: {e}") from e


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def expect(cond: bool, msg) -> None:
    """Fail the input (a crash Atheris saves) unless ``cond``; ``msg`` may be a callable."""
    if not cond:
        raise ContractViolation(msg() if callable(msg) else msg)


def is_int(v) -> bool:
    """A real integer id: Python/NumPy ints, never bools."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class IntSub(int):
    """An int subclass (read by value; exact-int fast paths must refuse or read it right)."""


class ShrinkingInt(np.int64):
    """A NumPy integer whose ``int()`` empties the list holding it: a conversion that runs
    user code must notice the list changed (never read past its end)."""

    owner: list

    def __int__(self):
        self.owner.clear()
        return int(np.int64(self))

    __index__ = __int__


class Draw:
    """Structured values from libFuzzer's bytes (deterministic for a given input)."""

    def __init__(self, data: bytes):
        import atheris   # imported by the harness first (instrumentation order)
        self.fdp = atheris.FuzzedDataProvider(data)

    def int(self, lo: int, hi: int) -> int:
        return self.fdp.ConsumeIntInRange(lo, hi)

    def bool(self) -> bool:
        return self.fdp.ConsumeBool()

    def chance(self, k: int) -> bool:
        """True about once in ``k`` draws."""
        return self.fdp.ConsumeIntInRange(0, k - 1) == 0

    def pick(self, seq):
        return seq[self.fdp.ConsumeIntInRange(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        b = self.fdp.ConsumeBytes(n)
        return b + bytes(n - len(b))      # fixed width even when the input ran out

    def text(self, n: int) -> str:
        return self.fdp.ConsumeUnicodeNoSurrogates(self.int(0, n))

    def remaining(self) -> int:
        return self.fdp.remaining_bytes()

    def edge(self):
        return self.pick(EDGE_INTS)

    def token(self):
        """A token count: mostly small, sometimes edge ints / junk."""
        k = self.int(0, 15)
        if k < 11:
            return self.int(0, 5000)
        if k < 14:
            return self.edge()
        return self.pick((True, 2.0, None, np.int64(7), np.uint64(2**64 - 1), "3"))

    def block_id(self, nb: int):
        """One id: mostly in [0, nb), sometimes an edge int, just past the pool, or k << 24
        (a small id when its bytes are read in the other byte order)."""
        k = self.int(0, 31)
        if k == 0:
            return self.edge()
        if k == 1:
            return nb + self.int(0, 3)
        if k == 2:
            return self.int(1, 127) << 24
        return self.int(0, max(nb - 1, 0))


def group(d: Draw, nb: int, max_len: int = 12, ids=None):
    """``(obj, meaning, form)``: one group of block ids in some container form.

    ``meaning`` is the list of Python ints ``obj`` stands for, or None when an element (a
    bool, float, None, str, nested list...) or the dtype/shape is not an integer id.
    ``form``: "list"/"tuple" of exact ints, "array" (1-D integer, C-contiguous, native
    order), "strided"/"swapped"/"readonly"/"subclass" (other integer arrays), "object",
    "npscalars", "intsub", "shrinking", "junk", "float", "bool", "twod".
    """
    vals = ids if ids is not None else [d.block_id(nb) for _ in range(d.int(0, max_len))]
    form = d.pick(("list", "list", "list", "tuple", "array", "array", "array", "strided",
                   "swapped", "readonly", "subclass", "object", "npscalars", "intsub",
                   "shrinking", "junk", "float", "bool", "twod"))
    if form in ("list", "tuple"):
        return (list(vals) if form == "list" else tuple(vals)), list(vals), form
    if form == "junk":
        pos = d.int(0, len(vals))
        return list(vals[:pos]) + [d.pick(JUNK)] + list(vals[pos:]), None, form
    if form == "npscalars":
        out = [np.int64(v) if -2**63 <= v < 2**63 else v for v in vals]
        return out, list(vals), form
    if form == "intsub":
        return [IntSub(v) for v in vals], list(vals), form
    if form == "shrinking":
        vals = [v for v in vals if -2**63 <= v < 2**63] or [1]
        lst = list(vals)
        pos = d.int(0, len(lst) - 1)
        x = ShrinkingInt(lst[pos])
        x.owner = lst
        lst[pos] = x
        return lst, list(vals), form
    if form == "object":
        return np.array(vals, dtype=object).reshape(-1), list(vals), form
    if form == "float":
        return np.array(vals, dtype=np.float64), ([] if not vals else None), form
    if form == "bool":
        return np.array([bool(v) for v in vals], dtype=np.bool_), ([] if not vals else None), form
    if form == "twod":
        return np.zeros((len(vals), 2), dtype=np.int32), None, form
    dt = np.dtype(d.pick(INT_DTYPES) if form != "array" or d.bool() else np.int32)
    info = np.iinfo(dt)
    vals = [v for v in vals if info.min <= v <= info.max]
    a = np.array(vals, dtype=dt)
    if form == "strided":
        b = np.zeros(2 * len(vals), dtype=dt)
        b[::2] = a
        a = b[::2]
    elif form == "swapped":
        a = a.astype(dt.newbyteorder())
    elif form == "readonly":
        a.flags.writeable = False
    elif form == "subclass":
        a = a.view(_ArraySub)
    return a, [int(v) for v in vals], form


class _ArraySub(np.ndarray):
    """A trivial ndarray subclass (exact-ndarray fast paths must not misread it)."""


CANONICAL = ("list", "tuple", "array", "strided", "readonly")   # as_block_table must accept


def ids_ok(meaning, hi: int, lo: int = 0) -> bool:
    """Every id an int in ``[lo, hi)`` (``meaning`` None: malformed)."""
    return meaning is not None and all(is_int(v) and lo <= v < hi for v in meaning)


def snapshot(obj):
    """A copy of a table's groups to check the input was not modified."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, (list, tuple)):
        return [snapshot(x) for x in obj]
    return obj


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and (a.dtype == object or np.array_equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a is b or a == b


def table(d: Draw, G: int, nb: int, *, max_len: int = 12, none_groups: bool = False, ids=None):
    """``(obj, meaning, canonical)``: a block table for ``G`` groups in some outer form.

    ``meaning``: one id list per group (a None group counts as empty when ``none_groups``),
    or None when the table is malformed (wrong group count, a malformed group, an outer
    form that is no table). ``canonical``: the forms :func:`hmacore.tables.as_block_table`
    documents (list/tuple of lists, tuples or 1-D integer arrays; for one group a flat
    list/array), which must be accepted whenever every id is in range. ``ids``: the ids of
    each group (default: drawn).
    """
    if G == 1 and d.chance(3):      # single-group back-compat: a flat list/array of ids
        obj, m, form = group(d, nb, max_len, None if ids is None else ids[0])
        if isinstance(obj, list) and obj and (obj[0] is None or isinstance(obj[0], (list, tuple))):
            obj[0] = 2.5            # a leading list/None would make it a nested table
        return obj, (None if m is None else [m]), form in CANONICAL
    n = G if not d.chance(8) else d.int(0, G + 2)
    parts = [(None, [], "list") if none_groups and d.chance(6) else
             group(d, nb, max_len, None if ids is None or g >= len(ids) else ids[g])
             for g in range(n)]
    outer = d.pick(("list", "list", "list", "tuple", "tuple", "tuple", "dict", "array2d", "iter"))
    objs = [p[0] for p in parts]
    if outer == "dict":
        return dict(enumerate(objs)), None, False
    if outer == "array2d":
        return np.zeros((n, 3), np.int32), None, False
    if outer == "iter":
        return iter(objs), None, False
    obj = list(objs) if outer == "list" else tuple(objs)
    if n != G:
        return (obj, [[]], True) if (G == 1 and n == 0) else (obj, None, False)
    meaning = [p[1] for p in parts]
    if any(m is None for m in meaning):
        return obj, None, False
    return obj, meaning, all(p[2] in CANONICAL for p in parts)


BLOCK_SIZES = (1, 4, 8, 16, 32, 64, 256, 544)
PRESETS = ("deepseek-v4", "qwen3-next-80b", "gpt-oss-120b", "gemma-3-27b", "llama-3-70b")


def layout(d: Draw, num_blocks=(None, 64, 5000), *, huge: bool = True):
    """A KVLayout: a preset, or 1-5 random groups (FULL / SW / CHUNKED_LOCAL / MAMBA, random
    block sizes, windows, kernel blocks, speculative slots, page bytes). With ``huge``,
    rarely a window / chunk / slot count far past int64 (valid for GroupSpec)."""
    from hmacore.presets import get_preset
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    nb = d.pick(num_blocks)
    if d.chance(4):
        return get_preset(d.pick(PRESETS), num_blocks=nb)
    groups = []
    for i in range(d.int(1, 5)):
        kind = d.pick((GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL,
                       GroupKind.MAMBA))
        bs = d.pick(BLOCK_SIZES)
        big = huge and d.chance(40)
        kw = {"page_bytes": 16 * d.int(1, 8)}
        if kind == GroupKind.SLIDING_WINDOW:
            kw["sliding_window"] = d.int(1, 4096) if not big else d.pick((2**62, 2**70))
            kw["extra_retained_tokens"] = d.pick((0, 0, 1, 16, 100))
        elif kind == GroupKind.CHUNKED_LOCAL:
            kw["chunk_size"] = d.pick((64, 8192)) if not big else 2**70
        elif kind == GroupKind.MAMBA:
            kw["num_speculative_blocks"] = d.int(0, 3) if not big else d.pick((2**62, 2**70))
        if kind != GroupKind.MAMBA and d.bool():
            kw["kernel_block_size"] = d.pick([k for k in (1, 2, 4, 8, 16, 32) if bs % k == 0])
        groups.append(GroupSpec(kind, bs, (f"l{i}",), **kw))
    return KVLayout(groups=tuple(groups), num_blocks=nb)


def shrinks(obj) -> bool:
    """True when obj holds a ShrinkingInt: the first call that reads it empties its list, so
    a second call sees another table (not the library's doing)."""
    if isinstance(obj, (list, tuple)):
        return any(type(x) is ShrinkingInt or shrinks(x) for x in obj)
    return False


def instrument_harness(namespace: dict) -> None:
    """Atheris coverage for a harness's own functions and methods and for this module's
    generators: their branches tell libFuzzer which operation, input form and outcome an
    input reached. The kernels' own branches are C code, invisible to it (no clang edge
    coverage here; only their compare operands, through trace-cmp)."""
    import types

    import atheris
    for ns in (namespace, globals()):
        for v in list(ns.values()):
            if isinstance(v, types.FunctionType) and v.__module__ == ns["__name__"]:
                atheris.instrument_func(v)
            elif isinstance(v, type) and v.__module__ == ns["__name__"]:
                for m in vars(v).values():
                    if isinstance(m, types.FunctionType):
                        atheris.instrument_func(m)
