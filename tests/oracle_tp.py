"""Plain-Python oracle for heterogeneous-TP reads: which remote byte every local byte needs.

Written from the rules alone (vLLM's head sharding, the page model of hmacore/tp.py's
docstring, positional block pairing), without hmacore.tp: a local byte of block id ``B`` at
request position ``idx`` of group ``g``, region ``r``, byte ``i`` is chunk ``c = i // chunk``,
local head ``j``, offset ``o``; it needs global head ``heads_local[j]`` from the remote rank
chosen for that head, at the same region, chunk and offset (block-size ratio: remote block
``idx*ratio + o // hb_remote``, offset ``o % hb_remote``).
"""


def oracle_heads(h, tp, rank):
    """Global heads of a rank as a list (vLLM: contiguous shards, or one replicated head)."""
    if tp <= h:
        assert h % tp == 0
        n = h // tp
        return list(range(rank * n, rank * n + n))
    assert tp % h == 0
    return [rank * h // tp]


def oracle_source(h, tp_r, local_rank, head):
    """The remote rank a local rank reads ``head`` from: the only holder, or among the
    ``copies`` holders the one at ``local_rank % copies``."""
    holders = [p for p in range(tp_r) if head in oracle_heads(h, tp_r, p)]
    return holders[local_rank % len(holders)]


def expected_sources(layout, shardings, local_plan, remote_plans, tp_l, d, tp_r, local_ids,
                     remote_ids, ratio=1):
    """dict local address -> (remote rank, remote address) for every byte the request needs.

    shardings: per group (num_heads, chunks, replicated). remote_plans: rank -> plan; regions
    pair by (group, layer, ordinal among that layer's regions), not by index (aliasing can
    differ between TP sizes)."""
    l2g = layout.layer_to_group

    def holders(plan, g, layer):
        """Regions of a plan holding ``layer``'s pages for group g, in dlist order."""
        return [r for r, reg in enumerate(plan.regions)
                if layer in reg.layers and reg.group in (-1, g)]

    out = {}
    for r, reg in enumerate(local_plan.regions):
        groups = [reg.group] if reg.group >= 0 else [
            g for g in layout.transfer_group_ids
            if (layout.groups[g].kind.name == "MAMBA") == reg.state]
        for g in groups:
            mine = [n for n in reg.layers if l2g[n] == g]
            if not mine:
                continue
            nth = holders(local_plan, g, mine[0]).index(r)
            rr_of = {p: holders(remote_plans[p], g, mine[0])[nth] for p in remote_plans}
            h, k, repl = shardings[g]
            split = 1 if reg.state else ratio
            for idx, b in enumerate(local_ids[g]):
                for i in range(reg.block_len):
                    laddr = reg.base + b * reg.stride + i
                    if repl:
                        p = d % tp_r
                        rreg = remote_plans[p].regions[rr_of[p]]
                        q, off = idx * split + i // rreg.block_len, i % rreg.block_len
                        out[laddr] = (p, rreg.base + remote_ids[g][q] * rreg.stride + off)
                        continue
                    lheads = oracle_heads(h, tp_l, d)
                    chunk = reg.block_len // k
                    hb = chunk // len(lheads)
                    c, j, o = i // chunk, (i % chunk) // hb, i % hb
                    head = lheads[j]
                    p = oracle_source(h, tp_r, d, head)
                    rreg = remote_plans[p].regions[rr_of[p]]
                    rheads = oracle_heads(h, tp_r, p)
                    rchunk = rreg.block_len // k
                    hbr = rchunk // len(rheads)
                    q, orr = idx * split + o // hbr, o % hbr
                    raddr = (rreg.base + remote_ids[g][q] * rreg.stride + c * rchunk
                             + rheads.index(head) * hbr + orr)
                    out[laddr] = (p, raddr)
    return out


def simulate_reads(pairs, local_ids, remote_ids):
    """dict local address -> list of (remote rank, remote address) written by the descriptors
    that the pair plans' desc_ids select (a byte listed twice was written twice)."""
    got = {}
    for p, pair in pairs.items():
        lids, rids = pair.desc_ids(local_ids, remote_ids)
        ld = pair.local.descriptors()
        rd = pair.remote.descriptors()
        assert len(lids) == len(rids)
        for a, b in zip(lids.tolist(), rids.tolist()):
            la, ln, _ = (int(x) for x in ld[a])
            ra, rn, _ = (int(x) for x in rd[b])
            assert ln == rn, (ln, rn)
            for t in range(ln):
                got.setdefault(la + t, []).append((p, ra + t))
    return got


# -- layouts and per-rank page sizes shared by the unit, property and NIXL tests -------------

def full_sliding_layout(bs=16, layers=2, window=None):
    """Full + sliding-window groups; the window is ``window`` tokens (default ``2 * bs``)."""
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    return KVLayout(groups=(
        GroupSpec(GroupKind.FULL, bs, tuple(f"full.{i}" for i in range(layers)), name="full"),
        GroupSpec(GroupKind.SLIDING_WINDOW, bs, tuple(f"swa.{i}" for i in range(layers)),
                  sliding_window=window or 2 * bs, name="swa"),
    ))


def dsv4_like_layout(scale=1, layers=2):
    """Five groups shaped like DeepSeek-V4's (block sizes 16/4/4/2/4 divided by ``scale``):
    three MLA groups (replicated) and two compressor groups modelled as head-sharded
    attention, so one layout mixes replicated and sharded pages."""
    from hmacore.spec import GroupKind, GroupSpec, KVLayout
    def names(p):
        return tuple(f"{p}.{i}" for i in range(layers))
    return KVLayout(groups=(
        GroupSpec(GroupKind.FULL, 16 // scale, names("mla"), mla=True, name="mla"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4 // scale, names("swa_a"), sliding_window=8, mla=True,
                  name="swa_a"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4 // scale, names("swa_b"), sliding_window=8, mla=True,
                  name="swa_b"),
        GroupSpec(GroupKind.SLIDING_WINDOW, max(1, 2 // scale), names("c4"), sliding_window=4,
                  name="c4"),
        GroupSpec(GroupKind.SLIDING_WINDOW, 4 // scale, names("c128"), sliding_window=16,
                  name="c128"),
    ))


def rank_pages(shardings, head_block_bytes, tp):
    """Per group page bytes on a rank of ``tp``: chunks x heads on the rank x bytes per head
    per chunk per block (``head_block_bytes[g]``; for replicated groups the whole page)."""
    out = []
    for (h, k, repl), hbb in zip(shardings, head_block_bytes):
        out.append(hbb if repl else k * len(oracle_heads(h, tp, 0)) * hbb)
    return out


# -- TP byte pattern: derived from (layer, token position, chunk, GLOBAL head, byte) ------------

def tp_pattern(layer, positions, block_size, page_bytes, heads=None, chunks=1):
    """uint8 pages ``(len(positions), page_bytes)`` of one layer on one rank.

    Sharded (``heads`` = the rank's global heads): byte (chunk c, head slot j, offset o) of
    block position p derives from (layer, token p*bs + o // (hb/bs), c, heads[j], byte within
    the token), so every TP size and block size lays out the same values by global head and
    token. Replicated (``heads`` None): from (layer, token, 0, 0, byte within the token)."""
    import zlib
    import numpy as np
    pos = np.asarray(positions, dtype=np.uint64).reshape(-1, 1)
    i = np.arange(page_bytes, dtype=np.uint64)
    bs = np.uint64(block_size)
    if heads is None:
        c = np.zeros_like(i)
        head = np.zeros_like(i)
        o = i
        hb = np.uint64(page_bytes)
    else:
        n = len(heads)
        assert page_bytes % (chunks * n) == 0
        chunk = page_bytes // chunks
        hb = np.uint64(chunk // n)
        c = i // np.uint64(chunk)
        j = (i % np.uint64(chunk)) // hb
        head = np.asarray(heads, dtype=np.uint64)[j.astype(np.int64)]
        o = i % hb
    assert int(hb) % block_size == 0, "whole bytes per token"
    per_tok = hb // bs
    tok = pos * bs + (o // per_tok).reshape(1, -1)
    byte = o % per_tok  # byte within the token: the same at every block size
    key = np.uint64(zlib.crc32(layer.encode()) + 1)
    with np.errstate(over="ignore"):
        x = key * np.uint64(0x9E3779B97F4A7C15) + tok * np.uint64(0x94D049BB133111EB) \
            + (c * np.uint64(1 << 20) + head * np.uint64(1 << 8) + byte).reshape(1, -1) \
            * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def tp_case_layout(name, scale=1, bs_div=1):
    """(layout, shardings as (heads, chunks, replicated), head_block_bytes) of the NIXL cases;
    ``scale`` multiplies every page; ``bs_div`` divides the (full_sliding) block size and pages."""
    if name == "full_sliding":
        lay = full_sliding_layout(16 // bs_div, 2, window=32)  # the model's window, in tokens
        return lay, [(4, 2, False)] * 2, [64 * scale // bs_div] * 2
    assert bs_div == 1
    lay = dsv4_like_layout(1, 2)
    return lay, [(1, 1, True)] * 3 + [(4, 1, False)] * 2, [b * scale for b in (256, 64, 64, 32, 64)]


def request_ids(layout, num_tokens, first=1):
    """Per group: block positions a request moves (window clipped) and fresh ids for them."""
    from hmacore.grain import cdiv
    pos, ids, nxt = [], [], first
    for spec in layout.groups:
        n = cdiv(num_tokens, spec.block_size)
        w = spec.window_blocks()
        keep = min(n, w) if w else n
        pos.append(list(range(n - keep, n)))
        ids.append(list(range(nxt, nxt + keep)))
        nxt += keep
    return pos, ids, nxt
