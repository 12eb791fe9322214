"""Plain-Python oracle of vLLM's longest cache hit (vllm-hma.md §3.5, §3.6, §11.5).

A direct transcription over a Python ``set`` of ``(group_id, hash_bytes)``; block lists are
Python lists of ``None`` (null block) / ``True`` (present). Written for obviousness, not speed.
"""
from __future__ import annotations

import math

from hmacore.spec import GroupKind, KVLayout

NULL = None
PRESENT = True


def cdiv(a, b):
    return -(-a // b)


class CoarseView:
    """Hashes of ``bs``-token blocks from ``h``-token hashes: the last one ("last") or the
    concatenation ("concat") of the ``bs/h`` hashes inside the block."""

    def __init__(self, hashes, h, bs, coarse):
        self.hashes, self.k, self.coarse = hashes, bs // h, coarse

    def __len__(self):
        return len(self.hashes) // self.k

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self.coarse == "last" or self.k == 1:
            return self.hashes[(i + 1) * self.k - 1]
        return b"".join(self.hashes[i * self.k:(i + 1) * self.k])


def get_cached(cached, block_hash, group_ids):
    if cached is None:       # mask mode
        return True
    return all((g, bytes(block_hash)) in cached for g in group_ids)


def full_attention(hashes, h, max_length, gids, cached, bs, drop, align, coarse):
    fine = align < bs and bs % align == 0
    coarse_hashes = CoarseView(hashes, h, bs, coarse)
    blocks = []
    for i in range(min(max_length // bs, len(coarse_hashes))):
        if not get_cached(cached, coarse_hashes[i], gids):
            break
        blocks.append(PRESENT)
    hit = len(blocks) * bs
    if fine:
        sf = bs // align
        first = len(blocks) * sf
        top = min(first + sf - 1, max_length // align, len(hashes))
        for j in range(top - 1, first - 1, -1):
            if get_cached(cached, hashes[j], gids):
                blocks.append(PRESENT)
                hit = (j + 1) * align
                break
    if drop and hit > 0:
        hit -= min(align, bs)
    hit -= hit % align
    del blocks[cdiv(hit, bs):]
    return blocks, hit


def sliding_window(hashes, h, max_length, gids, cached, bs, window, drop, align, coarse):
    coarse_hashes = CoarseView(hashes, h, bs, coarse)
    need = cdiv(window - 1, bs) + (1 if drop else 0)
    n = min(max_length // bs, len(coarse_hashes))   # no hash past the rows: a miss
    blocks = [NULL] * n
    run = 0
    found = False
    for i in range(n - 1, -1, -1):
        if get_cached(cached, coarse_hashes[i], gids):
            if run == 0 and bs != align:
                end_blocks = i if drop else i + 1
                if end_blocks * bs % align:
                    continue
            blocks[i] = PRESENT
            run += 1
            if run >= need:
                del blocks[i + run:]
                found = True
                break
        else:
            run = 0
    if not found:
        del blocks[run:]
        while bs != align and len(blocks) * bs % align:
            blocks.pop()
    if drop and blocks:
        blocks.pop()
        while bs != align and len(blocks) * bs % align:
            blocks.pop()
    return blocks, len(blocks) * bs


def chunked_local(hashes, h, max_length, gids, cached, bs, chunk, align, coarse):
    assert bs == align
    coarse_hashes = CoarseView(hashes, h, bs, coarse)
    start = max_length // chunk * chunk if max_length > 0 else 0
    blocks = [NULL] * (start // bs)
    for i in range(start // bs, max_length // bs):
        if not get_cached(cached, coarse_hashes[i], gids):
            break
        blocks.append(PRESENT)
    return blocks, len(blocks) * bs


def mamba(hashes, h, max_length, gids, cached, bs, align, coarse):
    if align < bs and bs % align == 0:
        sf = bs // align
        for j in range(min(max_length // align, len(hashes)) - 1, -1, -1):
            if get_cached(cached, hashes[j], gids):
                return [NULL] * (j // sf) + [PRESENT], (j + 1) * align
        return [], 0
    coarse_hashes = CoarseView(hashes, h, bs, coarse)
    for i in range(min(max_length // bs, len(coarse_hashes)) - 1, -1, -1):
        if get_cached(cached, coarse_hashes[i], gids):
            if bs != align and (i + 1) * bs % align:
                continue
            return [NULL] * i + [PRESENT], (i + 1) * bs
    return [], 0


class OracleFinder:
    """vLLM's coordinator over a Python set, configured straight from a KVLayout."""

    def __init__(self, layout: KVLayout, coarse="last", eagle=False, alignment=None,
                 eagle_gated=False, retained_coverage=False, single_spec_direct=False):
        cp = layout.context_parallel
        self.layout, self.coarse = layout, coarse
        self.bs = [s.block_size * cp for s in layout.groups]
        self.h = layout.hash_block_size * cp
        self.G = layout.num_groups
        cacheable = [g for g, s in enumerate(layout.groups) if s.prefix_cacheable]
        looked_up = [g for g in layout.prefix_cacheable_group_ids]
        lcm = math.lcm(*self.bs)
        partial = self.G > 1 and any(
            layout.groups[g].kind == GroupKind.MAMBA and self.bs[g] > self.h for g in cacheable)
        if partial:
            for g in cacheable:
                if layout.groups[g].kind not in (GroupKind.FULL, GroupKind.MAMBA) \
                        and self.bs[g] != self.h:
                    partial = False
        derived = self.bs[0] if self.G == 1 else (self.h if partial else lcm)
        if alignment is not None and alignment != derived:
            assert alignment == lcm, "vLLM resolves the hash or the scheduler block size"
            partial = False         # vLLM's coordinator without fine-grained hits
        self.partial = partial
        self.align = derived if alignment is None else alignment
        flagged = {g for g in looked_up if layout.groups[g].eagle}
        if eagle and not flagged:
            flagged = set(looked_up)
        if eagle_gated and not eagle:   # core coordinator's drop_eagle_group_ids
            flagged = set()
        self.spec_groups = []        # [spec, [gids], eagle]
        for g in looked_up:
            s = layout.groups[g]
            window, extra = s.sliding_window, s.extra_retained_tokens
            if retained_coverage and s.kind == GroupKind.SLIDING_WINDOW:
                # the store coordinator's _coverage_spec: the window covers the retained tail
                window, extra = window + extra, 0
            # vLLM merges groups whose KVCacheSpec objects are equal (head fields included)
            key = (s.kind, s.block_size, window, s.chunk_size, extra, s.mamba_mode, s.mla,
                   s.num_speculative_blocks, s.page_bytes, s.num_kv_heads, s.head_size,
                   s.head_size_v, s.dtype, s.attn_type)
            for entry in self.spec_groups:
                if entry[0] == key:
                    entry[1].append(g)
                    entry[2] = entry[2] or g in flagged
                    break
            else:
                self.spec_groups.append([key, [g], g in flagged])
        self.spec_groups.sort(key=lambda e: e[0][0] != GroupKind.FULL)
        # one manager call without the fixed point: one group (core coordinator) or, under
        # the store coordinator's rule, one spec group
        self.direct = self.G == 1 or (single_spec_direct and len(self.spec_groups) == 1)

    def _manager(self, key, gids, hashes, max_length, cached, drop):
        kind, bs = key[0], self.bs[gids[0]]
        if kind == GroupKind.FULL:
            return full_attention(hashes, self.h, max_length, gids, cached, bs, drop,
                                  self.align, self.coarse)
        if kind == GroupKind.SLIDING_WINDOW:
            return sliding_window(hashes, self.h, max_length, gids, cached, bs, key[2], drop,
                                  self.align, self.coarse)
        if kind == GroupKind.CHUNKED_LOCAL:
            return chunked_local(hashes, self.h, max_length, gids, cached, bs, key[3],
                                 self.align, self.coarse)
        return mamba(hashes, self.h, max_length, gids, cached, bs, self.align, self.coarse)

    def longest_hit(self, hashes, cached, max_length, apply_eagle=True):
        """(hit tokens, per-group list of bools: block i must be loaded)."""
        blocks_by_group = [None] * self.G
        if self.direct:
            key, gids, eagle = self.spec_groups[0]
            blocks, hit = self._manager(key, gids, hashes, max_length, cached,
                                        eagle and apply_eagle)
            for g in gids:
                blocks_by_group[g] = list(blocks)
            return hit, self._masks(blocks_by_group)
        len_by_group = [0] * self.G
        hit = max_length
        simple = len(self.spec_groups) == 2 and self.spec_groups[0][0][0] == GroupKind.FULL
        verified = set()
        while True:
            curr = hit
            for idx, (key, gids, eagle) in enumerate(self.spec_groups):
                if key[0] == GroupKind.FULL and blocks_by_group[gids[0]] is not None:
                    curr = min(curr, len_by_group[gids[0]])
                    continue
                drop = eagle and apply_eagle and idx not in verified
                bound = curr
                if drop and key[0] != GroupKind.MAMBA:
                    bs = self.bs[gids[0]]
                    fine_ok = key[0] in (GroupKind.FULL, GroupKind.MAMBA)
                    margin = self.h if (self.partial and fine_ok and bs > self.h) else bs
                    bound = min(curr + margin, len(hashes) * self.h)
                blocks, new = self._manager(key, gids, hashes, bound, cached, drop)
                if drop:
                    verified.add(idx)
                elif new < curr:
                    verified.clear()
                curr = new
                for g in gids:
                    blocks_by_group[g] = list(blocks)
                    len_by_group[g] = new
            if curr >= hit:
                break
            hit = curr
            if simple:
                break
        for key, gids, _ in self.spec_groups:
            if key[0] == GroupKind.FULL:
                for g in gids:
                    del blocks_by_group[g][cdiv(hit, self.bs[g]):]
        return hit, self._masks(blocks_by_group)

    @staticmethod
    def _masks(blocks_by_group):
        return [[b is not NULL for b in blocks] if blocks is not None else []
                for blocks in blocks_by_group]

    def coarse_key(self, hashes, g, i):
        """The (group, bytes) key of block i of group g in this oracle's convention."""
        return (g, CoarseView(hashes, self.h, self.bs[g], self.coarse)[i])
