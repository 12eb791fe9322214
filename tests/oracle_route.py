"""Plain-Python oracle of the routing index: per engine a dict (group, hash bytes) -> count,
and vLLM's hit rule from oracle_hits.OracleFinder over the keys whose count is positive.
Written for obviousness, not speed (bench/bench_route.py times it as the baseline)."""
from __future__ import annotations

from oracle_hits import OracleFinder

STORE, REMOVE, CLEAR = 1, -1, 0


def fold(h: bytes, int_hashes: bool) -> bytes:
    """What an event names a vLLM digest by: its low 64 bits (big-endian) or itself."""
    return h[-8:] if int_hashes else h


class OracleRoute:
    def __init__(self, layout, int_hashes: bool = True, **rule):
        self.finder = OracleFinder(layout, **rule)
        self.int_hashes = int_hashes
        self.engines: dict = {}

    def add_engine(self, key):
        self.engines.setdefault(key, {})

    def apply(self, key, ops, groups, hashes):
        """hashes: per row the event's hash as bytes (8 bytes for int hashes)."""
        counts = self.engines.get(key)
        if counts is None:
            return
        for op, g, h in zip(ops, groups, hashes):
            if op == CLEAR:
                counts.clear()
            elif op == STORE:
                counts[(g, h)] = counts.get((g, h), 0) + 1
            elif counts.get((g, h), 0) > 0:
                counts[(g, h)] -= 1
                if counts[(g, h)] == 0:
                    del counts[(g, h)]

    def apply_events(self, key, events):
        """A decoded KV event batch's events (kv_event_wire structs), as a Python subscriber
        would apply them: GPU events only, hashes as 8-byte keys (ints converted) or digests."""
        counts = self.engines.get(key)
        if counts is None:
            return
        for ev in events:
            name = type(ev).__name__
            if name == "AllBlocksCleared":
                counts.clear()
                continue
            if ev.medium not in (None, "GPU"):
                continue
            g = ev.group_idx or 0
            for h in ev.block_hashes:
                h = h.to_bytes(8, "big") if type(h) is int else h
                if name == "BlockStored":
                    counts[(g, h)] = counts.get((g, h), 0) + 1
                else:
                    c = counts.get((g, h), 0)
                    if c > 1:
                        counts[(g, h)] = c - 1
                    elif c == 1:
                        del counts[(g, h)]

    def hits(self, digests: list[bytes], num_tokens: int) -> dict:
        names = [fold(h, self.int_hashes) for h in digests]
        max_length = max(num_tokens - 1, 0)
        out = {}
        for key, counts in self.engines.items():
            resident = set(counts)
            out[key] = self.finder.longest_hit(names, resident, max_length)[0] if names else 0
        return out
