"""Key strings (vllm-hma.md §5.3 / §13.2) and the all-namespaces presence rule."""
from __future__ import annotations

import numpy as np
import pytest

from hmacore.errors import HashInputError
from hmacore.keys import KeyBuilder, RankNamespace


def test_key_format_matches_mooncake():
    kb = KeyBuilder("llama", RankNamespace(tp_rank=3, pcp_rank=1, dcp_rank=2, pp_rank=4))
    d = np.arange(32, dtype=np.uint8).reshape(1, 32)
    assert kb.keys(5, d) == [
        "llama@tp_rank:3@pcp1@dcp2@pp_rank:4@group:5@" + bytes(range(32)).hex()]


def test_cache_prefix_and_store_namespace():
    kb = KeyBuilder("m", cache_prefix="dep1", store_namespace="@store_tp:2")
    d = np.zeros((2, 16), dtype=np.uint8)
    d[1, -1] = 1
    assert kb.keys(0, d) == ["dep1@m@store_tp:2@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + "00" * 16,
                             "dep1@m@store_tp:2@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + "00" * 15 + "01"]


def test_bulk_keys_equal_per_row_keys():
    rng = np.random.default_rng(0)
    d = rng.integers(0, 256, (1000, 32), dtype=np.uint8)
    kb = KeyBuilder("m")
    assert kb.keys(2, d) == [kb.prefix(2) + "@" + bytes(r).hex() for r in d]
    wide = rng.integers(0, 256, (3, 64), dtype=np.uint8)          # concatenated coarse keys
    assert kb.keys(1, wide)[2].endswith(bytes(wide[2]).hex())


def test_presence_needs_every_namespace():
    spaces = [RankNamespace(tp_rank=t) for t in range(3)]
    kb = KeyBuilder("m", lookup_namespaces={0: spaces})
    d = np.arange(64, dtype=np.uint8).reshape(2, 32)
    keys = kb.lookup_keys(0, d)
    assert len(keys) == 6 and "tp_rank:0" in keys[0] and "tp_rank:2" in keys[2]
    assert keys[0].endswith(bytes(d[0]).hex()) and keys[3].endswith(bytes(d[1]).hex())
    assert kb.fold_presence(0, [1, 1, 1, 1, 0, 1], 2).tolist() == [1, 0]
    assert kb.fold_presence(0, [1, 1, -900, 1, 1, 1], 2).tolist() == [0, 1]   # error = miss
    assert kb.lookup_keys(1, d) == kb.keys(1, d)                                 # default: own rank
    assert kb.fold_presence(1, [], 0).size == 0


def test_empty_digests_give_no_keys():
    kb = KeyBuilder("m")
    assert kb.keys(0, np.zeros((0, 32), dtype=np.uint8)) == []
    assert kb.lookup_keys(0, np.zeros((0, 16), dtype=np.uint8)) == []


@pytest.mark.parametrize("call", [
    lambda kb: kb.keys(0, np.zeros((2, 20), dtype=np.uint8)),        # width not 16k
    lambda kb: kb.keys(0, np.zeros((2, 16), dtype=np.int32)),        # dtype
    lambda kb: kb.keys(0, [b"\0" * 16]),                            # not an array
    lambda kb: kb.keys(-1, np.zeros((1, 16), dtype=np.uint8)),       # group id
    lambda kb: kb.keys(True, np.zeros((1, 16), dtype=np.uint8)),
    lambda kb: kb.fold_presence(0, [1, 1, 1], 2),                    # wrong answer count
])
def test_bad_inputs_are_rejected(call):
    with pytest.raises(HashInputError):
        call(KeyBuilder("m"))


@pytest.mark.parametrize("group", [2**31, np.int64(2**31), 2**63, -1])
def test_group_ids_outside_existence_set_range_are_rejected(group):
    """KeyBuilder takes exactly the group ids ExistenceSet takes: [0, 2**31-1]."""
    from hmacore.hits import ExistenceSet
    kb, d = KeyBuilder("m"), np.zeros((1, 16), dtype=np.uint8)
    for call in (lambda: kb.keys(group, d), lambda: kb.lookup_keys(group, d),
                 lambda: kb.prefix(group), lambda: kb.namespaces(group),
                 lambda: KeyBuilder("m", lookup_namespaces={group: [RankNamespace()]})):
        with pytest.raises(HashInputError, match=r"group must be an int group id in \[0, 2\*\*31-1\]"):
            call()
    with pytest.raises(HashInputError, match="group"):
        ExistenceSet(16).add(group, b"\0" * 16)


def test_largest_group_id_is_accepted_by_both():
    from hmacore.hits import ExistenceSet
    g = 2**31 - 1
    assert KeyBuilder("m").keys(g, np.zeros((1, 16), dtype=np.uint8))[0].startswith(
        f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{g}@")
    es = ExistenceSet(16)
    es.add(g, b"\0" * 16)
    assert es.contains(g, b"\0" * 16)


def test_bad_builders_are_rejected():
    with pytest.raises(HashInputError, match="model"):
        KeyBuilder("a@b")
    with pytest.raises(HashInputError, match="tp_rank"):
        RankNamespace(tp_rank=-1)
    with pytest.raises(HashInputError, match="lookup_namespaces"):
        KeyBuilder("m", lookup_namespaces={0: []})


def test_lookup_plan_keys_and_fold():
    from hmacore.hits import HitFinder
    from hmacore.presets import get_preset
    finder = HitFinder(get_preset("gpt-oss-120b"))
    kb = KeyBuilder("m", lookup_namespaces={1: [RankNamespace(tp_rank=0), RankNamespace(tp_rank=1)]})
    hs = np.random.default_rng(0).integers(0, 256, (8, 32), dtype=np.uint8)
    plan = finder.lookup_keys(hs, 130, kb)                  # aligned to 128 tokens: 8 blocks
    assert [(g, rows.tolist(), count) for g, rows, _, count in plan.spans] == \
        [(0, list(range(8)), 8), (1, list(range(8)), 16)]
    res = [1] * 8 + [1, 1] * 7 + [1, 0]                     # FA group: last block on one rank only
    es = plan.fold(res, hs, kb)
    assert es.contains_many(0, hs).all()
    assert es.contains_many(1, hs).tolist() == [1] * 7 + [0]
    assert len(plan.fold(res[:-1], hs, kb)) == 0            # wrong answer count: all misses
    assert finder.lookup_keys(hs, 10, kb).keys == []       # below one aligned block: nothing
