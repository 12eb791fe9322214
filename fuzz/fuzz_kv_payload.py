#!/usr/bin/env python3
"""Atheris harness: RoutingIndex.apply_payload, the compiled reader of vLLM's KV event batch
bytes (hmacore/_fast/_route_payload.pxi), against the decoded path it stands in for.

The input's first byte picks the index (64-bit int hashes or sha256 digests), the medium
applied (``"GPU"``, None, ``"CPU"``), the spec-kind check (vLLM's kinds or none) and the
stream's DP rank (0 or 1); the rest is the payload, read raw (libFuzzer mutates the
committed corpus of vLLM-shaped batches, fuzz/corpus/kv_payload, written by
``python fuzz/fuzz_kv_payload.py --seed-corpus``). Two indexes holding the same few keys
take it: one by ``apply_payload``, the other by msgspec's ``index_decoder`` + the DP rank
rule + ``apply_events`` (a decode error or an HmacoreError: refused). The contract:

* ``apply_payload`` never raises for bytes, never crashes (ASan / UBSan in this build);
* declined (None): the decoded path may do anything, and the index is unchanged;
* applied: the decoded path applies too, with the same ApplyStats, and every (group, hash)
  the batch names or the index held has the same count on both (read off by removing it).
"""
import sys

import atheris

with atheris.instrument_imports(include=["hmacore"]):
    import msgspec
    from hmacore.errors import HmacoreError
    from hmacore.presets import get_preset
    from hmacore.route_index import RoutingIndex
    from hmacore.transport import kv_event_wire as W
    from hmacore.transport.kv_events import SPEC_KINDS

from fuzzlib import call, expect, instrument_harness  # noqa: E402

LAYOUT = get_preset("gpt-oss-120b")          # full attention + a sliding window
KEY = ("e", 0)
HELD = [(0, 11), (1, 11), (0, 2**64 - 1), (1, 2**63)]       # held before each input
MEDIUMS = (W.MEDIUM_GPU, None, "CPU")
DECODER = W.index_decoder()


def fresh(ints: bool) -> RoutingIndex:
    index = RoutingIndex(LAYOUT, int_hashes=ints)
    index.add_engine(*KEY)
    return index


INDEXES = {ints: (fresh(ints), fresh(ints)) for ints in (True, False)}


def key_of(index: RoutingIndex, h: int):
    return h if index.int_hashes else h.to_bytes(8, "big") * (index.digest_size // 8)


def prepare(index: RoutingIndex) -> None:
    index.reset_engine(KEY)
    for g, h in HELD:
        index.store(KEY, g, [key_of(index, h)])


def decoded(index: RoutingIndex, payload: bytes, rank: int, medium, kinds):
    """The decoded path's result (None: refused)."""
    try:
        batch = DECODER.decode(payload)
        if batch.data_parallel_rank not in (None, rank):
            return None
        return index.apply_events(KEY, batch.events, W.INDEX_EVENT_TYPES, medium=medium,
                                  spec_kinds=kinds)
    except (*W.DECODE_ERRORS, HmacoreError):
        return None


def probe_keys(index: RoutingIndex, payload: bytes) -> list:
    """(group, hash) of every row the payload names (as decoded) and the held keys."""
    keys = [(g, key_of(index, h)) for g, h in HELD]
    try:
        batch = DECODER.decode(payload)
    except W.DECODE_ERRORS:
        return keys
    for ev in batch.events:
        if isinstance(ev, W.IndexAllBlocksCleared):
            continue
        g = ev.group_idx or 0
        if not 0 <= g < LAYOUT.num_groups:
            continue
        keys += [(g, h) for h in ev.block_hashes[:32]]
    return keys[:64]


def counts(index: RoutingIndex, keys: list) -> list:
    """Each key's count (up to 3), read off by removing it three times (changes the index)."""
    out = []
    for g, h in keys:
        ok, got = call(index.remove, KEY, g, [h] * 3)
        out.append(got.removed if ok else None)
    return out


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    cfg, payload = data[0], bytes(data[1:])
    ints = not cfg & 1
    medium = MEDIUMS[(cfg >> 1) % 3]
    kinds = SPEC_KINDS if cfg & 8 else None
    rank = (cfg >> 4) & 1
    fast, slow = INDEXES[ints]
    prepare(fast)
    prepare(slow)
    ok, got = call(fast.apply_payload, KEY, payload, dp_rank=rank, medium=medium,
                   spec_kinds=kinds)
    expect(ok, lambda: f"apply_payload raised on bytes: {got!r}")
    want = decoded(slow, payload, rank, medium, kinds)
    if got is None:
        prepare(slow)           # the decoded path's effect is not the comparison here
    else:
        expect(want is not None, lambda: f"applied {got} what the decoded path refuses")
        expect(got == want, lambda: f"apply_payload {got} != decoded path {want}")
    keys = probe_keys(fast, payload)
    a, b = counts(fast, keys), counts(slow, keys)
    expect(a == b, lambda: f"counts differ after the batch: {a} vs {b} for {keys}")


def seed_corpus(directory: str) -> None:
    """vLLM-shaped batches (every field vLLM sets, int and digest hashes, each config byte
    class) as the committed starting corpus."""
    import os
    import random
    rng = random.Random(0)
    os.makedirs(directory, exist_ok=True)
    enc = msgspec.msgpack.Encoder()
    for i in range(48):
        ints = i % 2 == 0
        evs: list = []
        for _ in range(rng.randint(0, 5)):
            g = rng.choice([0, 1, None, 1])
            hs = [rng.choice([11, 2**63, 2**64 - 1, rng.randrange(2**64)])
                  for _ in range(rng.randint(0, 3))]
            hs = hs if ints else [h.to_bytes(8, "big") * 4 for h in hs]
            medium = rng.choice(["GPU", "GPU", None, "CPU"])
            if rng.random() < 0.55:
                evs.append(W.BlockStored(
                    block_hashes=hs, parent_block_hash=hs[0] if hs else None,
                    token_ids=[rng.randrange(1, 200000) for _ in range(16 * len(hs))],
                    block_size=16, lora_id=rng.choice([None, 3]), medium=medium,
                    group_idx=g, kv_cache_spec_kind=rng.choice(
                        ["full_attention", "sliding_window", "unknown"]),
                    kv_cache_spec_sliding_window=rng.choice([None, 128])))
            elif rng.random() < 0.85:
                evs.append(W.BlockRemoved(block_hashes=hs, medium=medium, group_idx=g))
            else:
                evs.append(W.AllBlocksCleared())
        body = enc.encode(W.EventBatch(ts=rng.random() * 1e9, events=evs,
                                       data_parallel_rank=rng.choice([None, 0, 1])))
        cfg = (0 if ints else 1) | (rng.randrange(3) << 1) | (8 if i % 3 else 0)
        with open(os.path.join(directory, f"seed-{i:02d}"), "wb") as f:
            f.write(bytes([cfg]) + body)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seed-corpus"]:
        seed_corpus(sys.argv[2] if len(sys.argv) > 2 else "fuzz/corpus/kv_payload")
        sys.exit(0)
    instrument_harness(globals())
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
