"""RoutingIndex.apply_payload (the compiled reader of vLLM's KV event batch bytes) against the
slow path it stands in for: msgspec's ``kv_event_wire.index_decoder()`` + the DP rank check
+ ``RoutingIndex.apply_events`` (what KVEventSubscriber does), and the plain-Python oracle.

The contract checked on every payload: apply_payload never raises on bytes (and raises
ArgumentTypeError naming ``payload`` on anything else: it takes exactly ``bytes``); it returns
the ApplyStats the slow path returns and leaves the index as the slow path leaves it, or it
returns None (declined) with the index unchanged; where the slow path refuses (DecodeError,
ValidationError, a HmacoreError from apply_events, another DP rank) it returns None. On
batches shaped as vLLM's publisher writes them (msgspec.msgpack.encode of
kv_event_wire.EventBatch, no lookahead token ids) it must not decline: the accept rate there
is asserted to be 100%.

Two indexes take the same payloads: "fast" through apply_payload (the slow path on a
decline, as the subscriber would), "slow" through the slow path only; a third, the oracle
(tests/oracle_route.py), takes the slow path's rows. After every payload their stats, resident
counts and queries over the hash pool agree; at the end every pool key's count is read off
by removing it. Also: hand-written msgpack (odd but valid encodings, refusals), byte-level
and semantic fuzz, 32-bit length forms, ``apply_payloads`` (a stream's queued batches in one
call) against apply_payload one by one, and the harness itself against planted bugs (a
Python stand-in of apply_payload with one bug each: every one must fail some check). No
vLLM import here (tests/vllm/test_kv_payload_vllm.py encodes with vLLM's own classes).
The tests marked slow are a bigger sweep of the same generators.
"""
from __future__ import annotations

import os
import random
import struct

import msgspec
import pytest

from hmacore.errors import ArgumentTypeError, ArgumentValueError, HmacoreError
from hmacore.route_index import ApplyStats, RoutingIndex
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode
from hmacore.transport import kv_event_wire as W
from hmacore.transport.kv_events import SPEC_KINDS

from oracle_route import OracleRoute

BS = 16
ONE = KVLayout(groups=(GroupSpec(GroupKind.FULL, BS, ("f0",)),))
TWO = KVLayout(groups=(GroupSpec(GroupKind.FULL, BS, ("f0",)),
                       GroupSpec(GroupKind.SLIDING_WINDOW, BS, ("s0",), sliding_window=64)))
MULTI = KVLayout(groups=(GroupSpec(GroupKind.FULL, BS, ("f0",)),
                         GroupSpec(GroupKind.SLIDING_WINDOW, BS, ("s0",), sliding_window=48),
                         GroupSpec(GroupKind.MAMBA, 2 * BS, ("m0",), mamba_mode=MambaMode.ALIGN),
                         GroupSpec(GroupKind.FULL, 4 * BS, ("f1",))))
LAYOUTS = {"one": ONE, "two": TWO, "multi": MULTI}

