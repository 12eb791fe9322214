"""RoutingIndex: differential property tests against the plain-Python oracle (random layouts,
random event streams with disorder, duplicates, unknown engines and clears, random queries),
the semantics of odd events, bad input, and the hash re-implementation against vLLM's
published algorithm."""
from __future__ import annotations

import hashlib
import os
import pickle

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import ArgumentTypeError, ArgumentValueError, ConfigError, HashInputError
from hmacore.presets import get_preset
from hmacore.route_hashing import BlockHasher
from hmacore.route_index import OP_CLEAR, OP_REMOVE, OP_STORE, RoutingIndex
from hmacore.transport import kv_event_wire as W
from hmacore.transport.kv_events import SPEC_KINDS

from hits_scenarios import layouts
from oracle_route import OracleRoute, fold

#: the full wire schema's classes (the subscriber decodes into W.INDEX_EVENT_TYPES; both work)
_EVENT_TYPES = (W.BlockStored, W.BlockRemoved, W.AllBlocksCleared)


def chain(n: int, seed: int, width: int = 32) -> list[bytes]:
    """n distinct digests standing for one prompt's hash rows."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, width, dtype=np.uint8).tobytes() for _ in range(n)]


def as_event_hash(h: bytes, int_hashes: bool):
    return int.from_bytes(h[-8:], "big") if int_hashes else h


@st.composite
def scenarios(draw):
    layout = draw(layouts())
    int_hashes = draw(st.booleans())
    h = layout.hash_block_size
    n_rows = draw(st.integers(1, 24))
    prompts = [chain(n_rows, seed) for seed in range(draw(st.integers(1, 3)))]
    engines = [("e", d) for d in range(draw(st.integers(1, 3)))]

    @st.composite
    def event(draw):
        """Rows of one event: a run of one group's blocks of one prompt (as vLLM stores and
        evicts them), a clear, or hashes of no prompt."""
        op = draw(st.sampled_from([OP_STORE, OP_STORE, OP_REMOVE, OP_CLEAR]))
        if op == OP_CLEAR:
            return [(OP_CLEAR, 0, b"\0" * 32)]
        g = draw(st.integers(0, layout.num_groups - 1))
        k = draw(st.sampled_from([layout.groups[g].block_size // h, 1]))
        prompt = draw(st.sampled_from(prompts))
        blocks = len(prompt) // k
        if blocks == 0 or draw(st.integers(0, 9)) == 0:
            return [(op, g, hashlib.sha256(bytes([draw(st.integers(0, 255))])).digest())]
        a = draw(st.integers(0, blocks - 1))
        b = draw(st.integers(a + 1, blocks))
        return [(op, g, prompt[(i + 1) * k - 1]) for i in range(a, b)]

    batches = draw(st.lists(st.tuples(st.sampled_from(engines + [("stranger", 0)]),
                                      st.lists(event(), max_size=6)), max_size=10))
    return layout, int_hashes, prompts, engines, batches


def query_form(digests: list[bytes], form: int):
    """The digests as a query takes them: a list of bytes (0), an (N, 32) array (1), a strided
    view of a wider array (2, copied by the kernel), a tuple (3, the general path)."""
    if form == 0:
        return list(digests)
    if form == 3:
        return tuple(digests)
    arr = (np.frombuffer(b"".join(digests), np.uint8).reshape(-1, 32) if digests
           else np.zeros((0, 32), np.uint8))
    if form == 2:
        wide = np.zeros((arr.shape[0], 40), np.uint8)
        wide[:, 4:36] = arr
        return wide[:, 4:36]
    return arr


@settings(max_examples=min(400, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(scenarios(), st.data())
def test_index_matches_oracle(sc, data):
    layout, int_hashes, prompts, engines, batches = sc
    index = RoutingIndex(layout, int_hashes=int_hashes)
    oracle = OracleRoute(layout, int_hashes=int_hashes)
    for key in engines:
        index.add_engine(*key)
        oracle.add_engine(key)
    h = layout.hash_block_size
    for key, events in batches:
        rows = [r for ev in events for r in ev]
        ops = [op for op, _, _ in rows]
        groups = [g for _, g, _ in rows]
        raw = [d for _, _, d in rows]
        index.apply(key, ops, groups, [as_event_hash(d, int_hashes) for d in raw] if int_hashes
                    else (np.frombuffer(b"".join(raw), np.uint8).reshape(-1, 32) if raw
                          else np.zeros((0, 32), np.uint8)))
        oracle.apply(key, ops, groups, [fold(d, int_hashes) for d in raw])
        prompt = data.draw(st.sampled_from(prompts))
        n = data.draw(st.integers(0, len(prompt)))
        num_tokens = n * h + data.draw(st.integers(0, h))
        got = index.query_hashes(query_form(prompt[:n], data.draw(st.integers(0, 3))),
                                 num_tokens)
        want = oracle.hits(prompt[:n], num_tokens)
        assert got.hits == want
        assert got.best == max(want.values(), default=0)
        assert set(got.best_engines) == ({k for k, v in want.items() if v == got.best}
                                         if got.best else set())
    for key in engines:
        assert index.resident_blocks(key) == len(oracle.engines[key])


@pytest.mark.parametrize("int_hashes", [True, False])
def test_masks_widen_with_keys_held(int_hashes):
    """The shared table's engine masks widen as engines are added while keys are held: one
    uint64 word up to 64 engines (8-byte keys: 24-byte slots), then a word per 64 engines.
    Every widening keeps every key, count and hit; the widened engines' stores and removes,
    and removes of the first engines' keys (a slot freed when its mask empties), match the
    oracle."""
    layout = get_preset("gpt-oss-120b")
    h = layout.hash_block_size
    index = RoutingIndex(layout, int_hashes=int_hashes)
    oracle = OracleRoute(layout, int_hashes=int_hashes)
    prompt = chain(12, 7)
    k0 = max(index.finder.block_sizes) // h
    rows = len(prompt) // k0

    def feed(key, op, blocks):
        # both groups (a nonzero tag: its bytes must never read as mask bits)
        raw = [prompt[(b + 1) * k0 - 1] for b in blocks for _ in range(2)]
        groups = [g for _ in blocks for g in (0, layout.num_groups - 1)]
        index.apply(key, [op] * len(raw), groups, ints(raw) if int_hashes
                    else np.frombuffer(b"".join(raw), np.uint8).reshape(len(raw), -1))
        oracle.apply(key, [op] * len(raw), groups, [fold(d, int_hashes) for d in raw])

    def check():
        for key in oracle.engines:
            assert index.resident_blocks(key) == len(oracle.engines[key])
        # a slot lives while some engine holds its key
        assert index._residency.num_keys == len(set().union(*oracle.engines.values()))
        for n in range(len(prompt) + 1):
            assert index.query_hashes(prompt[:n], n * h).hits == oracle.hits(prompt[:n], n * h)

    keys = []
    for e in range(2):
        keys.append(index.add_engine(f"e{e}"))
        oracle.add_engine(keys[-1])
    feed(keys[0], OP_STORE, range(rows))
    feed(keys[0], OP_STORE, [0])                   # a count of 2
    feed(keys[1], OP_STORE, range(0, rows, 2))
    cap_bytes = index._residency.nbytes
    check()
    feed(keys[1], OP_REMOVE, range(rows))         # its keys 0, 2, ... stay (engine 0's)
    feed(keys[0], OP_REMOVE, range(1, rows, 2))   # keys 1, 3, ... go
    check()
    feed(keys[1], OP_STORE, range(0, rows, 2))
    ds = index._residency.digest_size

    def slot(mask_bytes):                   # mask, tag, key, padded to 8
        return (mask_bytes + 4 + ds + 7) // 8 * 8

    if int_hashes:
        assert slot(8) == 24
    for n_engines, mask_bytes in ((32, 8), (64, 8), (65, 16), (129, 24)):
        while len(keys) < n_engines:
            keys.append(index.add_engine(f"e{len(keys)}"))
            oracle.add_engine(keys[-1])
        # the same slots, each wider (the capacity is unchanged: every key fits the first)
        assert index._residency.nbytes == cap_bytes // slot(8) * slot(mask_bytes)
        check()
        feed(keys[-1], OP_STORE, range(1, rows))
        feed(keys[-1], OP_REMOVE, [2, 3])
        check()
    feed(keys[1], OP_REMOVE, range(rows))
    feed(keys[0], OP_REMOVE, range(rows))
    check()
    feed(keys[0], OP_REMOVE, range(rows))
    feed(keys[-1], OP_REMOVE, range(rows))
    for key in keys[2:-1]:
        feed(key, OP_REMOVE, range(rows))
    check()
    assert index._residency.num_keys == 0


@settings(max_examples=min(25, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(layouts(), st.integers(65, 200), st.randoms(use_true_random=False))
def test_many_engines_match_oracle(layout, n_engines, rnd):
    """More engines than one 64-bit mask word holds (the shared table widens its masks), with
    engines removed and new ones reusing their bits, duplicates, removes and clears: every
    engine's hit and residency equal the oracle's."""
    index = RoutingIndex(layout)
    oracle = OracleRoute(layout)
    h = layout.hash_block_size
    prompts = [chain(16, seed) for seed in range(3)]

    def feed(key):
        ops, groups, raw = [], [], []
        for _ in range(rnd.randint(1, 4)):
            g = rnd.randrange(layout.num_groups)
            k = rnd.choice([layout.groups[g].block_size // h, 1])
            prompt = rnd.choice(prompts)
            blocks = len(prompt) // k
            if not blocks:
                continue
            op = rnd.choice([OP_STORE, OP_STORE, OP_STORE, OP_REMOVE, OP_CLEAR])
            end = rnd.randint(1, blocks)
            for i in range(rnd.randrange(end) if op == OP_REMOVE else 0, end):
                ops.append(op)
                groups.append(g)
                raw.append(prompt[(i + 1) * k - 1])
                if op == OP_CLEAR:
                    break
        index.apply(key, ops, groups, ints(raw))
        oracle.apply(key, ops, groups, [fold(d, True) for d in raw])

    keys = [index.add_engine(f"e{i}") for i in range(n_engines)]
    for key in keys:
        oracle.add_engine(key)
    for rnd_round in range(3):
        for key in keys:
            feed(key)
        for key in rnd.sample(keys, 5):               # engines leave; new ones take their bits
            assert index.remove_engine(key)
            del oracle.engines[key]
            keys.remove(key)
        for i in range(5):
            key = index.add_engine(f"new{rnd_round}-{i}")
            oracle.add_engine(key)
            keys.append(key)
            feed(key)
        for prompt in prompts:
            n = rnd.randint(0, len(prompt))
            num_tokens = n * h + rnd.randint(0, h)
            got = index.query_hashes(prompt[:n], num_tokens)
            want = oracle.hits(prompt[:n], num_tokens)
            assert got.hits == want
            assert set(got.best_engines) == ({k for k, v in want.items() if v == got.best}
                                             if got.best else set())
        for key in keys:
            assert index.resident_blocks(key) == len(oracle.engines[key])


# -- semantics of odd events -------------------------------------------------------------------
@pytest.fixture
def index():
    ix = RoutingIndex(get_preset("gpt-oss"))
    ix.add_engine("a")
    return ix


def ints(hashes):
    return [int.from_bytes(h[-8:], "big") for h in hashes]


def test_multiset_residency(index):
    toks = list(range(1, 160))
    hs = index.block_hashes(toks)
    key = ("a", 0)
    for g in (0, 1):
        index.store(key, g, ints(hs))
    assert index.query(toks).hits[key] == 144                 # 9 blocks of 16, capped at 158
    index.store(key, 1, ints(hs[:1]))                         # a second block with hash 0
    index.remove(key, 1, ints(hs[:1]))
    assert index.query(toks).hits[key] == 144                 # still held by the other block
    st_ = index.remove(key, 1, ints(hs[:1]))
    assert st_.removed == 1 and index.query(toks).hits[key] == 0   # full attention: block 0 gone
    again = index.remove(key, 1, ints(hs[:1]))                # remove of an absent key: no-op
    assert again.removed == 0 and again.ignored == 1
    index.store(key, 1, ints(hs[:1]))
    assert index.query(toks).hits[key] == 144


def test_unknown_engine_and_reset(index):
    hs = index.block_hashes(list(range(64)))
    st_ = index.store(("nobody", 0), 1, ints(hs))
    assert st_.unknown_engine == len(hs) and st_.stored == 0
    assert index.engines == (("a", 0),)
    index.store(("a", 0), 1, ints(hs))
    index.store(("a", 0), 1, ints(hs))                        # duplicates: count 2
    assert index.resident_blocks(("a", 0)) == len(hs)
    assert index.reset_engine(("a", 0)) and index.resident_blocks(("a", 0)) == 0
    assert not index.reset_engine(("nobody", 0))
    index.store(("a", 0), 1, ints(hs))
    assert index.clear(("a", 0)).cleared == 1 and index.resident_blocks(("a", 0)) == 0
    assert index.remove_engine(("a", 0)) and index.engines == ()
    assert index.query(list(range(64))).best_engines == ()


def test_bad_batch_is_refused_whole(index):
    hs = ints(index.block_hashes(list(range(64))))
    key = ("a", 0)
    with pytest.raises(ArgumentValueError, match="groups"):
        index.apply(key, [1, 1], [1, 7], hs[:2])
    with pytest.raises(ArgumentValueError, match="ops"):
        index.apply(key, [1, 2], [1, 1], hs[:2])
    with pytest.raises(ArgumentValueError, match="one (row|entry) per"):
        index.apply(key, [1, 1], [1, 1], hs[:3])
    with pytest.raises(HashInputError, match="2\\*\\*64"):
        index.apply(key, [1], [1], [-1])
    with pytest.raises(HashInputError):
        index.apply(key, [1], [1], [b"x" * 32])
    with pytest.raises(ArgumentTypeError, match="groups"):
        index.apply(key, [1], ["0"], hs[:1])
    with pytest.raises(ArgumentTypeError):
        index.apply(key, [1], [1.5], hs[:1])
    # the same refusals through the numpy path
    with pytest.raises(ArgumentValueError, match="groups"):
        index.apply(key, np.array([1, 1]), np.array([1, 7]), np.array(hs[:2], np.uint64))
    with pytest.raises(ArgumentValueError, match="ops"):
        index.apply(key, np.array([1, 2]), np.array([1, 1]), np.array(hs[:2], np.uint64))
    with pytest.raises(ArgumentValueError, match="one (row|entry) per"):
        index.apply(key, np.array([1, 1]), np.array([1, 1]), np.array(hs[:3], np.uint64))
    with pytest.raises(HashInputError):
        index.apply(key, np.array([1]), np.array([1]), np.array([-1]))
    with pytest.raises(HashInputError):
        index.apply(key, [1], [1], [2**64])
    # numpy scalars in lists take the general path and mean the same
    index.apply(key, [np.int8(1)], [np.int64(1)], [np.uint64(hs[0])])
    assert index.resident_blocks(key) == 1
    index.apply(key, [-1], [1], hs[:1])
    # a bad last row refuses the whole batch
    with pytest.raises(ArgumentValueError, match="groups\\[2\\]"):
        index.apply(key, [1, 1, 1], [1, 1, 9], hs[:3])
    assert index.resident_blocks(key) == 0
    with pytest.raises(ArgumentValueError, match="num_tokens"):
        index.query_hashes([], -1)
    with pytest.raises(HashInputError, match="token_ids"):
        index.query([1.0, 2.0] * 16)
    with pytest.raises(ConfigError, match="hash_block_size"):
        RoutingIndex(get_preset("gpt-oss"), hash_block_size=8)
    with pytest.raises(ConfigError, match="hash_algo"):
        RoutingIndex(get_preset("gpt-oss"), hash_algo="md5")
    with pytest.raises(ArgumentValueError, match="engine_id"):
        index.add_engine("")


@settings(max_examples=min(60, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(st.integers(1, 3), st.integers(0, 2**32), st.integers(1, 6))
def test_table_churn_matches_oracle(n_engines, seed, rounds):
    """Store / remove / clear cycles over one key space (the table's deletions, emptied runs
    of tombstones, the clear with and without other holders): residency and hits equal the
    oracle's after every round, and the table does not grow from churn alone."""
    layout = get_preset("gpt-oss")
    index, oracle = RoutingIndex(layout), OracleRoute(layout)
    rng = np.random.default_rng(seed)
    prompt = chain(40, seed)
    keys = [index.add_engine(f"e{i}") for i in range(n_engines)]
    for key in keys:
        oracle.add_engine(key)
    sizes = []
    assert layout.num_groups == 2
    for _ in range(rounds):
        for key in keys:
            rows = rng.permutation(40)[:rng.integers(1, 41)]
            ops = rng.choice([OP_STORE, OP_STORE, OP_REMOVE], rows.size).tolist()
            if rng.integers(0, 5) == 0:
                ops[rng.integers(0, rows.size)] = OP_CLEAR
            groups = rng.integers(0, layout.num_groups, rows.size).tolist()
            raw = [prompt[i] for i in rows]
            index.apply(key, ops, groups, ints(raw))
            oracle.apply(key, ops, groups, [fold(d, True) for d in raw])
        for key in keys:
            assert index.resident_blocks(key) == len(oracle.engines[key])
        n = int(rng.integers(0, 41))
        assert index.query_hashes(prompt[:n], n * 16).hits == oracle.hits(prompt[:n], n * 16)
        sizes.append(index._residency.nbytes)
    # at most 80 keys (40 rows x 2 groups) and 40 stores a batch: churn never grows the
    # table past 256 slots of 24 bytes (mask word, tag, 8-byte key)
    assert index._residency.num_keys <= 80 and max(sizes) <= 256 * 24
    for key in keys:
        index.clear(key)
    assert index._residency.num_keys == 0


