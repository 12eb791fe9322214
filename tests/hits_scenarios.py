"""Shared generators for hit tests: random layouts, request hashes and cached sets."""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from hmacore.hits import ExistenceSet
from hmacore.spec import GroupKind, GroupSpec, KVLayout, MambaMode


def make_hashes(n: int, ds: int, seed: int) -> np.ndarray:
    """n distinct random digests (chained hashes never repeat inside one request)."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(n, ds), dtype=np.uint8)
    if n:
        arr[:, :4] = np.arange(n, dtype=">u4").view(np.uint8).reshape(n, 4)   # distinct
    return np.ascontiguousarray(arr)


@st.composite
def group_specs(draw, h: int, extra: bool = False):
    """One random group over hash block h (block sizes are multiples of h); ``extra``: sliding
    windows may retain ``extra_retained_tokens`` (vLLM's MTP re-prefill tail)."""
    kind = draw(st.sampled_from([GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA]))
    bs = h * draw(st.sampled_from([1, 1, 2, 3, 4]))
    eagle = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else False
    if kind == GroupKind.SLIDING_WINDOW:
        window = draw(st.integers(1, 4 * bs + 1))
        retained = draw(st.sampled_from([0, 0, 1, 2, 3, bs, 2 * bs + 1])) if extra else 0
        return GroupSpec(kind, bs, sliding_window=window, eagle=eagle,
                         extra_retained_tokens=retained)
    if kind == GroupKind.MAMBA:
        return GroupSpec(kind, bs, mamba_mode=MambaMode.ALIGN, eagle=eagle)
    return GroupSpec(kind, bs, eagle=eagle)


@st.composite
def layouts(draw, extra: bool = False):
    """Random layouts; ``extra``: sliding windows may retain extra tokens, and some twins
    trade window for retained tokens (equal coverage, unequal specs)."""
    h = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 5))
    groups = []
    for _ in range(n):
        if groups and draw(st.integers(0, 3)) == 0:
            twin = draw(st.sampled_from(groups))                  # equal spec -> merged
            if extra and twin.kind == GroupKind.SLIDING_WINDOW and draw(st.booleans()):
                # same coverage (window + retained), split differently
                total = twin.sliding_window + twin.extra_retained_tokens
                w = draw(st.integers(1, total))
                twin = dataclasses.replace(twin, sliding_window=w, extra_retained_tokens=total - w)
            groups.append(dataclasses.replace(twin, eagle=draw(st.booleans()))
                          if draw(st.booleans()) else twin)
        else:
            groups.append(draw(group_specs(h, extra)))
    if draw(st.integers(0, 4)) == 0:     # some layouts with a fine-grained Mamba group
        groups.append(GroupSpec(GroupKind.MAMBA, h * draw(st.sampled_from([2, 4])),
                                mamba_mode=MambaMode.ALIGN))
    named = [GroupSpec(s.kind, s.block_size, (f"l{i}",), sliding_window=s.sliding_window,
                       mamba_mode=s.mamba_mode, eagle=s.eagle,
                       extra_retained_tokens=s.extra_retained_tokens)
             for i, s in enumerate(groups)]
    return KVLayout(groups=tuple(named))


def chunked_layouts(draw_bs: int, chunk_mult: int, with_full: bool) -> KVLayout:
    bs = draw_bs
    groups = [GroupSpec(GroupKind.CHUNKED_LOCAL, bs, ("c0",), chunk_size=bs * chunk_mult)]
    if with_full:
        groups.append(GroupSpec(GroupKind.FULL, bs, ("f0",)))
    return KVLayout(groups=tuple(groups))


def draw_max_length(data, n: int, h: int) -> int:
    """A hit cap in tokens, <= num_tokens - 1 for some num_tokens whose hashes are the n rows."""
    if data.draw(st.booleans()):
        return n * h + data.draw(st.integers(0, h - 1))
    return data.draw(st.integers(0, n * h + h - 1))


def populate(data, finder, oracle, hashes: np.ndarray, ds: int):
    """Draw a cached set; return (ExistenceSet, python set) holding the same blocks."""
    es = ExistenceSet(ds)
    py = set()
    h = finder.hash_block_size
    n = hashes.shape[0]
    raw = [bytes(r) for r in hashes]
    shared = data.draw(st.one_of(st.integers(0, n * h),   # a prefix every group tends to hold
                                 st.sampled_from([n * h, 3 * n * h // 4, n * h // 2])))
    coherent = data.draw(st.booleans())                # every group holds (about) that prefix
    for g in finder.group_ids:
        bs = finder.block_sizes[g]
        k = bs // h
        nb = n // k
        modes = ["shared", "shared", "shared-holes", "prefix", "random", "all", "none", "tail"]
        mode = data.draw(st.sampled_from(modes[:3] if coherent else modes))
        if mode.startswith("shared"):
            present = list(range(min(nb, shared // bs)))
            if mode == "shared-holes" and present:
                holes = set(data.draw(st.lists(st.sampled_from(present), max_size=3)))
                present = [i for i in present if i not in holes]
        elif mode == "prefix":
            p = data.draw(st.integers(0, nb))
            present = list(range(p))
        elif mode == "all":
            present = list(range(nb))
        elif mode == "none":
            present = []
        elif mode == "tail":
            p = data.draw(st.integers(0, nb))
            present = list(range(p, nb))
        else:
            bits = data.draw(st.lists(st.booleans(), min_size=nb, max_size=nb))
            present = [i for i, b in enumerate(bits) if b]
        for i in present:
            es.add(g, raw[(i + 1) * k - 1])
            py.add(oracle.coarse_key(raw, g, i))
        # interior (fine) keys: partial tails written by fine-grained savers
        extra = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=6)) if n else []
        for j in extra:
            if finder.coarse == "concat" and k > 1 and (j + 1) % k == 0:
                continue
            es.add(g, raw[j])
            py.add((g, raw[j]))
    # noise: keys of other requests
    for j in range(data.draw(st.integers(0, 3))):
        junk = bytes([j + 1]) * ds
        for g in finder.group_ids:
            es.add(g, junk)
            py.add((g, junk))
    return es, py