ENC = msgspec.msgpack.Encoder()
DEC = W.index_decoder()
REFUSED = "refused"
ENGINES = [("e", 0), ("e", 1)]          # key (engine_id, dp_rank): apply_payload's dp_rank
GHOST = ("ghost", 0)                    # never added: rows counted as unknown_engine
#: vLLM's kv_cache_spec_kind strings a group of each kind may carry (SPEC_KINDS' inverse)
KIND_NAMES = {kind: [name for name, k in SPEC_KINDS.items() if k == kind] for kind in GroupKind}
INT_EDGES = [0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


# -- the slow path, the oracle, the state ------------------------------------------------------
def slow_apply(index: RoutingIndex, key, payload: bytes, dp_rank: int, medium="GPU",
               spec_kinds=SPEC_KINDS):
    """What KVEventSubscriber does with one payload: (ApplyStats, decoded batch), or
    (REFUSED, None) where it drops the batch."""
    try:
        batch = DEC.decode(payload)
    except W.DECODE_ERRORS:     # msgspec's errors, UnicodeDecodeError and RecursionError
        return REFUSED, None
    rank = dp_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
    if rank != dp_rank:
        return REFUSED, None
    try:
        return index.apply_events(key, batch.events, W.INDEX_EVENT_TYPES, medium=medium,
                                  spec_kinds=spec_kinds), batch
    except HmacoreError:
        return REFUSED, None


def oracle_rows(batch, medium):
    """The rows apply_events applies for a decoded batch (the Python subscriber's reading)."""
    ops, groups, hashes = [], [], []
    for ev in batch.events:
        if isinstance(ev, W.IndexAllBlocksCleared):
            ops.append(0), groups.append(0), hashes.append(b"")
            continue
        if ev.medium is not None and ev.medium != medium:
            continue
        op = 1 if isinstance(ev, W.IndexBlockStored) else -1
        for h in ev.block_hashes:
            ops.append(op), groups.append(ev.group_idx or 0)
            hashes.append(h.to_bytes(8, "big") if type(h) is int else h)
    return ops, groups, hashes


class Trio:
    """fast / slow / oracle over one layout, hash mode and call options."""

    def __init__(self, layout, int_hashes, medium="GPU", spec_kinds=SPEC_KINDS, pool=(),
                 fast_cls=RoutingIndex):
        self.fast = fast_cls(layout, int_hashes=int_hashes)
        self.slow = RoutingIndex(layout, int_hashes=int_hashes)
        self.oracle = OracleRoute(layout, int_hashes=int_hashes)
        for key in ENGINES:
            self.fast.add_engine(*key)
            self.slow.add_engine(*key)
            self.oracle.add_engine(key)
        self.layout, self.int_hashes = layout, int_hashes
        self.medium, self.spec_kinds = medium, spec_kinds
        self.ds = self.fast.digest_size
        self.set_pool(pool)
        self.accepted = self.declined = self.refused = 0
        self.must_accept_declined: list[bytes] = []

    def set_pool(self, pool):
        """The hashes batches draw from (queries and the final read-off use them)."""
        self.pool = list(pool)
        self.digests = [(h.to_bytes(8, "big") if type(h) is int else h) for h in self.pool]

    def state(self, ix: RoutingIndex):
        """Resident counts, and per group the hit of a one-row query of every pool key (on a
        one-group layout: that key's residency) and of a few chains."""
        out = [tuple(ix.resident_blocks(k) for k in ENGINES), ix._residency.num_keys]
        h = ix.hash_block_size
        for i in range(0, len(self.digests), 1 if self.layout.num_groups == 1 else 3):
            out.append(tuple(sorted(ix.query_hashes(self.digests[i:i + 1], h + 1).hits.items())))
        for n in (2, 4, 8):
            out.append(tuple(sorted(ix.query_hashes(self.digests[:n], n * h).hits.items())))
        return out

    def oracle_state(self):
        out = [tuple(len(self.oracle.engines[k]) for k in ENGINES)]
        h = self.fast.hash_block_size
        for n in (2, 4, 8):
            out.append(tuple(sorted(self.oracle.hits(self.digests[:n], n * h).items())))
        return out

    def step(self, key, payload: bytes, dp_rank: int, must_accept: bool = False):
        """One payload through all three; checks the contract; returns the fast result."""
        before = self.state(self.fast)
        got = self.fast.apply_payload(key, payload, dp_rank=dp_rank, medium=self.medium,
                                      spec_kinds=self.spec_kinds)
        assert got is None or type(got) is ApplyStats, got
        if got is None:
            assert self.state(self.fast) == before, f"declined yet changed: {payload.hex()}"
            fell_back, _ = slow_apply(self.fast, key, payload, dp_rank, self.medium,
                                      self.spec_kinds)
        want, batch = slow_apply(self.slow, key, payload, dp_rank, self.medium, self.spec_kinds)
        if want is REFUSED:
            self.refused += 1
            assert got is None, f"slow path refuses, fast applied {got}: {payload.hex()}"
        elif got is None:
            self.declined += 1
            assert fell_back == want
            if must_accept:
                self.must_accept_declined.append(payload)
        else:
            self.accepted += 1
            assert got == want, f"fast {got} != slow {want}: {payload.hex()}"
        if batch is not None and key in self.oracle.engines:
            self.oracle.apply(key, *oracle_rows(batch, self.medium))
        after = self.state(self.fast)
        assert after == self.state(self.slow), f"state differs after {payload.hex()}"
        return got

    def check_oracle(self):
        assert self.state(self.fast)[:1] == self.oracle_state()[:1]
        fast_q = [q for q in self.state(self.fast)[-3:]]
        assert fast_q == self.oracle_state()[1:]

    def read_off(self):
        """Every pool key's count per engine, read by removing it until a remove is a no-op
        (destructive: call last); equal across fast, slow and oracle."""
        want = {}
        for key in ENGINES:
            for (g, d), c in self.oracle.engines[key].items():
                want[(key, g, d)] = c
        for ix in (self.fast, self.slow):
            got = {}
            for key in ENGINES:
                for g in range(self.layout.num_groups):
                    for h, d in zip(self.pool, self.digests):
                        c = 0
                        while ix.remove(key, g, [h] if self.int_hashes else [d]).removed:
                            c += 1
                        if c:
                            got[(key, g, d)] = c
            # keys outside the pool (fuzzed hashes) are not read off
            assert got == {k: v for k, v in want.items() if k[2] in set(self.digests)}
        assert [self.fast.resident_blocks(k) for k in ENGINES] == \
            [self.slow.resident_blocks(k) for k in ENGINES] == \
            [len([1 for g, d in self.oracle.engines[k] if d not in set(self.digests)])
             for k in ENGINES]


# -- vLLM-shaped batches -----------------------------------------------------------------------
def make_pool(rng: random.Random, int_hashes: bool, ds: int, n: int = 18) -> list:
    if int_hashes:
        extra = [rng.getrandbits(64) for _ in range(n - len(INT_EDGES))]
        return list(dict.fromkeys(INT_EDGES + extra))
    edges = [b"\0" * ds, b"\xff" * ds, (1).to_bytes(ds, "big")]
    return list(dict.fromkeys(edges + [rng.randbytes(ds) for _ in range(n - len(edges))]))


def spec_kind(rng: random.Random, layout: KVLayout, g: int):
    """A kv_cache_spec_kind a group of layout's kind g may carry (or None / an unchecked one)."""
    r = rng.random()
    if r < 0.3:
        return None
    if r < 0.4:
        return rng.choice(["unknown", "cross_attention", "x" * 40])
    return rng.choice(KIND_NAMES[layout.groups[g].kind])


def random_event(rng: random.Random, layout: KVLayout, pool: list, *, lookahead=False,
                 big=False):
    r = rng.random()
    if r < 0.07:
        return W.AllBlocksCleared()
    g = rng.randrange(layout.num_groups)
    group_idx = None if g == 0 and rng.random() < 0.5 else g
    n = rng.choice([0, 1, 1, 2, 3, 4, 6, 9]) if not big else rng.randrange(100, 700)
    hashes = [rng.choice(pool) for _ in range(n)]
    medium = rng.choice(["GPU"] * 6 + [None, None, "CPU", "STORAGE", ""])
    if r < 0.6:
        kw = {}
        if rng.random() < 0.7:
            kw["parent_block_hash"] = rng.choice(pool)
        if rng.random() < 0.8:
            kw["token_ids"] = [rng.randrange(-1, 2**31) if rng.random() < 0.9
                               else rng.choice([2**63 - 1, -2**63, 2**64 - 1])
                               for _ in range(rng.choice([0, BS, n * BS, 3]))]
            kw["block_size"] = rng.choice([BS, 2 * BS, 0, 1])
        if rng.random() < 0.2:
            kw["lora_id"] = rng.randrange(0, 2**40)
            kw["lora_name"] = rng.choice(["adapter", "", "l" * 300])
        if rng.random() < 0.3:
            kw["kv_cache_spec_sliding_window"] = rng.choice([None, 64, 4096])
        if lookahead:
            kw["lookahead_token_ids"] = [[rng.randrange(1000)] for _ in hashes]
        return W.BlockStored(block_hashes=hashes, medium=medium, group_idx=group_idx,
                             kv_cache_spec_kind=spec_kind(rng, layout, g), **kw)
    return W.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx)


def random_batch(rng: random.Random, layout: KVLayout, pool: list, dp_rank: int, *,
                 lookahead=False):
    n = rng.choice([0, 1, 1, 2, 3, 5, 8, 16, 40])
    events = [random_event(rng, layout, pool, lookahead=lookahead and rng.random() < 0.5)
              for _ in range(n)]
    if rng.random() < 0.03:
        events.append(random_event(rng, layout, pool, big=True))
    ts = rng.choice([0.0, 1.5, 1.7e9 + rng.random(), -0.0, float(rng.randrange(10**6))])
    rank = rng.choice([None, None, dp_rank])
    return W.EventBatch(ts=ts, events=events, data_parallel_rank=rank)


def run_valid(seed: int, layout: KVLayout, int_hashes: bool, n_batches: int, **opts):
    """n_batches random vLLM-shaped batches through a Trio; every check of Trio.step, none
    refused, none declined but those with lookahead token ids, oracle and read-off equal."""
    rng = random.Random(seed)
    trio = Trio(layout, int_hashes, **opts)
    trio.set_pool(make_pool(rng, int_hashes, trio.ds))
    lookahead = 0
    for _ in range(n_batches):
        key = rng.choice(ENGINES + ENGINES + [GHOST])
        dp = key[1]
        batch = random_batch(rng, layout, trio.pool, dp, lookahead=rng.random() < 0.1)
        has_lookahead = any(getattr(e, "lookahead_token_ids", None) is not None
                            for e in batch.events)
        lookahead += has_lookahead
        got = trio.step(key, ENC.encode(batch), dp, must_accept=not has_lookahead)
        if got is not None and key == GHOST:
            assert (got.stored, got.removed, got.ignored, got.cleared) == (0, 0, 0, 0)
    trio.check_oracle()
    assert trio.refused == 0
    assert not trio.must_accept_declined, \
        f"{len(trio.must_accept_declined)} vLLM-shaped batches declined, e.g. " \
        f"{trio.must_accept_declined[0].hex()}"
    trio.read_off()
    return trio


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("layout", ["one", "two", "multi"])
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
def test_valid_batches_equal_slow_path_and_all_accepted(seed, layout, int_hashes):
    """~300 random vLLM-shaped batches per case (stores with every field, removes, clears
    anywhere, empty batches and hash lists, GPU / None / other media, group None, edge
    hashes, DP rank None or the stream's, an unknown engine): equal to the slow path and to
    the oracle, none declined except those with lookahead token ids."""
    run_valid(seed, LAYOUTS[layout], int_hashes, 300)


