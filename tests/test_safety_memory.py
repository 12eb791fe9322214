"""Memory safety of the Cython core against hostile or concurrent callers.

Each scenario that crashed (or corrupted the heap) before its fix runs in a child
interpreter: a crash there is a failed assertion here, not a dead test run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hmacore.errors import BlockTableError, HashInputError
from hmacore.hits import ExistenceSet
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout
from hmacore.tables import TrackerSet, as_block_table, from_wire, ids_from_objects
from hmacore.windows import clip_to_window, clip_windows, trim_remote_to_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_clean(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (f"child exited with {proc.returncode} (negative = killed by "
                                  f"that signal)\nstdout: {proc.stdout[-2000:]}\n"
                                  f"stderr: {proc.stderr[-2000:]}")


# -- 1. raw pointers into a caller's list while the GIL is released --------------------------
_RACE = """
import sys, threading, time
import numpy as np
from hmacore.plan import TransferPlan
from hmacore.spec import GroupKind, GroupSpec, KVLayout

layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",), page_bytes=64),
                          GroupSpec(GroupKind.FULL, 32, ("b",), page_bytes=64)), num_blocks=64)
plan = TransferPlan.from_layout(layout, 64, page_bytes=64)
N = 1 << 20        # 4 MiB per group: malloc'd with mmap, so a freed array is unmapped
ids = [np.full(N, 3, np.int32), np.full(N, 5, np.int32)]
stop = time.monotonic() + {seconds}
done = False

def churn():
    while not done:
        for g in (0, 1):
            ids[g] = np.full(N, 3 + g, np.int32)   # drops the previous array

t = threading.Thread(target=churn, daemon=True)
t.start()
calls = 0
while time.monotonic() < stop:
    {call}
    calls += 1
done = True
t.join()
print("calls", calls)
"""


@pytest.mark.parametrize("call", [
    "out = plan.desc_ids(ids); assert out.shape[0] == 2 * N",
    "r = plan._desc.pair_ids32(plan._desc, ids, ids, (64, 64)); assert r is not None",
], ids=["desc_ids", "pair_ids32"])
def test_list_of_arrays_replaced_by_another_thread_does_not_crash(call):
    for _ in range(3):
        assert_clean(run_child(_RACE.format(seconds=2.0, call=call)))


def test_desc_ids_reads_a_snapshot_of_the_list():
    """The ids are the ones the list held when the call started, whatever happens later."""
    layout = KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",), page_bytes=64),), num_blocks=64)
    plan = TransferPlan.from_layout(layout, 64, page_bytes=64)
    ids = [np.array([1, 2, 3], np.int32)]
    assert plan.desc_ids(ids).tolist() == [1, 2, 3]
    assert plan.desc_ids(tuple(ids)).tolist() == [1, 2, 3]


# -- 2. list -> int32 conversion that runs user code ------------------------------------------
class Shrinker(np.int64):
    """An np.int64 whose __int__/__index__ empties the list being converted."""

    victim: list = []

    def __int__(self):
        Shrinker.victim.clear()
        return 1

    __index__ = __int__


class IntShrinker(int):
    def __index__(self):
        Shrinker.victim.clear()
        return 1


_SHRINK = """
import numpy as np
from hmacore.errors import BlockTableError
from hmacore.tables import as_block_table

class Shrinker(np.int64):
    def __int__(self):
        victim.clear()
        return 1
    __index__ = __int__

victim = [1, 2, Shrinker(3)] + list(range(4, 200000))
try:
    as_block_table([victim], 1)
except BlockTableError as e:
    print("refused:", e)
else:
    print("converted")
