"""RoutingIndex.apply_payload on KV event batches encoded by the installed vLLM's OWN classes
(``vllm.distributed.kv_events``: KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)
with every field set, those the index does not read included (token ids, parent hash, block
size, LoRA, extra_keys, locality, ownership, session id, sliding window; 0.33:
lookahead_token_ids), and on the bytes vLLM's ``ZmqEventPublisher`` itself buffered and
replays: accepted (never declined, except stores with lookahead token ids, which it may
decline) and equal to the slow path (msgspec's index decoder + apply_events) and the oracle.

The checks (Trio.step: stats, resident counts, queries every batch, every pool key's count
read off at the end) are tests/test_kv_payload.py's.
"""
from __future__ import annotations

import random
import time

import msgspec
import pytest
import vllm
import zmq
from vllm.distributed import kv_events as V

from hmacore.transport import kv_event_wire as W
from hmacore.transport.kv_events import SPEC_KINDS
from ports import free_port
from test_kv_payload import (BS, ENGINES, GHOST, LAYOUTS, MULTI, TWO, Trio, make_pool,
                             spec_kind)

VERSION = ".".join(vllm.__version__.split(".")[:2])
#: vLLM 0.33 adds BlockStored.lookahead_token_ids
HAS_LOOKAHEAD = "lookahead_token_ids" in V.BlockStored.__struct_fields__
ENC = msgspec.msgpack.Encoder()          # what ZmqEventPublisher encodes with


def test_installed_version():
    assert VERSION in W.WIRE_VERSIONS
    assert HAS_LOOKAHEAD == (VERSION != "0.32")


def extra_keys(rng: random.Random, n: int, ascii_only: bool):
    """vLLM's per-block extra keys as published (to_event_extra_keys): LoRA name, (mm
    identifier, offset) pairs, cache salt, prompt-embeds digests; None for plain blocks."""
    salt = "salt-7" if ascii_only else rng.choice(["salt-7", "sél", "用户"])
    keys = [None, ("adapter-a",), (("mm-4f2a", 0), ("mm-4f2a", 16)), (salt,),
            ("adapter-a", ("mm-9", 32), salt, rng.randbytes(32))]
    out = [rng.choice(keys) for _ in range(n)]
    return out if out and rng.random() < 0.7 else None


def v_event(rng: random.Random, layout, pool, *, lookahead=False, ascii_only=True):
    r = rng.random()
    if r < 0.07:
        return V.AllBlocksCleared()
    g = rng.randrange(layout.num_groups)
    group_idx = None if g == 0 and rng.random() < 0.5 else g
    hashes = [rng.choice(pool) for _ in range(rng.choice([0, 1, 1, 2, 3, 4, 8]))]
    medium = rng.choice([V.MEDIUM_GPU] * 6 + [None, V.MEDIUM_CPU, V.MEDIUM_STORAGE])
    locality = rng.choice([None, "LOCAL", "REMOTE"])
    ownership = rng.choice([None, "tier-1"])
    if r < 0.6:
        kw = {}
        if lookahead:
            kw["lookahead_token_ids"] = [[rng.randrange(1000)] for _ in hashes]
        return V.BlockStored(
            block_hashes=hashes, parent_block_hash=rng.choice(pool + [None]),
            token_ids=[rng.randrange(200_000) for _ in range(len(hashes) * BS)],
            block_size=BS, lora_id=rng.choice([None, 3]), medium=medium,
            lora_name=rng.choice([None, "adapter-a"] if ascii_only else [None, "adaptér"]),
            extra_keys=extra_keys(rng, len(hashes), ascii_only), group_idx=group_idx,
            kv_cache_spec_kind=spec_kind(rng, layout, g),
            kv_cache_spec_sliding_window=rng.choice([None, 48, 64]), locality=locality,
            ownership=ownership,
            session_id=rng.choice([None, "sess-1"] if ascii_only else [None, "sessão"]), **kw)
    return V.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group_idx,
                          locality=locality, ownership=ownership)


def v_batch(rng: random.Random, layout, pool, dp_rank: int, **kw) -> V.KVEventBatch:
    events = [v_event(rng, layout, pool, **kw)
              for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 16, 40]))]
    return V.KVEventBatch(ts=time.time(), events=events,
                          data_parallel_rank=rng.choice([None, dp_rank]))