@pytest.mark.parametrize("medium, spec_kinds", [(None, None), ("CPU", SPEC_KINDS),
                                                ("GPU", None), ("", {})])
def test_valid_batches_other_call_options(medium, spec_kinds):
    """apply_payload's medium / spec_kinds as apply_events takes them."""
    for int_hashes in (True, False):
        run_valid(11, MULTI, int_hashes, 150, medium=medium, spec_kinds=spec_kinds)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 112))
def test_valid_batches_sweep(seed):
    for layout in LAYOUTS.values():
        for int_hashes in (True, False):
            run_valid(seed, layout, int_hashes, 1500)


# -- msgpack written by hand: odd but valid encodings, and refusals ---------------------------
class Pairs(list):
    """A msgpack map as a list of (key, value) pairs (order kept, duplicates allowed)."""


class Raw(bytes):
    """Bytes written into a packed value as they are."""


def pack(obj, rng: random.Random | None = None, wide: float = 0.0) -> bytes:
    """msgpack of obj; with rng, each header / int / float may take a wider (still valid)
    form with probability ``wide``. wide=0: msgspec's own (shortest) forms."""
    def w() -> bool:
        return rng is not None and rng.random() < wide

    def pick(valid):
        """The first (shortest) of the valid forms, or with rng a random one."""
        return rng.choice(valid) if w() else valid[0]

    def length(n, fix_base, fix_max, forms):
        valid = ([bytes([fix_base | n])] if n <= fix_max else []) + \
            [bytes([tag]) + struct.pack(fmt, n) for tag, fmt, cap in forms if n < cap]
        return pick(valid)

    if isinstance(obj, Raw):
        return bytes(obj)
    if obj is None:
        return b"\xc0"
    if obj is True or obj is False:
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        valid = []
        if 0 <= obj < 128:
            valid.append(bytes([obj]))
        if -32 <= obj < 0:
            valid.append(struct.pack(">b", obj))
        for tag, fmt, lo, hi in ((0xcc, ">B", 0, 2**8), (0xcd, ">H", 0, 2**16),
                                 (0xce, ">I", 0, 2**32), (0xcf, ">Q", 0, 2**64),
                                 (0xd0, ">b", -2**7, 2**7), (0xd1, ">h", -2**15, 2**15),
                                 (0xd2, ">i", -2**31, 2**31), (0xd3, ">q", -2**63, 2**63)):
            if lo <= obj < hi and (obj < 0 or tag < 0xd0 or w()):
                valid.append(bytes([tag]) + struct.pack(fmt, obj))
        return pick(valid)
    if isinstance(obj, float):
        if w() and struct.unpack(">f", struct.pack(">f", obj))[0] == obj:
            return b"\xca" + struct.pack(">f", obj)
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        b = obj.encode()
        return length(len(b), 0xa0, 31, [(0xd9, ">B", 2**8), (0xda, ">H", 2**16),
                                         (0xdb, ">I", 2**32)]) + b
    if isinstance(obj, (bytes, bytearray)):
        return length(len(obj), 0, -1, [(0xc4, ">B", 2**8), (0xc5, ">H", 2**16),
                                        (0xc6, ">I", 2**32)]) + bytes(obj)
    if isinstance(obj, Pairs):
        return length(len(obj), 0x80, 15, [(0xde, ">H", 2**16), (0xdf, ">I", 2**32)]) + \
            b"".join(pack(k, rng, wide) + pack(v, rng, wide) for k, v in obj)
    if isinstance(obj, dict):
        return pack(Pairs(obj.items()), rng, wide)
    if isinstance(obj, (list, tuple)):
        return length(len(obj), 0x90, 15, [(0xdc, ">H", 2**16), (0xdd, ">I", 2**32)]) + \
            b"".join(pack(x, rng, wide) for x in obj)
    raise TypeError(type(obj))


def test_pack_is_msgspec_shortest_form():
    rng = random.Random(5)
    for _ in range(300):
        layout = rng.choice(list(LAYOUTS.values()))
        pool = make_pool(rng, rng.random() < 0.5, 32)
        payload = ENC.encode(random_batch(rng, layout, pool, 0))
        assert pack(msgspec.msgpack.decode(payload)) == payload


def ev(tag: str, **fields) -> Pairs:
    return Pairs([("type", tag)] + list(fields.items()))


AC = ev("AllBlocksCleared")


def batch(*events, rank=None, ts=0.0) -> list:
    return [ts, list(events)] + ([] if rank is None else [rank])


