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


# -- injectivity: separators cannot hide inside a field ------------------------------------
from hypothesis import given, strategies as st  # noqa: E402

from hmacore.keys import KeyParts, parse_key  # noqa: E402

_free = st.text(st.characters(blacklist_characters="@:", blacklist_categories=("Cs",)),
                min_size=1, max_size=12)
_fields = st.tuples(
    st.one_of(st.just(""), _free),                                       # cache_prefix
    _free,                                                               # model
    st.lists(st.tuples(_free, _free), max_size=3).map(                   # store_namespace
        lambda segs: "".join(f"@{k}:{v}" for k, v in segs)),
    st.builds(RankNamespace, *(st.integers(0, 10**6) for _ in range(4))),
    st.integers(0, 2**31 - 1),                                           # group
    st.integers(1, 2).flatmap(lambda n: st.binary(min_size=16 * n, max_size=16 * n)))


def _key(f):
    prefix, model, ns, rank, group, digest = f
    kb = KeyBuilder(model, rank, cache_prefix=prefix, store_namespace=ns)
    return kb.keys(group, np.frombuffer(digest, dtype=np.uint8).reshape(1, -1))[0]


@given(_fields)
def test_parse_key_inverts_keys(f):
    assert parse_key(_key(f)) == KeyParts(*f)     # an inverse exists: keys are injective


@given(_fields, _fields)
def test_different_fields_never_build_the_same_key(a, b):
    assert (_key(a) == _key(b)) == (a == b)


@pytest.mark.parametrize("a,b", [
    # (cache_prefix, model, store_namespace) pairs that collided before separators were refused
    (("a@b", "c", ""), ("a", "b@c", "")),
    (("a", "b:1", ""), ("", "a", "@b:1")),
    (("", "m", "@x"), ("", "m@x", "")),
    (("p", "m", "@tp_rank:0@pcp0"), ("p", "m", "")),
])
def test_ambiguous_fields_are_refused(a, b):
    with pytest.raises(HashInputError):
        for prefix, model, ns in (a, b):
            KeyBuilder(model, cache_prefix=prefix, store_namespace=ns)


@pytest.mark.parametrize("kw,msg", [
    (dict(model="a:b"), "model must be a non-empty str without the key separators '@' and ':'"),
    (dict(model="a@b"), "model must be a non-empty str without the key separators"),
    (dict(model=""), "model must be a non-empty str"),
    (dict(model=3), "model must be a str, got int"),
    (dict(model="m", cache_prefix="dep@1"), "cache_prefix must be a str without the key separators"),
    (dict(model="m", cache_prefix="dep:1"), "cache_prefix must be a str without the key separators"),
    (dict(model="m", store_namespace="store_tp:2"), "store_namespace must be '' or '@name:value' segments"),
    (dict(model="m", store_namespace="@store_tp"), "store_namespace must be '' or '@name:value'"),
    (dict(model="m", store_namespace="@a:b:c"), "store_namespace must be '' or '@name:value'"),
    (dict(model="m", store_namespace="@a:"), "store_namespace must be '' or '@name:value'"),
    (dict(model="m", store_namespace=None), "store_namespace must be a str, got NoneType"),
    (dict(model="m", rank=(0, 0, 0, 0)), "rank must be a RankNamespace, got tuple"),
    (dict(model="m", lookup_namespaces=[RankNamespace()]), "lookup_namespaces must be a mapping"),
    (dict(model="m", lookup_namespaces={0: RankNamespace()}),
     "lookup_namespaces\\[0\\] must be a non-empty list of RankNamespace"),
])
def test_fields_with_separators_are_refused(kw, msg):
    model = kw.pop("model")
    with pytest.raises(HashInputError, match=msg):
        KeyBuilder(model, **kw)


def test_digests_and_answers_refuse_floats():
    kb = KeyBuilder("m")
    with pytest.raises(HashInputError, match="uint8"):
        kb.keys(0, np.zeros((1, 16), dtype=np.float64))
    with pytest.raises(HashInputError, match="uint8"):
        kb.lookup_keys(0, np.zeros((1, 16), dtype=np.float32))
    with pytest.raises(HashInputError, match="group must be an int group id"):
        kb.keys(1.0, np.zeros((1, 16), dtype=np.uint8))
    with pytest.raises(HashInputError, match="results must be ints .* got dtype float64"):
        kb.fold_presence(0, [1.7, 0.2], 2)          # would truncate to [1, 0]
    with pytest.raises(HashInputError, match="num_rows must be an int >= 0, got 2.0"):
        kb.fold_presence(0, [1, 1], 2.0)
    with pytest.raises(HashInputError, match="num_rows must be an int >= 0"):
        kb.fold_presence(0, [1], True)
    assert kb.fold_presence(0, np.array([1, 0], dtype=np.int32), 2).tolist() == [1, 0]
    assert kb.fold_presence(0, [True, False], 2).tolist() == [1, 0]


@pytest.mark.parametrize("key", ["m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0", "x",
                                 "m@tp_rank:01@pcp0@dcp0@pp_rank:0@group:0@" + "00" * 16,
                                 "@m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + "00" * 16,
                                 "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + "0" * 30])
def test_parse_key_refuses_foreign_keys(key):
    with pytest.raises(HashInputError):
        parse_key(key)