def test_event_lists_refused_with_their_row(index):
    """The compiled list path names the bad row and applies nothing."""
    key = ("a", 0)
    hs = ints(index.block_hashes(list(range(64))))
    cases = [([1, 2**40], [1, 1], hs[:2], ArgumentValueError, "ops\\[1\\]"),
             ([1, -1], [1, 2**70], hs[:2], ArgumentValueError, "groups\\[1\\]"),
             ([1, 1], [1, -1], hs[:2], ArgumentValueError, "groups\\[1\\]"),
             ([1, 1], [1, 1], [hs[0], 2**64], HashInputError, "hashes\\[1\\]"),
             ([1, 1], [1, 1], [hs[0], -5], HashInputError, "hashes\\[1\\]"),
             ([1, 1], [1, 1], [hs[0], -2**70], HashInputError, "hashes\\[1\\]")]
    for ops, groups, hashes, err, match in cases:
        with pytest.raises(err, match=match):
            index.apply(key, ops, groups, hashes)
        assert index.resident_blocks(key) == 0
    index.apply(key, [1, 0, 1], [1, 2**70, 1], [hs[0], 0, 2**64 - 1])   # a clear's group: unread
    assert index.resident_blocks(key) == 1
    assert index.query_hashes([], 0).hits == {key: 0}
    with pytest.raises(HashInputError, match="hashes"):
        index.query_hashes([b"x" * 32, b"y" * 31], 64)
    with pytest.raises(HashInputError, match="hashes"):
        index.query_hashes([7], 64)
    with pytest.raises(HashInputError, match="hashes"):
        index.query_hashes(np.zeros((2, 4), np.uint8), 64)
    with pytest.raises(HashInputError, match="hashes"):
        index.query_hashes(np.zeros((2, 32), np.int8), 64)