"""


def test_shrinking_int_subclass_does_not_crash_as_block_table():
    assert_clean(run_child(_SHRINK))


def _shrinking(n=1000):
    lst = [1, 2, Shrinker(3)] + list(range(4, n))
    Shrinker.victim = lst
    return lst


@pytest.mark.parametrize("convert", [
    lambda x: as_block_table([x], 1),
    lambda x: as_block_table(x, 1),
    lambda x: from_wire([x, [1]], 2),
    lambda x: TrackerSet(KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),))).add("r", [x]),
    lambda x: TransferPlan.from_layout(KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),)),
                                       4096, page_bytes=64).desc_ids([x]),
], ids=["as_block_table", "flat", "from_wire", "tracker_add", "desc_ids"])
def test_list_mutated_during_conversion_is_refused(convert):
    with pytest.raises(BlockTableError, match="changed size"):
        convert(_shrinking())


@pytest.mark.parametrize("convert", [
    lambda x: clip_to_window([x], KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),))),
    lambda x: clip_windows([x], KVLayout(groups=(GroupSpec(
        GroupKind.SLIDING_WINDOW, 16, ("a",), sliding_window=10**6),))),
    lambda x: trim_remote_to_local([x], [list(range(1, 2000))],
                                   KVLayout(groups=(GroupSpec(GroupKind.FULL, 16, ("a",)),))),
], ids=["clip_to_window", "clip_windows", "trim"])
def test_list_mutated_during_clipping_is_refused_or_read_from_a_copy(convert):
    # these paths slice the list first: the conversion may read the (unchanged) slice
    try:
        out = convert(_shrinking())
    except BlockTableError as e:
        assert "changed size" in str(e)
    else:
        assert out[0][:3].tolist() == [1, 2, 1]


def test_int_subclass_with_index_is_converted_by_value():
    # int subclasses are ints: their value is read directly, no user code runs
    lst = [1, IntShrinker(2), 3]
    Shrinker.victim = lst
    assert as_block_table([lst], 1)[0].tolist() == [1, 2, 3] and len(lst) == 3


# -- 3. ExistenceSet re-initialisation --------------------------------------------------------
_REINIT = """
import numpy as np
from hmacore.hits import ExistenceSet
es = ExistenceSet(32)
rows = np.random.default_rng(0).integers(0, 256, (5000, 32), dtype=np.uint8)
es.add_many(1, rows)
try:
    es.__init__(16)
except RuntimeError as e:
    print("refused:", e)
    assert len(es) == 5000 and es.digest_size == 32 and es.contains_many(1, rows).all()
else:
    small = np.random.default_rng(1).integers(0, 256, (5000, 16), dtype=np.uint8)
    es.add_many(2, small)       # writes 20-byte slots over a 36-byte-slot table
    es.contains_many(2, small)
    raise SystemExit(3)
"""


def test_existence_set_reinit_is_refused():
    assert_clean(run_child(_REINIT))


def test_existence_set_reinit_refused_in_process():
    es = ExistenceSet(16, capacity=10)
    es.add(1, b"x" * 16)
    with pytest.raises(RuntimeError, match="already initialised"):
        es.__init__(32)
    with pytest.raises(RuntimeError, match="already initialised"):
        es.__init__(16)
    assert es.digest_size == 16 and es.contains(1, b"x" * 16)


def test_existence_set_new_without_init_is_a_valid_empty_set():
    es = ExistenceSet.__new__(ExistenceSet)
    assert es.digest_size == 32 and len(es) == 0
    with pytest.raises(HashInputError):
        es.add(1, b"")
    es.add(1, b"y" * 32)
    assert es.contains(1, b"y" * 32)


class _Block:
    """A KVCacheBlock-like object (vLLM 0.32: ``block_id``, ``_block_hash``)."""
    __slots__ = ("block_id", "_block_hash")

    def __init__(self, block_id, block_hash=None):
        self.block_id, self._block_hash = block_id, block_hash


class _ShrinkingBlock:
    """Its id property empties the list being read."""
    victim: list = []
    _block_hash = None

    @property
    def block_id(self):
        _ShrinkingBlock.victim.clear()
        return 7


def test_ids_from_objects_reads_ids_and_hash_flags():
    blocks = [_Block(i, b"h" if i % 3 else None) for i in range(5000)]
    ids, hashed = ids_from_objects(blocks, flag_attr="_block_hash")
    assert ids.dtype == np.int32 and ids.tolist() == list(range(5000))
    assert hashed.dtype == np.bool_ and hashed.tolist() == [bool(i % 3) for i in range(5000)]
    empty_ids, empty_hashed = ids_from_objects([], flag_attr="_block_hash")
    assert empty_ids.shape == empty_hashed.shape == (0,)


@pytest.mark.parametrize("bad, rule", [(-1, "negative"), (2**31, "int32"), (2**70, "int32"),
                                       (1.0, "integers"), (True, "integers"),
                                       (None, "integers")])
def test_ids_from_objects_names_the_bad_block(bad, rule):
    with pytest.raises(BlockTableError, match=rf"KVCacheBlocks \(block_id\): group 3, "
                                              rf"index 1: .*{rule}"):
        ids_from_objects([_Block(1), _Block(bad)], flag_attr="_block_hash",
                         name="KVCacheBlocks", group=3)


def test_ids_from_objects_list_shrunk_by_a_property_is_refused():
    victim = [_Block(1), _ShrinkingBlock(), _Block(2), _Block(3)]
    _ShrinkingBlock.victim = victim
    with pytest.raises(BlockTableError, match="changed size"):
        ids_from_objects(victim, flag_attr="_block_hash")