def refusal_cases(int_hashes: bool, ds: int):
    """(name, payload) the slow path refuses, each with the same valid rows beside it."""
    h = (lambda i: i) if int_hashes else (lambda i: i.to_bytes(ds, "big"))
    ok = ev("BlockStored", block_hashes=[h(5), h(6)], group_idx=1)
    tail = ev("BlockRemoved", block_hashes=[h(5)], medium="GPU", group_idx=1)
    cases = {
        "group out of range": ev("BlockStored", block_hashes=[h(7)], group_idx=2),
        "group 2**40": ev("BlockRemoved", block_hashes=[h(7)], group_idx=2**40),
        "group negative": ev("BlockRemoved", block_hashes=[h(7)], group_idx=-1),
        "group str": ev("BlockRemoved", block_hashes=[h(7)], group_idx="0"),
        "refused spec kind": ev("BlockStored", block_hashes=[h(7)], group_idx=1,
                                kv_cache_spec_kind="full_attention"),
        "refused spec kind group None": ev("BlockStored", block_hashes=[h(7)],
                                           kv_cache_spec_kind="mamba"),
        "unknown event type": ev("BlockEvicted", block_hashes=[h(7)]),
        "tag not a str": Pairs([("type", 1), ("block_hashes", [h(7)])]),
        "no tag": Pairs([("block_hashes", [h(7)])]),
        "missing block_hashes": ev("BlockStored", group_idx=0),
        "block_hashes not a list": ev("BlockStored", block_hashes=h(7)),
        "hash float": ev("BlockStored", block_hashes=[h(7), 1.0]),
        "hash None": ev("BlockRemoved", block_hashes=[None]),
        "hash str": ev("BlockRemoved", block_hashes=["abc"]),
        "hash bool": ev("BlockRemoved", block_hashes=[True]),
        "medium int": ev("BlockStored", block_hashes=[h(7)], medium=1),
        "group 2**63": ev("BlockRemoved", block_hashes=[h(7)], group_idx=2**63),
        "group 2**64-1": ev("BlockStored", block_hashes=[h(7)], group_idx=2**64 - 1),
        "group -2**63": ev("BlockStored", block_hashes=[h(7)], group_idx=-2**63),
        "group float": ev("BlockStored", block_hashes=[h(7)], group_idx=1.0),
        "tag a prefix": ev("BlockStore", block_hashes=[h(7)]),
        "tag extended": ev("BlockStoredX", block_hashes=[h(7)]),
        "tag case": ev("blockstored", block_hashes=[h(7)]),
        "tag nil": Pairs([("type", None), ("block_hashes", [h(7)])]),
        "spec kind int": ev("BlockStored", block_hashes=[h(7)], kv_cache_spec_kind=5),
        "lookahead not a list": ev("BlockStored", block_hashes=[h(7)], lookahead_token_ids=5),
        "lookahead ids not ints": ev("BlockStored", block_hashes=[h(7)],
                                     lookahead_token_ids=[["a"]]),
        "block_hashes nil": ev("BlockRemoved", block_hashes=None),
        "medium a list": ev("BlockRemoved", block_hashes=[h(7)], medium=["GPU"]),
        "an int key": Pairs([("type", "BlockStored"), ("block_hashes", [h(7)]), (1, 2)]),
        "event not a map": [1, 2],
        "event nil": None,
        "event a str": "BlockStored",
    }
    if int_hashes:
        cases.update({
            "negative hash": ev("BlockStored", block_hashes=[h(7), -1]),
            "hash -2**63": ev("BlockRemoved", block_hashes=[-2**63]),
            "bytes hash on int index": ev("BlockStored", block_hashes=[b"\0" * 8]),
        })
    else:
        cases.update({
            "hash one byte short": ev("BlockStored", block_hashes=[h(7), b"\0" * (ds - 1)]),
            "hash one byte long": ev("BlockStored", block_hashes=[b"\1" * (ds + 1)]),
            "empty hash": ev("BlockRemoved", block_hashes=[b""]),
            "int hash on digest index": ev("BlockStored", block_hashes=[5]),
        })
    out = [(name, pack(batch(ok, AC, bad, tail)))
           for name, bad in cases.items()]
    good = pack(batch(ok, AC, tail))
    out += [
        ("wrong dp rank", pack(batch(ok, rank=1))),
        ("dp rank 2**64-1", pack(batch(ok, rank=2**64 - 1))),
        ("dp rank 2**32", pack(batch(ok, rank=2**32))),
        ("dp rank str", pack(batch(ok, rank="0"))),
        ("dp rank float", pack(batch(ok, rank=0.0))),
        ("ts nil", pack([None, []])),
        ("dp rank -1", pack(batch(ok, rank=-1))),
        ("dp rank bool", pack(batch(ok, rank=True))),
        ("ts missing", pack([])),
        ("ts str", pack(["0", []])),
        ("ts bool", pack([True, []])),
        ("events missing", pack([0.0])),
        ("events a map", pack([0.0, {}])),
        ("batch a map", pack(Pairs([("ts", 0.0), ("events", [])]))),
        ("trailing garbage", good + b"\x00"),
        ("trailing second batch", good + good),
        ("empty payload", b""),
        ("truncated by one", good[:-1]),
        ("truncated mid-hash", good[: len(good) // 2]),
        ("reserved byte 0xc1", pack(batch(ok, Raw(b"\xc1")))),
        ("array count past the end", b"\x92\xcb" + struct.pack(">d", 0.0)
         + b"\xdd\xff\xff\xff\xff"),
    ]
    return out, good



@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
@pytest.mark.parametrize("key", [ENGINES[0], GHOST], ids=["known", "unknown-engine"])
def test_refusals_declined_index_unchanged(int_hashes, key):
    """Every batch the slow path refuses: apply_payload returns None and nothing changes
    (also for an engine never added: the slow path validates it before counting it)."""
    run_refusals(int_hashes, key)


def run_refusals(int_hashes, key, fast_cls=RoutingIndex):
    trio = Trio(TWO, int_hashes, fast_cls=fast_cls)
    cases, good = refusal_cases(int_hashes, trio.ds)
    pool = [5, 6] if int_hashes else [i.to_bytes(trio.ds, "big") for i in (5, 6)]
    trio.set_pool(pool)
    # something resident first, so "unchanged" means something
    assert trio.step(ENGINES[0], pack(batch(ev("BlockStored", block_hashes=pool * 2,
                                                 group_idx=1))), 0, True).stored == 4
    for name, payload in cases:
        before = trio.state(trio.fast)
        want, _ = slow_apply(trio.slow, key, payload, key[1])
        assert want is REFUSED, f"{name}: the slow path applies it ({want})"
        got = trio.fast.apply_payload(key, payload, dp_rank=key[1], spec_kinds=SPEC_KINDS)
        assert got is None, f"{name}: applied {got} ({payload.hex()})"
        assert trio.state(trio.fast) == before == trio.state(trio.slow), name
    # the good rows alone apply
    got = trio.step(key, good, key[1], must_accept=True)
    assert got is not None and not trio.must_accept_declined
    if key == GHOST:
        assert got == ApplyStats(unknown_engine=4)           # 3 hash rows and the clear
    else:
        assert (got.stored, got.removed, got.ignored, got.cleared) == (2, 0, 1, 1)


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
def test_accepted_and_odd_but_valid(int_hashes):
    """Payloads the slow path applies that are not what vLLM writes: fast may decline them
    but, if it applies one, equal to the slow path (tag not first, duplicate fields, unknown
    fields, wide int / header forms, float32 ts, int ts, a 4th batch element, explicit nils,
    non-ASCII text, other-medium events with bad groups / hashes)."""
    trio = Trio(TWO, int_hashes)
    ds = trio.ds
    h = (lambda i: i) if int_hashes else (lambda i: i.to_bytes(ds, "big"))
    trio.set_pool([h(i) for i in range(1, 9)])
    odd = [
        [0.0, [Pairs([("block_hashes", [h(1)]), ("type", "BlockStored")])]],
        [0.0, [Pairs([("type", "BlockStored"), ("block_hashes", [h(1)]),
                      ("block_hashes", [h(2)])])]],
        [0.0, [Pairs([("type", "BlockStored"), ("block_hashes", [h(1)]), ("group_idx", 1),
                      ("group_idx", None)])]],
        [0.0, [Pairs([("type", "BlockStored"), ("block_hashes", [h(3)]),
                      ("type", "BlockRemoved")])]],
        [0.0, [ev("BlockStored", block_hashes=[h(1)], group_idx=5, medium="GPU",
                  medium2="x")]],
        [0.0, [ev("BlockStored", block_hashes=[h(1)], future_field={"a": [1, 2.5, None]},
                  group_idx=1)]],
        [0.0, [ev("BlockStored", block_hashes=[h(4)], medium=None, group_idx=None,
                  kv_cache_spec_kind=None, lookahead_token_ids=None)]],
        [0.0, [ev("BlockStored", block_hashes=[h(4)], kv_cache_spec_kind="плотный")]],
        [0.0, [ev("BlockStored", block_hashes=[h(4)], lora_name="é")]],
        [0.0, [ev("BlockStored", block_hashes=[h(4)], medium="GPÜ")]],
        [0, [ev("BlockStored", block_hashes=[h(5)])]],
        [0.0, [], None, 5],
        [0.0, [ev("BlockRemoved", block_hashes=[h(5)])], 0],
        [0.0, [ev("BlockStored", block_hashes=[h(6)], group_idx=9, medium="CPU")]],
        [0.0, [ev("BlockStored", block_hashes=[-1 if int_hashes else b"x"], group_idx=-3,
                  medium="CPU", kv_cache_spec_kind="mamba")]],
        [0.0, [ev("BlockStored", block_hashes=[h(6)], token_ids="not ids",
                  parent_block_hash=[1.5])]],
        [0.0, [ev("BlockStored", block_hashes=[h(6)], lookahead_token_ids=[[1]])]],
        [0.0, [ev("BlockStored", block_hashes=[h(7)], lookahead_token_ids=[])]],
        [0.0, [ev("AllBlocksCleared", block_hashes=[h(1)], group_idx=99)]],
        [0.0, [ev("BlockStored", block_hashes=[h(7)], extra_keys=[Raw(b"\xd4\x01\x02")])]],
    ]
    rng = random.Random(3)
    for obj in odd:
        trio.step(ENGINES[0], pack(obj), 0)
        for _ in range(20):                     # the same batch in wider / mixed forms
            trio.step(ENGINES[0], pack(obj, rng, 0.3), 0)
    # vLLM-shaped batches re-encoded in wider forms and shuffled key order
    for _ in range(400):
        obj = msgspec.msgpack.decode(ENC.encode(random_batch(rng, TWO, trio.pool, 0)))
        for e in obj[1]:
            items = list(e.items())
            head, rest = (items[:1], items[1:]) if rng.random() < 0.8 else ([], items)
            rng.shuffle(rest)
            e.clear()
            e.update(head + rest)
        trio.step(ENGINES[0], pack(obj, rng, rng.choice([0.0, 0.05, 0.5])), 0)
    trio.check_oracle()
    trio.read_off()


def test_non_bytes_payload_refused_by_type():
    """apply_payload takes exactly bytes (its docs): anything else, bytearray and memoryview
    included, raises ArgumentTypeError (a HmacoreError and a TypeError) naming payload."""
    index = RoutingIndex(TWO)
    key = index.add_engine("e")
    good = ENC.encode(W.EventBatch(ts=0.0, events=[W.BlockStored(block_hashes=[1])]))
    for bad in (good.decode("latin-1"), bytearray(good), memoryview(good), None, 5,
                [good], type("B", (bytes,), {})(good)):
        with pytest.raises(ArgumentTypeError, match="payload") as e:
            index.apply_payload(key, bad)
        assert isinstance(e.value, TypeError) and isinstance(e.value, HmacoreError)
    assert index.resident_blocks(key) == 0
    assert index.apply_payload(key, good).stored == 1


#: a stored event whose medium is the str b"\xff" (invalid UTF-8)
BAD_UTF8 = bytes.fromhex("92cb0000000000000000" "9183a474797065ab426c6f636b53746f726564"
                         "ac626c6f636b5f6861736865739101" "a66d656469756da1ff")


#: a stored event with an unread field nested 1000 arrays deep (msgspec: RecursionError)
DEEP = bytes.fromhex("92cb0000000000000000" "9183a474797065ab426c6f636b53746f726564"
                     "ac626c6f636b5f6861736865739101a178") + b"\x91" * 1000 + b"\x01"


def test_decode_errors_beyond_msgspecs_own():
    """msgspec raises UnicodeDecodeError for invalid UTF-8 in a str field it builds and
    RecursionError past its depth limit, neither a msgspec error (both in
    kv_event_wire.DECODE_ERRORS, the subscriber's bad batches): apply_payload(s) declines
    both, and reads the same payloads once they decode, as the slow path does."""
    trio = Trio(TWO, True, pool=[1])
    for bad, fixed, error in ((BAD_UTF8, BAD_UTF8.replace(b"\xa1\xff", b"\xa1G"),
                               UnicodeDecodeError),
                              (DEEP, DEEP.replace(b"\x91" * 1000, b"\x91" * 10), RecursionError)):
        with pytest.raises(error):
            DEC.decode(bad)
        assert issubclass(error, W.DECODE_ERRORS)
        assert not issubclass(error, msgspec.MsgspecError)
        assert trio.fast.apply_payloads(ENGINES[0], [bad]) == (ApplyStats(), 0)
        assert trio.step(ENGINES[0], bad, 0) is None and trio.refused
        assert trio.step(ENGINES[0], fixed, 0, must_accept=True) is not None
    assert not trio.must_accept_declined
    trio.read_off()


def test_unknown_engine_counts_rows_as_apply_events():
    index = RoutingIndex(MULTI)
    index.add_engine("e")
    evs = [W.BlockStored(block_hashes=[1, 2, 3], group_idx=2), W.AllBlocksCleared(),
           W.BlockRemoved(block_hashes=[4], group_idx=None, medium="CPU"),
           W.BlockRemoved(block_hashes=[5, 6], group_idx=3)]
    payload = ENC.encode(W.EventBatch(ts=1.0, events=evs))
    want = index.apply_events(GHOST, DEC.decode(payload).events, W.INDEX_EVENT_TYPES,
                              spec_kinds=SPEC_KINDS)
    assert want.unknown_engine == 6 and want.other_medium == 1
    assert index.apply_payload(GHOST, payload, spec_kinds=SPEC_KINDS) == want
    assert index.resident_blocks(("e", 0)) == 0


# -- fuzz: mutated payloads --------------------------------------------------------------------
def mutate(rng: random.Random, payload: bytes, other: bytes) -> bytes:
    b = bytearray(payload)
    kind = rng.randrange(9)
    if kind == 0 and b:                                  # byte flips
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:                                # random byte values
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.choice([0x00, 0x7f, 0x80, 0x90, 0xa0, 0xc0, 0xc1,
                                                   0xc2, 0xc3, 0xc4, 0xcc, 0xcf, 0xd3, 0xd4,
                                                   0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff,
                                                   rng.randrange(256)])
    elif kind == 2:                                      # truncation
        b = b[:rng.randrange(len(b) + 1)]
    elif kind == 3:                                      # insertion
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randrange(1, 6))
    elif kind == 4 and b:                                # deletion
        i = rng.randrange(len(b))
        del b[i:i + rng.randrange(1, 6)]
    elif kind == 5:                                      # splice of two payloads
        b = b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):]
    elif kind == 6:                                      # random bytes
        b = bytearray(rng.randbytes(rng.randrange(0, 64)))
    elif kind == 7 and len(b) > 2:                       # duplicate a slice
        i = rng.randrange(len(b))
        j = min(len(b), i + rng.randrange(1, 24))
        b[j:j] = b[i:j]
    else:                                                # a count / length byte bumped
        i = rng.randrange(len(b)) if b else 0
        if b:
            b[i] = (b[i] + rng.choice([-1, 1])) & 0xff
    return bytes(b)