def test_apply_and_query_from_threads(index):
    """A subscriber thread applying events while another queries: every answer is a state
    the event stream passed through (whole batches), never a torn one."""
    import threading
    toks = list(range(1, 1601))
    hs = ints(index.block_hashes(toks))
    key = ("a", 0)
    seen, stop = set(), threading.Event()

    def query():
        while not stop.is_set():
            seen.add(index.query(toks).hits[key])

    t = threading.Thread(target=query)
    t.start()
    try:
        for _ in range(50):
            index.apply(key, [1] * 2 * len(hs), [0] * len(hs) + [1] * len(hs), hs + hs)
            index.clear(key)
    finally:
        stop.set()
        t.join(timeout=60)
    assert not t.is_alive()
    assert seen <= {0, 1584}


# -- hashes ------------------------------------------------------------------------------------
def test_hasher_follows_vllm_algorithm():
    """Row j = sha256(pickle((parent, tuple(block tokens), None))), parent of row 0 =
    sha256(pickle(seed)) (vLLM's NONE_HASH)."""
    hb = BlockHasher(4, "sha256", seed="0")
    toks = list(range(10))
    parent = hashlib.sha256(pickle.dumps("0", protocol=5)).digest()
    want = []
    for s in (0, 4):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(toks[s:s + 4]), None),
                                             protocol=5)).digest()
        want.append(parent)
    assert hb.hashes(toks) == want
    assert hb.hashes(np.array(toks, dtype=np.int64)) == want       # numpy ids hash the same
    assert BlockHasher(4, "sha256", seed="1").hashes(toks) != want
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        saved = os.environ.pop("PYTHONHASHSEED", None)
        try:
            BlockHasher(4, "xxhash")
        finally:
            if saved is not None:
                os.environ["PYTHONHASHSEED"] = saved