def lookahead_in(batch: V.KVEventBatch) -> bool:
    return any(getattr(e, "lookahead_token_ids", None) is not None for e in batch.events)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", ["one", "two", "multi"])
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int", "digest"])
def test_vllm_encoded_batches_accepted_and_equal(seed, layout, int_hashes):
    rng = random.Random(seed)
    lay = LAYOUTS[layout]
    trio = Trio(lay, int_hashes)
    trio.set_pool(make_pool(rng, int_hashes, trio.ds))
    for _ in range(250):
        key = rng.choice(ENGINES + ENGINES + [GHOST])
        batch = v_batch(rng, lay, trio.pool, key[1],
                        lookahead=HAS_LOOKAHEAD and rng.random() < 0.1)
        payload = ENC.encode(batch)
        W.decoder().decode(payload)        # the pinned full wire schema reads vLLM's bytes
        trio.step(key, payload, key[1], must_accept=not lookahead_in(batch))
    assert trio.refused == 0
    assert not trio.must_accept_declined, \
        f"{len(trio.must_accept_declined)} of {trio.accepted + trio.declined} vLLM batches " \
        f"declined, e.g. {trio.must_accept_declined[0].hex()}"
    trio.check_oracle()
    trio.read_off()


def test_vllm_non_ascii_text_in_unread_fields_equal():
    """A user's cache_salt / LoRA name / session id with non-ASCII text rides in fields the
    index does not read: apply_payload steps over them as msgspec skips them (text
    unchecked), so such batches are applied from the bytes too, equal to the slow path."""
    rng = random.Random(9)
    for int_hashes in (True, False):
        trio = Trio(MULTI, int_hashes)
        trio.set_pool(make_pool(rng, int_hashes, trio.ds))
        for _ in range(150):
            batch = v_batch(rng, MULTI, trio.pool, 0, ascii_only=False)
            trio.step(ENGINES[0], ENC.encode(batch), 0, must_accept=not lookahead_in(batch))
        assert trio.refused == 0 and trio.accepted + trio.declined == 150
        assert not trio.must_accept_declined, trio.must_accept_declined[0].hex()
        trio.check_oracle()
        trio.read_off()


@pytest.mark.skipif(not HAS_LOOKAHEAD, reason="vLLM 0.32 has no lookahead_token_ids")
def test_vllm_lookahead_stores_equal_if_applied():
    rng = random.Random(4)
    trio = Trio(TWO, True)
    trio.set_pool(make_pool(rng, True, 8))
    for _ in range(100):
        trio.step(ENGINES[0], ENC.encode(v_batch(rng, TWO, trio.pool, 0, lookahead=True)), 0)
    assert trio.refused == 0
    trio.read_off()


def test_vllm_publisher_bytes():
    """The payloads vLLM's ZmqEventPublisher itself encoded and buffered (read back over its
    replay socket: no PUB/SUB subscription race), every one accepted and equal."""
    rng = random.Random(17)
    trio = Trio(MULTI, True, spec_kinds=SPEC_KINDS)
    trio.set_pool(make_pool(rng, True, 8))
    replay = free_port()
    pub = V.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{free_port()}",
                              replay_endpoint=f"tcp://127.0.0.1:{replay}")
    sent = [v_batch(rng, MULTI, trio.pool, 0) for _ in range(60)]
    payloads: list[bytes] = []
    try:
        for b in sent:
            pub.publish(b)
        deadline = time.monotonic() + 60
        ctx = zmq.Context.instance()
        while len(payloads) < len(sent):
            assert time.monotonic() < deadline, f"replayed {len(payloads)} of {len(sent)}"
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{replay}")
            try:
                s.send_multipart((b"", (0).to_bytes(8, "big")))
                got = []
                while s.poll(5000):
                    f = s.recv_multipart()
                    if f[2] == W.REPLAY_END_SEQ:
                        break
                    got.append(f[3])
            finally:
                s.close()
            payloads = got
            if len(payloads) < len(sent):
                time.sleep(0.1)
    finally:
        pub.shutdown()
    assert payloads == [ENC.encode(b) for b in sent]
    for p in payloads:
        trio.step(ENGINES[0], p, 0, must_accept=True)
    assert trio.accepted == len(sent) and not trio.must_accept_declined
    trio.check_oracle()
    trio.read_off()