#: field names an event map may carry: the read ones, unread ones, near misses
FIELD_NAMES = ["type", "block_hashes", "medium", "group_idx", "kv_cache_spec_kind",
               "lookahead_token_ids", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "lora_name", "extra_keys", "kv_cache_spec_sliding_window",
               "block_hashe", "block_hashesX", "Medium", "group_id", "group_idx\0", "",
               "typ", "types", "locality"]
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStore", "BlockStoredX",
        "blockstored", "AllBlocksCleare", ""]


def interesting(rng: random.Random, pool: list):
    return rng.choice([
        None, True, False, 0, 1, -1, 2, 3, 127, 128, -32, -33, 255, 256, 2**16, 2**31, 2**32,
        2**63 - 1, 2**63, 2**64 - 1, -2**63, 0.0, 1.5, -0.0, "", "GPU", "CPU", "GPU\0",
        "full_attention", "mamba", "sliding_window", "unknown", b"", b"\0" * 8, b"\1" * 32,
        [], [1], [[1]], [[]], {}, {"a": 1}, rng.choice(pool), [rng.choice(pool)],
        [rng.choice(pool) for _ in range(3)], rng.choice(TAGS)])


def field_value(rng: random.Random, name: str, pool: list, num_groups: int):
    """A value for a known field: mostly one of its type (valid or just out of range)."""
    if rng.random() < 0.25:
        return interesting(rng, pool)
    if name == "block_hashes":
        return [rng.choice(pool) for _ in range(rng.randrange(4))]
    if name == "group_idx":
        return rng.choice([None, num_groups, -1] + list(range(num_groups)))
    if name == "medium":
        return rng.choice([None, "GPU", "GPU", "CPU", "", "GP", "GPUs"])
    if name == "kv_cache_spec_kind":
        return rng.choice([None, "unknown"] + list(SPEC_KINDS))
    if name == "lookahead_token_ids":
        return rng.choice([None, [[1]], []])
    return interesting(rng, pool)