# -- apply_events: a decoded KV event batch in one call ---------------------------------------


def wire_events(events, int_hashes, draw_medium):
    """The scenario's events as kv_event_wire structs: group 0 sometimes as group_idx None,
    some events on another medium (which apply_events leaves out)."""
    out = []
    for rows in events:
        op, g = rows[0][0], rows[0][1]
        if op == OP_CLEAR:
            out.append(W.AllBlocksCleared())
            continue
        hashes = [as_event_hash(d, int_hashes) for _, _, d in rows]
        medium = draw_medium()
        gi = None if g == 0 and medium == "GPU" else g
        if op == OP_STORE:      # with what vLLM sends beside (the index decoder skips it)
            out.append(W.BlockStored(block_hashes=hashes, group_idx=gi, medium=medium,
                                     parent_block_hash=hashes[0], block_size=4,
                                     token_ids=list(range(70_000, 70_000 + 4 * len(hashes)))))
        else:
            out.append(W.BlockRemoved(block_hashes=hashes, group_idx=gi, medium=medium))
    return out


@settings(max_examples=min(300, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(scenarios(), st.data())
def test_apply_events_matches_oracle(sc, data):
    """apply_events on the scenario's batches (as structs, or decoded by msgspec with the full
    schema or the subscriber's index decoder) equals the Python subscriber's oracle and the
    flattened-rows path, hit and residency, every batch."""
    layout, int_hashes, prompts, engines, batches = sc
    index = RoutingIndex(layout, int_hashes=int_hashes)
    rows_index = RoutingIndex(layout, int_hashes=int_hashes)
    oracle = OracleRoute(layout, int_hashes=int_hashes)
    for key in engines:
        index.add_engine(*key)
        rows_index.add_engine(*key)
        oracle.add_engine(key)
    h = layout.hash_block_size
    medium = lambda: data.draw(st.sampled_from(["GPU", "GPU", "GPU", None, "CPU"]))  # noqa: E731
    for key, events in batches:
        evs = wire_events(events, int_hashes, medium)
        how, types, given = data.draw(st.sampled_from(["structs", "full", "index"])), \
            _EVENT_TYPES, evs
        if how != "structs":
            payload = msgspec.msgpack.encode(W.EventBatch(ts=0.0, events=evs))
            if how == "full":
                given = W.decoder().decode(payload).events
            else:
                given, types = W.index_decoder().decode(payload).events, W.INDEX_EVENT_TYPES
        got = index.apply_events(key, given, types, spec_kinds=SPEC_KINDS)
        oracle.apply_events(key, evs)
        gpu = [ev for ev in evs if isinstance(ev, W.AllBlocksCleared) or ev.medium != "CPU"]
        flat = [(0 if isinstance(ev, W.AllBlocksCleared) else
                 (OP_STORE if isinstance(ev, W.BlockStored) else OP_REMOVE), ev.group_idx or 0
                 if not isinstance(ev, W.AllBlocksCleared) else 0, x)
                for ev in gpu for x in (ev.block_hashes if not isinstance(ev, W.AllBlocksCleared)
                                        else [0 if int_hashes else b"\0" * 32])]
        want = rows_index.apply(key, [r[0] for r in flat], [r[1] for r in flat],
                                [r[2] for r in flat] if int_hashes else
                                (np.frombuffer(b"".join(r[2] for r in flat), np.uint8)
                                 .reshape(-1, 32) if flat else np.zeros((0, 32), np.uint8)))
        other = sum(len(ev.block_hashes) for ev in evs if not isinstance(ev, W.AllBlocksCleared)
                    and ev.medium == "CPU")
        assert got._replace(other_medium=0) == want
        assert got.other_medium == other
        prompt = data.draw(st.sampled_from(prompts))
        n = data.draw(st.integers(0, len(prompt)))
        num_tokens = n * h + data.draw(st.integers(0, h))
        assert index.query_hashes(prompt[:n], num_tokens).hits == oracle.hits(prompt[:n],
                                                                              num_tokens)
    for key in engines:
        assert index.resident_blocks(key) == len(oracle.engines[key])


def test_apply_events_refuses_a_bad_event_whole():
    """A bad event anywhere refuses the batch, naming the event (and hash); nothing of the
    batch is applied, whatever came before the bad event; the scratch rows are reusable."""
    layout = get_preset("gpt-oss-120b")
    index = RoutingIndex(layout)
    key = index.add_engine("e")
    good = [W.BlockStored(block_hashes=[1, 2, 3], group_idx=1),
            W.BlockRemoved(block_hashes=[9], group_idx=0)]
    assert index.apply_events(key, good, _EVENT_TYPES).stored == 3
    cases = [
        (W.BlockStored(block_hashes=[4, -1], group_idx=1), HashInputError,
         r"events\[2\]\.block_hashes\[1\] must be in \[0, 2\*\*64\)"),
        (W.BlockStored(block_hashes=[4, 2**64], group_idx=1), HashInputError,
         r"events\[2\]\.block_hashes\[1\]"),
        (W.BlockStored(block_hashes=[4, b"x" * 8], group_idx=1), ArgumentTypeError,
         r"events\[2\]\.block_hashes\[1\] must be an int"),
        (W.BlockRemoved(block_hashes=[4], group_idx=2), ArgumentValueError,
         r"events\[2\]\.group_idx must be a group id in \[0, 2\)"),
        (W.BlockRemoved(block_hashes=[4], group_idx=-1), ArgumentValueError,
         r"events\[2\]\.group_idx"),
        (W.BlockStored(block_hashes=[4], group_idx=0, kv_cache_spec_kind="full_attention"),
         ConfigError, r"events\[2\]: the engine's group 0 is 'full_attention'"),
        (W.EventBatch(ts=0.0, events=[]), ArgumentTypeError, r"events\[2\] must be a stored"),
    ]
    for bad, error, match in cases:
        batch = [W.BlockStored(block_hashes=[5, 6], group_idx=1), W.AllBlocksCleared(), bad,
                 W.BlockStored(block_hashes=[7], group_idx=0)]
        with pytest.raises(error, match=match):
            index.apply_events(key, batch, _EVENT_TYPES, spec_kinds=SPEC_KINDS)
        assert index.resident_blocks(key) == 3       # neither the clear nor the stores
    with pytest.raises(ArgumentTypeError, match="types"):
        index.apply_events(key, good, (W.BlockStored, W.BlockRemoved))
    with pytest.raises(ArgumentTypeError, match="medium"):
        index.apply_events(key, good, _EVENT_TYPES, medium=b"GPU")      # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        index.apply_events(key, tuple(good), _EVENT_TYPES)             # type: ignore[arg-type]
    # an unknown engine's batch: validated, then counted; a big batch then a small one
    assert index.apply_events(("x", 0), good + [W.AllBlocksCleared()],
                              _EVENT_TYPES).unknown_engine == 5
    big = [W.BlockStored(block_hashes=list(range(10, 100_010)), group_idx=1)]
    assert index.apply_events(key, big, _EVENT_TYPES).stored == 100_000
    # rows past the kept 65536 that take no more bytes than the table are kept: the next big
    # batch reuses them (stale rows of the last batch underneath)
    evict = [W.BlockRemoved(block_hashes=[h], group_idx=1) for h in range(10, 70_010)]
    st_ = index.apply_events(key, evict + [W.BlockStored(block_hashes=[5], group_idx=0)],
                             _EVENT_TYPES)
    assert (st_.stored, st_.removed, st_.ignored) == (1, 70_000, 0)
    assert index.resident_blocks(key) == 30_004      # good's 3 + 100_000 - 70_000 + 1
    assert index.apply_events(key, [W.AllBlocksCleared()] + good, _EVENT_TYPES) \
        == (3, 0, 1, 0, 1, 0, 0)
    assert index.resident_blocks(key) == 3


def test_apply_events_digest_hashes_and_lookahead():
    """Digest events (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): bytes of the digest size, an
    int or a short digest refused; lookahead stores counted."""
    layout = get_preset("gpt-oss-120b")
    index = RoutingIndex(layout, int_hashes=False)
    key = index.add_engine("e")
    d = chain(3, 1)
    st_ = index.apply_events(key, [W.BlockStored(block_hashes=d, group_idx=1,
                                                 lookahead_token_ids=[[1], [2], [3]])],
                             _EVENT_TYPES)
    assert (st_.stored, st_.lookahead) == (3, 3) and index.resident_blocks(key) == 3
    for bad in (5, d[0][:16]):
        with pytest.raises(ArgumentTypeError, match=r"events\[0\]\.block_hashes\[1\] must be a "
                                                    r"32-byte digest"):
            index.apply_events(key, [W.BlockRemoved(block_hashes=[d[0], bad], group_idx=1)],
                               _EVENT_TYPES)
    assert index.resident_blocks(key) == 3


def _attribute_event_types():
    """(stored, removed, cleared) classes named as vLLM's whose fields live in the instance
    ``__dict__``: ``apply_events`` reads them by ``getattr`` (its general walk) instead of
    in place (the object-slot walk it takes for msgspec structs)."""
    def make(name, fields):
        def __init__(self, **kw):
            for f in fields:
                setattr(self, f, kw.get(f))
        return type(name, (), {"__init__": __init__})
    return (make("BlockStored", ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind",
                                 "lookahead_token_ids")),
            make("BlockRemoved", ("block_hashes", "medium", "group_idx")),
            make("AllBlocksCleared", ()))


ATTRIBUTE_TYPES = _attribute_event_types()


@settings(max_examples=min(150, int(os.environ.get("HMACORE_EXAMPLES", "2000"))), deadline=None)
@given(st.booleans(), st.booleans(), st.integers(0, 2**32 - 1), st.data())
def test_apply_events_paths_match_rows_one_by_one(int_hashes, wide, seed, data):
    """``apply_events`` through both walks (fields read in place from msgspec structs, or by
    getattr) and both table paths (8-byte keys with one mask word: the inlined probe; digests
    or two mask words: the general one) leaves the same index, with the same answers, as
    applying the same rows one call per row. Batches are drawn from 8 keys per group, so a key
    stored then removed, stored twice or removed unheld inside one batch is common, and
    AllBlocksCleared lands mid-batch; a bad event anywhere refuses its whole batch and leaves
    the index as it was."""
    layout = get_preset("gpt-oss-120b")
    h = layout.hash_block_size
    prompt = chain(8, seed)
    indexes = [RoutingIndex(layout, int_hashes=int_hashes) for _ in range(3)]
    engines = [("e", d) for d in range(66 if wide else 2)]    # 66: two mask words
    for ix in indexes:
        for key in engines:
            ix.add_engine(*key)
    used = [engines[0], engines[-1]]
    k_of = {g: indexes[0].finder.block_sizes[g] // h for g in range(layout.num_groups)}

    def state(ix):
        return (tuple(ix.resident_blocks(key) for key in used),
                tuple(tuple(sorted(ix.query_hashes(prompt[:n], n * h).hits.items()))
                      for n in (1, 3, 5, 8)))

    for _ in range(data.draw(st.integers(1, 6))):
        key = data.draw(st.sampled_from(used))
        spec = data.draw(st.lists(st.tuples(
            st.sampled_from([OP_STORE, OP_STORE, OP_REMOVE, OP_REMOVE, OP_CLEAR]),
            st.integers(0, layout.num_groups - 1),
            st.lists(st.integers(0, 7), min_size=1, max_size=3)), max_size=8))
        rows, direct, by_attr = [], [], []
        for op, g, blocks in spec:
            if op == OP_CLEAR:
                rows.append((op, 0, None))
                direct.append(W.AllBlocksCleared())
                by_attr.append(ATTRIBUTE_TYPES[2]())
                continue
            hashes = [as_event_hash(prompt[(b + 1) * k_of[g] - 1], int_hashes) for b in blocks
                      if (b + 1) * k_of[g] <= len(prompt)]
            rows += [(op, g, x) for x in hashes]
            medium = data.draw(st.sampled_from(["GPU", None]))
            w_cls, a_cls = ((W.BlockStored, ATTRIBUTE_TYPES[0]) if op == OP_STORE
                            else (W.BlockRemoved, ATTRIBUTE_TYPES[1]))
            direct.append(w_cls(block_hashes=hashes, group_idx=g, medium=medium))
            by_attr.append(a_cls(block_hashes=hashes, group_idx=g, medium=medium))
        before = [state(ix) for ix in indexes]
        assert before[0] == before[1] == before[2]
        bad_at = data.draw(st.none() | st.integers(0, len(spec)))
        if bad_at is not None:
            bad = dict(block_hashes=[as_event_hash(prompt[0], int_hashes)], group_idx=2)
            direct.insert(bad_at, W.BlockRemoved(**bad))
            by_attr.insert(bad_at, ATTRIBUTE_TYPES[1](**bad))
            for ix, evs, types in ((indexes[0], direct, _EVENT_TYPES),
                                   (indexes[1], by_attr, ATTRIBUTE_TYPES)):
                with pytest.raises(ArgumentValueError, match=rf"events\[{bad_at}\]\.group_idx"):
                    ix.apply_events(key, evs, types)
                assert state(ix) == before[0]
            continue
        got = indexes[0].apply_events(key, direct, _EVENT_TYPES)
        assert indexes[1].apply_events(key, by_attr, ATTRIBUTE_TYPES) == got
        one = [0, 0, 0, 0]
        for op, g, x in rows:
            if op == OP_CLEAR:
                st_ = indexes[2].clear(key)
            else:
                x = [x] if int_hashes else np.frombuffer(x, np.uint8).reshape(1, -1)
                st_ = indexes[2].apply(key, [op], [g], x)
            one = [a + b for a, b in zip(one, (st_.stored, st_.removed, st_.ignored,
                                               st_.cleared))]
        assert [got.stored, got.removed, got.ignored, got.cleared] == one
        after = [state(ix) for ix in indexes]
        assert after[0] == after[1] == after[2]


def test_apply_events_survives_caller_code_in_the_kind_lookup():
    """The spec-kind lookup is the one place the compiled walk can run the caller's code (a
    non-str key's ``__eq__`` in ``refused_kinds``, which ``_route.apply_events`` takes as
    given): a key that swaps the event's hashes applies the new ones, one that empties the
    batch is a clear error with nothing applied; no read of a freed list (ASan runs this
    file in ``make sanitize-short``)."""
    from hmacore._fast import _route
    res = _route.SharedResidency(8)
    bit = res.add_engine()
    events: list = []

    class Hostile:
        def __init__(self, empty_batch):
            self.empty_batch = empty_batch

        def __hash__(self):
            return hash("full_attention")

        def __eq__(self, other):
            if events:
                events[0].block_hashes = [7]        # frees the list the walk had read
                if self.empty_batch:
                    del events[:]
            return False

    for empty_batch, want in ((False, 1), (True, None)):
        events[:] = [W.BlockStored(block_hashes=list(range(1, 50)), group_idx=0,
                                   kv_cache_spec_kind="full_attention")]
        refused = ({Hostile(empty_batch): "sliding window"}, {})
        if want is None:
            with pytest.raises(ValueError, match="events changed while being applied"):
                _route.apply_events(res, bit, events, _EVENT_TYPES, "GPU", refused, 2)
            assert res.resident(bit) == 1           # as before the call
        else:
            assert _route.apply_events(res, bit, events, _EVENT_TYPES, "GPU", refused,
                                       2)[0] == want
            assert res.resident(bit) == 1


def test_apply_events_compiled_method_state():
    """``RoutingIndex.apply_events`` is a compiled function reading the index's
    ``EventState``: the refusals follow the ``spec_kinds`` object given (cached per object,
    not stuck on the first), None checks nothing; a test's swap of the module-level hook
    ``_route.apply_events`` is honoured; the state takes only a 7-field NamedTuple class."""
    from hmacore._fast import _route
    from hmacore.route_index import ApplyStats
    index = RoutingIndex(get_preset("gpt-oss-120b"))      # group 0 sliding, 1 full
    key = index.add_engine("e")
    ev = [W.BlockStored(block_hashes=[5], group_idx=0, kv_cache_spec_kind="full_attention")]
    with pytest.raises(ConfigError, match="group 0 is 'full_attention'"):
        index.apply_events(key, ev, _EVENT_TYPES, spec_kinds=SPEC_KINDS)
    lenient = {"full_attention": index.layout.groups[0].kind}
    assert index.apply_events(key, ev, _EVENT_TYPES, spec_kinds=lenient).stored == 1
    with pytest.raises(ConfigError):
        index.apply_events(key, ev, _EVENT_TYPES, spec_kinds=SPEC_KINDS)
    assert index.apply_events(key, ev, _EVENT_TYPES).stored == 1
    with pytest.raises(ArgumentTypeError, match="spec_kinds must be a dict"):
        index.apply_events(key, ev, _EVENT_TYPES, spec_kinds=[])      # type: ignore[arg-type]
    assert index.resident_blocks(key) == 1
    seen = []
    hook = _route.apply_events

    def counting(*args):
        seen.append(args[1])
        return hook(*args)
    _route.apply_events = counting
    try:
        got = index.apply_events(key, [W.BlockRemoved(block_hashes=[5], group_idx=0)] * 3,
                                 _EVENT_TYPES)
        assert index.apply_events(("x", 0), ev, _EVENT_TYPES).unknown_engine == 1
    finally:
        _route.apply_events = hook
    assert seen == [index._engines[key], -1]
    assert got == ApplyStats(removed=2, ignored=1) and type(got) is ApplyStats
    for bad in (tuple, type("Four", (tuple,), {"_fields": ("a",) * 4})):
        with pytest.raises(TypeError, match="7-field NamedTuple"):
            _route.EventState(index._residency, {}, index._lock, 2, ({}, {}), bad)