def mutate_tree(rng: random.Random, payload: bytes, pool: list,
                num_groups: int) -> bytes | None:
    """A semantic mutation: the payload decoded (untyped), one to three of its values,
    keys, tags or elements changed, packed again (mostly shortest forms: what msgspec
    writes, so the fast path reads it rather than declining the encoding)."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except W.DECODE_ERRORS:
        return None
    if type(obj) is not list or len(obj) < 2 or type(obj[1]) is not list:
        return None
    events = [Pairs(e.items()) if type(e) is dict else e for e in obj[1]]
    obj[1] = events
    for _ in range(rng.randrange(1, 4)):
        k = rng.randrange(10)
        maps = [e for e in events if type(e) is Pairs]
        if k == 0 and obj:
            obj[0] = interesting(rng, pool)                            # ts
        elif k == 1:
            while len(obj) < 3:
                obj.append(None)
            obj[2] = rng.choice([None, 0, 1, -1, 2**63, 2**64 - 1, True, 0.0, "0"])  # rank
        elif k == 2:
            obj.append(interesting(rng, pool)) if rng.random() < 0.5 or not obj else obj.pop()
        elif k == 3 and events:
            events.insert(rng.randrange(len(events) + 1), rng.choice(events))
        elif k == 4 and events:
            del events[rng.randrange(len(events))]
        elif not maps:
            events.append(interesting(rng, pool))
        else:
            e = rng.choice(maps)
            i = rng.randrange(len(e)) if e else 0
            if k == 5 and e:                                           # a value
                e[i] = (e[i][0], field_value(rng, e[i][0], pool, num_groups))
            elif k == 6 and e:                                         # a key
                e[i] = (rng.choice(FIELD_NAMES), e[i][1])
            elif k == 7:                                               # a field added
                name = rng.choice(FIELD_NAMES)
                e.insert(rng.randrange(len(e) + 1),
                         (name, field_value(rng, name, pool, num_groups)))
            elif k == 8 and e:                                         # a field dropped
                del e[i]
            else:                                                      # the tag
                e.insert(0, ("type", rng.choice(TAGS)))
                if len(e) > 1 and e[1][0] == "type" and rng.random() < 0.8:
                    del e[1]
    try:
        return pack(obj, rng, rng.choice([0.0, 0.0, 0.0, 0.1]))
    except (TypeError, ValueError):
        return None


def run_fuzz(seed: int, n: int, layout: KVLayout = TWO, fast_cls=RoutingIndex):
    rng = random.Random(seed)
    stats = {}
    for int_hashes in (True, False):
        trio = Trio(layout, int_hashes, fast_cls=fast_cls)
        trio.set_pool(make_pool(rng, int_hashes, trio.ds, 10))
        seeds = [ENC.encode(random_batch(rng, layout, trio.pool, 0, lookahead=i < 5))
                 for i in range(40)]
        refused = [c for _, c in refusal_cases(int_hashes, trio.ds)[0]]
        done = 0
        while done < n:
            p = rng.choice(seeds if rng.random() < 0.8 else refused)
            if rng.random() < 0.5:
                m = mutate(rng, p, rng.choice(seeds + refused))
                if rng.random() < 0.3:
                    m = mutate(rng, m, rng.choice(seeds))
            else:
                m = mutate_tree(rng, p, trio.pool, layout.num_groups)
                if m is None:
                    continue
            trio.step(rng.choice([ENGINES[0], ENGINES[0], GHOST]), m, 0)
            done += 1
        trio.read_off()
        stats[int_hashes] = (trio.accepted, trio.declined, trio.refused)
        assert trio.accepted > n // 20          # the fuzz reaches the apply path
    return stats


#: mutated payloads per seed: 6000, fewer where HMACORE_EXAMPLES asks for a short run (the
#: ASan build of scripts/sanitize.sh short: 20 per example; libFuzzer's family
#: fuzz/fuzz_kv_payload.py is the long run)
FUZZ_PAYLOADS = min(6000, 20 * int(os.environ.get("HMACORE_EXAMPLES", "2000")))


@pytest.mark.parametrize("seed", [21, 22])
def test_fuzz_mutated_payloads(seed):
    """Thousands of mutated payloads (byte flips, truncation, insertions, deletions, splices,
    random bytes; and semantic: values, keys, tags, fields, events changed and packed again):
    never raises, never crashes; refused by the slow path -> None; applied -> equal to the
    slow path; declined -> unchanged."""
    run_fuzz(seed, FUZZ_PAYLOADS, TWO if seed % 2 else MULTI)


def add_stats(stats) -> ApplyStats:
    return ApplyStats(*(sum(col) for col in zip(ApplyStats(), *stats)))


@pytest.mark.parametrize("seed", [31, 32, 33])
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
def test_apply_payloads_equal_one_by_one(seed, int_hashes):
    """apply_payloads (a stream's queued batches in one call) stops exactly at the first
    payload apply_payload alone declines, applies those before it as one apply_payload
    each would (stats summed, the same index), and leaves the declined one unapplied."""
    rng = random.Random(seed)
    trio = Trio(MULTI, int_hashes)
    trio.set_pool(make_pool(rng, int_hashes, trio.ds, 12))
    key = ENGINES[1] if seed % 3 else GHOST
    dp = key[1]
    refused = [c for _, c in refusal_cases(int_hashes, trio.ds)[0]]
    payloads = []
    for _ in range(600):
        r = rng.random()
        if r < 0.8:
            payloads.append(ENC.encode(random_batch(rng, MULTI, trio.pool, dp,
                                                    lookahead=rng.random() < 0.05)))
        elif r < 0.9:
            payloads.append(rng.choice(refused))
        else:
            m = mutate_tree(rng, ENC.encode(random_batch(rng, MULTI, trio.pool, dp)),
                            trio.pool, MULTI.num_groups)
            payloads.append(m if m is not None else b"")
    single = RoutingIndex(MULTI, int_hashes=int_hashes)      # apply_payload one by one
    for k in ENGINES:
        single.add_engine(*k)
    assert trio.fast.apply_payloads(key, [], dp_rank=dp) == (ApplyStats(), 0)
    i = calls = 0
    while i < len(payloads):
        chunk = payloads[i:i + rng.choice([1, 2, 3, 5, 8, 16, 40])]
        before = trio.state(trio.fast)
        got, applied = trio.fast.apply_payloads(key, list(chunk), dp_rank=dp,
                                                spec_kinds=SPEC_KINDS)
        calls += 1
        assert 0 <= applied <= len(chunk)
        one = [single.apply_payload(key, p, dp_rank=dp, spec_kinds=SPEC_KINDS)
               for p in chunk[:applied + 1]]
        assert None not in one[:applied], "apply_payloads applied what apply_payload declines"
        want = []
        for p in chunk[:applied]:
            w, batch = slow_apply(trio.slow, key, p, dp)
            assert w is not REFUSED
            want.append(w)
            if key in trio.oracle.engines:
                trio.oracle.apply(key, *oracle_rows(batch, "GPU"))
        assert got == add_stats(want) == add_stats(one[:applied])
        if applied == 0:
            assert trio.state(trio.fast) == before
        if applied < len(chunk):            # the declined one: the slow path on all three
            assert one[applied] is None, "apply_payloads stopped at a payload it reads alone"
            declined = chunk[applied]
            assert trio.fast.apply_payload(key, declined, dp_rank=dp,
                                           spec_kinds=SPEC_KINDS) is None
            for ix in (trio.fast, trio.slow, single):
                _, batch = slow_apply(ix, key, declined, dp)
            if batch is not None and key in trio.oracle.engines:
                trio.oracle.apply(key, *oracle_rows(batch, "GPU"))
            applied += 1
        assert trio.state(trio.fast) == trio.state(trio.slow) == trio.state(single)
        i += applied
    assert calls < len(payloads)
    trio.read_off()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 210))
def test_fuzz_sweep(seed):
    run_fuzz(seed, 40000, [ONE, TWO, MULTI][seed % 3])


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
def test_big_batches_in_32_bit_forms(int_hashes):
    """What msgspec writes past 65535 elements / bytes (array32 hash lists, token ids and
    event lists, str32 text) and a 16-entry event map (map16) are read, not declined; rows
    past the kept scratch, and apply_payloads packing several big batches into one scratch
    (grown while packing), equal the slow path."""
    trio = Trio(TWO, int_hashes)
    ds = trio.ds
    h = (lambda i: i) if int_hashes else (lambda i: i.to_bytes(ds, "big"))
    big = [h(i) for i in range(1, 70_001)]
    trio.set_pool(big[:10] + big[-10:])
    E = ENC.encode
    payloads = [
        E(W.EventBatch(ts=0.0, events=[W.BlockStored(block_hashes=big, group_idx=1)])),
        E(W.EventBatch(ts=0.0, events=[W.BlockStored(block_hashes=big[:3],
                                                     token_ids=list(range(70_000)))])),
        E(W.EventBatch(ts=0.0, events=[W.BlockStored(block_hashes=big[:2],
                                                     lora_name="l" * 70_000)])),
        E(W.EventBatch(ts=0.0, events=[W.BlockRemoved(block_hashes=[x], group_idx=1)
                                       for x in big])),
        E(W.EventBatch(ts=0.0, events=[W.BlockStored(block_hashes=big[5:40_000]),
                                       W.AllBlocksCleared(),
                                       W.BlockStored(block_hashes=big[:20_000])])),
        msgspec.msgpack.encode([0.0, [dict([("type", "BlockStored"), ("block_hashes", big[:4])]
                                           + [(f"future_{i}", i) for i in range(15)])]]),
    ]
    n32 = (70_000).to_bytes(4, "big")
    assert all(bytes([tag]) + n32 in p for tag, p in zip(b"\xdd\xdd\xdb\xdd", payloads))
    for p in payloads:
        trio.step(ENGINES[0], p, 0, must_accept=True)
    assert not trio.must_accept_declined
    # the same, queued: one apply_payloads call packs them all, then one more twice over
    stats, applied = trio.fast.apply_payloads(ENGINES[1], payloads + payloads[:1], dp_rank=1)
    assert applied == len(payloads) + 1
    want = []
    for p in payloads + payloads[:1]:
        w, batch = slow_apply(trio.slow, ENGINES[1], p, 1)
        want.append(w)
        trio.oracle.apply(ENGINES[1], *oracle_rows(batch, "GPU"))
    assert stats == add_stats(want)
    assert trio.state(trio.fast) == trio.state(trio.slow)
    trio.check_oracle()
    trio.read_off()


# -- the harness against planted bugs ----------------------------------------------------------
class Mutant(RoutingIndex):
    """apply_payload as msgspec + apply_events with one planted bug (``bug``): the checks
    above must catch every one (they would catch the same bug in the compiled reader)."""

    bug = ""

    def apply_payload(self, key, payload, *, dp_rank=0, medium="GPU", spec_kinds=None):
        if type(payload) is not bytes:
            raise ArgumentTypeError("payload must be bytes")
        bug = self.bug
        try:
            b = DEC.decode(payload)
        except W.DECODE_ERRORS:
            return None
        rank = dp_rank if b.data_parallel_rank is None else b.data_parallel_rank
        if rank != dp_rank and bug != "ignores the DP rank":
            return None
        events = list(b.events)
        rep = msgspec.structs.replace
        if bug == "drops the last event" and events:
            events.pop()
        if bug == "drops clears":
            events = [e for e in events if not isinstance(e, W.IndexAllBlocksCleared)]
        if bug == "reads group None as 1":
            events = [rep(e, group_idx=1) if getattr(e, "group_idx", 0) is None else e
                      for e in events]
        if bug == "applies other media":
            events = [e if isinstance(e, W.IndexAllBlocksCleared) else rep(e, medium=None)
                      for e in events]
        if bug == "little-endian int hashes" and self.int_hashes:
            events = [e if isinstance(e, W.IndexAllBlocksCleared) else rep(
                e, block_hashes=[int.from_bytes(h.to_bytes(8, "big"), "little")
                                 if type(h) is int and 0 <= h < 2**64 else h
                                 for h in e.block_hashes]) for e in events]
        if bug == "wraps negative hashes":
            events = [e if isinstance(e, W.IndexAllBlocksCleared) else rep(
                e, block_hashes=[h % 2**64 if type(h) is int else h for h in e.block_hashes])
                for e in events]
        if bug == "drops the first hash of a stored event":
            events = [rep(e, block_hashes=e.block_hashes[1:])
                      if isinstance(e, W.IndexBlockStored) else e for e in events]
        if bug == "skips the spec-kind check":
            spec_kinds = None
        try:
            got = self.apply_events(key, events, W.INDEX_EVENT_TYPES, medium=medium,
                                    spec_kinds=spec_kinds)
        except HmacoreError:
            if bug == "half-applies a refused batch":
                for i in range(len(events), 0, -1):
                    try:
                        self.apply_events(key, events[:i - 1], W.INDEX_EVENT_TYPES,
                                          medium=medium, spec_kinds=spec_kinds)
                        break
                    except HmacoreError:
                        continue
            return None
        if bug == "swaps removed and ignored":
            got = got._replace(removed=got.ignored, ignored=got.removed)
        if bug == "counts no unknown-engine rows":
            got = got._replace(unknown_engine=0)
        if bug == "applies, then declines batches with a parent hash" and \
                b"parent_block_hash" in payload:
            return None
        return got


MUTANTS = ["drops the last event", "drops clears", "reads group None as 1",
           "applies other media", "little-endian int hashes", "wraps negative hashes",
           "drops the first hash of a stored event", "skips the spec-kind check",
           "half-applies a refused batch", "swaps removed and ignored",
           "counts no unknown-engine rows", "ignores the DP rank",
           "applies, then declines batches with a parent hash"]


def test_mutant_harness_is_sound():
    """The harness passes with a bug-free Python stand-in of apply_payload."""
    run_valid(1, MULTI, True, 100)
    cls = type("Clean", (Mutant,), {"bug": ""})
    for int_hashes in (True, False):
        trio = Trio(MULTI, int_hashes, fast_cls=cls)
        rng = random.Random(2)
        trio.set_pool(make_pool(rng, int_hashes, trio.ds))
        for _ in range(100):
            trio.step(ENGINES[0], ENC.encode(random_batch(rng, MULTI, trio.pool, 0)), 0,
                      must_accept=True)
        trio.read_off()
        run_refusals(int_hashes, ENGINES[0], cls)
    run_fuzz(3, 300, TWO, cls)


@pytest.mark.parametrize("bug", MUTANTS)
def test_harness_catches_planted_bug(bug):
    """Each planted bug fails the valid-batch, refusal or fuzz checks."""
    cls = type("M", (Mutant,), {"bug": bug})
    caught = []
    for int_hashes in (True, False):
        for check in (lambda: run_valid_with(cls, int_hashes),
                      lambda: run_refusals(int_hashes, ENGINES[0], cls),
                      lambda: run_refusals(int_hashes, GHOST, cls)):
            try:
                check()
            except AssertionError:
                caught.append(check)
    if not caught:
        try:
            run_fuzz(4, 1500, TWO, cls)
        except AssertionError:
            caught.append("fuzz")
    assert caught, f"no check caught: {bug}"


def run_valid_with(cls, int_hashes):
    rng = random.Random(7)
    trio = Trio(MULTI, int_hashes, fast_cls=cls)
    trio.set_pool(make_pool(rng, int_hashes, trio.ds))
    for _ in range(150):
        key = rng.choice(ENGINES + [GHOST])
        trio.step(key, ENC.encode(random_batch(rng, MULTI, trio.pool, key[1])), key[1],
                  must_accept=True)
    trio.check_oracle()
    trio.read_off()


def test_dp_rank_argument_and_wide_ranks():
    """Ranks past a fixint (uint8 / uint16 / uint32 forms) match the stream's; another rank
    or a bad dp_rank argument is refused (the argument by ArgumentValueError)."""
    index = RoutingIndex(TWO)
    for dp in (0, 127, 128, 300, 70_000, 2**32 + 1):
        key = index.add_engine("e", dp)
        for rank in (None, dp):
            p = ENC.encode(W.EventBatch(ts=1.0, events=[W.BlockStored(block_hashes=[dp])],
                                        data_parallel_rank=rank))
            assert index.apply_payload(key, p, dp_rank=dp) == ApplyStats(stored=1)
        for other in (dp + 1, dp ^ 1, dp + 2**32):
            p = ENC.encode(W.EventBatch(ts=1.0, events=[W.BlockStored(block_hashes=[dp])],
                                        data_parallel_rank=other))
            assert index.apply_payload(key, p, dp_rank=dp) is None
        assert index.resident_blocks(key) == 1
    p = ENC.encode(W.EventBatch(ts=1.0, events=[]))
    for bad in (-1, True, 1.0, None, "0", 2**63, 2**70):
        with pytest.raises(ArgumentValueError, match="dp_rank"):
            index.apply_payload(("e", 0), p, dp_rank=bad)
    for bad in (b"GPU", 5):
        with pytest.raises(ArgumentTypeError, match="medium"):
            index.apply_payload(("e", 0), p, medium=bad)


def test_medium_that_is_not_utf8_encodable_matches_no_event():
    """A ``medium`` str with a lone surrogate cannot be any payload's text: every event with a
    str medium is another medium's (counted), a nil one applied, as apply_events does."""
    index = RoutingIndex(TWO)
    key = index.add_engine("e")
    evs = [W.BlockStored(block_hashes=[1], medium="GPU"), W.BlockStored(block_hashes=[2]),
           W.BlockRemoved(block_hashes=[3], medium="CPU")]
    p = ENC.encode(W.EventBatch(ts=1.0, events=evs))
    got = index.apply_payload(key, p, medium="\ud800")
    want = RoutingIndex(TWO)
    wkey = want.add_engine("e")
    assert got == want.apply_events(wkey, W.index_decoder().decode(p).events,
                                    W.INDEX_EVENT_TYPES, medium="\ud800")
    assert got == ApplyStats(stored=1, other_medium=2)
